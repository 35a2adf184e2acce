#include "engine/telemetry/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain {

MetricsWriter::MetricsWriter(const std::string& dir, bool append) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MT_CHECK(!ec, "metrics: cannot create folder '{}': {}", dir, ec.message());
  path_ = (std::filesystem::path(dir) / "metrics.jsonl").string();
  out_.open(path_, append ? std::ios::app : std::ios::trunc);
  MT_CHECK(out_.is_open(), "metrics: cannot open '{}' for writing", path_);
}

std::string metrics_json(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["loss"] = m.loss;
  j["aux_loss"] = m.aux_loss;
  if (!m.loss_terms.empty()) {
    j["loss_terms"] = nlohmann::json::object();
    for (const auto& [name, value] : m.loss_terms) j["loss_terms"][name] = value;
  }
  j["lr"] = m.lr;
  j["grad_norm"] = m.grad_norm;
  j["tokens_per_s"] = m.tokens_per_s;
  j["tflops"] = m.tflops;
  j["step_time_s"] = m.step_time_s;
  j["expert_load_max_over_mean"] = m.expert_load_max_over_mean;
  if (m.router_bias) j["router_bias"] = {{"abs_max", m.router_bias->abs_max}, {"range", m.router_bias->range}};
  j["peak_memory_bytes"] = m.peak_memory_bytes;
  j["tokens"] = m.tokens;
  j["val_loss"] = m.val_loss ? nlohmann::json(*m.val_loss) : nlohmann::json(nullptr);
  if (m.checkpoint_stall_s) j["checkpoint_stall_s"] = *m.checkpoint_stall_s;
  j["restart_generation"] = m.restart_generation;
  j["world_size"] = m.world_size;
  if (m.restart_downtime_s) j["restart_downtime_s"] = *m.restart_downtime_s;
  j["memory"] = {{"peak_bytes", m.peak_memory_bytes},
                 {"live_bytes", m.live_memory_bytes},
                 {"reserved_bytes", m.reserved_memory_bytes},
                 {"growth_bytes", m.memory_growth_bytes},
                 {"pinned_host_bytes", m.pinned_host_bytes}};
  j["infra"] = {{"world_size", m.world_size}, {"restart_generation", m.restart_generation}, {"layout", m.layout}};
  if (m.checkpoint_stall_s) j["infra"]["checkpoint_stall_ms"] = *m.checkpoint_stall_s * 1e3;
  if (m.checkpoint_commit) {
    j["infra"]["checkpoint_commit"] = {{"saved_step", m.checkpoint_commit->step},
                                       {"ms", m.checkpoint_commit->seconds * 1e3},
                                       {"bytes", m.checkpoint_commit->bytes}};
  }
  if (m.replicas) {
    const StepMetrics::Replicas& r = *m.replicas;
    j["replicas_in_quorum"] = r.in_quorum;
    j["quorum_ms"] = r.quorum_ms;
    j["recovered_from"] = r.recovered_from ? nlohmann::json(*r.recovered_from) : nlohmann::json(nullptr);
    j["fault_tolerance"] = {{"quorum_id", r.quorum_id}, {"heal_bytes", r.heal_bytes}, {"heal_s", r.heal_s},
                            {"discarded_steps", r.discarded_steps}};
  }
  if (m.collectives) {
    nlohmann::json c = nlohmann::json::object();
    for (int k = 0; k < kNumCollectives; ++k) {
      const CollectiveTotals& t = (*m.collectives)[static_cast<size_t>(k)];
      if (t.count == 0) continue;
      c[std::string(collective_name(static_cast<Collective>(k)))] = {
          {"ms", t.ms}, {"exposed_ms", t.exposed_ms}, {"hidden", t.hidden()}, {"count", t.count}, {"bytes", t.bytes}};
    }
    j["collective"] = std::move(c);
  }
  if (!m.expert_tokens.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    for (size_t i = 0; i < m.expert_tokens.size(); ++i) {
      const ExpertLoad l = expert_load(m.expert_tokens[i]);
      nlohmann::json layer = {{"moe_layer", i}, {"load_max_over_mean", l.max_over_mean}, {"load_cv", l.cv},
                              {"idle_experts", l.idle}, {"tokens_per_expert", m.expert_tokens[i]}};
      if (i < m.router_entropy.size()) layer["router_entropy"] = m.router_entropy[i];
      layers.push_back(std::move(layer));
    }
    j["moe"] = std::move(layers);
  }
  return j.dump();  // non-finite numbers become null
}

ExpertLoad expert_load(const std::vector<int64_t>& tokens) {
  ExpertLoad l;
  if (tokens.empty()) return l;
  double total = 0, most = 0;
  for (int64_t c : tokens) {
    total += static_cast<double>(c);
    most = std::max(most, static_cast<double>(c));
    l.idle += c == 0;
  }
  const double n = static_cast<double>(tokens.size()), mean = total / n;
  if (mean <= 0) return l;
  double var = 0;
  for (int64_t c : tokens) var += (static_cast<double>(c) - mean) * (static_cast<double>(c) - mean);
  l.max_over_mean = most / mean;
  l.cv = std::sqrt(var / n) / mean;
  return l;
}

std::string ExpertLoadWatch::observe(const StepMetrics& m) {
  const size_t n = m.expert_tokens.size();
  run_.resize(n, 0);
  warned_.resize(n, false);
  std::vector<std::string> layers;
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double skew = expert_load(m.expert_tokens[i]).max_over_mean;
    if (skew < threshold_) {
      run_[i] = 0;
      warned_[i] = false;
      continue;
    }
    if (++run_[i] >= steps_ && !warned_[i]) {
      warned_[i] = true;
      layers.push_back(std::to_string(i));
      worst = std::max(worst, skew);
    }
  }
  if (layers.empty()) return {};
  std::string list;
  for (size_t i = 0; i < layers.size(); ++i) list += (i ? ", " : "") + layers[i];
  return fmt::format("expert load: MoE layer{} {} of this rank {} had the busiest expert at {:.1f}x or more of the mean "
                     "for {} steps running (now up to {:.2f}x): the router is collapsing onto a few experts. "
                     "Balance it with [model].router_bias_update_speed (aux-loss-free, e.g. 0.001; if it is on, a "
                     "larger one moves the bias past the router's score gaps sooner) or an auxiliary loss "
                     "([model].router_aux_loss_coef; DeepSeek-V3: seq_aux_loss_coef)",
                     layers.size() > 1 ? "s" : "", list, layers.size() > 1 ? "have" : "has", threshold_, steps_, worst);
}

std::vector<std::pair<std::string, double>> metrics_scalars(const StepMetrics& m) {
  std::vector<std::pair<std::string, double>> v{
      {"train/loss", m.loss},
      {"train/aux_loss", m.aux_loss},
      {"train/lr", m.lr},
      {"train/grad_norm", m.grad_norm},
      {"train/tokens", static_cast<double>(m.tokens)},
      {"perf/tokens_per_s", m.tokens_per_s},
      {"perf/tflops", m.tflops},
      {"perf/step_time_s", m.step_time_s},
      {"memory/peak_bytes", static_cast<double>(m.peak_memory_bytes)},
      {"memory/live_bytes", static_cast<double>(m.live_memory_bytes)},
      {"memory/reserved_bytes", static_cast<double>(m.reserved_memory_bytes)},
      {"memory/growth_bytes", static_cast<double>(m.memory_growth_bytes)},
      {"memory/pinned_host_bytes", static_cast<double>(m.pinned_host_bytes)},
      {"moe/load_max_over_mean", m.expert_load_max_over_mean},
      {"infra/world_size", static_cast<double>(m.world_size)},
      {"infra/restart_generation", static_cast<double>(m.restart_generation)},
  };
  if (m.val_loss) v.emplace_back("val/loss", *m.val_loss);
  for (const auto& [name, value] : m.loss_terms) v.emplace_back("train/" + name, value);
  if (m.router_bias) {
    for (size_t i = 0; i < m.router_bias->abs_max.size(); ++i) {
      v.emplace_back(fmt::format("moe/layer{}/router_bias_abs_max", i), m.router_bias->abs_max[i]);
    }
  }
  if (m.checkpoint_stall_s) v.emplace_back("infra/checkpoint_stall_s", *m.checkpoint_stall_s);
  if (m.checkpoint_commit) v.emplace_back("infra/checkpoint_commit_ms", m.checkpoint_commit->seconds * 1e3);
  if (m.restart_downtime_s) v.emplace_back("infra/restart_downtime_s", *m.restart_downtime_s);
  if (m.replicas) {
    v.emplace_back("ft/replicas_in_quorum", static_cast<double>(m.replicas->in_quorum));
    v.emplace_back("ft/quorum_ms", m.replicas->quorum_ms);
    v.emplace_back("ft/discarded_steps", static_cast<double>(m.replicas->discarded_steps));
  }
  if (m.collectives) {
    for (int k = 0; k < kNumCollectives; ++k) {
      const CollectiveTotals& t = (*m.collectives)[static_cast<size_t>(k)];
      if (t.count == 0) continue;
      const std::string p = fmt::format("collective/{}/", collective_name(static_cast<Collective>(k)));
      v.emplace_back(p + "ms", t.ms);
      v.emplace_back(p + "hidden", t.hidden());
    }
  }
  for (size_t i = 0; i < m.expert_tokens.size(); ++i) {
    const ExpertLoad l = expert_load(m.expert_tokens[i]);
    const std::string p = fmt::format("moe/layer{}/", i);
    v.emplace_back(p + "load_max_over_mean", l.max_over_mean);
    v.emplace_back(p + "load_cv", l.cv);
    v.emplace_back(p + "idle_experts", static_cast<double>(l.idle));
    if (i < m.router_entropy.size()) v.emplace_back(p + "router_entropy", m.router_entropy[i]);
  }
  return v;
}

void MetricsWriter::write(const StepMetrics& m) {
  out_ << metrics_json(m) << '\n';
  out_.flush();
  MT_CHECK(out_.good(), "metrics: write to '{}' failed (disk full?)", path_);
}

std::string thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -static_cast<uint64_t>(v) : static_cast<uint64_t>(v));
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string human_line(const StepMetrics& m, int64_t total_steps) {
  std::string s = fmt::format("step {}/{} | loss {:.4f}", m.step, total_steps, m.loss);
  for (const auto& [name, value] : m.loss_terms) {  // the multi-token prediction loss beside the main one
    if (name == "mtp_loss") s += fmt::format(" | mtp {:.4f}", value);
  }
  if (m.val_loss) s += fmt::format(" | val {:.4f}", *m.val_loss);
  s += fmt::format(" | lr {:.2e} | gnorm {:.2f} | {} tok/s | {:.3f} TFLOP/s", m.lr, m.grad_norm,
                   thousands(static_cast<int64_t>(std::llround(std::isfinite(m.tokens_per_s) ? m.tokens_per_s : 0))),
                   m.tflops);
  if (m.expert_load_max_over_mean > 0) s += fmt::format(" | load max/mean {:.2f}", m.expert_load_max_over_mean);
  if (m.router_bias && !m.router_bias->abs_max.empty()) {
    s += fmt::format(" | bias |b| {:.3f}", *std::max_element(m.router_bias->abs_max.begin(), m.router_bias->abs_max.end()));
  }
  if (m.peak_memory_bytes > 0) {
    const double mb = static_cast<double>(m.peak_memory_bytes) / 1e6;
    s += mb < 10000 ? fmt::format(" | mem {:.0f} MB", mb) : fmt::format(" | mem {:.1f} GB", mb / 1e3);
  }
  if (m.replicas && (m.replicas->recovered_from || m.replicas->discarded_steps > 0)) {
    s += fmt::format(" | {} replica groups", m.replicas->in_quorum);
    if (m.replicas->recovered_from) s += fmt::format(", healed from group {}", *m.replicas->recovered_from);
    if (m.replicas->discarded_steps) s += fmt::format(", {} step(s) discarded before", m.replicas->discarded_steps);
  }
  if (m.restart_downtime_s) {
    s += fmt::format(" | resumed {:.2f} s after the failure (restart {}, {} ranks)", *m.restart_downtime_s,
                     m.restart_generation, m.world_size);
  }
  return s;
}

}  // namespace moetrain
