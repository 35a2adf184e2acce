// LayerwiseOptimizer: the optimizer step of a one-process run, taken bucket by bucket
// (ParamBucket: the embedding and head, each layer's attention, each layer's experts), so
// that on a GPU it runs beside the model's own work instead of after it:
//
//   - as soon as the last micro-batch's backward has finished a layer, that layer's share of
//     the squared gradient norm is summed on a second stream while the backward goes on
//     (the experts' share, the bulk, comes from the weight-gradient op itself when that op
//     writes the final gradients: a step of one micro-batch; see expert_grad_squares);
//   - after the step, each bucket's AdamW update is launched on that stream in forward order,
//     and the next forward of a layer waits only for its own update (WeightHooks), so the
//     updates of later layers run under the forward of earlier ones.
//
// The numbers do not depend on the overlap: the norm is always the sum, in bucket order, of
// per-bucket sums, and AdamW is element-wise (bf16-moment rounding keys on each element's
// place in the moment buffer), so a step with overlap on equals one with it off, bit for bit.
// Anything that reads the weights or the optimizer state outside a training forward
// (checkpoints, export, the end of training, the model's hook-less reference_forward) calls
// drain() first; the staged forward passes (training, validation, sampling) wait through
// the hooks by themselves. The embedding and the head are one bucket group, so a forward's
// first op waits for both (a finer split would let the head's update run under the layers).
// On the CPU everything runs in line.
#pragma once

#include <vector>

#include "core/cuda_runtime.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"

namespace moetrain {

struct LayerwiseConfig {
  bool overlap = true;  // GPU: a second stream (else every part runs in line on the current one)
  // With the overlap: the multiprocessors each update after the first two groups may occupy
  // (0: all), so that the next forward, which by then has its weights, runs on the rest
  // instead of queueing behind the update's blocks.
  int update_sms = 0;
};

class LayerwiseOptimizer : public WeightHooks {
 public:
  // Installs itself as the model's weight hooks (the model must have none).
  LayerwiseOptimizer(Model& model, AdamW& opt, LayerwiseConfig cfg);
  ~LayerwiseOptimizer() override;
  LayerwiseOptimizer(const LayerwiseOptimizer&) = delete;
  LayerwiseOptimizer& operator=(const LayerwiseOptimizer&) = delete;

  // Turns the overlap on or off from the next step (drains first).
  void set_overlap(bool on);
  bool overlapping() const { return stream_ != nullptr && cfg_.overlap; }

  // The micro-batch about to run is the step's last: its backward leaves final gradients.
  void begin_last_micro_batch() { armed_ = true; }
  // After the step's backward: the global gradient norm (one host wait), then every
  // bucket's AdamW update at lr with the clipping factor (launched; see the top).
  GradNorm step(double lr, double max_norm);
  // Instead of step(): the step is abandoned (no update, the optimizer's count unchanged);
  // returns the gradient norm it had, for the log. The next step starts afresh.
  double discard();
  // Work on the current stream from now on follows every update launched so far.
  void drain();

  // WeightHooks
  void before_forward(int64_t layer) override;
  void after_forward(int64_t, bool) override {}
  void before_backward(int64_t) override {}
  void after_backward(int64_t layer) override;
  // On the step's last micro-batch, the layer's experts bucket: its weight-gradient op sums
  // the squares itself (it has the values in registers) instead of this summing them again.
  ops::SumSquaresInto expert_grad_squares(int64_t layer) override;

 private:
  struct Group {  // the buckets of one layer id (-1: embedding, final norm, head)
    int64_t layer;
    std::vector<size_t> buckets;
    std::vector<size_t> params;  // indices into the model's parameters
    cuda::Event updated = nullptr;
    bool pending = false;  // an update launched and not yet waited for on the current stream
  };
  Group* group_of(int64_t layer);
  void make_stream();  // GPU: the second stream and its events, once
  void sum_bucket(size_t b);  // bucket b's squared norm into norms_[b]
  // The step's squared gradient norm: every bucket's part summed (the step's one host wait);
  // disarms the hooks for the next step.
  double finish_norm();

  Model& model_;
  AdamW& opt_;
  LayerwiseConfig cfg_;
  std::vector<Group> groups_;  // forward order: -1 first, then ascending layer ids
  Tensor norms_;               // f64 [buckets] on the model's device
  std::vector<bool> summed_;   // per bucket, this step
  bool armed_ = false;
  cuda::Stream stream_ = nullptr;  // GPU only
  cuda::Event grads_ready_ = nullptr, norms_ready_ = nullptr;
};

}  // namespace moetrain
