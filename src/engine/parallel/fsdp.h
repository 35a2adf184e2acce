// Sharded data parallelism (ZeRO): the optimizer state, the f32 masters and the reduced
// gradients of a model are cut into shards, one per rank of each bucket's sharding group,
// so each rank updates and stores only 1/n of them.
//
// A model's parameters lie in flat buckets (ParamBucket). Each bucket is padded to a
// multiple of its group's size n and rank r of the group owns the element range
// [r*S, (r+1)*S), S = numel/n. Expert buckets shard over dp x cp (the ranks that hold the
// same experts); every other bucket over dp x cp x ep. One step:
//   reduce_scatter_grads()  each bucket's gradient summed over its group (f32), this
//                           rank's shard kept;
//   grad_norm()             the global norm: shard sums of squares summed over the world
//                           (every element is owned by exactly one rank);
//   step()                  AdamW on the shards (masters and moments exist only there), the
//                           updated weight shards all-gathered back into the whole buckets.
// With shard_weights (ZeRO stage 3; [parallel].shard_weights = "auto" picks it only for weights
// too large to keep whole) the whole weights exist only while a layer
// runs: the model's WeightHooks gather a layer's buckets before its forward and backward
// and drop them after; when a layer is gathered, the gather of the next one (in the pass's
// order) starts, on a communication stream under NCCL so it overlaps the layer's compute
// (Gloo gathers finish before they return: there it only runs early); each layer's gradients are reduce-scattered (and accumulated over
// micro-batches into the shard) right after its backward, and dropped too. Without it
// (ZeRO stage 2) weights and gradients stay whole: less communication, more memory.
//
// Overlap (ZeRO-2 on GPUs, set_overlap; [optimizer].overlap): as one GPU's LayerwiseOptimizer
// does, the step's optimizer work runs beside the model's instead of after it. During the
// step's last micro-batch each layer's gradients are reduce-scattered on a communication
// stream as soon as its backward has made them; after the norm, each layer's AdamW update of
// its shards and the all-gather of its updated weights are launched there in forward order,
// and the next forward of a layer waits only for its own (the hooks). The numbers are those
// of the step in line, bit for bit (the same collectives of the same buffers, AdamW
// element-wise). Anything that reads the weights or the optimizer state outside a forward
// calls drain() first.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/parallel/replica_bridge.h"

namespace moetrain {

class FsdpContext final : public WeightHooks {
 public:
  // `dense_group` shards non-expert buckets, `expert_group` expert buckets, `replica_world`
  // (every rank of this replica group) sums the gradient norm. HSDP: `bridge` (or nullptr)
  // crosses to the ranks holding the same shards in the other replica groups; their gradient
  // shards are summed over it once a step, at the time of the step (it can be rebuilt).
  // The model's f32 masters (if any; their low halves) move into the shards and leave the model,
  // so construct this after the model's weights are initialised. With shard_weights the
  // model's whole weights are released here and gathered on use.
  // Tensor parallelism: `tp_group` (nullptr when tp = 1) sums the gradient shards of the
  // buckets every tp rank holds whole (ParamBucket::tp_replicated: norms, routers), each rank
  // having made its own tokens' part; the global norm counts them once.
  FsdpContext(Model& model, Communicator& dense_group, Communicator& expert_group, Communicator& replica_world,
              AdamWConfig adamw, bool shard_weights, ReplicaBridge* bridge = nullptr,
              Communicator* tp_group = nullptr);
  ~FsdpContext() override;

  // Before each micro-batch's forward_backward: the first one writes the gradient shards,
  // the others add to them; `last`: its backward leaves the step's final gradients (the
  // overlap reduce-scatters each layer's as soon as they are made).
  void begin_micro_batch(bool first, bool last = false) {
    first_micro_batch_ = first;
    last_micro_batch_ = last;
  }
  // Turns the overlap on or off (drains first). It takes a GPU, whole weights (no
  // shard_weights), no tensor parallelism, a bridge that crosses to no other replica group,
  // and groups that are NCCL or of one rank; elsewhere it stays off. Returns whether it is
  // on. The first time on, collective over the sharding groups (each is split into a copy
  // for the overlap's collectives): every rank of them calls it alike.
  bool set_overlap(bool on);
  bool overlapping() const { return overlap_; }
  // Work on the current stream from now on follows every update and gather launched so far.
  void drain();
  // Whether the model's whole gradients live across a step's micro-batches (only without
  // shard_weights; with them each layer's are reduced after its backward, micro-batch by
  // micro-batch).
  bool keeps_whole_grads() const { return !shard_weights_; }
  // The model's accumulate_grads for micro-batch i.
  bool model_accumulates(size_t micro_batch) const { return keeps_whole_grads() && micro_batch > 0; }

  // After the last micro-batch: each bucket's gradient reduce-scattered over its group
  // (without shard_weights; with them each layer did it after its backward), then, under
  // HSDP, the shards summed over the replica groups.
  void reduce_scatter_grads();
  // HSDP: every replica group holds the same shards, so only the first writes them to a
  // checkpoint.
  bool writes_checkpoint() const { return bridge_ == nullptr || bridge_->index() == 0; }
  // What crosses to the other replica groups (nullptr: none).
  ReplicaBridge* bridge() const { return bridge_; }
  GradNorm grad_norm(double max_norm);
  void step(double lr, double grad_scale);

  // This rank's pieces of parameters: an element range of model.parameters()[param].
  const std::vector<ShardSegment>& segments() const { return segments_; }
  // One Parameter per segment (same order): value a 1-D view into the model's bucket, grad
  // a view of the reduced gradient shard, master_low (bf16 models) the master's low half.
  ParameterList& shard_params() { return shard_params_; }
  AdamW& optimizer() { return opt_; }
  // After the shards' values were loaded (a checkpoint): the whole weights made consistent.
  void gather_values();

  // WeightHooks (shard_weights only).
  void before_forward(int64_t layer) override;
  void after_forward(int64_t layer, bool backward_follows) override;
  void before_backward(int64_t layer) override;
  void after_backward(int64_t layer) override;

 private:
  struct Shard {
    ParamBucket* bucket;
    Communicator* group;
    int64_t size;   // S
    Tensor grad;    // [S], this rank's reduced gradient
    Tensor value;   // [S], this rank's weights (shard_weights), else a view of the bucket
    Tensor scratch; // [S], one micro-batch's reduced gradient before it is added
    cuda::Event ready = nullptr;  // NCCL prefetch: recorded after the gather on comm_stream_
    bool in_flight = false;       // a prefetched gather the compute stream has not waited for
    bool reduced = false;         // overlap: reduce-scattered on comm_stream_ this step
    int64_t lo() const { return group->rank() * size; }
  };
  std::vector<Shard*> unit(int64_t layer);
  // The layer whose weights a pass needs after `layer`: the next id forward, the previous
  // backward (ids as in ParamBucket::layer); `layer` itself when there is none.
  int64_t neighbour(int64_t layer, bool forward) const;
  void gather(Shard& sh);
  void prefetch(int64_t layer);
  void release(Shard& sh);
  // Gradients of the shard's bucket reduced into `into` (its shard) over `group` (nullptr: the
  // shard's), timed as a reduce-scatter: on the compute stream, or on `stream` when given.
  void reduce_scatter(Shard& sh, Tensor& into, Communicator* group = nullptr, cuda::Stream stream = nullptr);
  // The shard's weights all-gathered into the whole bucket over `group` (from a copy: the
  // shard is part of the output buffer), timed likewise.
  void gather_into_bucket(Shard& sh, Communicator& group, cuda::Stream stream = nullptr);
  // The bytes a gather of the shard sends, on the active collective timer.
  void count_gather_bytes(const Shard& sh) const;
  // Overlap: the layer's gradients reduce-scattered on comm_stream_ (last micro-batch).
  void reduce_scatter_early(int64_t layer);
  // Overlap: the forward of `layer` waits for its update and gather.
  void wait_for_update(int64_t layer);
  // The communication stream, made on first use (GPU only).
  void make_comm_stream();

  Model& model_;
  Communicator& replica_world_;
  ReplicaBridge* bridge_;
  Communicator* tp_group_;
  std::vector<bool> tp_whole_;  // per shard parameter: in a tp_replicated bucket (tp > 1)
  bool shard_weights_;
  bool first_micro_batch_ = true, last_micro_batch_ = false;
  bool overlap_ = false;
  struct UnitUpdate {                    // overlap: a layer's update and gather, launched on comm_stream_
    std::vector<size_t> params;          // indices into shard_params_
    cuda::Event done = nullptr;
    bool pending = false;                // launched and not yet waited for on the current stream
    bool gathers = false;                // it all-gathers (a group of more than one rank)
  };
  std::vector<UnitUpdate> updates_;      // per units_ entry
  // Overlap: each sharding group's own copy (Communicator::split) for the comm stream's
  // collectives. NCCL runs a communicator's kernels in the order issued, whatever the stream:
  // on the group itself, the next step's first collective (its token count, or an expert
  // exchange over the same ranks) would wait for every update and gather.
  std::map<Communicator*, std::unique_ptr<Communicator>> overlap_groups_;
  Communicator& overlap_group(const Shard& sh) { return *overlap_groups_.at(sh.group); }
  std::vector<int64_t> units_;           // the layer ids of the buckets, ascending (-1 first)
  cuda::Stream comm_stream_ = nullptr;   // NCCL and shard_weights: where prefetches run; the overlap's
  cuda::Event compute_point_ = nullptr;  // orders a prefetch after the compute stream's work
  std::vector<Shard> shards_;
  std::vector<ShardSegment> segments_;
  ParameterList shard_params_;
  AdamW opt_;
};

}  // namespace moetrain
