// TrainContext: the live state one rank trains with, built from a RunConfig in one call for
// `train` and `bench` alike: the rank's place in the mesh (ParallelContext), the pipeline
// schedules and chunks when pp > 1 (or ep_overlap), the part of the model the rank holds, the expert
// dispatcher, the optimizer (sharded over the data ranks when there are several) and the
// pipeline executor. step() runs one optimizer step the way the layout needs.
#pragma once

#include <memory>
#include <vector>

#include "core/cuda_runtime.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/optim/layerwise.h"
#include "engine/parallel/fsdp.h"
#include "engine/parallel/parallel_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/schedule.h"
#include "engine/run_config.h"
#include "engine/trainer.h"

namespace moetrain {

// Whether data parallelism shards the weights too (ZeRO-3) for [parallel].shard_weights =
// `setting` ("auto", "true", "false"): never under a pipeline; with "auto", only when this
// rank's whole weights and f32 gradients would take more than a quarter of its memory (the
// choice is logged with the numbers). `memory`: the rank's bytes (0: the device's, or the host's).
bool choose_shard_weights(const std::string& setting, Model& model, const Device& device, bool pipelined,
                          int64_t memory = 0);
// Whether plain expert parallelism runs its micro-batches in overlapped pairs
// ([parallel].ep_overlap; "auto" is logged with its reason). Called with ep > 1 and pp = 1.
bool choose_ep_overlap(const RunConfig& cfg, Model& model, const Device& device, int64_t memory = 0);

struct TrainContext {
  ParallelContext par;
  // CUDA with ep > 1: the streams the expert exchanges run on (the forward's, and the
  // backward's where the transport takes two), so one micro-batch's exchange overlaps
  // another's compute (owned; outlive the dispatcher, declared before it).
  struct StreamHolder {
    cuda::Stream stream = nullptr;
    ~StreamHolder();
  } comm_stream, comm_stream_backward;
  std::unique_ptr<PipelineSchedule> pipe_train, pipe_val;  // pipelined: a step, a validation pass
  std::vector<ChunkSpec> chunks;                           // pipelined: the model cut for them
  std::unique_ptr<Model> model;                            // this rank's part, initialised
  std::unique_ptr<ExpertDispatcher> dispatcher;            // local, or all-to-all over ep
  std::unique_ptr<FsdpContext> fsdp;                       // several ranks: sharded optimizer
  std::unique_ptr<AdamW> single_opt;                       // one rank
  std::unique_ptr<LayerwiseOptimizer> layerwise;           // one rank: single_opt, layer by layer
  std::unique_ptr<PipelineExecutor> pipeline;              // pp > 1

  // Builds everything on the ranks `par` connected (ParallelContext::build); errors name the
  // [parallel] or [training] keys that do not fit.
  static std::unique_ptr<TrainContext> build(const RunConfig& cfg, ParallelContext par);

  AdamW& optimizer() { return fsdp ? fsdp->optimizer() : *single_opt; }
  // One optimizer step over this rank's micro-batches (on the model's device).
  // `commit`: asked once the gradients are complete (trainer.h's CommitFn).
  StepResult step(const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit = {});
  // Makes later work on the current stream follow every optimizer update still running (one
  // rank on a GPU: see optim/layerwise.h; FSDP's overlap: parallel/fsdp.h); before reading weights or optimizer state other
  // than through the model's forward (checkpoints, the end of the run).
  void settle() {
    if (layerwise) layerwise->drain();
    if (fsdp) fsdp->drain();
  }
  // Whether the optimizer's work runs beside the model's (one GPU, or FSDP's overlap), and
  // turning it off and on (bench times the stages with it off).
  bool optimizer_overlapping() const {
    return (layerwise && layerwise->overlapping()) || (fsdp && fsdp->overlapping());
  }
  void set_optimizer_overlap(bool on) {
    if (layerwise) layerwise->set_overlap(on);
    if (fsdp) fsdp->set_overlap(on);
  }
  // Tokens of one step over all data ranks.
  // The step's tokens: the rows of every (dp, ep) rank's micro-batches, whole sequences (the
  // cp ranks of a place share their rows, each holding part of every sequence).
  int64_t tokens_per_step(const TrainingConfig& tc) const {
    return tc.micro_batch_size * par.layout.row_world() * tc.seq_len * tc.grad_accum_steps;
  }
};

}  // namespace moetrain
