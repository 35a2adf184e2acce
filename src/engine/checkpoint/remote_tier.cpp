#include "engine/checkpoint/remote_tier.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/log.h"
#include "core/timer.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/ft/fault.h"
#include "engine/json_file.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

struct FileSum {
  uint64_t bytes = 0;
  std::string xxh3;  // hex64
};

FileSum file_sum(const fs::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  MT_CHECK(f, "{}: cannot open: {}", path.string(), std::strerror(errno));
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(size_t{4} << 20);
  FileSum out;
  for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;) {
    XXH3_64bits_update(st, buf.data(), n);
    out.bytes += n;
  }
  const bool ok = !std::ferror(f);
  std::fclose(f);
  out.xxh3 = hex64(XXH3_64bits_digest(st));
  XXH3_freeState(st);
  MT_CHECK(ok, "{}: read failed", path.string());
  return out;
}

}  // namespace

RemoteTier::RemoteTier(const std::string& url, S3Options options, int64_t keep)
    : url_(url), loc_(S3Location::parse(url)), client_(std::move(options)), keep_(keep) {}

std::string RemoteTier::step_key(int64_t step) const {
  return (loc_.prefix.empty() ? "" : loc_.prefix + "/") + Checkpointer::step_dir_name(step) + "/";
}

namespace {

// The objects under `root` grouped by step ("<root>step-N/<file>"); other keys are ignored.
std::map<int64_t, std::vector<S3Client::Object>> by_step(const std::vector<S3Client::Object>& objects,
                                                         const std::string& root) {
  std::map<int64_t, std::vector<S3Client::Object>> out;
  for (const S3Client::Object& o : objects) {
    const std::string rest = o.key.substr(root.size());
    const size_t slash = rest.find('/');
    int64_t step = 0;
    if (slash != std::string::npos && Checkpointer::parse_step_dir_name(rest.substr(0, slash), &step)) {
      out[step].push_back(o);
    }
  }
  return out;
}

bool has_marker(const std::vector<S3Client::Object>& objects) {
  return std::any_of(objects.begin(), objects.end(), [](const S3Client::Object& o) {
    return o.key.size() >= std::strlen(RemoteTier::kMarker) + 1 &&
           o.key.compare(o.key.size() - std::strlen(RemoteTier::kMarker) - 1, std::string::npos,
                         std::string("/") + RemoteTier::kMarker) == 0;
  });
}

}  // namespace

std::vector<int64_t> RemoteTier::committed() {
  const std::string root = loc_.prefix.empty() ? "" : loc_.prefix + "/";
  std::vector<int64_t> out;
  for (const auto& [step, objects] : by_step(client_.list(loc_.bucket, root), root)) {
    if (has_marker(objects)) out.push_back(step);
  }
  return out;
}

uint64_t RemoteTier::upload(int64_t step, const std::string& step_dir) {
  const fs::path dir(step_dir);
  const nlohmann::json index = read_json_file((dir / "index.json").string());
  nlohmann::json marker = {{"format", "moetrain-remote-step"}, {"step", step}, {"files", nlohmann::json::object()}};
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file()) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  // The local copy is checked before it is mirrored: a file damaged since its commit would
  // otherwise become the remote tier's good copy.
  for (const std::string& name : names) {
    const FileSum sum = file_sum(dir / name);
    if (index["files"].contains(name)) {
      const auto& want = index["files"][name];
      MT_CHECK(want["bytes"].get<uint64_t>() == sum.bytes && want["xxh3_64"].get<std::string>() == sum.xxh3,
               "checkpoint {}: file {} has {} bytes with XXH3 {}, the index records {} bytes with XXH3 {}: the local "
               "step is damaged and is not mirrored to {}",
               step_dir, name, sum.bytes, sum.xxh3, want["bytes"].get<uint64_t>(), want["xxh3_64"].get<std::string>(),
               url_);
    }
    marker["files"][name] = {{"bytes", sum.bytes}, {"xxh3_64", sum.xxh3}};
  }
  const std::string key = step_key(step);
  // A step mirrored before (a run that resumed from an older step commits it again) is
  // uncommitted first, so no reader takes it while its objects are replaced.
  client_.remove(loc_.bucket, key + kMarker);
  uint64_t bytes = 0;
  for (const std::string& name : names) bytes += client_.put_file(loc_.bucket, key + name, (dir / name).string());
  for (const std::string& name : names) {
    const auto stored = client_.head(loc_.bucket, key + name);
    const uint64_t want = marker["files"][name]["bytes"].get<uint64_t>();
    MT_CHECK(stored && stored->size == want, "checkpoint step {}: {} holds {} after the upload, expected {} bytes",
             step, loc_.url(key + name), stored ? fmt::format("{} bytes", stored->size) : std::string("nothing"), want);
  }
  client_.put(loc_.bucket, key + kMarker, marker.dump(1));  // the remote commit
  prune(step);
  return bytes;
}

void RemoteTier::prune(int64_t newest) {
  const std::string root = loc_.prefix.empty() ? "" : loc_.prefix + "/";
  const auto steps = by_step(client_.list(loc_.bucket, root), root);
  std::vector<int64_t> committed_steps;
  for (const auto& [step, objects] : steps) {
    if (has_marker(objects)) committed_steps.push_back(step);
  }
  std::set<int64_t> doomed;
  if (keep_ > 0) {
    for (size_t i = 0; i + static_cast<size_t>(keep_) < committed_steps.size(); ++i) {
      if (committed_steps[i] != newest) doomed.insert(committed_steps[i]);
    }
  }
  for (const auto& [step, objects] : steps) {
    if (step < newest && !has_marker(objects)) doomed.insert(step);
  }
  for (int64_t step : doomed) {
    const std::string key = step_key(step);
    client_.remove(loc_.bucket, key + kMarker);  // uncommitted first
    for (const S3Client::Object& o : steps.at(step)) {
      if (o.key != key + kMarker) client_.remove(loc_.bucket, o.key);
    }
    spdlog::info("checkpoint: removed step {} from {}", step, url_);
  }
}

std::string RemoteTier::download(int64_t step, const std::string& local_root) {
  const auto t0 = SteadyClock::now();
  const std::string key = step_key(step);
  nlohmann::json marker;
  try {
    marker = nlohmann::json::parse(client_.get(loc_.bucket, key + kMarker));
    MT_CHECK(marker.contains("files") && marker["files"].is_object(), "no \"files\" object");
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not a commit marker: {}", loc_.url(key + kMarker), e.what());
  }
  const fs::path root(local_root);
  const fs::path final_dir = root / Checkpointer::step_dir_name(step);
  MT_CHECK(!fs::exists(final_dir), "checkpoint {} already exists: the download of step {} from {} never overwrites it",
           final_dir.string(), step, url_);
  const fs::path tmp = root / (".download-" + Checkpointer::step_dir_name(step));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  uint64_t bytes = 0;
  for (auto it = marker["files"].begin(); it != marker["files"].end(); ++it) {
    const std::string& name = it.key();
    MT_CHECK(name.find('/') == std::string::npos && name != "." && name != "..",
             "{}: the marker names a file '{}' outside the step", loc_.url(key + kMarker), name);
    const auto [got, sum] = client_.get_file(loc_.bucket, key + name, (tmp / name).string());
    const uint64_t want = it.value()["bytes"].get<uint64_t>();
    const std::string want_sum = it.value()["xxh3_64"].get<std::string>();
    MT_CHECK(got == want && hex64(sum) == want_sum,
             "checkpoint step {}: {} downloaded as {} bytes with XXH3 {}, its marker records {} bytes with XXH3 {}",
             step, loc_.url(key + name), got, hex64(sum), want, want_sum);
    bytes += got;
  }
  fsync_dir(tmp.string());
  fs::rename(tmp, final_dir);
  fsync_dir(root.string());
  const double s = seconds_since(t0);
  spdlog::info("checkpoint: step {} downloaded from {} to {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s)", step,
               loc_.url(key), final_dir.string(), bytes / 1e6, s, bytes / 1e6 / std::max(s, 1e-9));
  return final_dir.string();
}

// ---- the uploader ----

Uploader::Uploader(const std::string& url, S3Options options, int64_t keep, std::string local_root)
    : url_(url), local_root_(std::move(local_root)) {
  options.cancel = &cancel_;
  tier_ = std::make_unique<RemoteTier>(url, std::move(options), keep);
  // Staging folders of an uploader that did not finish (a crash): their steps are
  // committed locally and submitted again when they are the newest.
  if (fs::is_directory(local_root_)) {
    for (const auto& e : fs::directory_iterator(local_root_)) {
      if (e.path().filename().string().rfind(".upload-", 0) == 0) fs::remove_all(e.path());
    }
  }
  thread_ = std::thread([this] { worker(); });
}

Uploader::~Uploader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cancel_ = true;
  cv_.notify_all();
  thread_.join();
  std::error_code ec;
  if (pending_ >= 0) fs::remove_all(staging(pending_), ec);
}

std::string Uploader::staging(int64_t step) const {
  return (fs::path(local_root_) / (".upload-" + Checkpointer::step_dir_name(step))).string();
}

void Uploader::submit(int64_t step, const std::string& step_dir) {
  // Hard links: no bytes copied, and the files outlive the step directory's removal.
  const fs::path stage = staging(step);
  fs::remove_all(stage);
  fs::create_directories(stage);
  for (const auto& e : fs::directory_iterator(step_dir)) {
    if (!e.is_regular_file()) continue;
    std::error_code ec;
    fs::create_hard_link(e.path(), stage / e.path().filename(), ec);
    if (ec) fs::copy_file(e.path(), stage / e.path().filename());  // a file system without hard links
  }
  int64_t replaced = -1, busy_with = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    replaced = pending_;
    busy_with = in_flight_;
    pending_ = step;
  }
  cv_.notify_all();
  if (replaced >= 0 && replaced != step) {
    fs::remove_all(staging(replaced));
    spdlog::warn("checkpoint: step {} is not mirrored to {}: step {} replaced it {} (it stays committed locally)",
                 replaced, url_, step,
                 busy_with >= 0 ? fmt::format("while the uploader was busy with step {}", busy_with)
                                : std::string("before the uploader took it"));
  }
}

int64_t Uploader::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

int64_t Uploader::mirrored() {
  std::lock_guard<std::mutex> lock(mu_);
  return mirrored_;
}

bool Uploader::drain(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                      [this] { return pending_ < 0 && in_flight_ < 0; });
}

void Uploader::worker() {
  // Uploading yields the cores to training: this thread's nice value is raised (per thread
  // on Linux); best effort.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
  std::unique_lock<std::mutex> lock(mu_);
  double retry_s = 1.0;
  while (true) {
    cv_.wait(lock, [this] { return stop_ || pending_ >= 0; });
    if (stop_) return;
    const int64_t step = pending_;
    pending_ = -1;
    in_flight_ = step;
    lock.unlock();
    const auto t0 = SteadyClock::now();
    std::string error;
    try {
      // Fault injection: `stall=S@upload` is storage that hangs, `error@upload` one that fails.
      if (fault_point("upload", step)) MT_THROW("upload of step {} failed (injected by MOETRAIN_FAULT)", step);
      const uint64_t bytes = tier_->upload(step, staging(step));
      const double s = seconds_since(t0);
      spdlog::info("checkpoint: step {} mirrored to {} ({:.1f} MB in {:.2f} s, {:.0f} MB/s)", step, url_, bytes / 1e6,
                   s, bytes / 1e6 / std::max(s, 1e-9));
      fs::remove_all(staging(step));
    } catch (const std::exception& e) {
      error = e.what();
    }
    lock.lock();
    if (error.empty()) {
      mirrored_ = std::max(mirrored_, step);
      retry_s = 1.0;
    } else if (!stop_ && pending_ >= 0) {  // a newer step came meanwhile: it is the one worth mirroring
      std::error_code ec;
      fs::remove_all(staging(step), ec);
      spdlog::error("checkpoint: step {} was not mirrored to {}: {}; step {} is next", step, url_, error, pending_);
    } else if (!stop_) {
      spdlog::error("checkpoint: step {} was not mirrored to {} (it stays committed locally; training goes on): {}; "
                    "trying again in {:.0f} s",
                    step, url_, error, retry_s);
      // Still in flight while it waits (drain() waits for it), unless a newer step or the
      // end comes first.
      cv_.wait_for(lock, std::chrono::duration<double>(retry_s), [this] { return stop_ || pending_ >= 0; });
      if (pending_ < 0 && !stop_) {
        pending_ = step;
      } else {
        std::error_code ec;
        fs::remove_all(staging(step), ec);
      }
      retry_s = std::min(retry_s * 2, 30.0);
    }
    in_flight_ = -1;
    cv_.notify_all();
  }
}

}  // namespace moetrain
