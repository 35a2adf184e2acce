#include "engine/plan/memory_plan.h"

#include "engine/parallel/layout_choices.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/error.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/schedule.h"

namespace moetrain {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// What the rank's layers and outer parts hold: parameters (whole, before sharding) and the
// activations of one micro-batch through them.
struct Held {
  double dense = 0, experts = 0;  // parameters: every bucket but the experts' / the experts'
  double outer = 0;               // the embedding / head bucket (part of dense)
  double largest_layer = 0;       // the largest layer's parameters (ZeRO-3 gathers two at once)
  double kept = 0;                // one micro-batch's activations kept through the forward
  double backward = 0;            // the largest layer's backward extra
  double deferred = 0;            // a deferred micro-batch's expert inputs (every MoE layer)
  double recomputed = 0;          // the largest recomputed layer's kept, rebuilt at its backward
  int64_t layers = 0;
  bool head = false;
  double head_copy = 0;           // a pipeline's head helper: the head's parameters it copies
};

Held held_by(const RunConfig& cfg, const PlanLayout& l, const std::vector<int64_t>& layer_ids, bool embed, bool head,
             int act) {
  const ModelConfig& m = *cfg.model;
  const ModelShape shape = m.shape();
  const auto& t = cfg.training;
  // A rank's tokens: its 2 zigzag chunks of each sequence under context parallelism.
  const double T = static_cast<double>(t.micro_batch_size * t.seq_len) / l.cp, H = static_cast<double>(shape.hidden_size);
  const double V = static_cast<double>(shape.vocab_size);
  Held h;
  h.head = head;
  const bool all_to_all = l.ep > 1 && (cfg.parallel.ep_dispatch == "all_to_all" ||
                                       (cfg.parallel.ep_dispatch == "auto" && l.ep >= shape.experts_per_token));
  for (int64_t id : layer_ids) {
    const LayerFootprint f = m.layer_footprint(id, act);
    const double experts_here = static_cast<double>(f.experts) / l.ep;
    const double params = static_cast<double>(f.params) + experts_here * static_cast<double>(f.expert_params);
    h.dense += static_cast<double>(f.params);
    h.experts += experts_here * static_cast<double>(f.expert_params);
    h.largest_layer = std::max(h.largest_layer, params);
    const double rows = T * static_cast<double>(f.top_k);  // balanced: this rank's tokens' copies
    double kept = T * f.kept_per_token + rows * f.kept_per_row;
    if (all_to_all && f.experts > 0) kept += act * rows * H;  // the rows brought home for the combine
    // Never an MTP module's layer. Paired micro-batches (ep_overlap) take the weight gradients
    // after both input gradients, so a recomputed layer's rebuilt activations stay until
    // then: planned as kept.
    const bool recomputes = id < shape.num_layers && t.recomputes(id) && !l.ep_overlap;
    if (recomputes && t.recompute == "full") {
      h.recomputed = std::max(h.recomputed, kept);
      kept = act * T * H;  // its input
    } else if (recomputes) {  // selective: the norm/rotary outputs, and the rows when local
      const double dropped = T * f.selective_per_token + (f.experts > 0 && l.ep == 1 ? act * rows * H : 0);
      h.recomputed = std::max(h.recomputed, dropped);
      kept -= dropped;
    }
    h.kept += kept;
    // Context parallelism's ring (context_attention.cpp), at a layer's backward: the key/value
    // block in hand and the next, two blocks of their gradient sums, and on the GPU (bf16
    // activations) the sums in f32 (twice a block), the block's own bf16 dk, dv, and dq as an
    // f32 sum beside the block's bf16 dq: 7 key/value blocks and 3 query-sized tensors.
    const double q_per_token = (f.attention_per_token - f.kv_per_token) / 2;  // a query (or its gradient)
    const double ring = l.cp <= 1 ? 0 : act == 2 ? T * (7 * f.kv_per_token + 3 * q_per_token) : 4 * T * f.kv_per_token;
    h.backward = std::max(h.backward, T * f.backward_per_token + rows * f.backward_per_row + ring);
    h.deferred += rows * f.deferred_per_row;
    ++h.layers;
  }
  const double outer = static_cast<double>(m.outer_params());
  const double table = V * H;  // one of the embedding and the head
  if (embed || head) {
    const double part = embed && head ? outer : embed ? table : outer - table;
    h.dense += part;
    h.outer += part;
  }
  if (head) {
    // The final norm's input and output, the gradient at the chunk's output; the logits of
    // one chunk of rows (at most 2^28 elements), their gradient written over them.
    h.kept += 3 * act * T * H;
    h.backward = std::max(h.backward, act * std::min(T, std::max(1.0, (1 << 28) / V)) * V);
  }
  return h;
}

// Micro-batches (or DualPipeV chunk passes, as fractions of the rank's layers) in flight.
double in_flight(const PlanLayout& l, int r, int64_t micro_batches) {
  if (l.pp > 1 && l.schedule == "1f1b") return std::min<double>(l.pp - r, static_cast<double>(micro_batches));
  if (l.pp > 1) return std::min<double>(2 * l.pp + 1, 2.0 * static_cast<double>(micro_batches)) / 2;  // chunks of half
  return l.ep_overlap ? 2 : 1;
}

}  // namespace

std::string PlanLayout::str() const {
  std::string s = cp > 1 ? fmt::format("pp{} dp{} cp{} ep{}", pp, dp, cp, ep) : fmt::format("pp{} dp{} ep{}", pp, dp, ep);
  if (pp > 1) s += " " + schedule;
  if (world() > 1) s += shard_weights ? " zero3" : " zero2";
  if (ep_overlap) s += " ep_overlap";
  return s;
}

double MemoryPlan::outside_bytes() const {
  double b = 0;
  for (const MemoryPart& p : outside) b += p.bytes;
  return b;
}

namespace {

// The trainer's choices for a layout (parallel/layout_choices.h), from the planned whole
// weights and f32 gradients.
void resolve_choices(const RunConfig& cfg, PlanLayout& l, double device_bytes) {
  PlanLayout probe = l;
  probe.shard_weights = false;
  probe.ep_overlap = false;
  const MemoryPlan p = plan_memory(cfg, probe, cfg.training.device == "cuda");
  WholeWeightBytes whole{0, device_bytes};
  for (const MemoryPart& part : p.parts) {
    if (part.name == "weights" || part.name == "gradients") whole.bytes += part.bytes;
  }
  l.shard_weights = l.world() > 1 && decide_shard_weights(cfg.parallel.shard_weights, l.pp > 1, whole).on;
  l.ep_overlap = l.pp == 1 && l.ep > 1 && decide_ep_overlap(cfg, whole).on;
  if (l.ep_overlap) l.shard_weights = false;
}

}  // namespace

PlanLayout layout_of(const RunConfig& cfg, int world, double device_bytes) {
  const ParallelConfig& p = cfg.parallel;
  PlanLayout l;
  l.pp = static_cast<int>(p.pp);
  l.ep = static_cast<int>(p.ep);
  l.cp = static_cast<int>(p.cp);
  MT_CHECK(world % (l.pp * l.cp * l.ep) == 0, "plan: {} GPUs do not divide into pp {} x cp {} x ep {}", world, l.pp,
           l.cp, l.ep);
  l.dp = p.dp > 0 ? static_cast<int>(p.dp) : world / (l.pp * l.cp * l.ep);
  MT_CHECK(l.world() == world, "plan: pp {} x dp {} x cp {} x ep {} is {} ranks, not {}", l.pp, l.dp, l.cp, l.ep,
           l.world(), world);
  l.schedule = p.schedule;
  resolve_choices(cfg, l, device_bytes);
  return l;
}

std::vector<PlanLayout> layouts_of(const RunConfig& cfg, int gpus, double device_bytes) {
  const ModelShape shape = cfg.model->shape();
  std::vector<PlanLayout> out;
  const int cp = static_cast<int>(cfg.parallel.cp);  // the config's: the others stay as they are
  MT_CHECK(gpus % cp == 0, "plan: {} GPUs do not divide into [parallel].cp = {} ranks", gpus, cp);
  gpus /= cp;
  for (int pp = 1; pp <= gpus; ++pp) {
    if (gpus % pp != 0) continue;
    const int64_t chunks = pp == 1 ? 1 : (cfg.parallel.schedule == "1f1b" ? pp : 2 * pp);
    if (chunks > shape.num_layers) continue;
    for (int ep = 1; ep * pp <= gpus; ++ep) {
      if ((gpus / pp) % ep != 0 || (shape.num_experts > 0 && shape.num_experts % ep != 0)) continue;
      if (shape.num_experts == 0 && ep > 1) continue;
      PlanLayout l;
      l.pp = pp;
      l.cp = cp;
      l.ep = ep;
      l.dp = gpus / (pp * ep);
      l.schedule = cfg.parallel.schedule;
      resolve_choices(cfg, l, device_bytes);
      out.push_back(l);
    }
  }
  return out;
}

MemoryPlan plan_memory(const RunConfig& cfg, const PlanLayout& l, bool gpu, int rank) {
  const ModelShape shape = cfg.model->shape();
  const auto& t = cfg.training;
  const int act = gpu ? 2 : 4;
  const int64_t M = t.grad_accum_steps;
  const double T = static_cast<double>(t.micro_batch_size * t.seq_len) / l.cp, H = static_cast<double>(shape.hidden_size);
  const int64_t L = shape.num_layers + shape.mtp_layers;

  // The layers and outer parts of each pipeline rank.
  std::vector<Held> ranks;
  if (l.pp == 1) {
    std::vector<int64_t> all;
    for (int64_t id = 0; id < L; ++id) all.push_back(id);
    ranks.push_back(held_by(cfg, l, all, true, true, act));
  } else {  // each rank's chunks as the trainer places them (only the schedule's chunk layout is read)
    const PipelineSchedule chunk_layout = make_forward_only(l.pp, 1, l.schedule != "1f1b");
    const std::vector<ChunkSpec> chunks =
        partition_layers(shape.num_layers, chunk_layout.num_chunks, shape.mtp_layers, head_weight_in_layers(*cfg.model));
    for (int r = 0; r < l.pp; ++r) {
      const ModelPlacement mine = pipeline_placement(chunks, chunk_layout, r, {});
      ranks.push_back(held_by(cfg, l, mine.layers, mine.embed, mine.head, act));
    }
    // The head helper (pipeline/schedule.h) holds a copy of the head and its f32 gradient,
    // where the trainer would put one (the placement reads only the training schedule's shape).
    if (shape.mtp_layers == 0 && cfg.parallel.tp == 1) {
      const int m = std::max<int>(static_cast<int>(M), 2 * l.pp);
      const PipelineSchedule train_layout = l.schedule == "1f1b" ? make_1f1b(l.pp, m) : make_dualpipev(l.pp, m);
      const HeadHelp help =
          choose_head_helper(chunks, train_layout, head_weight_in_layers(*cfg.model), cfg.parallel.head_share);
      if (help.share > 0) {
        ranks[static_cast<size_t>(help.helper)].head_copy =
            static_cast<double>(shape.vocab_size) * static_cast<double>(shape.hidden_size);
      }
    }
  }

  MemoryPlan best;
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
    const Held& h = ranks[static_cast<size_t>(r)];
    MemoryPlan p;
    p.layout = l;
    p.pipeline_rank = r;
    const double P = h.dense + h.experts;
    const double value = act, grad = 4, low = gpu ? 2 : 0, moments = cfg.optimizer.moments == "bf16" ? 4 : 8;
    const bool fsdp = l.world() > 1;
    auto add = [&](const std::string& name, double bytes, const std::string& note) {
      if (bytes > 0) p.parts.push_back({name, bytes, note});
    };
    if (!fsdp) {
      add("weights", value * P, fmt::format("{:.3g} B parameters, {} bytes each", P / 1e9, act));
      add("gradients", grad * P, "f32");
      add("masters", low * P, "the f32 master's low halves (i16)");
      add("optimizer", moments * P, fmt::format("AdamW moments ({})", cfg.optimizer.moments));
    } else {
      // Shards: dense buckets over dp x ep, experts over dp; a shard holds its low half and
      // moments, and, cut over more than one rank, its reduced gradient and a scratch as large
      // (over one rank the shard's gradient is the bucket's); under ZeRO-3 its weights too.
      const double nd = static_cast<double>(l.dp) * l.cp * l.ep, ne = static_cast<double>(l.dp) * l.cp;
      auto shard = [&](double params, double n) {
        return params / n * ((n > 1 ? 2 * grad : 0) + low + moments + (l.shard_weights ? value : 0));
      };
      const double shards = shard(h.dense, nd) + shard(h.experts, ne);
      add("optimizer shards", shards,
          fmt::format("gradient, scratch, master low half, moments of 1/{} (experts 1/{}){}", l.dp * l.cp * l.ep, l.dp * l.cp,
                      l.shard_weights ? ", weights" : ""));
      if (!l.shard_weights) {
        add("weights", value * P, fmt::format("{:.3g} B parameters, whole (ZeRO-2)", P / 1e9));
        add("gradients", grad * P, "f32, whole (ZeRO-2)");
      } else {
        // Gathered: the outer bucket for the whole pass, two layers at once (the one running
        // and the next, prefetched), a layer's f32 gradients in its backward.
        add("gathered weights", value * (h.outer + 2 * h.largest_layer) + grad * (h.outer + h.largest_layer),
            "ZeRO-3: the embedding/head and two layers whole, a layer's f32 gradients");
      }
      // FSDP's constructor: under ZeRO-2 the model's whole values, gradients and low halves
      // beside every shard it makes; under ZeRO-3 the whole gradients go first and each
      // bucket's whole values once its shard is made, so the low halves, the shards and a
      // bucket's values (at most a layer's) at once, or the model as built, if more.
      p.startup_peak = l.shard_weights ? std::max((value + grad + low) * P, low * P + shards + value * h.largest_layer)
                                       : (value + grad + low) * P + shards;
    }
    add("head copy", (value + grad) * h.head_copy, "the pipeline's head helper: the head's weights and f32 gradient");
    const double flight = in_flight(l, r, M);  // DualPipeV: its chunk passes as halves of the rank's layers
    add("activations", flight * h.kept,
        fmt::format("{:.3g} micro-batch{} of {} layers kept for the backward, {:.2f} GiB each", flight,
                    flight == 1 ? "" : "es", h.layers, h.kept / kGiB));
    // Paired micro-batches run two backwards in turn, each with a layer's extras live.
    const double backwards = l.ep_overlap ? 2 : 1;
    add("backward", backwards * (h.backward + h.recomputed),
        fmt::format("{}{}", backwards == 2 ? "two micro-batches' (paired): " : "",
                    h.recomputed > 0 ? "a layer's backward, and a recomputed layer's activations" : "a layer's backward"));
    // The micro-batch loop and a pipeline's W steps alike (each chunk's W in groups).
    const bool defers = !l.shard_weights && M > 1 && t.expert_wgrad_group > 1;
    if (defers) {
      const double kept = static_cast<double>(std::min(t.expert_wgrad_group, M) - 1);
      add("deferred expert inputs", kept * h.deferred,
          fmt::format("{} micro-batches' expert rows kept for one weight-gradient pass (expert_wgrad_group)",
                      static_cast<int64_t>(kept)));
    }
    if (l.pp > 1) {  // (ep_overlap's one-rank pipeline sends nothing)
      // Every message of the step is received into a buffer of its own, and every sent one is
      // held until the step ends: 2 per micro-batch and chunk boundary the rank touches.
      const bool end_rank = r == 0 || r == l.pp - 1;
      const double boundaries = (l.schedule == "1f1b" ? 1 : 2) * (end_rank ? 1 : 2);
      add("pipeline messages", boundaries * 2 * static_cast<double>(M) * act * T * H,
          "activations and gradients sent and received this step");
    }
    add("batches", static_cast<double>(M) * 16 * T, "the step's token ids, targets, positions, segments");
    for (const MemoryPart& part : p.parts) p.training_peak += part.bytes;
    if (gpu) {
      p.outside.push_back({"CUDA context", 0.55 * kGiB, "runtime, cuBLAS, cuDNN kernels (measured order)"});
      p.outside.push_back({"cuBLASLt workspace", 32.0 * 1024 * 1024, "ops/cuda/handles.cpp"});
      if (l.ep > 1) {
        p.outside.push_back({"peer arenas", 2 * (4096 + 2.0 * l.ep * std::max(T * H * 2, 1024.0 * 1024)),
                             "the all-gather dispatch's copies into peers' memory"});
      }
      if (l.world() > 1) p.outside.push_back({"NCCL", 0.3 * kGiB, "communicator buffers (estimate)"});
    }
    if (rank >= 0) {
      if (r == rank) return p;
      continue;
    }
    if (r == 0 || p.peak() > best.peak()) best = p;
  }
  MT_CHECK(rank < 0, "plan: pipeline rank {} of a layout of pp {}", rank, l.pp);
  return best;
}

void check_memory_at_start(const RunConfig& cfg, int pp, int dp, int cp, int ep, double device_bytes, bool log,
                           bool refuse) {
  PlanLayout l;
  l.pp = pp;
  l.dp = dp;
  l.cp = cp;
  l.ep = ep;
  l.schedule = cfg.parallel.schedule;
  resolve_choices(cfg, l, device_bytes);
  const MemoryPlan p = plan_memory(cfg, l, /*gpu=*/true);
  const double total = p.peak() + p.outside_bytes();
  if (log) {
    spdlog::info("memory plan: {} needs ~{:.1f} GiB a GPU (peak {:.1f} + {:.1f} outside the allocator) of {:.1f}: {} "
                 "(the parts: moetrain plan --config ...)",
                 l.str(), total / kGiB, p.peak() / kGiB, p.outside_bytes() / kGiB, device_bytes / kGiB,
                 p.fits(device_bytes) ? "fits" : "does NOT fit");
  }
  MT_CHECK(p.fits(device_bytes) || !refuse,
           "the run will not fit the GPU's memory: the plan needs ~{:.1f} GiB of {:.1f}\n{}Lower the micro-batch, "
           "use [training].recompute = \"full\", [optimizer].moments = \"bf16\", more ranks (moetrain plan --gpus N "
           "lists the layouts), or skip this check with --training.check_memory=false",
           total / kGiB, device_bytes / kGiB, format_memory_plan(p, device_bytes));
}

std::string format_memory_plan(const MemoryPlan& p, double device_bytes) {
  std::string out = fmt::format("memory plan: {} (pipeline rank {}), GiB per GPU\n", p.layout.str(), p.pipeline_rank);
  for (const MemoryPart& part : p.parts) {
    out += fmt::format("  {:<24} {:>8.2f}  {}\n", part.name, part.bytes / kGiB, part.note);
  }
  out += fmt::format("  {:<24} {:>8.2f}  (what peak_memory_bytes measures)\n", "training peak", p.training_peak / kGiB);
  if (p.startup_peak > 0) {
    out += fmt::format("  {:<24} {:>8.2f}  FSDP's start: the model as built, or its shards beside what is left\n",
                       "start-up peak",
                       p.startup_peak / kGiB);
  }
  for (const MemoryPart& part : p.outside) {
    out += fmt::format("  {:<24} {:>8.2f}  {} (not in the peak)\n", part.name, part.bytes / kGiB, part.note);
  }
  const double total = p.peak() + p.outside_bytes();
  out += fmt::format("  {:<24} {:>8.2f}  of {:.1f}: {}\n", "total", total / kGiB, device_bytes / kGiB,
                     p.fits(device_bytes) ? "fits" : "does NOT fit");
  return out;
}

std::string format_memory_plans(const std::vector<MemoryPlan>& plans, double device_bytes) {
  std::string out = fmt::format("{:<34} {:>10} {:>10} {:>10}  {}\n", "layout", "peak GiB", "outside", "total",
                                fmt::format("of {:.1f} GiB", device_bytes / kGiB));
  for (const MemoryPlan& p : plans) {
    out += fmt::format("{:<34} {:>10.2f} {:>10.2f} {:>10.2f}  {}\n", p.layout.str(), p.peak() / kGiB,
                       p.outside_bytes() / kGiB, (p.peak() + p.outside_bytes()) / kGiB,
                       p.fits(device_bytes) ? "fits" : "does not fit");
  }
  return out;
}

}  // namespace moetrain
