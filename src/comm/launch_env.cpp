#include "comm/launch_env.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/error.h"

namespace moetrain {
namespace {

int parse_int(const std::string& var, const std::string& text, int lo, int hi) {
  int v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  MT_CHECK(ec == std::errc() && p == end && !text.empty(), "environment: {}='{}' is not an integer", var, text);
  MT_CHECK(v >= lo && v <= hi, "environment: {}={} is out of range (expected {} to {})", var, v, lo, hi);
  return v;
}

// Reads one launcher's variables; names differ, rules do not.
struct Names {
  const char* launcher;
  const char* rank;
  const char* world;
  const char* local_rank;
  const char* local_world;
};

class Reader {
 public:
  explicit Reader(const LaunchEnv::Lookup& lookup) : lookup_(lookup) {}
  std::optional<std::string> get(const std::string& var) const { return lookup_(var); }
  bool has(const std::string& var) const { return lookup_(var).has_value(); }
  std::string text(const std::string& var) const { return lookup_(var).value_or(""); }
  int integer(const std::string& var, int lo, int hi) const { return parse_int(var, *lookup_(var), lo, hi); }
  std::optional<int> optional_int(const std::string& var, int lo, int hi) const {
    auto v = lookup_(var);
    if (!v) return std::nullopt;
    return parse_int(var, *v, lo, hi);
  }

 private:
  const LaunchEnv::Lookup& lookup_;
};

constexpr int kMaxRanks = 1 << 24;

// Rank and world size are both required once either is set; the local pair defaults to
// "every rank on this node" when the launcher does not say.
void read_ranks(const Reader& r, const Names& n, LaunchEnv& e) {
  for (const char* v : {n.rank, n.world}) {
    MT_CHECK(r.has(v), "environment: {} is set but {} is not ({} sets both)",
             r.has(n.rank) ? n.rank : n.world, v, n.launcher);
  }
  e.launcher = n.launcher;
  e.world_size = r.integer(n.world, 1, kMaxRanks);
  e.rank = r.integer(n.rank, 0, kMaxRanks);
  MT_CHECK(e.rank < e.world_size, "environment: {}={} is not below {}={}", n.rank, e.rank, n.world, e.world_size);
  e.local_world_size = r.optional_int(n.local_world, 1, kMaxRanks).value_or(e.world_size);
  MT_CHECK(e.local_world_size <= e.world_size, "environment: {}={} exceeds {}={}", n.local_world,
           e.local_world_size, n.world, e.world_size);
  e.local_rank = r.optional_int(n.local_rank, 0, kMaxRanks).value_or(e.rank % e.local_world_size);
  MT_CHECK(e.local_rank < e.local_world_size, "environment: {}={} is not below {}={}", n.local_rank, e.local_rank,
           r.has(n.local_world) ? n.local_world : n.world, e.local_world_size);
}

void read_master(const Reader& r, LaunchEnv& e) {
  e.master_addr = r.text("MASTER_ADDR");
  if (auto p = r.optional_int("MASTER_PORT", 1, 65535)) e.master_port = *p;
}

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_') ? c : '_';
  return out;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at the first comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == ',' && depth == 0) break;
    if (c == '[') ++depth;
    if (c == ']') --depth;
    first += c;
  }
  MT_CHECK(!first.empty() && depth == 0, "environment: SLURM_JOB_NODELIST='{}' is not a node list", nodelist);
  size_t open = first.find('[');
  if (open == std::string::npos) return first;
  size_t close = first.find(']', open);
  std::string range = first.substr(open + 1, close - open - 1);
  std::string lo = range.substr(0, range.find_first_of(",-"));
  MT_CHECK(!lo.empty(), "environment: SLURM_JOB_NODELIST='{}' has an empty range", nodelist);
  return first.substr(0, open) + lo + first.substr(close + 1);
}

int slurm_tasks_on_node(const std::string& text, int node, const char* variable) {
  std::vector<int> per_node;
  size_t i = 0;
  while (i < text.size()) {
    size_t end = text.find(',', i);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(i, end - i);
    int repeat = 1;
    size_t paren = item.find("(x");
    if (paren != std::string::npos) {
      MT_CHECK(item.back() == ')', "environment: {}='{}' is malformed at '{}'", variable, text, item);
      repeat = parse_int(variable, item.substr(paren + 2, item.size() - paren - 3), 1, kMaxRanks);
      item = item.substr(0, paren);
    }
    int tasks = parse_int(variable, item, 1, kMaxRanks);
    for (int k = 0; k < repeat && static_cast<int>(per_node.size()) <= node; ++k) per_node.push_back(tasks);
    i = end + 1;
  }
  MT_CHECK(node < static_cast<int>(per_node.size()), "environment: {}='{}' lists fewer than {} nodes", variable,
           text, node + 1);
  return per_node[node];
}

std::string LaunchEnv::str() const {
  return fmt::format("rank {} of {} (local {} of {}, {})", rank, world_size, local_rank, local_world_size,
                     launcher);
}

LaunchEnv LaunchEnv::parse(const Lookup& lookup) {
  Reader r(lookup);
  LaunchEnv e;
  e.store = r.text("MOETRAIN_STORE");
  std::vector<std::string> run_parts;
  if (r.has("RANK") || r.has("WORLD_SIZE")) {
    read_ranks(r, {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}, e);
    read_master(r, e);
    run_parts = {r.text("TORCHELASTIC_RUN_ID"), r.text("TORCHELASTIC_RESTART_COUNT")};
  } else if (r.has("OMPI_COMM_WORLD_RANK") || r.has("OMPI_COMM_WORLD_SIZE")) {
    read_ranks(r,
               {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"},
               e);
    read_master(r, e);
    run_parts = {r.text("OMPI_MCA_ess_base_jobid"), r.text("PMIX_NAMESPACE")};
  } else if (r.has("SLURM_PROCID") || r.has("SLURM_NTASKS")) {
    read_ranks(r, {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"}, e);
    if (!r.has("SLURM_NTASKS_PER_NODE") && r.has("SLURM_TASKS_PER_NODE")) {
      MT_CHECK(r.has("SLURM_NODEID") || r.text("SLURM_TASKS_PER_NODE").find(',') == std::string::npos,
               "environment: SLURM_TASKS_PER_NODE='{}' differs between nodes but SLURM_NODEID is not set",
               r.text("SLURM_TASKS_PER_NODE"));
      int node = r.optional_int("SLURM_NODEID", 0, kMaxRanks).value_or(0);
      e.local_world_size = slurm_tasks_on_node(r.text("SLURM_TASKS_PER_NODE"), node, "SLURM_TASKS_PER_NODE");
      MT_CHECK(e.local_world_size <= e.world_size && e.local_rank < e.local_world_size,
               "environment: SLURM_LOCALID={} and SLURM_TASKS_PER_NODE='{}' (node {}: {} tasks) do not fit "
               "SLURM_NTASKS={}",
               e.local_rank, r.text("SLURM_TASKS_PER_NODE"), node, e.local_world_size, e.world_size);
    }
    read_master(r, e);
    if (e.master_addr.empty()) {
      if (auto nodes = r.get("SLURM_JOB_NODELIST")) e.master_addr = first_slurm_host(*nodes);
      else if (auto nodes = r.get("SLURM_NODELIST")) e.master_addr = first_slurm_host(*nodes);
    }
    // No MASTER_PORT: derive one from the job id, so every task of the job agrees on it
    // without talking. Below Linux's ephemeral range (32768-60999).
    if (e.master_port == 0 && r.has("SLURM_JOB_ID")) {
      e.master_port = 10000 + parse_int("SLURM_JOB_ID", r.text("SLURM_JOB_ID"), 0, INT32_MAX) % 20000;
    }
    run_parts = {r.text("SLURM_JOB_ID"), r.text("SLURM_STEP_ID")};
  }
  if (r.has("TORCHELASTIC_RESTART_COUNT")) {
    e.restart_generation = parse_int("TORCHELASTIC_RESTART_COUNT", r.text("TORCHELASTIC_RESTART_COUNT"), 0, INT32_MAX);
  } else if (r.has("SLURM_RESTART_COUNT")) {
    e.restart_generation = parse_int("SLURM_RESTART_COUNT", r.text("SLURM_RESTART_COUNT"), 0, INT32_MAX);
  }
  if (r.has("MOETRAIN_FAILURE_AT")) {
    const std::string t = r.text("MOETRAIN_FAILURE_AT");
    char* end = nullptr;
    e.failure_at = std::strtod(t.c_str(), &end);
    MT_CHECK(end != t.c_str() && *end == '\0' && e.failure_at >= 0,
             "MOETRAIN_FAILURE_AT='{}' is not a time in seconds since the epoch", t);
  }
  std::vector<std::string> id{e.launcher};
  for (const std::string& p : run_parts) {
    if (!p.empty()) id.push_back(sanitize(p));
  }
  if (e.master_port != 0) id.push_back(std::to_string(e.master_port));
  e.run_id = fmt::format("{}", fmt::join(id, "-"));
  return e;
}

LaunchEnv LaunchEnv::from_environment() {
  return parse([](const std::string& var) -> std::optional<std::string> {
    const char* v = std::getenv(var.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace moetrain
