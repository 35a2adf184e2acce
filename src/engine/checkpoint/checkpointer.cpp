#include "engine/checkpoint/checkpointer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/cuda_runtime.h"
#include "core/log.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MT_CHECK(fd >= 0, "{}: cannot open directory to sync: {}", dir.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MT_CHECK(rc == 0, "{}: fsync failed: {}", dir.string(), std::strerror(errno));
}

// Test hook: MOETRAIN_CHECKPOINT_CRASH=<point>@<step> kills the process (no unwinding, no
// flushing: like a power cut) at that point of step's commit. Points, in order:
// files (rank files written, no index), index (index written, not renamed),
// rename (renamed, latest not moved), latest (latest moved, old ones not pruned).
void crash_point(const char* point, int64_t step) {
  const char* spec = std::getenv("MOETRAIN_CHECKPOINT_CRASH");
  if (spec == nullptr) return;
  if (std::string(spec) == fmt::format("{}@{}", point, step)) {
    std::fprintf(stderr, "moetrain: MOETRAIN_CHECKPOINT_CRASH: dying at '%s' of step %lld\n", point,
                 static_cast<long long>(step));
    std::_Exit(86);
  }
}

bool parse_step_dir(const std::string& name, int64_t* step) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5) return false;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  *step = std::stoll(name.substr(5));
  return true;
}

}  // namespace

// ---- what is saved ----

CheckpointItems checkpoint_items(ParameterList& params, AdamW* opt) {
  CheckpointItems items;
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    items.model.push_back({p.name, p.value});
    if (opt == nullptr) continue;
    if (p.master.defined()) items.optimizer.push_back({p.name + ".master", p.master});
    items.optimizer.push_back({p.name + ".exp_avg", opt->exp_avg()[i]});
    items.optimizer.push_back({p.name + ".exp_avg_sq", opt->exp_avg_sq()[i]});
  }
  return items;
}

void load_model_weights(CheckpointReader& reader, ParameterList& params) {
  bool tied_head_missing = false;
  for (Parameter& p : params) {
    if (p.name == "lm_head.weight" && !reader.has(p.name)) {
      tied_head_missing = true;
      continue;
    }
    MT_CHECK(reader.has(p.name), "checkpoint {}: no tensor '{}' (the model needs {} {})", reader.dir(), p.name,
             dtype_name(p.value.dtype()), shape_str(p.value.shape()));
    const std::string master_name = p.name + ".master";
    if (p.master.defined()) {
      reader.read(reader.has(master_name) ? master_name : p.name, p.master);
      p.value.copy_from(p.master);
    } else {
      reader.read(p.name, p.value);
    }
  }
  MT_CHECK(!tied_head_missing, "checkpoint {}: no tensor 'lm_head.weight' (set tie_word_embeddings = true for a model "
           "whose head is its embedding)", reader.dir());
}

void load_optimizer_state(CheckpointReader& reader, ParameterList& params, AdamW& opt) {
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor m = opt.exp_avg()[i], v = opt.exp_avg_sq()[i];
    reader.read(params[i].name + ".exp_avg", m);
    reader.read(params[i].name + ".exp_avg_sq", v);
  }
}

// ---- the writer ----

std::string Checkpointer::step_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::vector<std::pair<int64_t, std::string>> Checkpointer::committed(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    int64_t step = 0;
    if (e.is_directory() && parse_step_dir(e.path().filename().string(), &step) &&
        fs::exists(e.path() / "index.json")) {
      out.push_back({step, e.path().string()});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

Checkpointer::Checkpointer(std::string dir, int64_t keep, bool async) : dir_(std::move(dir)), keep_(keep), async_(async) {
  fs::create_directories(dir_);
  if (async_) thread_ = std::thread([this] { worker(); });
}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("checkpoint: {}", e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Checkpointer::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !busy_; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void Checkpointer::prepare(const CheckpointItems& items) {
  wait();  // the snapshot buffers are the previous save's until it is written
  auto fit = [](std::vector<TensorSlice>& host, const std::vector<std::pair<std::string, Tensor>>& live) {
    bool same = host.size() == live.size();
    for (size_t i = 0; same && i < live.size(); ++i) {
      same = host[i].name == live[i].first && host[i].data.shape() == live[i].second.shape() &&
             host[i].data.dtype() == live[i].second.dtype();
    }
    if (same) return;
    host.clear();
    for (const auto& [name, t] : live) host.push_back(whole_slice(name, Tensor::empty_pinned(t.shape(), t.dtype())));
  };
  fit(host_.model, items.model);
  fit(host_.optimizer, items.optimizer);
}

SaveStats Checkpointer::save(int64_t step, const CheckpointItems& items, const nlohmann::json& trainer_state) {
  const auto t0 = Clock::now();
  prepare(items);  // waits for the previous save; allocates only when the tensors changed
  uint64_t bytes = 0;
  bool any_device = false;
  auto copy = [&](std::vector<TensorSlice>& host, const std::vector<std::pair<std::string, Tensor>>& live) {
    for (size_t i = 0; i < live.size(); ++i) {
      const Tensor& src = live[i].second;
      bytes += src.nbytes();
      if (src.nbytes() == 0) continue;
      if (src.device().is_cpu()) {
        std::memcpy(host[i].data.raw(), src.raw(), src.nbytes());
      } else {
        cuda::copy_device_to_host_async(host[i].data.raw(), src.raw(), src.nbytes());
        any_device = true;
      }
    }
  };
  copy(host_.model, items.model);
  copy(host_.optimizer, items.optimizer);
  if (any_device) cuda::stream_synchronize(cuda::current_stream());
  SaveStats stats{step, 0, bytes};
  if (async_) {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = true;
    pending_step_ = step;
    pending_state_ = trainer_state;
    cv_.notify_all();
  } else {
    commit(step, host_, trainer_state);
  }
  stats.stall_s = seconds_since(t0);
  return stats;
}

void Checkpointer::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || pending_step_ >= 0; });
    if (pending_step_ < 0 && stop_) return;
    const int64_t step = pending_step_;
    const nlohmann::json state = std::move(pending_state_);
    pending_step_ = -1;
    lock.unlock();
    std::exception_ptr err;
    try {
      commit(step, host_, state);
    } catch (const std::exception& e) {
      spdlog::error("checkpoint: step {} was not committed: {}", step, e.what());
      err = std::current_exception();
    }
    lock.lock();
    error_ = err;
    busy_ = false;
    cv_.notify_all();
  }
}

void Checkpointer::commit(int64_t step, const Host& host, const nlohmann::json& state) {
  const auto t0 = Clock::now();
  const fs::path root(dir_);
  const fs::path final_dir = root / step_dir_name(step);
  MT_CHECK(!fs::exists(final_dir), "checkpoint {} already exists: a committed checkpoint is never overwritten",
           final_dir.string());
  const fs::path tmp = root / (".tmp-" + step_dir_name(step));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  write_rank_files(tmp.string(), 0, host.model, host.optimizer);
  crash_point("files", step);
  write_index(tmp.string(), 1, state);
  fsync_dir(tmp);
  crash_point("index", step);
  fs::rename(tmp, final_dir);
  fsync_dir(root);
  crash_point("rename", step);
  {
    const fs::path latest_tmp = root / ".latest.tmp";
    std::FILE* f = std::fopen(latest_tmp.c_str(), "wb");
    MT_CHECK(f, "{}: cannot create", latest_tmp.string());
    const std::string text = step_dir_name(step) + "\n";
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0 &&
                    ::fsync(fileno(f)) == 0;
    std::fclose(f);
    MT_CHECK(ok, "{}: write failed", latest_tmp.string());
    fs::rename(latest_tmp, root / "latest");
    fsync_dir(root);
  }
  crash_point("latest", step);
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(final_dir)) bytes += e.file_size();
  if (keep_ > 0) {
    auto all = committed(dir_);
    for (size_t i = 0; i + static_cast<size_t>(keep_) < all.size(); ++i) {
      if (all[i].first == step) continue;
      fs::remove_all(all[i].second);
    }
  }
  const double s = seconds_since(t0);
  spdlog::info("checkpoint: step {} committed to {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s)", step, final_dir.string(),
               bytes / 1e6, s, bytes / 1e6 / std::max(s, 1e-9));
}

std::string resolve_resume(const std::string& dir, const std::string& resume) {
  if (fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".tmp-", 0) == 0) {
        spdlog::warn("checkpoint: removing {} (a save that never committed)", e.path().string());
        fs::remove_all(e.path());
      }
    }
  }
  const auto all = Checkpointer::committed(dir);
  if (resume == "never") {
    MT_CHECK(all.empty(),
             "[checkpoint].dir '{}' already holds committed checkpoints (newest {}); resume from them with "
             "[checkpoint].resume = \"auto\", or choose another [checkpoint].dir",
             dir, all.empty() ? "" : all.back().second);
    return "";
  }
  if (resume == "auto") return all.empty() ? "" : all.back().second;
  MT_CHECK(is_checkpoint_dir(resume), "[checkpoint].resume: '{}' is not a committed checkpoint directory (no index.json)",
           resume);
  return resume;
}

}  // namespace moetrain
