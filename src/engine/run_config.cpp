#include "engine/run_config.h"

#include <algorithm>

#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <toml++/toml.h>

#include "comm/mesh.h"
#include "core/error.h"
#include "core/log.h"

namespace moetrain {
namespace {

// lo <= v < hi
ConfigFields::Check in_half_open(const double* v, double lo, double hi) {
  return [v, lo, hi]() -> std::optional<std::string> {
    if (*v >= lo && *v < hi) return std::nullopt;
    return fmt::format("must be in [{}, {}), got {}", lo, hi, *v);
  };
}

}  // namespace

void ParallelConfig::describe(ConfigFields& f) {
  f.add("pp", &pp, "pipeline-parallel stages", positive(&pp));
  f.add("schedule", &schedule,
        "pipeline schedule (pp > 1): dualpipev (2 * pp chunks in a V, needs grad_accum_steps >= 2 * pp) or 1f1b",
        one_of(&schedule, {"dualpipev", "1f1b"}));
  f.add("cp", &cp,
        "context-parallel ranks: every sequence cut into 2 cp chunks, rank r holding chunks r and 2cp-1-r; keys and "
        "values passed round them (CPU), or gathered into whole sequences (GPU, for now): docs/memory.md",
        positive(&cp));
  f.add("tp", &tp,
        "tensor-parallel ranks (neighbours, inside a node): q/k/v and gate/up split by heads / columns, o_proj and "
        "down_proj by rows, embedding and head by vocabulary; norms, residuals and the router on 1/tp of the tokens "
        "(sequence parallelism); MoE layers put their experts on the tp x ep ranks: docs/parallel.md",
        positive(&tp));
  f.add("fold_experts", &fold_experts,
        "tp > 1: true puts the MoE layers' experts on the tp x ep ranks (each tp rank its own experts); false gives "
        "every tp rank the ep rank's experts, each running its own tokens through them (gradients summed over tp)");
  f.add("ep", &ep, "expert-parallel ranks (experts split evenly over them)", positive(&ep));
  f.add("dp", &dp, "data-parallel ranks, sharded (ZeRO); -1 = world / (pp * cp * tp * ep)",
        [this]() -> std::optional<std::string> {
          if (dp == -1 || dp >= 1) return std::nullopt;
          return fmt::format("must be -1 (inferred) or >= 1, got {}", dp);
        });
  f.add("dp_replicate", &dp_replicate,
        "HSDP: replica groups the dp ranks split into (shard within a group, all-reduce gradients across); 1 = FSDP",
        positive(&dp_replicate));
  f.add("shard_weights", &shard_weights,
        "many ranks: true shards the weights too and gathers each layer's when used, every micro-batch (ZeRO-3); "
        "false keeps weights and gradients whole between one gather and one reduce-scatter a step (ZeRO-2); auto: "
        "ZeRO-2 when a rank's whole weights and f32 gradients fit in a quarter of its memory",
        one_of(&shard_weights, {"auto", "true", "false"}));
  f.add("head_share", &head_share,
        "pp > 1: share of each micro-batch's token rows whose output head another pipeline rank computes (with a "
        "copy of the head, its gradient added back each step); -1 auto: what evens out the head's rank and the "
        "lightest other one when the layers cannot (off under 5%, tp > 1 or MTP modules); 0 off",
        [this]() -> std::optional<std::string> {
          if (head_share == -1 || (head_share >= 0 && head_share < 1)) return std::nullopt;
          return fmt::format("must be -1 (auto) or in [0, 1), got {}", head_share);
        });
  f.add("ep_overlap", &ep_overlap,
        "ep > 1, pp = 1: run the micro-batches as DualPipeV on one rank (two chunks, overlapped forward/backward "
        "pairs) so one micro-batch's expert exchange hides under another's compute; grad_accum_steps >= 2, weights "
        "kept whole (ZeRO-2); auto: on GPUs with >= 2 micro-batches when shard_weights is not true and whole "
        "weights fit",
        one_of(&ep_overlap, {"auto", "true", "false"}));
  f.add("ep_dispatch", &ep_dispatch,
        "ep > 1: all_to_all sends each (token, routed expert) copy to its expert's rank; all_gather sends each token "
        "once to every EP rank and combines on the experts' side (top_k / ep times fewer bytes); auto: all_gather "
        "when ep < top_k",
        one_of(&ep_dispatch, {"auto", "all_to_all", "all_gather"}));
  f.add("ep_transport", &ep_transport,
        "ep_dispatch = all_gather on GPUs: auto copies token rows straight into the peer GPUs' memory over NVLink "
        "(copy engines, no SMs) when every EP rank shares this host, else NCCL; nccl: always NCCL",
        one_of(&ep_transport, {"auto", "nccl"}));
  f.add("fallbacks", &fallbacks,
        "layouts to use, in order, when this one does not fit the ranks there are (an elastic restart on fewer "
        "nodes): each \"key=value ...\" over pp, dp, cp, tp, ep, dp_replicate, schedule, shard_weights; e.g. [\"ep=2\"]",
        [this]() -> std::optional<std::string> {
          for (const std::string& fb : fallbacks) {
            try {
              (void)with(fb);
            } catch (const Error& e) {
              return fmt::format("entry '{}': {}", fb, e.what());
            }
          }
          return std::nullopt;
        });
  f.add("check_exchange", &check_exchange,
        "debug: check token conservation over the EP group at every expert dispatch (one all-gather and host wait "
        "each)");
}

ParallelConfig ParallelConfig::with(const std::string& fallback) const {
  ParallelConfig c = *this;
  c.fallbacks.clear();
  ConfigFields f("parallel");
  c.describe(f);
  const std::string origin = fmt::format("[parallel].fallbacks entry '{}'", fallback);
  std::string rest = fallback;
  int keys = 0;
  for (char& ch : rest) {
    if (ch == ',') ch = ' ';
  }
  size_t at = 0;
  while ((at = rest.find_first_not_of(' ', at)) != std::string::npos) {
    const size_t end = rest.find(' ', at);
    const std::string item = rest.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end;
    const size_t eq = item.find('=');
    MT_CHECK(eq != std::string::npos && eq > 0, "{}: '{}' is not key=value", origin, item);
    const std::string key = item.substr(0, eq);
    MT_CHECK(key != "fallbacks", "{}: a fallback cannot list fallbacks", origin);
    f.set_from_string(key, item.substr(eq + 1), origin);
    ++keys;
  }
  MT_CHECK(keys > 0, "{}: sets no key (write e.g. \"ep=2\")", origin);
  f.validate(origin);
  return c;
}

bool ParallelConfig::fits(int64_t world) const {
  try {
    Mesh(world, pp, dp, cp, ep, tp);
    return true;
  } catch (const Error&) {
    return false;
  }
}

ParallelConfig ParallelConfig::for_world(int64_t world) const {
  if (fits(world)) return *this;
  std::string tried = fmt::format("pp={} dp={} cp={} tp={} ep={}", pp, dp, cp, tp, ep);
  for (const std::string& fb : fallbacks) {
    ParallelConfig c = with(fb);
    if (c.fits(world)) {
      spdlog::warn("parallel: [parallel] (pp={} dp={} cp={} tp={} ep={}) does not fit {} ranks; using fallback '{}'",
                   pp, dp, cp, tp, ep, world, fb);
      c.fallbacks = fallbacks;
      return c;
    }
    tried += "; " + fb;
  }
  MT_CHECK(fallbacks.empty(), "[parallel]: neither the layout nor any of its fallbacks fits {} ranks (tried {})", world,
           tried);
  return *this;  // ParallelContext::build says why it does not fit
}

void TrainingConfig::describe(ConfigFields& f) {
  f.add("steps", &steps, "optimizer steps to train", positive(&steps));
  f.add("micro_batch_size", &micro_batch_size, "sequences per micro-batch", positive(&micro_batch_size));
  f.add("seq_len", &seq_len, "tokens per sequence", positive(&seq_len));
  f.add("grad_accum_steps", &grad_accum_steps, "micro-batches per optimizer step", positive(&grad_accum_steps));
  f.add("seed", &seed, "seed of initialisation, data order and sampling", non_negative(&seed));
  f.add("device", &device, "where to train: cpu (f32) or cuda (bf16 compute, f32 masters, GPU 0)",
        one_of(&device, {"cpu", "cuda"}));
  f.add("grad_clip", &grad_clip, "clip the global gradient norm to this; 0 disables", non_negative(&grad_clip));
  f.add("eval_every", &eval_every, "validation loss every N steps (and at step 0 and the end)",
        positive(&eval_every));
  f.add("eval_batches", &eval_batches, "micro-batches per validation", positive(&eval_batches));
  f.add("sample_tokens", &sample_tokens, "tokens sampled at the end of the run; 0 disables",
        non_negative(&sample_tokens));
  f.add("sample_prompt", &sample_prompt, "text the end-of-run sample starts from");
  f.add("sample_temperature", &sample_temperature, "softmax temperature of the sample",
        positive(&sample_temperature));
  f.add("threads", &threads, "CPU threads; 0 = all cores", non_negative(&threads));
  f.add("expert_wgrad_group", &expert_wgrad_group,
        "with grad_accum_steps > 1: the expert weight gradients of this many micro-batches in one pass (fewer f32 "
        "read-modify-writes; their inputs kept meanwhile); 1 = one pass each",
        positive(&expert_wgrad_group));
  f.add("deterministic", &deterministic,
        "bitwise-repeatable kernels; false: the GPU attention backward adds dQ with atomics in one pass (faster)");
  f.add("fp8", &fp8,
        "block-scaled FP8 (e4m3) for the layers' projections (DeepSeek-V3's recipe; experts, router, head stay BF16 "
        "for now: docs/fp8.md)");
  f.add("recompute", &recompute,
        "activation recomputation: none; selective (norm and rotary outputs, and expert input rows that are a local "
        "permutation, made again before the backward); or full (a layer keeps only its input and redoes its "
        "forward, the expert exchange included). Same gradients, bit for bit",
        one_of(&recompute, {"none", "selective", "full"}));
  f.add("recompute_layers", &recompute_layers,
        "with recompute: the decoder layer ids it applies to; empty = every layer");
  f.add("check_memory", &check_memory,
        "on GPUs: stop before allocating when the memory plan (moetrain plan) says the run will not fit");
  f.add("stop_after_steps", &stop_after_steps,
        "end this process after this many steps (the schedule still spans steps); 0 = run to the end",
        non_negative(&stop_after_steps));
}

bool TrainingConfig::recomputes(int64_t id) const {
  return recompute != "none" && (recompute_layers.empty() ||
                                 std::find(recompute_layers.begin(), recompute_layers.end(), id) != recompute_layers.end());
}

void OptimizerConfig::describe(ConfigFields& f) {
  f.add("name", &name, "optimizer: adamw", one_of(&name, {"adamw"}));
  f.add("lr", &lr, "peak learning rate", positive(&lr));
  f.add("min_lr", &min_lr, "learning rate at the end of the decay", non_negative(&min_lr));
  f.add("beta1", &beta1, "AdamW first-moment decay", in_half_open(&beta1, 0, 1));
  f.add("beta2", &beta2, "AdamW second-moment decay", in_half_open(&beta2, 0, 1));
  f.add("eps", &eps, "AdamW denominator epsilon", positive(&eps));
  f.add("weight_decay", &weight_decay, "decoupled weight decay (matrices only)", non_negative(&weight_decay));
  f.add("moments", &moments,
        "dtype of the AdamW moments: f32, or bf16 (half their memory and optimizer traffic; stochastic rounding)",
        one_of(&moments, {"f32", "bf16"}));
  f.add("overlap", &overlap,
        "one GPU: gradient norm and AdamW on a second stream, under the backward and the next forward (same results)");
  f.add("overlap_sms", &overlap_sms,
        "with overlap: multiprocessors a later layer's AdamW update may occupy, the next forward running on the "
        "rest (0 = all; at most 4096)",
        in_range(&overlap_sms, 0, 4096));
  f.add("schedule", &schedule, "learning-rate schedule: cosine, wsd (warmup-stable-decay) or constant",
        one_of(&schedule, {"cosine", "wsd", "constant"}));
  f.add("warmup_steps", &warmup_steps, "linear warmup from 0 to lr over this many steps", non_negative(&warmup_steps));
  f.add("decay_fraction", &decay_fraction, "wsd: last fraction of the steps that decays to min_lr",
        in_range(&decay_fraction, 0, 1));
}

void DataConfig::describe(ConfigFields& f) {
  f.add("kind", &kind,
        "data format: text (plain text files, fortune '%' separators), shards (token shards of moetrain tokenize) "
        "or sft (chat JSONL, loss on the assistant tokens)",
        [this, known = one_of(&kind, {"text", "shards", "sft"})]() -> std::optional<std::string> {
          if (auto err = known()) return err;
          if (kind == "sft" && tokenizer == "byte") {
            return "= \"sft\" needs a tokenizer with the chat template's special tokens (<|im_start|>, <|im_end|>); "
                   "[data].tokenizer = \"byte\" has none: name a chat model's tokenizer.json";
          }
          return std::nullopt;
        });
  f.add("tokenizer", &tokenizer, "tokenizer: byte (256 bytes + end-of-text), a tokenizer.json, or a folder holding one",
        [this]() -> std::optional<std::string> {
          if (tokenizer.empty()) return "must be \"byte\" or the path of a tokenizer.json (or of its folder)";
          return std::nullopt;
        });
  f.add("paths", &paths,
        "text: files or folders of text (folders read recursively); shards: folders of token shards; sft: JSONL "
        "files or folders of them",
        [this]() -> std::optional<std::string> {
          if (paths.empty()) return "must name at least one file or folder";
          for (const auto& p : paths) {
            if (p.empty()) return "must not hold an empty path";
          }
          return std::nullopt;
        });
  f.add("val_fraction", &val_fraction,
        "share held out for validation: of the documents (text) or conversations (sft), or the stream's last tokens "
        "(shards)",
        [this]() -> std::optional<std::string> {
          if (val_fraction > 0 && val_fraction < 1) return std::nullopt;
          return fmt::format("must be in (0, 1), got {}", val_fraction);
        });
  f.add("chat_template", &chat_template, "sft: how a conversation is rendered: chatml (<|im_start|>role ... <|im_end|>)",
        one_of(&chat_template, {"chatml"}));
  f.add("packing", &packing,
        "sft: pack several conversations into each sequence (attention kept within each); false: one per sequence");
}

void CheckpointConfig::describe(ConfigFields& f) {
  f.add("dir", &dir, "folder of the run's checkpoints; empty = <metrics.dir>/checkpoints");
  f.add("every", &every, "save every N steps; 0 = only the final save", non_negative(&every));
  f.add("save_final", &save_final, "save after the last step of the process");
  f.add("keep", &keep, "committed checkpoints kept (the oldest are deleted); 0 keeps all", non_negative(&keep));
  f.add("async", &async, "write checkpoints in the background after a copy to host memory");
  f.add("resume", &resume, "auto (the newest checkpoint in dir, if any), never, or a step directory",
        [this]() -> std::optional<std::string> {
          if (resume.empty()) return "must be auto, never or a checkpoint directory";
          return std::nullopt;
        });
  f.add("init_from", &init_from, "Hugging Face model folder or moetrain checkpoint to take the weights from");
  f.add("remote", &remote,
        "s3://bucket/prefix: mirror each committed step there in the background (credentials from AWS_*); "
        "empty = local only",
        [this]() -> std::optional<std::string> {
          if (!remote.empty() && (remote.rfind("s3://", 0) != 0 || remote.size() <= 5 || remote[5] == '/')) {
            return "must be empty or s3://bucket[/prefix]";
          }
          return std::nullopt;
        });
  f.add("remote_endpoint", &remote_endpoint,
        "S3 endpoint URL (http://host:port for MinIO and the like); empty = $AWS_ENDPOINT_URL, else AWS");
  f.add("remote_keep", &remote_keep, "committed steps kept on the remote tier; 0 keeps all", non_negative(&remote_keep));
  f.add("remote_part_mb", &remote_part_mb, "files above this many MB go up in parts of it (multipart upload)",
        in_range(&remote_part_mb, 5, 5120));
  f.add("remote_wait_s", &remote_wait_s, "seconds the end of a run waits for its last upload",
        non_negative(&remote_wait_s));
}

std::string CheckpointConfig::resolved_dir(const std::string& metrics_dir) const {
  return dir.empty() ? (std::filesystem::path(metrics_dir) / "checkpoints").string() : dir;
}

void FaultToleranceConfig::describe(ConfigFields& f) {
  f.add("lighthouse", &lighthouse,
        "HOST:PORT of `moetrain lighthouse`: train as one of several replica groups that agree on a quorum each "
        "step, drop a failed group and heal a returning one from a peer; empty = off");
  f.add("replica_id", &replica_id, "this replica group's id, 0 .. replica_groups - 1 (one per launched group)",
        non_negative(&replica_id));
  f.add("replica_groups", &replica_groups,
        "replica groups the run is planned for: each global batch is cut into that many parts, one per group "
        "(a missing group's part is not trained on)",
        positive(&replica_groups));
  f.add("quorum_timeout_s", &quorum_timeout_s,
        "longest wait for a quorum, the lighthouse being down included; then the group stops with an error",
        positive(&quorum_timeout_s));
  f.add("timeout_s", &timeout_s,
        "longest wait for another replica group in a collective or a state copy; then the step is discarded and "
        "a new quorum formed",
        positive(&timeout_s));
  f.add("heartbeat_interval_ms", &heartbeat_interval_ms, "how often the group tells the lighthouse it is alive",
        positive(&heartbeat_interval_ms));
}

void MetricsConfig::describe(ConfigFields& f) {
  f.add("dir", &dir, "folder for metrics.jsonl and the run's printed config", [this]() -> std::optional<std::string> {
    if (dir.empty()) return "must not be empty";
    return std::nullopt;
  });
  f.add("log_every", &log_every, "human log line every N steps", positive(&log_every));
  f.add("progress", &progress, "progress bar on a terminal");
  f.add("detailed", &detailed,
        "the record's costlier parts: each kind of collective's time and hidden share (CUDA events around every "
        "collective) and every MoE layer's router entropy (a reduction per layer and micro-batch)");
  f.add("tensorboard", &tensorboard,
        "rank 0 also writes every metric, and per MoE layer a histogram of tokens per expert, as TensorBoard event "
        "files in <dir>/tb (tensorboard --logdir <dir>/tb)");
  f.add("prometheus_port", &prometheus_port,
        "> 0: rank 0 serves the latest step's metrics for Prometheus at http://<prometheus_bind>:<port>/metrics; 0: "
        "off",
        [this]() -> std::optional<std::string> {
          if (prometheus_port >= 0 && prometheus_port <= 65535) return std::nullopt;
          return fmt::format("must be a TCP port in [0, 65535] (0: off), got {}", prometheus_port);
        });
  f.add("prometheus_bind", &prometheus_bind,
        "the address the Prometheus endpoint listens on (0.0.0.0: every interface; 127.0.0.1: this machine only)");
}

namespace {

// The sections of a RunConfig, in file order, each with its fields.
struct Sections {
  std::vector<ConfigFields> list;
  explicit Sections(RunConfig& c) {
    list.emplace_back("model");
    c.model->describe(list.back());
    list.emplace_back("parallel");
    c.parallel.describe(list.back());
    list.emplace_back("training");
    c.training.describe(list.back());
    list.emplace_back("optimizer");
    c.optimizer.describe(list.back());
    list.emplace_back("data");
    c.data.describe(list.back());
    list.emplace_back("checkpoint");
    c.checkpoint.describe(list.back());
    list.emplace_back("fault_tolerance");
    c.fault_tolerance.describe(list.back());
    list.emplace_back("metrics");
    c.metrics.describe(list.back());
  }
  ConfigFields* find(const std::string& name) {
    for (auto& s : list) {
      if (s.section() == name) return &s;
    }
    return nullptr;
  }
  std::vector<std::string> names() const {
    std::vector<std::string> n;
    for (const auto& s : list) n.push_back(s.section());
    return n;
  }
};

std::string unknown_section_hint(const std::string& name, const std::vector<std::string>& known) {
  if (auto m = closest_match(name, known)) return fmt::format(" (did you mean '{}'?)", *m);
  return fmt::format(" (known sections: {})", fmt::join(known, ", "));
}

struct Override {
  std::string text;  // as given, for errors
  std::string section, key, value;
  std::string origin() const { return fmt::format("command line override '{}'", text); }
};

Override parse_override(std::string text) {
  if (text.rfind("--", 0) == 0) text = text.substr(2);
  Override o;
  o.text = text;
  const size_t eq = text.find('=');
  const size_t dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq || dot == 0 || dot + 1 == eq) {
    MT_THROW("command line: override '{}' is not of the form section.key=value (e.g. training.steps=100)", text);
  }
  o.section = text.substr(0, dot);
  o.key = text.substr(dot + 1, eq - dot - 1);
  o.value = text.substr(eq + 1);
  return o;
}

// `p` as an absolute path, a relative one taken from `base` (a folder; empty: the working
// folder), so that the printed config still points at the same file from anywhere.
std::string absolute_from(const std::filesystem::path& base, const std::string& p) {
  if (p.empty()) return p;
  std::filesystem::path path(p);
  if (path.is_relative() && !base.empty()) path = base / path;
  return std::filesystem::absolute(path).lexically_normal().string();
}

}  // namespace

RunConfig RunConfig::load(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  MT_CHECK(std::filesystem::exists(path, ec), "config file '{}' does not exist", path);
  MT_CHECK(!std::filesystem::is_directory(path, ec), "config file '{}' is a folder, not a TOML file", path);

  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    MT_THROW("{}:{}:{}: TOML parse error: {}", path, e.source().begin.line, e.source().begin.column, e.description());
  }

  std::vector<Override> parsed;
  for (const auto& text : overrides) parsed.push_back(parse_override(text));

  // [model] may point at an HF config.json: read it first, so that the other [model] keys
  // (and overrides) win over it. A run initialised from a model folder takes its shape from
  // the folder's config.json unless [model].config_json names another one.
  const toml::table* model_table = root["model"].as_table();
  const std::filesystem::path toml_dir = std::filesystem::path(path).parent_path();
  // A string key of [model], the command line's value winning; a path relative to the TOML
  // file's folder (command line: the working folder) is made absolute.
  std::string origin = path;  // of the last key model_string read, for errors
  auto model_string = [&](const std::string& key, bool is_path) {
    std::string value;
    origin = path;
    if (model_table != nullptr) {
      if (const toml::node* n = model_table->get(key)) {
        const auto v = n->value<std::string>();
        MT_CHECK(v.has_value(), "{}:{}: [model].{} must be a string", path, n->source().begin.line, key);
        value = is_path ? absolute_from(toml_dir, *v) : *v;
      }
    }
    for (const auto& o : parsed) {
      if (o.section == "model" && o.key == key) {
        value = is_path ? absolute_from({}, o.value) : o.value;
        origin = o.origin();
      }
    }
    return value;
  };
  std::string json_path = model_string("config_json", true);
  if (json_path.empty()) {
    std::string init_from;
    if (const toml::table* ck = root["checkpoint"].as_table()) {
      if (auto v = (*ck)["init_from"].value<std::string>()) init_from = absolute_from(toml_dir, *v);
    }
    for (const auto& o : parsed) {
      if (o.section == "checkpoint" && o.key == "init_from") init_from = absolute_from({}, o.value);
    }
    if (!init_from.empty() && std::filesystem::exists(std::filesystem::path(init_from) / "config.json")) {
      json_path = (std::filesystem::path(init_from) / "config.json").string();
    }
  }
  // The family: [model].model_type (file or command line), else the HF config's, else the default.
  std::string family = model_string("model_type", false);
  if (family.empty() && !json_path.empty()) {
    family = hf_model_type(json_path);
    origin = json_path;
  }
  if (family.empty()) family = default_model_family();

  RunConfig cfg;
  cfg.model = ModelSection(make_model_config(family, origin));
  Sections sections(cfg);
  const std::vector<std::string> known = sections.names();

  // Every top-level entry must be one of our section tables.
  for (auto&& [k, node] : root) {
    const std::string name(k.str());
    const std::string at = fmt::format("{}:{}", path, k.source().begin.line);
    if (sections.find(name) == nullptr) {
      MT_THROW("{}: unknown section [{}]{}", at, name, unknown_section_hint(name, known));
    }
    MT_CHECK(node.is_table(), "{}: [{}] must be a section (a table), got a {} value", at, name,
             node.is_array() ? "list" : "plain");
  }

  for (const Override& o : parsed) {
    if (sections.find(o.section) == nullptr) {
      MT_THROW("{}: unknown section [{}]{}", o.origin(), o.section, unknown_section_hint(o.section, known));
    }
  }

  if (!json_path.empty()) cfg.model->load_hf_json(json_path);

  for (auto& s : sections.list) {
    if (const toml::table* t = root[s.section()].as_table()) s.load(*t, path);
  }
  cfg.model->config_json = json_path;

  // Validation errors name the line of the key in the file, or the command line when the
  // key was overridden there.
  std::map<std::string, std::string> origin_of;
  for (auto&& [sk, snode] : root) {
    for (auto&& [k, node] : *snode.as_table()) {
      const auto& b = node.source().begin;
      origin_of[fmt::format("{}.{}", sk.str(), k.str())] = fmt::format("{}:{}:{}", path, b.line, b.column);
    }
  }
  for (const auto& o : parsed) {
    sections.find(o.section)->set_from_string(o.key, o.value, o.origin());
    origin_of[o.section + "." + o.key] = o.origin();
  }

  for (const auto& s : sections.list) {
    for (const auto& f : s.fields()) {
      if (!f.check) continue;
      if (auto err = f.check()) {
        auto it = origin_of.find(s.section() + "." + f.key);
        MT_THROW("{}: [{}].{} {}", it == origin_of.end() ? path : it->second, s.section(), f.key, *err);
      }
    }
  }
  cfg.model->validate(path);
  const ModelShape shape = cfg.model->shape();

  // Cross-section checks.
  const auto& t = cfg.training;
  const auto& o = cfg.optimizer;
  MT_CHECK(o.warmup_steps <= t.steps, "{}: [optimizer].warmup_steps ({}) must be <= [training].steps ({})", path,
           o.warmup_steps, t.steps);
  // MoE layers put their experts on the tp x ep ranks (tensor parallelism folds into expert
  // parallelism there), or on the ep ranks when not folded.
  auto expert_ranks = [](const ParallelConfig& p) { return p.fold_experts ? p.tp * p.ep : p.ep; };
  MT_CHECK(shape.num_experts == 0 || shape.num_experts % expert_ranks(cfg.parallel) == 0,
           "{}: [model] has {} experts, which must be a multiple of the {} expert ranks ([parallel].tp x ep = {} x {}{}): "
           "experts are split evenly",
           path, shape.num_experts, expert_ranks(cfg.parallel), cfg.parallel.tp, cfg.parallel.ep,
           cfg.parallel.fold_experts ? "" : ", not folded: ep");
  for (const std::string& fb : cfg.parallel.fallbacks) {
    const ParallelConfig f = cfg.parallel.with(fb);
    MT_CHECK(shape.num_experts == 0 || shape.num_experts % expert_ranks(f) == 0,
             "{}: [parallel].fallbacks entry '{}': [model] has {} experts, not a multiple of tp x ep = {} x {}", path,
             fb, shape.num_experts, f.tp, f.ep);
    if (f.tp > 1) cfg.model->validate_tensor_parallel(f.tp, fmt::format("{}: [parallel].fallbacks entry '{}'", path, fb));
  }
  if (cfg.parallel.tp > 1) {
    const int64_t tp = cfg.parallel.tp;
    cfg.model->validate_tensor_parallel(tp, fmt::format("{}: [parallel].tp = {}", path, tp));
    MT_CHECK(t.micro_batch_size * t.seq_len % tp == 0,
             "{}: [training].micro_batch_size x seq_len ({} x {}) must be a multiple of [parallel].tp ({}): sequence "
             "parallelism gives each tp rank an equal slice of a micro-batch's tokens",
             path, t.micro_batch_size, t.seq_len, tp);
    MT_CHECK(cfg.parallel.cp == 1,
             "{}: [parallel].tp = {} with cp = {}: tensor and context parallelism together are not built yet; use one",
             path, tp, cfg.parallel.cp);
    MT_CHECK(t.recompute != "selective",
             "{}: [parallel].tp = {} with [training].recompute = \"selective\" is not built yet (the dropped norm "
             "outputs would need gathering again); use \"full\" or \"none\"",
             path, tp);
  }
  MT_CHECK(cfg.fault_tolerance.replica_id < cfg.fault_tolerance.replica_groups,
           "{}: [fault_tolerance].replica_id ({}) must be below [fault_tolerance].replica_groups ({})", path,
           cfg.fault_tolerance.replica_id, cfg.fault_tolerance.replica_groups);
  MT_CHECK(!cfg.fault_tolerance.enabled() || cfg.parallel.dp_replicate == 1,
           "{}: [parallel].dp_replicate = {} with [fault_tolerance]: the replica groups of live fault tolerance "
           "replace HSDP's; shard inside each group (dp_replicate = 1) and run more groups instead",
           path, cfg.parallel.dp_replicate);
  for (int64_t id : t.recompute_layers) {
    MT_CHECK(id >= 0 && id < shape.num_layers,
             "{}: [training].recompute_layers names layer {}, but the model's decoder layers are 0..{}", path, id,
             shape.num_layers - 1);
  }
  MT_CHECK(t.recompute_layers.empty() || t.recompute != "none",
           "{}: [training].recompute_layers is set but [training].recompute is \"none\" (say \"selective\" or \"full\")", path);
  if (cfg.parallel.cp > 1) {
    const int64_t cp = cfg.parallel.cp;
    MT_CHECK(t.seq_len % (2 * cp) == 0,
             "{}: [training].seq_len ({}) must be a multiple of 2 x [parallel].cp ({}): each sequence is cut into 2 cp "
             "equal chunks", path, t.seq_len, 2 * cp);
  }
  MT_CHECK(o.min_lr <= o.lr, "{}: [optimizer].min_lr ({}) must be <= [optimizer].lr ({})", path, o.min_lr, o.lr);
  MT_CHECK(t.seq_len <= shape.max_positions,
           "{}: [training].seq_len ({}) must be <= [model].max_position_embeddings ({})", path, t.seq_len,
           shape.max_positions);
  if (cfg.data.tokenizer == "byte") {
    MT_CHECK(shape.vocab_size >= 257,
             "{}: [model].vocab_size ({}) is too small for the byte tokenizer, which needs 257 (256 bytes + "
             "end-of-text)",
             path, shape.vocab_size);
  }
  return cfg;
}

std::string RunConfig::to_toml() {
  Sections sections(*this);
  std::string out;
  for (const auto& s : sections.list) {
    if (!out.empty()) out += "\n";
    out += fmt::format("[{}]\n", s.section());
    out += s.to_toml();
  }
  return out;
}

}  // namespace moetrain
