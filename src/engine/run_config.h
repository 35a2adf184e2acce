// RunConfig: everything one training run is told, one TOML file with sections
// [model] [parallel] [training] [optimizer] [data] [checkpoint] [fault_tolerance] [metrics],
// each a *Config that can describe its keys (see config.h). Any key can be overridden on the
// command line as --section.key=value.
#pragma once

#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/models/model_config.h"

namespace moetrain {

struct ParallelConfig {
  int64_t pp = 1, cp = 1, ep = 1;
  // Tensor parallelism (docs/parallel.md): attention and dense MLPs split over tp ranks by
  // heads / columns, the tokens between them by rows (sequence parallelism), the embedding and
  // head by vocabulary; MoE layers fold their experts over the tp x ep ranks.
  int64_t tp = 1;
  // tp > 1: true puts the MoE layers' experts on the tp x ep ranks (Megatron's folding: each
  // tp rank its own experts); false gives every tp rank the ep rank's experts whole, each
  // running its own tokens through them (the experts data-parallel over tp).
  bool fold_experts = true;
  int64_t dp = -1;  // -1: inferred as world / (pp * cp * tp * ep)
  std::string schedule = "dualpipev";  // pipeline schedule when pp > 1: "dualpipev" or "1f1b"
  // pp > 1: the share of each micro-batch's token rows whose output head another pipeline
  // rank computes with a copy of the head (pipeline/schedule.h, add_head_helper). -1 (auto):
  // the share that evens out the head's rank and the lightest other rank where the layers
  // cannot (a few layers per chunk; DualPipeV puts the embedding and the head on rank 0), off
  // when under 5%, under tensor parallelism or with multi-token prediction; 0: off.
  double head_share = -1;
  // Data-parallel sharding (ZeRO): gradients and optimizer state are always sharded over
  // the data ranks; with shard_weights the weights too, gathered per layer when used (ZeRO-3).
  // "auto": ZeRO-2 (whole weights and gradients, one gather and one reduce-scatter a step)
  // when they fit in a quarter of a rank's memory, ZeRO-3 when they do not; "true"/"false".
  std::string shard_weights = "auto";
  // Expert parallelism without a pipeline: run a step's micro-batches as DualPipeV on one
  // rank (the model in two chunks, forward/backward pairs overlapped) so that one
  // micro-batch's exchanges run under another's compute. Needs grad_accum_steps >= 2 and
  // keeps weights whole (ZeRO-2). "auto": on GPUs when there are >= 2 micro-batches, the
  // weights are not asked to be sharded and whole weights fit (shard_weights' test).
  std::string ep_overlap = "auto";
  // How expert parallelism moves tokens: "all_to_all" sends each (token, routed expert) copy
  // to the expert's rank; "all_gather" sends each token once to every EP rank and sums the
  // expert outputs on the experts' side (K / ep times fewer bytes with top-K routing);
  // "auto": all_gather when ep < top_k.
  std::string ep_dispatch = "auto";
  // How the all-gather dispatch moves token rows among the GPUs of one host: "auto" copies
  // them straight into the peers' memory on the copy engines (no SMs) when every EP rank
  // can, else NCCL; "nccl" always NCCL.
  std::string ep_transport = "auto";
  // HSDP: dp splits into dp_replicate replica groups; sharding stays inside a group (one node,
  // say) and the groups all-reduce gradient shards. 1: plain FSDP over all dp ranks.
  int64_t dp_replicate = 1;
  // Debugging expert parallelism: every dispatch checks over the EP group that each rank
  // receives exactly the rows sent to it (an all-gather and a host wait per dispatch).
  bool check_exchange = false;
  // Layouts to fall back on, in order, when this one does not fit the world (an elastic job
  // restarted on fewer nodes): each "key=value ..." over the keys above, e.g. "ep=2" or
  // "pp=1 ep=2". dp = -1 (inferred) already follows the world; these cover the rest.
  std::vector<std::string> fallbacks;
  void describe(ConfigFields& f);
  // This layout with one fallback's keys set (errors name the entry and key).
  ParallelConfig with(const std::string& fallback) const;
  // Whether pp x dp x cp x ep fits `world` ranks.
  bool fits(int64_t world) const;
  // This layout when it fits `world`, else the first fallback that does; an error listing
  // what was tried when none does.
  ParallelConfig for_world(int64_t world) const;
};

struct TrainingConfig {
  int64_t steps = 1000;
  int64_t micro_batch_size = 16;    // sequences per micro-batch
  int64_t seq_len = 128;            // tokens per sequence
  int64_t grad_accum_steps = 1;     // micro-batches per optimizer step
  int64_t seed = 1234;
  std::string device = "cpu";       // "cpu" (f32) or "cuda" (bf16 compute, f32 masters)
  double grad_clip = 1.0;           // global grad-norm clip; 0 disables
  int64_t eval_every = 100;         // validation loss every N steps (and at step 0 and the end)
  int64_t eval_batches = 8;         // micro-batches per validation
  int64_t sample_tokens = 200;      // tokens sampled at the end of the run; 0 disables
  std::string sample_prompt = "The ";
  double sample_temperature = 0.8;
  int64_t threads = 0;              // CPU threads; 0 = all cores
  // Bitwise-repeatable kernels (ops::set_deterministic). false lets the GPU attention
  // backward add dQ with f32 atomics in one pass: faster, last bits vary run to run.
  bool deterministic = true;
  // DeepSeek-V3's block-scaled FP8 for the layers' projections (attention's, MLA's); the
  // experts, router, head, norms and attention core stay BF16 for now (docs/fp8.md).
  bool fp8 = false;
  // Activation recomputation (docs/memory.md): "none" keeps every layer's activations for its
  // backward; "full" keeps only a layer's input and redoes its forward (the expert exchange
  // included) just before its backward, with the same kernels in the same order, so the
  // gradients are the same bits. recompute_layers: the decoder layer ids it applies to (empty:
  // every layer). "selective" keeps the layer's state but its norm and rotary outputs (and
  // the expert input rows when they are a local permutation), made again before the backward.
  std::string recompute = "none";
  // Whether decoder layer `id` is recomputed (recompute set, and id listed or the list empty).
  bool recomputes(int64_t id) const;
  // On GPUs: stop at start-up, before allocating, when the memory plan (engine/plan/memory_plan.h)
  // says the run will not fit.
  bool check_memory = true;
  std::vector<int64_t> recompute_layers;
  // With grad_accum_steps > 1 (not with FSDP's sharded weights nor in a pipeline): the experts'
  // weight gradients of each group of this many micro-batches in one pass over their f32 dW
  // (their inputs kept meanwhile); 1: one pass per micro-batch.
  int64_t expert_wgrad_group = 2;
  // End this process after this many steps of the run (the schedule still spans `steps`);
  // 0 runs to the end. For job time limits: save, stop, resume in the next job.
  int64_t stop_after_steps = 0;
  void describe(ConfigFields& f);
};

struct OptimizerConfig {
  std::string name = "adamw";
  double lr = 3e-3;
  double min_lr = 3e-4;             // floor of the decay
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  std::string moments = "f32";      // "f32" | "bf16": dtype of the AdamW moments
  // One process on a GPU: the gradient norm and AdamW on a second stream, overlapping the
  // backward and the next forward (optim/layerwise.h); several (FSDP with whole weights):
  // the last backward's reduce-scatters, the shards' AdamW and the weights' all-gathers on a
  // communication stream, under the backward and the next forward (parallel/fsdp.h); the
  // same numbers either way.
  bool overlap = true;
  // With the overlap: multiprocessors a later layer's update may occupy while the forward of
  // the layers before it runs on the others (0: all of them, the updates and the forward
  // take turns). Off by default: on the bench model it gained under 1 ms (docs/perf.md).
  int64_t overlap_sms = 0;
  std::string schedule = "cosine";  // "cosine" | "wsd" | "constant"
  int64_t warmup_steps = 50;
  double decay_fraction = 0.2;      // wsd: last fraction of steps that decays to min_lr
  void describe(ConfigFields& f);
};

struct DataConfig {
  // "text": plain text files, tokenized at start; "shards": token shards of `moetrain
  // tokenize`, streamed; "sft": chat JSONL, loss on the assistant tokens (data_context.h).
  std::string kind = "text";
  std::string tokenizer = "byte";    // "byte", a tokenizer.json, or a folder holding one
  // text: files or folders of text (folders recursively, skipping fortune's *.dat index
  // files and links); shards: folders of shards; sft: JSONL files or folders of them.
  std::vector<std::string> paths = {"/usr/share/games/fortunes"};
  // Share held out for validation: of the documents (text) or conversations (sft), by a
  // hash of their text; of the stream's last tokens (shards).
  double val_fraction = 0.05;
  std::string chat_template = "chatml";  // sft: how conversations are rendered
  bool packing = true;                   // sft: several conversations per sequence
  void describe(ConfigFields& f);
};

struct CheckpointConfig {
  std::string dir;                  // "" = <metrics.dir>/checkpoints
  int64_t every = 0;                // save every N steps; 0 = only the final save
  bool save_final = true;           // save after the run's last step (and at stop_after_steps)
  int64_t keep = 3;                 // committed checkpoints kept, newest first; 0 keeps all
  bool async = true;                // write in a background thread after a copy to host
  std::string resume = "auto";      // "auto" | "never" | path of a step directory
  std::string init_from;            // HF model folder or moetrain checkpoint: weights only
  // The remote tier (docs/checkpoints.md#the-remote-tier): committed steps mirrored to
  // "s3://bucket/prefix" in the background; resume takes the newest step of either tier.
  std::string remote;
  std::string remote_endpoint;      // "" = $AWS_ENDPOINT_URL (else AWS)
  int64_t remote_keep = 3;          // committed remote steps kept; 0 keeps all
  int64_t remote_part_mb = 64;      // multipart upload above this size, in parts of it
  double remote_wait_s = 600;       // the run's end waits this long for the last upload
  void describe(ConfigFields& f);
  // The directory checkpoints go to, given the metrics folder.
  std::string resolved_dir(const std::string& metrics_dir) const;
};

// Live fault tolerance (engine/ft/replica_manager.h, docs/fault-tolerance.md): the run trains
// as `replica_groups` data-parallel replica groups, each its own job (`moetrain launch` with
// the same config but its own replica_id), that agree on a quorum every step through the
// lighthouse. Off while `lighthouse` is empty.
struct FaultToleranceConfig {
  std::string lighthouse;           // "HOST:PORT" of `moetrain lighthouse`; "" = off
  int64_t replica_id = 0;           // this group's id, 0 .. replica_groups - 1
  int64_t replica_groups = 1;       // groups the run is planned for: each reads its part of a batch
  double quorum_timeout_s = 60;     // longest wait for a quorum (the lighthouse down included)
  double timeout_s = 30;            // longest wait for another group in a collective or a state copy
  int64_t heartbeat_interval_ms = 100;
  bool enabled() const { return !lighthouse.empty(); }
  void describe(ConfigFields& f);
};

struct MetricsConfig {
  std::string dir = "runs/default";  // metrics.jsonl and the run's printed config go here
  int64_t log_every = 10;            // human log line every N steps
  bool progress = true;              // progress bar on a terminal
  bool tensorboard = true;           // rank 0 also writes TensorBoard event files to <dir>/tb
  bool detailed = true;              // collective times by kind and router entropy in the record
  int64_t prometheus_port = 0;       // > 0: rank 0 serves the latest step at http://<bind>:<port>/metrics
  std::string prometheus_bind = "0.0.0.0";
  void describe(ConfigFields& f);
};

struct RunConfig {
  ModelSection model;  // the family named by [model].model_type (default: default_model_family())
  ParallelConfig parallel;
  TrainingConfig training;
  OptimizerConfig optimizer;
  DataConfig data;
  CheckpointConfig checkpoint;
  FaultToleranceConfig fault_tolerance;
  MetricsConfig metrics;

  // Loads `path` (TOML), then applies overrides of the form "section.key=value" (the
  // leading "--" already stripped), then validates everything, cross-section checks
  // included. Errors name the file (or "command line"), section and key.
  static RunConfig load(const std::string& path, const std::vector<std::string>& overrides);
  // The full config as TOML, every key with its value.
  std::string to_toml();
};

}  // namespace moetrain
