// The single-process training loop: builds the contexts a run needs from its RunConfig
// (data, model, dispatcher, optimizer, metrics), trains, validates every N steps, and ends
// with a summary and a short text sampled from the model.
#pragma once

#include <string>
#include <vector>

#include "engine/data/loader.h"
#include "engine/models/model.h"
#include "engine/optim/adamw.h"
#include "engine/run_config.h"
#include "engine/train_state.h"

namespace moetrain {

struct TrainSummary {
  int64_t steps = 0;
  double first_val_loss = 0, last_val_loss = 0;
  double first_train_loss = 0, last_train_loss = 0;
  double tokens_per_s = 0;  // training tokens over training time (validation excluded)
  double seconds = 0;       // whole run
  int64_t parameters = 0;
  std::string sample;
};

TrainSummary train(const RunConfig& cfg);

// One optimizer step: gradients of the mean loss over `batches` (micro-batches,
// accumulated), global-norm clipping, AdamW at `lr`. Every overload takes `commit`, asked
// once the step's gradients are complete and reduced, before the optimizer: false discards
// the step (no update, the optimizer's state and step count unchanged); empty commits.
using CommitFn = std::function<bool()>;
struct StepResult {
  bool committed = true;  // false: `commit` discarded the step
  double loss = 0;       // mean cross-entropy over the step's targets
  double aux_loss = 0;   // the model's loss terms summed (router losses: load balancing + z)
  LossTerms terms;       // each term, mean over micro-batches, summed over data ranks where a share
  double grad_norm = 0;  // before clipping
  std::vector<std::vector<int64_t>> expert_counts;  // [MoE layer][expert], summed over micro-batches
  std::vector<double> router_entropy;  // [MoE layer] sum over the tokens of expert_counts of the router's entropy
  double expert_imbalance = -1;  // set when computed over ranks (pipeline); else from expert_counts
};
StepResult train_step(Model& model, ExpertDispatcher& dispatcher, AdamW& opt, const std::vector<Batch>& batches,
                      double lr, double grad_clip, const CommitFn& commit = {});
// The same step with the optimizer taken layer by layer (optim/layerwise.h): on a GPU its
// updates may still be running when this returns, under the next forward.
class LayerwiseOptimizer;
StepResult train_step(Model& model, ExpertDispatcher& dispatcher, LayerwiseOptimizer& opt,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit = {});
// The same step on one of many ranks: `batches` are this rank's share; losses and token
// counts are summed over `data_group` (this replica group's data ranks) and fsdp's bridge
// (the other replica groups), gradients reduced and the optimizer stepped by fsdp.
class FsdpContext;
// Whether the micro-batch steps (train_step without a pipeline) make the experts' weight
// gradients in groups of model.expert_wgrad_group(): not where FSDP reduces each layer's
// gradients after every micro-batch (sharded weights). `fsdp`: null in one data rank.
bool groups_expert_weight_grads(const Model& model, const FsdpContext* fsdp);
StepResult train_step(Model& model, ExpertDispatcher& dispatcher, FsdpContext& fsdp, Communicator& data_group,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit = {});

// The same step through a pipeline schedule (pipeline/executor.h): `replica_world` (and
// fsdp's bridge across replica groups) gathers the loss from the ranks holding the head and
// the expert-load imbalance from every stage.
class PipelineExecutor;
struct PipelineSchedule;
StepResult train_step(PipelineExecutor& ex, const PipelineSchedule& schedule, Model& model,
                      FsdpContext& fsdp, Communicator& data_group, Communicator& replica_world,
                      const std::vector<Batch>& batches, double lr, double grad_clip, const CommitFn& commit = {});

// The busiest expert's load over the mean load, for the worst MoE layer (0 without MoE).
double expert_imbalance(const std::vector<std::vector<int64_t>>& counts);

// The model's loss terms (Model::loss_terms: one order on every rank) with the values of
// those in `have`, zero for the others.
LossTerms in_model_order(const Model& model, const LossTerms& have);

}  // namespace moetrain
