// The S3 client and the remote checkpoint tier against a real S3-compatible server
// (s3rver on a free localhost port, tests/s3rver.h): objects in and out, multipart uploads
// in small parts, errors that name what failed, retries while the server is down, a step
// mirrored and downloaded with its checksums checked, retention, and the uploader's
// newest-wins queue. Skipped, saying so, where scripts/fetch-s3rver has not run.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/checkpoint/remote_tier.h"
#include "engine/checkpoint/s3_client.h"
#include "s3rver.h"
#include "test_files.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using testing::S3rver;
using testing::ScratchDir;
constexpr const char* kBucket = S3rver::kBucket;

#define START_S3RVER(name, dir)                \
  S3rver name((dir) / "s3");                   \
  if (!name.ok()) GTEST_SKIP() << name.why()

std::string bytes_of(size_t n, unsigned seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (char& c : s) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  return s;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(S3, ObjectsGoInAndOutAndErrorsNameWhatFailed) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  S3Client c(s3.options());
  c.put(kBucket, "a/one.txt", "hello");
  c.put(kBucket, "a/b/two.bin", bytes_of(1000, 1));
  c.put(kBucket, "c/three", "");
  EXPECT_EQ(c.get(kBucket, "a/one.txt"), "hello");
  EXPECT_EQ(c.get(kBucket, "a/b/two.bin"), bytes_of(1000, 1));
  const auto h = c.head(kBucket, "a/b/two.bin");
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(h->size, 1000u);
  EXPECT_FALSE(c.head(kBucket, "a/nothing").has_value());
  const auto listed = c.list(kBucket, "a/");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].key, "a/b/two.bin");
  EXPECT_EQ(listed[0].size, 1000u);
  EXPECT_EQ(listed[1].key, "a/one.txt");
  c.remove(kBucket, "a/one.txt");
  c.remove(kBucket, "a/one.txt");  // gone already: no error
  EXPECT_EQ(c.list(kBucket, "a/").size(), 1u);
  // A 4xx is not retried and names the method, the object, the status and S3's code.
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = testing::error_of([&] { c.get(kBucket, "a/missing.txt"); });
  EXPECT_NE(e.find("S3 GET s3://moetrain-test/a/missing.txt: HTTP 404 NoSuchKey"), std::string::npos) << e;
  EXPECT_EQ(e.find("tries"), std::string::npos) << e;
  const std::string nb = testing::error_of([&] { c.put("no-such-bucket", "k", "x"); });
  EXPECT_NE(nb.find("s3://no-such-bucket/k: HTTP 404 NoSuchBucket"), std::string::npos) << nb;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  // Locations.
  EXPECT_EQ(S3Location::parse("s3://b/x/y/").prefix, "x/y");
  EXPECT_EQ(S3Location::parse("s3://b").bucket, "b");
  EXPECT_NE(testing::error_of([] { S3Location::parse("/tmp/x"); }).find("expected s3://bucket"), std::string::npos);
}

TEST(S3, LargeFilesGoUpInPartsAndComeBackBitwise) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  S3Options o = s3.options();
  o.part_size = 64 << 10;  // 64 KB parts: 5 parts, the last one short
  S3Client c(o);
  const std::string data = bytes_of((64 << 10) * 4 + 1234, 7);
  const std::string src = dir.file("big.bin", data);
  EXPECT_EQ(c.put_file(kBucket, "big/big.bin", src), data.size());
  EXPECT_EQ(c.head(kBucket, "big/big.bin")->size, data.size());
  const auto [n, sum] = c.get_file(kBucket, "big/big.bin", dir / "back.bin");
  EXPECT_EQ(n, data.size());
  EXPECT_EQ(sum, xxh3_bytes(data.data(), data.size()));
  EXPECT_TRUE(read_file(dir / "back.bin") == data) << "the parts came back in another order or cut";
  // The multipart calls themselves: parts sent out of order are put together by number.
  const std::string id = c.create_multipart(kBucket, "big/manual");
  const std::string p1 = bytes_of(70000, 3), p2 = bytes_of(500, 4);
  const std::string e2 = c.upload_part(kBucket, "big/manual", id, 2, p2);
  const std::string e1 = c.upload_part(kBucket, "big/manual", id, 1, p1);
  c.complete_multipart(kBucket, "big/manual", id, {e1, e2});
  EXPECT_TRUE(c.get(kBucket, "big/manual") == p1 + p2);
  // An aborted upload leaves no object. (s3rver 3.7.1 does not implement the abort and
  // answers 405, which the client reports as any 4xx, at once.)
  const std::string gone = c.create_multipart(kBucket, "big/aborted");
  c.upload_part(kBucket, "big/aborted", gone, 1, p1);
  try {
    c.abort_multipart(kBucket, "big/aborted", gone);
  } catch (const S3Error& e) {
    EXPECT_EQ(e.status(), 405) << e.what();
    EXPECT_NE(std::string(e.what()).find("S3 DELETE s3://moetrain-test/big/aborted: HTTP 405 MethodNotAllowed"),
              std::string::npos) << e.what();
  }
  EXPECT_FALSE(c.head(kBucket, "big/aborted").has_value());
}

TEST(S3, AServerThatIsDownIsRetriedWithBackoffUntilItIsBack) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  s3.stop();
  S3Options o = s3.options();
  o.max_attempts = 3;
  o.backoff_s = 0.05;
  {
    S3Client c(o);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = testing::error_of([&] { c.put(kBucket, "k", "x"); });
    EXPECT_NE(e.find("S3 PUT s3://moetrain-test/k: no answer from " + s3.endpoint()), std::string::npos) << e;
    EXPECT_NE(e.find("(after 3 tries)"), std::string::npos) << e;
    // 0.05 + 0.1 s of backoff between the three tries.
    EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.15);
  }
  // Back after about a second: a client with enough tries gets through.
  o.max_attempts = 12;
  o.backoff_s = 0.2;
  o.max_backoff_s = 0.5;
  S3Client c(o);
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    s3.start();
  });
  EXPECT_NO_THROW(c.put(kBucket, "k", "after"));
  restart.join();
  ASSERT_TRUE(s3.ok()) << s3.why();
  EXPECT_EQ(c.get(kBucket, "k"), "after");
}

// A committed step directory as the writer leaves it (rank files listed in index.json with
// their size and XXH3, the JSON files beside them).
std::string fake_step(const ScratchDir& dir, const std::string& root, int64_t step, size_t bytes) {
  const fs::path d = fs::path(root) / Checkpointer::step_dir_name(step);
  fs::create_directories(d);
  nlohmann::json files = nlohmann::json::object();
  for (const char* name : {"model-r00000.safetensors", "optimizer-r00000.safetensors"}) {
    const std::string data = bytes_of(bytes, static_cast<unsigned>(step * 10 + name[0]));
    std::ofstream(d / name, std::ios::binary) << data;
    files[name] = {{"bytes", data.size()}, {"xxh3_64", hex64(xxh3_bytes(data.data(), data.size()))}};
  }
  std::ofstream(d / "trainer_state.json") << nlohmann::json{{"step", step}}.dump();
  std::ofstream(d / "index.json") << nlohmann::json{{"files", files}}.dump();
  return d.string();
}

TEST(S3, RemoteTierMirrorsAStepMarkerLastAndDownloadsItChecked) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  S3Options o = s3.options();
  o.part_size = 100 << 10;
  RemoteTier tier(std::string("s3://") + kBucket + "/run/a", o, 2);
  const std::string local = dir / "local";
  EXPECT_TRUE(tier.committed().empty());
  const std::string step3 = fake_step(dir, local, 3, 300 << 10);
  EXPECT_GT(tier.upload(3, step3), 600u << 10);
  EXPECT_EQ(tier.committed(), std::vector<int64_t>{3});
  S3Client c(o);
  EXPECT_TRUE(c.head(kBucket, "run/a/step-00000003/commit.json").has_value());
  // Downloaded into another folder: every file bitwise, as step-00000003.
  const std::string fresh = dir / "fresh";
  fs::create_directories(fresh);
  const std::string got = tier.download(3, fresh);
  EXPECT_EQ(got, (fs::path(fresh) / "step-00000003").string());
  for (const auto& e : fs::directory_iterator(step3)) {
    EXPECT_TRUE(read_file(e.path().string()) == read_file((fs::path(got) / e.path().filename()).string()))
        << e.path();
  }
  EXPECT_FALSE(fs::exists(fs::path(fresh) / ".download-step-00000003"));
  // A remote object that changed after its commit is refused by name; no step appears.
  c.put(kBucket, "run/a/step-00000003/optimizer-r00000.safetensors", bytes_of(300 << 10, 99));
  const std::string again = dir / "again";
  fs::create_directories(again);
  const std::string e = testing::error_of([&] { tier.download(3, again); });
  EXPECT_NE(e.find("optimizer-r00000.safetensors downloaded as"), std::string::npos) << e;
  EXPECT_NE(e.find("its marker records"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(fs::path(again) / "step-00000003"));
  // A local step whose file no longer matches its index is not mirrored.
  const std::string step4 = fake_step(dir, local, 4, 1000);
  std::ofstream(fs::path(step4) / "model-r00000.safetensors", std::ios::binary | std::ios::app) << "x";
  const std::string bad = testing::error_of([&] { tier.upload(4, step4); });
  EXPECT_NE(bad.find("the local step is damaged and is not mirrored"), std::string::npos) << bad;
  EXPECT_FALSE(c.head(kBucket, "run/a/step-00000004/commit.json").has_value());
}

TEST(S3, RemoteRetentionKeepsTheNewestAndRemovesUploadsCutShort) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  RemoteTier tier(std::string("s3://") + kBucket + "/r", s3.options(), 2);
  S3Client c(s3.options());
  const std::string local = dir / "local";
  c.put(kBucket, "r/step-00000001/model-r00000.safetensors", "an upload cut short: no marker");
  for (int64_t s : {2, 3, 4, 5}) tier.upload(s, fake_step(dir, local, s, 1000));
  EXPECT_EQ(tier.committed(), (std::vector<int64_t>{4, 5}));
  for (const auto& o : c.list(kBucket, "r/")) {
    EXPECT_TRUE(o.key.rfind("r/step-00000004/", 0) == 0 || o.key.rfind("r/step-00000005/", 0) == 0) << o.key;
  }
}

TEST(S3, TheUploaderMirrorsInTheBackgroundAndTheNewestReplacesAWaitingStep) {
  ScratchDir dir;
  START_S3RVER(s3, dir);
  const std::string url = std::string("s3://") + kBucket + "/up";
  const std::string local = dir / "local";
  {
    Uploader up(url, s3.options(), 0, local);
    // Step 1 starts (16 MB: it takes a while); once it is in flight, 2 and 3 are submitted
    // at once: 2 waits and is replaced by 3. (Submitting all three at once left the order to
    // the uploader thread's start: on a loaded machine 2 could replace 1 instead.)
    std::vector<std::string> steps;
    for (int64_t s : {1, 2, 3}) steps.push_back(fake_step(dir, local, s, s == 1 ? 8 << 20 : 1000));
    up.submit(1, steps[0]);
    for (int i = 0; i < 10000 && up.in_flight() != 1 && up.mirrored() != 1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(up.in_flight(), 1) << "step 1 was not taken, or was mirrored before steps 2 and 3 came";
    for (int64_t s : {2, 3}) up.submit(s, steps[s - 1]);
    // The submitted steps may leave the local tier at once (retention): hard links upload.
    fs::remove_all(fs::path(local) / "step-00000003");
    ASSERT_TRUE(up.drain(60));
    EXPECT_EQ(up.mirrored(), 3);
  }
  RemoteTier tier(url, s3.options(), 0);
  const auto steps = tier.committed();
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), 3);
  EXPECT_TRUE(std::find(steps.begin(), steps.end(), 2) == steps.end()) << "step 2 was waiting and should be replaced";
  for (const auto& e : fs::directory_iterator(local)) {
    EXPECT_NE(e.path().filename().string().rfind(".upload-", 0), 0u) << "staging left behind: " << e.path();
  }
}

}  // namespace
}  // namespace moetrain
