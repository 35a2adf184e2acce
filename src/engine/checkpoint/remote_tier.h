// The second checkpoint tier: committed steps mirrored to an S3-compatible object store
// ([checkpoint].remote = "s3://bucket/prefix"), and brought back from it on a fresh node.
//
//   <prefix>/step-00000300/model-r00000.safetensors   every file of the committed local
//   <prefix>/step-00000300/...                         step directory, as it is there
//   <prefix>/step-00000300/commit.json                 the commit marker, written last:
//                                                      {"step", "files": {name: {bytes, xxh3_64}}}
//
// A step is committed on the remote tier when its commit.json exists: the marker is put
// only once every other object of the step is stored with its size checked, and is deleted
// first when a step is removed (or uploaded again). Readers ignore step prefixes without
// one (an upload cut short). The marker's checksums are checked on every downloaded byte.
//
// RemoteTier does the transfers in the calling thread; Uploader runs them in its own.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/checkpoint/s3_client.h"

namespace moetrain {

class RemoteTier {
 public:
  // url: "s3://bucket/prefix"; keep: committed remote steps kept, newest first (0: all).
  RemoteTier(const std::string& url, S3Options options, int64_t keep);

  const std::string& url() const { return url_; }
  // The steps committed on the remote tier, oldest first.
  std::vector<int64_t> committed();
  // Mirrors a committed local step directory (its rank files are checked against the
  // index's XXH3 first: a step damaged on the local disk is not mirrored), the marker last,
  // then removes the remote steps beyond `keep` (never this one). Returns the bytes sent.
  uint64_t upload(int64_t step, const std::string& step_dir);
  // Downloads committed step `step` into `<local_root>/.download-step-N`, checks every
  // file's size and XXH3 against the marker, fsyncs, and renames it to
  // `<local_root>/step-N` (the local commit, as the writer's). Returns that path.
  std::string download(int64_t step, const std::string& local_root);
  // Removes committed steps beyond `keep` (oldest first, never `newest`), and the objects
  // of uncommitted steps older than `newest` (uploads cut short).
  void prune(int64_t newest);

  static constexpr const char* kMarker = "commit.json";

 private:
  std::string step_key(int64_t step) const;  // "<prefix>/step-N/"

  std::string url_;
  S3Location loc_;
  S3Client client_;
  int64_t keep_;
};

// The background uploader of rank 0: submit() hands it a step the local tier has just
// committed and returns at once; its thread mirrors the step (RemoteTier::upload).
// One upload runs at a time and one waits: a step submitted while another waits replaces
// it (the newest step is what a resume wants; the one replaced stays committed locally).
// A failed upload (after the S3 client's own retries) is tried again, 1 s later at first and
// up to 30 s apart, until it succeeds or a newer step replaces it. The step's files are
// hard-linked into `<local_root>/.upload-step-N` when submitted, so local retention may
// delete the step directory while it uploads.
class Uploader {
 public:
  Uploader(const std::string& url, S3Options options, int64_t keep, std::string local_root);
  ~Uploader();  // abandons the upload in flight (the remote tier keeps its older steps)
  Uploader(const Uploader&) = delete;
  Uploader& operator=(const Uploader&) = delete;

  void submit(int64_t step, const std::string& step_dir);
  // Waits up to timeout_s for every submitted step to be mirrored (or replaced); returns
  // whether none is left.
  bool drain(double timeout_s);
  // The newest step mirrored by this uploader (-1: none yet).
  int64_t mirrored();
  // The step being uploaded now (-1: none).
  int64_t in_flight();
  const std::string& url() const { return url_; }

 private:
  void worker();
  std::string staging(int64_t step) const;

  std::string url_;
  std::string local_root_;
  std::atomic<bool> cancel_{false};
  std::unique_ptr<RemoteTier> tier_;

  std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_ = -1, in_flight_ = -1, mirrored_ = -1;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moetrain
