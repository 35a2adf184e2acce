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
#include "core/timer.h"
#include "engine/ft/fault.h"
#include "ops/ops.h"
#include <fmt/ranges.h>

namespace moetrain {
namespace fs = std::filesystem;
namespace {

using Clock = SteadyClock;

// Test hook: MOETRAIN_CHECKPOINT_CRASH=<point>@<step> kills the process (no unwinding, no
// flushing: like a power cut) at that point of step's commit. Points, in order:
// files (rank files written, no index), index (index written, not renamed),
// rename (renamed, latest not moved), latest (latest moved, old ones not pruned).
void crash_point(const char* point, int64_t step) {
  fault_point(point, step);  // the chaos tests' faults (ft/fault.h) at the same points
  const char* spec = std::getenv("MOETRAIN_CHECKPOINT_CRASH");
  if (spec == nullptr) return;
  if (std::string(spec) == fmt::format("{}@{}", point, step)) {
    std::fprintf(stderr, "moetrain: MOETRAIN_CHECKPOINT_CRASH: dying at '%s' of step %lld\n", point,
                 static_cast<long long>(step));
    std::_Exit(86);
  }
}

// The small text files ranks leave each other in a step's temporary directory (a rank's
// failed-rNNNNN.txt, rank 0's commit-failed.txt): best effort, since on a full disk these may
// fail too. Written under another name and renamed, so that a rank polling for the note
// never reads it half-written (a reader once saw the file created and still empty: "rank 0
// says: " with no reason).
void write_note(const fs::path& path, const std::string& text) {
  try {
    write_text_whole(path, text);
  } catch (const std::exception&) {  // best effort (above)
  }
}

std::string read_note(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

}  // namespace

// ---- what is saved ----

CheckpointItems checkpoint_items(ParameterList& params, AdamW* opt) {
  CheckpointItems items;
  for (size_t i = 0; i < params.size(); ++i) {
    const Parameter& p = params[i];
    items.model.push_back({p.name, p.value});
    if (opt == nullptr) continue;
    if (p.has_master()) items.optimizer.push_back({p.name + ".master", p.value, {}, -1, {}, p.master_low});
    items.optimizer.push_back({p.name + ".exp_avg", opt->exp_avg()[i]});
    items.optimizer.push_back({p.name + ".exp_avg_sq", opt->exp_avg_sq()[i]});
  }
  return items;
}

namespace {

// A rank's piece of a tensor-parallel parameter's shard: elements [begin, end) of its box
// (Parameter::start, value's shape) are boxes of the whole tensor (each contiguous in the
// piece): element_range_boxes of the piece, moved to where the piece starts.
std::vector<std::pair<Shape, Shape>> piece_boxes(const Parameter& p, int64_t begin, int64_t end) {
  std::vector<std::pair<Shape, Shape>> boxes = element_range_boxes(p.value.shape(), begin, end);
  for (auto& [start, box] : boxes) {
    for (size_t d = 0; d < start.size(); ++d) start[d] += p.start[d];
  }
  return boxes;
}

}  // namespace

CheckpointItems sharded_checkpoint_items(const ParameterList& params, ParameterList& shard_params,
                                         const std::vector<ShardSegment>& segments, AdamW& opt,
                                         const std::function<bool(size_t param)>& writes) {
  MT_CHECK(segments.size() == shard_params.size(), "sharded checkpoint: {} segments for {} shard parameters",
           segments.size(), shard_params.size());
  CheckpointItems items;
  for (size_t i = 0; i < segments.size(); ++i) {
    if (writes && !writes(segments[i].param)) continue;
    const Parameter& p = shard_params[i];
    const Parameter& whole = params[segments[i].param];
    const int64_t b = segments[i].begin;
    MT_CHECK(p.value.numel() == segments[i].end - b,
             "sharded checkpoint: '{}' holds {} elements for the range [{}, {})", p.name, p.value.numel(), b,
             segments[i].end);
    // One item per tensor (the weight, its master, its moments) and box of the whole tensor.
    auto add = [&](std::vector<CheckpointItem>& into, const std::string& name, const Tensor& data, const Tensor& low) {
      if (!whole.tp_split()) {
        into.push_back({name, data, whole.value.shape(), b, {}, low});
        return;
      }
      int64_t at = 0;
      for (const auto& [start, box] : piece_boxes(whole, b, segments[i].end)) {
        const int64_t n = shape_numel(box);
        into.push_back({name, data.slice(at, at + n).view(box), whole.whole_shape, -1, start,
                        low.defined() ? low.slice(at, at + n).view(box) : Tensor()});
        at += n;
      }
    };
    add(items.model, p.name, p.value, Tensor());
    if (p.has_master()) add(items.optimizer, p.name + ".master", p.value, p.master_low);
    add(items.optimizer, p.name + ".exp_avg", opt.exp_avg()[i], Tensor());
    add(items.optimizer, p.name + ".exp_avg_sq", opt.exp_avg_sq()[i], Tensor());
  }
  return items;
}

namespace {

// Checks that an item is one of the three kinds CheckpointItem describes and fits its tensor.
void check_item(const CheckpointItem& it) {
  MT_CHECK(it.data.defined(), "checkpoint item '{}' has no tensor", it.name);
  if (it.low.defined()) {
    MT_CHECK(it.data.dtype() == DType::BF16 && it.low.dtype() == DType::I16 && it.low.shape() == it.data.shape() &&
                 it.low.device() == it.data.device(),
             "checkpoint item '{}': a split master is a bf16 high half and an i16 low half of one shape and device, "
             "got {} and {}", it.name, it.data.str(), it.low.str());
  }
  if (it.flat_begin >= 0) {
    MT_CHECK(it.start.empty(), "checkpoint item '{}': a piece (flat_begin {}) has no box start", it.name,
             it.flat_begin);
    MT_CHECK(it.flat_begin + it.data.numel() <= shape_numel(it.global_shape),
             "checkpoint item '{}': elements [{}, {}) lie outside its global shape {}", it.name, it.flat_begin,
             it.flat_begin + it.data.numel(), shape_str(it.global_shape));
  } else if (!it.start.empty()) {
    const Shape& g = it.global_shape;
    bool fits = g.size() == it.start.size() && static_cast<int>(g.size()) == it.data.ndim();
    for (size_t d = 0; fits && d < g.size(); ++d) {
      fits = it.start[d] >= 0 && it.start[d] + it.data.shape()[d] <= g[d];
    }
    MT_CHECK(fits, "checkpoint item '{}': a box of shape {} at {} does not fit its global shape {}", it.name,
             shape_str(it.data.shape()), shape_str(it.start), shape_str(g));
  } else {
    MT_CHECK(it.global_shape.empty() || it.global_shape == it.data.shape(),
             "checkpoint item '{}' of shape {} has global shape {} but neither a box start nor an element range",
             it.name, shape_str(it.data.shape()), shape_str(it.global_shape));
  }
}

void check_has(CheckpointReader& reader, const std::string& name, const Tensor& dst, const Shape& shape) {
  MT_CHECK(reader.has(name), "checkpoint {}: no tensor '{}' (the model needs {} {})", reader.dir(), name,
           dtype_name(dst.dtype()), shape_str(shape));
  MT_CHECK(reader.info(name).shape == shape, "checkpoint {}: tensor '{}' has shape {}, expected {}", reader.dir(), name,
           shape_str(reader.info(name).shape), shape_str(shape));
}

// Reads dst's elements (any shape: in order) from `boxes` (start, shape) of tensor `name`,
// box by box, each into a view of dst.
void read_boxes(CheckpointReader& reader, const std::string& name, const std::vector<std::pair<Shape, Shape>>& boxes,
                Tensor& dst) {
  const Tensor flat = dst.view({dst.numel()});
  int64_t at = 0;
  for (const auto& [start, box] : boxes) {
    const int64_t n = shape_numel(box);
    Tensor view = flat.slice(at, at + n).view(box);
    reader.read(name, view, start);
    at += n;
  }
}

// Reads elements [begin, begin + dst.numel()) of tensor `name` (of `shape`) into dst.
void read_piece(CheckpointReader& reader, const std::string& name, const Shape& shape, int64_t begin, Tensor& dst) {
  check_has(reader, name, dst, shape);
  read_boxes(reader, name, element_range_boxes(shape, begin, begin + dst.numel()), dst);
}

// The tensor a parameter's values load from: its f32 master where the checkpoint has one
// and the parameter keeps more than bf16 (a split master, or f32 weights as on the CPU),
// since the bf16 weight saved beside the master is only the master rounded; else the weight.
std::string weights_from(const CheckpointReader& reader, const Parameter& p) {
  const std::string master = p.name + ".master";
  const bool finer_than_bf16 = p.has_master() || p.value.dtype() != DType::BF16;
  return finer_than_bf16 && reader.has(master) ? master : p.name;
}

// Fills a parameter's weights through `read(name, dst)` from weights_from's tensor: a split
// master is read as f32 and split into its halves.
template <typename Read>
void read_weights(const CheckpointReader& reader, Parameter& p, Read&& read) {
  Tensor dst = p.has_master() ? Tensor::empty(p.value.shape(), DType::F32, p.value.device()) : p.value;
  read(weights_from(reader, p), dst);
  if (p.has_master()) set_master(p, dst);
}

}  // namespace

void load_slices(CheckpointReader& reader, const std::vector<CheckpointItem>& items) {
  for (const CheckpointItem& it : items) {
    check_item(it);
    // A split master is read as f32 and split into its halves.
    Tensor dst = it.low.defined() ? Tensor::empty(it.data.shape(), DType::F32, it.data.device()) : it.data;
    if (it.flat_begin >= 0) {
      read_piece(reader, it.name, it.global_shape, it.flat_begin, dst);
    } else if (!it.start.empty()) {
      check_has(reader, it.name, dst, it.global_shape);
      reader.read(it.name, dst, it.start);
    } else {
      MT_CHECK(reader.has(it.name), "checkpoint {}: no tensor '{}' (the model needs {} {})", reader.dir(), it.name,
               dtype_name(dst.dtype()), shape_str(dst.shape()));
      reader.read(it.name, dst);
    }
    if (it.low.defined()) {
      Tensor high = it.data, low = it.low;
      ops::master_split_into(dst, high, low);
    }
  }
}

void load_sharded_state(CheckpointReader& reader, const ParameterList& params, ParameterList& shard_params,
                        const std::vector<ShardSegment>& segments, AdamW* opt) {
  for (size_t i = 0; i < segments.size(); ++i) {
    Parameter& p = shard_params[i];
    const Parameter& whole = params[segments[i].param];
    const int64_t b = segments[i].begin;
    MT_CHECK(p.name != "lm_head.weight" || reader.has(p.name),
             "checkpoint {}: no tensor 'lm_head.weight' (set tie_word_embeddings = true for a model whose head is "
             "its embedding)", reader.dir());
    // Elements [b, b + dst.numel()) of the parameter (of this rank's tensor-parallel piece).
    auto read_segment = [&](const std::string& name, Tensor& dst) {
      if (!whole.tp_split()) {
        read_piece(reader, name, whole.value.shape(), b, dst);
        return;
      }
      check_has(reader, name, dst, whole.whole_shape);
      read_boxes(reader, name, piece_boxes(whole, b, b + dst.numel()), dst);
    };
    read_weights(reader, p, read_segment);
    if (opt == nullptr) continue;
    Tensor m = opt->exp_avg()[i], v = opt->exp_avg_sq()[i];
    read_segment(p.name + ".exp_avg", m);
    read_segment(p.name + ".exp_avg_sq", v);
  }
}

void load_model_buffers(CheckpointReader& reader, const std::vector<NamedBuffer>& buffers) {
  std::vector<CheckpointItem> items;
  for (const NamedBuffer& b : buffers) {
    if (reader.has(b.name)) items.push_back({b.name, b.value});
  }
  load_slices(reader, items);
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
    read_weights(reader, p, [&](const std::string& name, Tensor& dst) { reader.read(name, dst); });
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

bool Checkpointer::parse_step_dir_name(const std::string& name, int64_t* step) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return false;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  *step = std::stoll(name.substr(5));
  return true;
}

std::vector<std::pair<int64_t, std::string>> Checkpointer::committed(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    int64_t step = 0;
    if (e.is_directory() && parse_step_dir_name(e.path().filename().string(), &step) &&
        fs::exists(e.path() / "index.json")) {
      out.push_back({step, e.path().string()});
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

Checkpointer::Checkpointer(std::string dir, int64_t keep, bool async, int rank, int world,
                           std::chrono::seconds commit_timeout)
    : dir_(std::move(dir)), keep_(keep), async_(async), rank_(rank), world_(world), commit_timeout_(commit_timeout) {
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

bool Checkpointer::busy() {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_;
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
  // The snapshot of an item: a host tensor of its elements (1-D for a piece) and its place.
  auto host_shape = [](const CheckpointItem& it) {
    return it.flat_begin >= 0 ? Shape{it.data.numel()} : it.data.shape();
  };
  auto global = [](const CheckpointItem& it) {
    return it.global_shape.empty() && it.flat_begin < 0 ? it.data.shape() : it.global_shape;
  };
  // A split master is written as f32.
  auto host_dtype = [](const CheckpointItem& it) { return it.low.defined() ? DType::F32 : it.data.dtype(); };
  auto fit = [&](std::vector<TensorSlice>& host, const std::vector<CheckpointItem>& live) {
    for (const CheckpointItem& it : live) check_item(it);
    bool same = host.size() == live.size();
    for (size_t i = 0; same && i < live.size(); ++i) {
      const CheckpointItem& it = live[i];
      same = host[i].name == it.name && host[i].data.shape() == host_shape(it) &&
             host[i].data.dtype() == host_dtype(it) && host[i].flat_begin == it.flat_begin &&
             host[i].global_shape == global(it) && host[i].start == it.start;
    }
    if (same) return;
    host.clear();
    for (const CheckpointItem& it : live) {
      // Pinned memory for what comes from a GPU (the copies run at full speed and async);
      // pageable for host items, which then never touch CUDA (a forked process may not).
      const bool pinned = !it.data.device().is_cpu();
      Tensor buf = pinned ? Tensor::empty_pinned(host_shape(it), host_dtype(it))
                          : Tensor::empty(host_shape(it), host_dtype(it));
      // Touch every page now, or the first save pays the page faults (pinned memory is
      // resident already).
      if ((!pinned || !cuda::available()) && buf.nbytes() > 0) std::memset(buf.raw(), 0, buf.nbytes());
      TensorSlice s = whole_slice(it.name, buf);
      s.global_shape = global(it);
      s.start = it.start;
      s.flat_begin = it.flat_begin;
      host.push_back(std::move(s));
    }
  };
  fit(host_.model, items.model);
  fit(host_.optimizer, items.optimizer);
}

SaveStats Checkpointer::save(int64_t step, const CheckpointItems& items, const nlohmann::json& trainer_state) {
  const auto t0 = Clock::now();
  prepare(items);  // waits for the previous save; allocates only when the tensors changed
  uint64_t bytes = 0;
  bool any_device = false;
  auto copy = [&](std::vector<TensorSlice>& host, const std::vector<CheckpointItem>& live) {
    for (size_t i = 0; i < live.size(); ++i) {
      Tensor src = live[i].data;
      if (live[i].low.defined() && src.numel() > 0) {
        // A split master: joined into f32 first, on the host directly, on the device in a
        // scratch buffer (reused: each copy is ordered on the stream before the next join).
        if (src.device().is_cpu()) {
          Tensor dst = host[i].data.view(src.shape());
          ops::master_join_into(dst, src, live[i].low);
          bytes += dst.nbytes();
          continue;
        }
        // Piece by piece, so the scratch stays small beside a large master (an expert stack).
        const int64_t n = src.numel(), piece = std::min(n, kJoinPieceElements);
        if (!join_scratch_.defined() || join_scratch_.numel() < piece || join_scratch_.device() != src.device()) {
          join_scratch_ = Tensor::empty({piece}, DType::F32, src.device());
        }
        const Tensor high = src.view({n}), low = live[i].low.view({n});
        for (int64_t b = 0; b < n; b += piece) {
          const int64_t e = std::min(n, b + piece);
          Tensor joined = join_scratch_.slice(0, e - b);
          ops::master_join_into(joined, high.slice(b, e), low.slice(b, e));
          cuda::copy_device_to_host_async(static_cast<float*>(host[i].data.raw()) + b, joined.raw(), joined.nbytes());
        }
        bytes += static_cast<uint64_t>(n) * sizeof(float);
        any_device = true;
        continue;
      }
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
  join_scratch_ = Tensor();  // not kept between saves
  SaveStats stats{step, 0, bytes};
  if (async_) {
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = true;
    pending_step_ = step;
    pending_state_ = trainer_state;
    cv_.notify_all();
  } else {
    std::optional<CommitStats> done = commit(step, host_, trainer_state);
    if (rank_ != 0) wait_for_commit(step);
    std::lock_guard<std::mutex> lock(mu_);
    if (done) committed_ = done;
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
    std::optional<CommitStats> done;
    try {
      done = commit(step, host_, state);
    } catch (const std::exception& e) {
      spdlog::error("checkpoint: step {} was not committed: {}", step, e.what());
      err = std::current_exception();
    }
    lock.lock();
    error_ = err;
    if (done) committed_ = done;
    busy_ = false;
    cv_.notify_all();
  }
}

std::optional<CommitStats> Checkpointer::take_commit() {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<CommitStats> c = committed_;
  committed_.reset();
  return c;
}

void Checkpointer::wait_for_commit(int64_t step) const {
  const fs::path root(dir_);
  const fs::path committed_index = root / step_dir_name(step) / "index.json";
  const fs::path tmp = root / (".tmp-" + step_dir_name(step));
  // Rank 0 gives its verdict within commit_timeout of reaching the commit, which may be later
  // than this rank did: twice that before giving up on rank 0 itself.
  for (const auto deadline = Clock::now() + 2 * commit_timeout_;;) {
    if (fs::exists(committed_index)) return;
    for (const fs::path& failed : {tmp / "commit-failed.txt", tmp / rank_file_name("failed", 0, "txt")}) {
      if (fs::exists(failed)) MT_THROW("checkpoint step {} is not committed: rank 0 says: {}", step, read_note(failed));
    }
    MT_CHECK(Clock::now() < deadline, "checkpoint step {}: rank 0 has not committed it into {} after {} s", step,
             (root / step_dir_name(step)).string(), 2 * commit_timeout_.count());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::optional<CommitStats> Checkpointer::commit(int64_t step, const Host& host, const nlohmann::json& state) {
  const auto t0 = Clock::now();
  const fs::path root(dir_);
  const fs::path final_dir = root / step_dir_name(step);
  MT_CHECK(!fs::exists(final_dir), "checkpoint {} already exists: a committed checkpoint is never overwritten",
           final_dir.string());
  const fs::path tmp = root / (".tmp-" + step_dir_name(step));
  if (world_ == 1) fs::remove_all(tmp);  // many ranks share it: stale ones go at start (resolve_resume)
  fs::create_directories(tmp);
  try {
    // Fault injection: `error@write` is a full disk.
    if (fault_point("write", step)) {
      MT_THROW("{}: write failed: {} (injected by MOETRAIN_FAULT)",
               (tmp / rank_file_name("model", rank_, "safetensors")).string(), std::strerror(ENOSPC));
    }
    write_rank_files(tmp.string(), rank_, host.model, host.optimizer);
  } catch (const std::exception& e) {
    // Tell rank 0, which would otherwise wait commit_timeout for this rank's manifest.
    write_note(tmp / rank_file_name("failed", rank_, "txt"), e.what());
    throw;
  }
  crash_point("files", step);
  if (rank_ != 0) return std::nullopt;  // rank 0 commits
  // The ranks that wait for this commit (synchronous saves) learn of a failure from this file.
  auto say_failed = [&](const std::string& why) { write_note(tmp / "commit-failed.txt", why); };
  // Every rank's manifest is written last and atomically: once all exist, all files are complete.
  for (const auto deadline = Clock::now() + commit_timeout_;;) {
    std::vector<int> missing;
    for (int r = 0; r < world_; ++r) {
      if (fs::exists(tmp / rank_file_name("manifest", r, "json"))) continue;
      missing.push_back(r);
      const fs::path failed = tmp / rank_file_name("failed", r, "txt");
      if (r != rank_ && fs::exists(failed)) {
        const std::string what = fmt::format("rank {} could not write its files: {}", r, read_note(failed));
        say_failed(what);
        MT_THROW("checkpoint step {} is not committed: {}", step, what);
      }
    }
    if (missing.empty()) break;
    if (Clock::now() >= deadline) {
      std::vector<std::string> named;
      for (size_t i = 0; i < missing.size() && i < 16; ++i) {
        named.push_back(fmt::format("rank {} ({})", missing[i], rank_file_name("manifest", missing[i], "json")));
      }
      if (missing.size() > named.size()) named.push_back(fmt::format("and {} more", missing.size() - named.size()));
      const std::string what = fmt::format("after {} s, {} of {} ranks have written no manifest into {}: {}",
                                           commit_timeout_.count(), missing.size(), world_, tmp.string(),
                                           fmt::join(named, ", "));
      say_failed(what);
      MT_THROW("checkpoint step {} is not committed: {}", step, what);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  write_index(tmp.string(), world_, state);
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
  if (on_commit_) {
    try {
      on_commit_(step, final_dir.string());
    } catch (const std::exception& e) {
      spdlog::error("checkpoint: step {} committed, but handing it on failed: {}", step, e.what());
    }
  }
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
  return CommitStats{step, s, bytes};
}

std::string resolve_resume(const std::string& dir, const std::string& resume, bool remove_stale) {
  if (remove_stale && fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".tmp-", 0) == 0 || n.rfind(".download-", 0) == 0) {  // a download from the remote tier too
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
