// Checkpoints: the safetensors reader/writer and its validation, sharded writes read back
// under another layout, the commit protocol under crashes, corruption detection, and the
// Hugging Face conversion round trip.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <nlohmann/json.hpp>

#include "core/cuda_runtime.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
#include "engine/checkpoint/hf_convert.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/models/deepseek_v3_config.h"
#include "engine/models/model.h"
#include "engine/models/qwen3_moe.h"
#include "engine/run_config.h"
#include "ops/ops.h"
#include "engine/optim/adamw.h"
#include "test_files.h"
#include "test_util.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::random_tensor;
using testing::ScratchDir;
using testing::bytes_equal;
using testing::has;


// ---- safetensors ----

TEST(Safetensors, RoundTripEveryDtypeAndShape) {
  ScratchDir dir;
  Tensor a = random_tensor({3, 4}, DType::F32, 1), b = random_tensor({5}, DType::F64, 2);
  Tensor c = random_tensor({2, 3, 2}, DType::BF16, 3);
  Tensor d = Tensor::empty({0, 7}, DType::I32);                      // no elements
  Tensor e = Tensor::from_vector(std::vector<int64_t>{-42}, {});     // 0-d
  Tensor g = Tensor::from_vector(std::vector<int16_t>{-32768, -1, 0, 32767}, {4});  // split masters' low halves
  SafetensorsWriter w;
  w.add("a", a);
  w.add("layer.b", b);
  w.add("c", c);
  w.add("d", d);
  w.add("e", e);
  w.add("g", g);
  w.set_metadata({{"format", "pt"}, {"who", "test"}});
  const auto written = w.write(dir / "x.safetensors");

  SafetensorsFile f(dir / "x.safetensors");
  EXPECT_EQ(f.file_size(), written.bytes);
  EXPECT_EQ(f.checksum(), written.xxh3);
  EXPECT_EQ(f.metadata().at("who"), "test");
  ASSERT_EQ(f.entries().size(), 6u);
  EXPECT_TRUE(bytes_equal(f.read("a"), a));
  EXPECT_TRUE(bytes_equal(f.read("layer.b"), b));
  EXPECT_TRUE(bytes_equal(f.read("c"), c));
  EXPECT_TRUE(bytes_equal(f.read("g"), g));
  EXPECT_EQ(f.read("g").dtype(), DType::I16);
  EXPECT_EQ(f.read("d").shape(), (Shape{0, 7}));
  EXPECT_EQ(f.read("e").to_vector<int64_t>(), std::vector<int64_t>{-42});
  EXPECT_EQ(f.find("nope"), nullptr);
  // The header is padded so the data starts 8-byte aligned.
  std::ifstream in(dir / "x.safetensors", std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

// A file with this header text and `data_bytes` zero bytes after it.
std::string raw_file(const ScratchDir& dir, const std::string& name, const std::string& header, size_t data_bytes,
                     int64_t claimed_header = -1) {
  std::string out(8, '\0');
  const uint64_t n = claimed_header >= 0 ? static_cast<uint64_t>(claimed_header) : header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  out += header;
  out.append(data_bytes, '\0');
  return dir.file(name, out);
}

TEST(Safetensors, EveryHeaderFieldIsValidated) {
  ScratchDir dir;
  auto error_for = [&](const std::string& path) { return error_of([&] { SafetensorsFile f(path); }); };
  std::string p = dir.file("short.safetensors", "abc");
  EXPECT_TRUE(has(error_for(p), "short.safetensors") && has(error_for(p), "shorter than the 8-byte")) << error_for(p);
  p = raw_file(dir, "huge.safetensors", "{}", 0, 1 << 20);
  EXPECT_TRUE(has(error_for(p), "huge.safetensors: header size 1048576 is impossible")) << error_for(p);
  p = raw_file(dir, "json.safetensors", "{\"a\": ", 0);
  EXPECT_TRUE(has(error_for(p), "json.safetensors: header is not valid JSON")) << error_for(p);
  p = raw_file(dir, "dtype.safetensors", R"({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})", 4);
  EXPECT_TRUE(has(error_for(p), "tensor 'w' has dtype \"F16\", expected one of")) << error_for(p);
  p = raw_file(dir, "count.safetensors", R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})", 12);
  EXPECT_TRUE(has(error_for(p), "tensor 'w': 12 bytes for shape [2, 2] of F32, expected 16")) << error_for(p);
  p = raw_file(dir, "trunc.safetensors", R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 9);
  EXPECT_TRUE(has(error_for(p), "tensor 'w': data_offsets [0, 16] fall outside the 9 data bytes")) << error_for(p);
  p = raw_file(dir, "gap.safetensors",
               R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
               12);
  EXPECT_TRUE(has(error_for(p), "tensor 'b' starts at byte 8 of the data, expected 4")) << error_for(p);
  p = raw_file(dir, "overlap.safetensors",
               R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
               8);
  EXPECT_TRUE(has(error_for(p), "overlap or gap")) << error_for(p);
  p = raw_file(dir, "tail.safetensors", R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", 6);
  EXPECT_TRUE(has(error_for(p), "cover 4 of the 6 data bytes")) << error_for(p);
  p = raw_file(dir, "shape.safetensors", R"({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4);
  EXPECT_TRUE(has(error_for(p), "tensor 'a': shape [-1] must hold non-negative integers")) << error_for(p);
  p = raw_file(dir, "meta.safetensors", R"({"__metadata__": {"k": 1}})", 0);
  EXPECT_TRUE(has(error_for(p), "__metadata__.k must be a string")) << error_for(p);
}

// ---- sharded checkpoints ----

// Tensor `full` cut into boxes: rows [r0, r1) x cols [c0, c1) for each given box.
TensorSlice box_of(const std::string& name, const Tensor& full, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t C = full.size(1);
  Tensor part = Tensor::empty({r1 - r0, c1 - c0}, full.dtype());
  const size_t e = dtype_size(full.dtype());
  for (int64_t r = r0; r < r1; ++r) {
    std::memcpy(static_cast<uint8_t*>(part.raw()) + (r - r0) * (c1 - c0) * e,
                static_cast<const uint8_t*>(full.raw()) + (r * C + c0) * e, (c1 - c0) * e);
  }
  TensorSlice s;
  s.name = name;
  s.global_shape = full.shape();
  s.start = {r0, c0};
  s.data = part;
  return s;
}

struct ShardedFixture {
  Tensor a = random_tensor({10, 6}, DType::F32, 11);   // rows over 4 ranks, unevenly
  Tensor b = random_tensor({4, 8}, DType::BF16, 12);   // 2 x 2 blocks over 4 ranks
  Tensor c = random_tensor({7}, DType::F32, 13);       // whole, on rank 0
  Tensor m = random_tensor({10, 6}, DType::F32, 14);   // an optimizer moment, rows
  const int64_t rows[5] = {0, 3, 6, 8, 10};

  void write(const std::string& dir, int ranks_written = 4) const {
    for (int r = 0; r < ranks_written; ++r) {
      std::vector<TensorSlice> model = {box_of("a", a, rows[r], rows[r + 1], 0, 6),
                                        box_of("b", b, (r / 2) * 2, (r / 2) * 2 + 2, (r % 2) * 4, (r % 2) * 4 + 4)};
      if (r == 0) model.push_back(whole_slice("c", c));
      write_rank_files(dir, r, model, {box_of("a.exp_avg", m, rows[r], rows[r + 1], 0, 6)});
    }
  }
};

TEST(Checkpoint, ShardsWrittenByFourRanksLoadWholeAndUnderAnotherLayout) {
  ScratchDir dir;
  ShardedFixture fx;
  fx.write(dir.path().string());
  write_index(dir.path().string(), 4, {{"step", 3}});

  CheckpointReader r(dir.path().string());
  EXPECT_FALSE(r.is_hf());
  EXPECT_EQ(r.trainer_state()["step"], 3);
  EXPECT_TRUE(bytes_equal(r.read_whole("a"), fx.a));
  EXPECT_TRUE(bytes_equal(r.read_whole("b"), fx.b));
  EXPECT_TRUE(bytes_equal(r.read_whole("c"), fx.c));
  EXPECT_TRUE(bytes_equal(r.read_whole("a.exp_avg"), fx.m));
  EXPECT_EQ(r.info("a").kind, "model");
  EXPECT_EQ(r.info("a.exp_avg").kind, "optimizer");
  // Three readers of a 3-way row split (another layout): each box spans two writers' slices.
  for (int64_t r0 : {0, 4, 7}) {
    const int64_t r1 = r0 == 7 ? 10 : r0 + 4;
    Tensor part = Tensor::empty({r1 - r0, 6}, DType::F32);
    r.read("a", part, {r0, 0});
    EXPECT_TRUE(bytes_equal(part, box_of("a", fx.a, r0, r1, 0, 6).data)) << "rows " << r0;
  }
  // A column box of the block-split tensor, converted from bf16 to f32 on the way.
  Tensor col = Tensor::empty({4, 3}, DType::F32);
  r.read("b", col, {0, 3});
  EXPECT_TRUE(bytes_equal(col, box_of("b", fx.b, 0, 4, 3, 6).data.to(DType::F32)));
  // Wrong shapes are refused, naming the tensor.
  Tensor wrong = Tensor::empty({10, 5}, DType::F32);
  EXPECT_TRUE(has(error_of([&] { r.read("a", wrong); }), "tensor 'a' has shape [10, 6], expected [10, 5]"));
  Tensor outside = Tensor::empty({4, 6}, DType::F32);
  EXPECT_TRUE(has(error_of([&] { r.read("a", outside, {8, 0}); }), "tensor 'a' has shape [10, 6]"));
  EXPECT_TRUE(has(error_of([&] { r.read_whole("zz"); }), "no tensor 'zz'"));
}

TEST(Checkpoint, IndexRefusesAMissingRankOrOverlappingSlices) {
  ScratchDir dir;
  ShardedFixture fx;
  fx.write(dir.path().string(), 3);
  EXPECT_TRUE(has(error_of([&] { write_index(dir.path().string(), 4, {}); }), "rank 3 wrote no manifest"));
  // Rank 3 claims rows rank 2 already holds: overlap. Then a tensor with rows missing.
  write_rank_files(dir.path().string(), 3, {box_of("a", fx.a, 7, 10, 0, 6)}, {});
  EXPECT_TRUE(has(error_of([&] { write_index(dir.path().string(), 4, {}); }), "tensor 'a': slices in"));
  write_rank_files(dir.path().string(), 3, {box_of("a", fx.a, 9, 10, 0, 6)}, {});
  const std::string e = error_of([&] { write_index(dir.path().string(), 4, {}); });
  EXPECT_TRUE(has(e, "tensor 'a': slices cover 54 of its 60 elements")) << e;
}

// An index.json is a file anyone may hand us (a downloaded checkpoint). Each edit below once
// escaped the reader as nlohmann's type_error (no file named), walked out of the folder, or
// made a tensor larger than the files that hold it (an allocation the disk does not back).
TEST(Checkpoint, AHostileIndexIsRefusedNamingTheIndex) {
  ScratchDir dir;
  ShardedFixture fx;
  fx.write(dir.path().string());
  write_index(dir.path().string(), 4, {{"step", 3}});
  const fs::path idx = dir.path() / "index.json";
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(idx));
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit, const std::string& expected) {
    SCOPED_TRACE(expected);
    nlohmann::json j = good;
    edit(j);
    std::ofstream(idx) << j.dump();
    const std::string e = error_of([&] { CheckpointReader r(dir.path().string()); });
    EXPECT_TRUE(has(e, idx.string())) << e;
    EXPECT_TRUE(has(e, expected)) << e;
  };
  refused([](nlohmann::json& j) { j["files"] = 7; }, "'files' and 'tensors' must be JSON objects");
  refused([](nlohmann::json& j) { j["tensors"]["a"]["shape"] = "ten by six"; },
          "tensors.a.shape must be an array of integers, got string");
  refused([](nlohmann::json& j) { j["tensors"]["c"]["slices"][0].erase("start"); }, "malformed checkpoint index");
  refused([](nlohmann::json& j) { j["files"]["model-r00000.safetensors"]["bytes"] = "356"; },
          "files.model-r00000.safetensors.bytes must be an integer, got \"356\"");
  // Found by fuzz_checkpoint_index: a float where an integer belongs was converted by a C++
  // cast, undefined beyond the integer's range (UBSan: 1.4e86 as unsigned long).
  refused([](nlohmann::json& j) { j["files"]["model-r00000.safetensors"]["bytes"] = 1.4e86; },
          "files.model-r00000.safetensors.bytes must be an integer, got 1.4e+86");
  refused([](nlohmann::json& j) { j["tensors"]["c"]["slices"][0]["shape"] = {7.5}; },
          "tensors.c.slices[].shape must be an integer, got 7.5");
  refused([](nlohmann::json& j) { j["tensors"]["c"]["slices"][0]["offset"] = -1e30; },
          "tensors.c.slices[].offset must be an integer");
  refused([](nlohmann::json& j) { j["metadata"]["format_version"] = 1e300; }, "format_version must be an integer");
  refused([](nlohmann::json& j) { j["files"]["../outside.safetensors"] = j["files"]["model-r00000.safetensors"]; },
          "file '../outside.safetensors' must be a plain file name inside the checkpoint directory");
  refused(
      [](nlohmann::json& j) {
        j["tensors"]["c"]["shape"] = {int64_t{1} << 40};
        j["tensors"]["c"]["slices"][0]["shape"] = {int64_t{1} << 40};
      },
      "tensor 'c': a slice of shape [1099511627776] at element 0 does not fit in model-r00000.safetensors");
  refused(
      [](nlohmann::json& j) {  // 20 slices that all read the same 7 elements: 560 bytes from a 356-byte file
        j["tensors"]["c"]["shape"] = {140};
        for (int i = 1; i < 20; ++i) {
          j["tensors"]["c"]["slices"].push_back({{"file", "model-r00000.safetensors"}, {"start", {7 * i}}, {"shape", {7}}});
        }
      },
      "tensor 'c': a slice of shape [7] at element 0 does not fit in model-r00000.safetensors (356 bytes)");
  refused([](nlohmann::json& j) { j["tensors"]["c"]["shape"] = {int64_t{1} << 40, int64_t{1} << 40, 0}; },
          "tensor 'c' has an impossible shape");
  refused(
      [](nlohmann::json& j) {  // start + shape overflows int64: the tensor holds no such box
        j["tensors"]["a"]["slices"][0]["start"] = {INT64_MAX, 0};
      },
      "lies outside the tensor's shape");
  std::ofstream(idx) << good.dump();
  EXPECT_TRUE(bytes_equal(CheckpointReader(dir.path().string()).read_whole("c"), fx.c));  // the edits were all

  // A Hugging Face folder's shard index may not name a file outside the folder either.
  ScratchDir hf;
  const fs::path hf_index = hf.path() / "model.safetensors.index.json";
  std::ofstream(hf_index) << nlohmann::json{{"weight_map", {{"w", "../model-r00000.safetensors"}}}}.dump();
  const std::string e = error_of([&] { CheckpointReader r(hf.path().string()); });
  EXPECT_TRUE(has(e, hf_index.string() + ": file '../model-r00000.safetensors' must be a plain file name")) << e;
}

// ---- the committing writer ----

// A small "model": a few parameters and an optimizer over them.
struct TinyState {
  ParameterList params;
  std::unique_ptr<AdamW> opt;
  explicit TinyState(uint64_t seed) {
    const std::pair<const char*, Shape> spec[] = {{"model.embed_tokens.weight", {16, 8}},
                                                  {"model.norm.weight", {8}},
                                                  {"lm_head.weight", {16, 8}}};
    for (const auto& [name, shape] : spec) {
      Parameter p;
      p.name = name;
      p.value = random_tensor(shape, DType::F32, seed++);
      p.grad = random_tensor(shape, DType::F32, seed++);
      params.push_back(p);
    }
    opt = std::make_unique<AdamW>(params, AdamWConfig{});
    opt->step(params, 1e-2);
  }
  // Changes every tensor: the next save must not see the old bytes.
  void advance() { opt->step(params, 1e-2); }
};

void expect_state_equal(CheckpointReader& r, TinyState& s) {
  for (size_t i = 0; i < s.params.size(); ++i) {
    EXPECT_TRUE(bytes_equal(r.read_whole(s.params[i].name), s.params[i].value)) << s.params[i].name;
    EXPECT_TRUE(bytes_equal(r.read_whole(s.params[i].name + ".exp_avg"), s.opt->exp_avg()[i]));
    EXPECT_TRUE(bytes_equal(r.read_whole(s.params[i].name + ".exp_avg_sq"), s.opt->exp_avg_sq()[i]));
  }
}

TEST(Checkpointer, CommitsKeepsTheLastKAndSnapshotsAtSaveTime) {
  for (bool async : {false, true}) {
    ScratchDir dir;
    TinyState s(1);
    std::vector<std::unique_ptr<TinyState>> expected;
    {
      Checkpointer ck(dir.path().string(), /*keep=*/2, async);
      for (int64_t step = 1; step <= 4; ++step) {
        ck.save(step, checkpoint_items(s.params, s.opt.get()), {{"step", step}});
        // What step `step` must hold: a copy taken now; then training moves on at once.
        auto copy = std::make_unique<TinyState>(1);
        for (size_t i = 0; i < s.params.size(); ++i) {
          copy->params[i].value = s.params[i].value.clone();
          Tensor m = copy->opt->exp_avg()[i], v = copy->opt->exp_avg_sq()[i];
          m.copy_from(s.opt->exp_avg()[i]);
          v.copy_from(s.opt->exp_avg_sq()[i]);
        }
        expected.push_back(std::move(copy));
        s.advance();
      }
      ck.wait();
    }
    auto all = Checkpointer::committed(dir.path().string());
    ASSERT_EQ(all.size(), 2u) << "async " << async;
    EXPECT_EQ(all[0].first, 3);
    EXPECT_EQ(all[1].first, 4);
    std::ifstream latest(dir.path() / "latest");
    std::string name;
    latest >> name;
    EXPECT_EQ(name, "step-00000004");
    for (int i = 0; i < 2; ++i) {
      CheckpointReader r(all[i].second);
      EXPECT_EQ(r.trainer_state()["step"], all[i].first);
      expect_state_equal(r, *expected[all[i].first - 1]);
    }
  }
}

TEST(Checkpointer, ACrashAtAnyPointLeavesTheLastCommittedCheckpointLoadable) {
  for (const char* point : {"files", "index", "rename", "latest"}) {
    ScratchDir dir;
    TinyState s(7);
    {
      Checkpointer ck(dir.path().string(), 3, /*async=*/false);
      ck.save(1, checkpoint_items(s.params, s.opt.get()), {{"step", 1}});
    }
    s.advance();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {  // the child dies inside the commit of step 2
      ::setenv("MOETRAIN_CHECKPOINT_CRASH", (std::string(point) + "@2").c_str(), 1);
      Checkpointer ck(dir.path().string(), 3, /*async=*/false);
      ck.save(2, checkpoint_items(s.params, s.opt.get()), {{"step", 2}});
      std::_Exit(0);  // not reached
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 86) << point;
    const std::string from = resolve_resume(dir.path().string(), "auto");
    const bool committed = std::string(point) == "rename" || std::string(point) == "latest";
    EXPECT_TRUE(has(from, committed ? "step-00000002" : "step-00000001")) << point << ": " << from;
    CheckpointReader r(from);
    if (committed) {
      expect_state_equal(r, s);
    } else {
      TinyState fresh(7);  // step 1 is the state after the first optimizer step
      expect_state_equal(r, fresh);
    }
    // No half-written directory survives the resume.
    for (const auto& e : fs::directory_iterator(dir.path())) {
      EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
    }
  }
}

TEST(Checkpointer, CorruptTruncatedAndMismatchedCheckpointsAreRefused) {
  ScratchDir dir;
  TinyState s(3);
  {
    Checkpointer ck(dir.path().string(), 0, false);
    ck.save(5, checkpoint_items(s.params, s.opt.get()), {{"step", 5}});
  }
  const fs::path step = dir.path() / "step-00000005";
  const fs::path model = step / "model-r00000.safetensors";
  // A flipped byte in the data: found by the checksum, naming the file.
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(model) - 5));
    char c;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(model) - 5));
    c ^= 0x20;
    f.write(&c, 1);
  }
  {
    CheckpointReader r(step.string());
    const std::string e = error_of([&] { r.read_whole("lm_head.weight"); });
    EXPECT_TRUE(has(e, "file model-r00000.safetensors is corrupt: XXH3")) << e;
  }
  // A truncated file: refused on open, naming the file and both sizes.
  fs::resize_file(model, fs::file_size(model) - 100);
  const std::string e = error_of([&] { CheckpointReader r(step.string()); });
  EXPECT_TRUE(has(e, "file model-r00000.safetensors has") && has(e, "the index says")) << e;
  // A model of another shape: the tensor and both shapes are named.
  ScratchDir dir2;
  TinyState t(4);
  {
    Checkpointer ck(dir2.path().string(), 0, false);
    ck.save(1, checkpoint_items(t.params, t.opt.get()), {{"step", 1}});
  }
  CheckpointReader r(Checkpointer::committed(dir2.path().string()).back().second);
  ParameterList other = t.params;
  other[0].value = Tensor::zeros({32, 8}, DType::F32);
  const std::string m = error_of([&] { load_model_weights(r, other); });
  EXPECT_TRUE(has(m, "tensor 'model.embed_tokens.weight' has shape [16, 8], expected [32, 8]")) << m;
  other = t.params;
  other.push_back(other[1]);
  other.back().name = "model.extra.weight";
  EXPECT_TRUE(has(error_of([&] { load_model_weights(r, other); }), "no tensor 'model.extra.weight'"));
}

// bf16 parameters with split f32 masters (engine/parameters.h) save their masters as f32
// "<name>.master", and load them back bit for bit, whole or from the pieces of a sharded
// save: on the CPU here, the same code the GPU runs (the join and split ops are compared
// between the backends in the op tests).
TEST(Checkpointer, SplitMastersSaveAsF32AndLoadBackExactly) {
  // bf16 weights with split masters (the GPU layout), or f32 weights (the CPU layout).
  auto make = [](DType dtype = DType::BF16) {
    ParameterList ps;
    for (auto [name, shape] : {std::pair<std::string, Shape>{"w.a", {6, 5}}, {"w.b", {7}}}) {
      Parameter p;
      p.name = name;
      p.value = Tensor::zeros(shape, dtype);
      p.grad = Tensor::zeros(shape, DType::F32);
      ps.push_back(p);
    }
    if (dtype == DType::BF16) attach_masters(ps);
    return ps;
  };
  ParameterList params = make();
  for (size_t i = 0; i < params.size(); ++i) {
    set_master(params[i], random_tensor(params[i].value.shape(), DType::F32, 30 + i));
    EXPECT_NE(ops::sum_squares(params[i].master_low.to(DType::F32)), 0.0) << "the low halves should be nonzero";
  }
  AdamW opt(params, AdamWConfig{});
  for (Parameter& p : params) p.grad.copy_from(random_tensor(p.value.shape(), DType::F32, 40));
  opt.step(params, 1e-2, 1.0);
  for (bool async : {false, true}) {
    ScratchDir dir;
    {
      Checkpointer ck(dir.path().string(), 1, async);
      ck.save(1, checkpoint_items(params, &opt), {{"step", 1}});
      ck.wait();
    }
    CheckpointReader r(Checkpointer::committed(dir.path().string()).at(0).second);
    ParameterList back = make();
    AdamW opt_back(back, AdamWConfig{});
    load_model_weights(r, back);
    load_optimizer_state(r, back, opt_back);
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& n = params[i].name;
      EXPECT_EQ(r.info(n + ".master").dtype, DType::F32) << n;
      EXPECT_TRUE(bytes_equal(master_f32(back[i]), master_f32(params[i]))) << n << " async " << async;
      EXPECT_TRUE(bytes_equal(back[i].value, params[i].value)) << n;
      EXPECT_TRUE(bytes_equal(back[i].master_low, params[i].master_low)) << n;
      EXPECT_TRUE(bytes_equal(opt_back.exp_avg()[i], opt.exp_avg()[i])) << n;
    }
    // An f32 model (a CPU run resuming or scoring a GPU run's checkpoint) takes the masters,
    // not the bf16 weights rounded from them.
    ParameterList f32 = make(DType::F32);
    load_model_weights(r, f32);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bytes_equal(f32[i].value, master_f32(params[i]))) << params[i].name << " into f32";
    }
  }
  // Two ranks' pieces (w.a cut at element 13), each rank saving its own, loaded whole.
  ScratchDir dir;
  const std::vector<ShardSegment> segs[2] = {{{0, 0, 13}}, {{0, 13, 30}, {1, 0, 7}}};
  std::vector<ParameterList> shards(2);
  std::vector<std::unique_ptr<AdamW>> opts;
  for (int r = 0; r < 2; ++r) {
    for (const ShardSegment& sg : segs[r]) {
      const Parameter& p = params[sg.param];
      Parameter s;
      s.name = p.name;
      s.value = p.value.view({p.value.numel()}).slice(sg.begin, sg.end);
      s.master_low = p.master_low.view({p.master_low.numel()}).slice(sg.begin, sg.end);
      s.grad = Tensor::zeros({sg.end - sg.begin}, DType::F32);
      shards[r].push_back(s);
    }
    opts.push_back(std::make_unique<AdamW>(shards[r], AdamWConfig{}));
  }
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Checkpointer ck(dir.path().string(), 0, /*async=*/r == 1, r, 2);
      ck.save(1, sharded_checkpoint_items(params, shards[r], segs[r], *opts[r]), {{"step", 1}});
      ck.wait();
    });
  }
  for (std::thread& t : ranks) t.join();
  CheckpointReader r(Checkpointer::committed(dir.path().string()).at(0).second);
  ParameterList back = make();
  load_model_weights(r, back);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(r.info(params[i].name + ".master").slices.size(), i == 0 ? 4u : 1u) << params[i].name;  // w.a: 2 boxes a piece
    EXPECT_TRUE(bytes_equal(master_f32(back[i]), master_f32(params[i]))) << params[i].name << " from pieces";
  }
  // The same pieces into an f32 model sharded as rank 1 was: its shards take the masters.
  const ParameterList f32 = make(DType::F32);
  ParameterList f32_shards;
  for (const ShardSegment& sg : segs[1]) {
    Parameter s;
    s.name = params[sg.param].name;
    s.value = Tensor::zeros({sg.end - sg.begin}, DType::F32);
    s.grad = Tensor::zeros({sg.end - sg.begin}, DType::F32);
    f32_shards.push_back(s);
  }
  load_sharded_state(r, f32, f32_shards, segs[1], nullptr);
  for (size_t k = 0; k < segs[1].size(); ++k) {
    const ShardSegment& sg = segs[1][k];
    const Tensor whole = master_f32(params[sg.param]);
    EXPECT_TRUE(bytes_equal(f32_shards[k].value, whole.view({whole.numel()}).slice(sg.begin, sg.end)))
        << f32_shards[k].name << " shard into f32";
  }
  // load_slices fills split-master items (the high and low halves) from the f32 pieces.
  std::vector<CheckpointItem> items;
  for (const CheckpointItem& it : sharded_checkpoint_items(params, shards[1], segs[1], *opts[1]).optimizer) {
    if (!it.low.defined()) continue;
    CheckpointItem blank = it;
    blank.data = Tensor::zeros(it.data.shape(), DType::BF16);
    blank.low = Tensor::zeros(it.low.shape(), DType::I16);
    items.push_back(blank);
  }
  ASSERT_EQ(items.size(), 2u);
  load_slices(r, items);
  for (size_t k = 0; k < items.size(); ++k) {
    EXPECT_TRUE(bytes_equal(items[k].data, shards[1][k].value)) << items[k].name;
    EXPECT_TRUE(bytes_equal(items[k].low, shards[1][k].master_low)) << items[k].name;
  }
}

// The same on the GPU, where a split master is joined on the device before its copy to the
// host: a master of more than one join piece (16 M elements) with an odd tail, saved
// asynchronously, loads back bit for bit into a GPU model and, as f32, into a CPU one.
TEST(Checkpointer, SplitMastersOnTheGpuSaveAndLoadExactly) {
  if (!cuda::available()) GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << cuda::unavailable_reason();
  const std::vector<std::pair<std::string, Shape>> shapes{{"w.big", {4099, 4097}}, {"w.small", {7, 3}}};
  auto make = [&](DType dtype, Device device) {
    ParameterList ps;
    for (const auto& [name, shape] : shapes) {
      Parameter p;
      p.name = name;
      p.value = Tensor::zeros(shape, dtype, device);
      p.grad = Tensor::zeros(shape, DType::F32, device);
      ps.push_back(p);
    }
    if (dtype == DType::BF16) attach_masters(ps);
    return ps;
  };
  ParameterList params = make(DType::BF16, Device::cuda(0));
  for (size_t i = 0; i < params.size(); ++i) {
    set_master(params[i], random_tensor(params[i].value.shape(), DType::F32, 50 + i));
  }
  AdamW opt(params, AdamWConfig{});
  ScratchDir dir;
  {
    Checkpointer ck(dir.path().string(), 1, /*async=*/true);
    ck.save(1, checkpoint_items(params, &opt), {{"step", 1}});
    ck.wait();
  }
  CheckpointReader r(Checkpointer::committed(dir.path().string()).at(0).second);
  ParameterList gpu = make(DType::BF16, Device::cuda(0)), cpu = make(DType::F32, Device::cpu());
  load_model_weights(r, gpu);
  load_model_weights(r, cpu);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor want = master_f32(params[i]).to(Device::cpu());
    EXPECT_TRUE(bytes_equal(master_f32(gpu[i]).to(Device::cpu()), want)) << params[i].name << " into the GPU";
    EXPECT_TRUE(bytes_equal(gpu[i].value.to(Device::cpu()), params[i].value.to(Device::cpu()))) << params[i].name;
    EXPECT_TRUE(bytes_equal(cpu[i].value, want)) << params[i].name << " into the CPU";
  }
}

TEST(Checkpointer, ResumeNeverRefusesAFolderWithCheckpoints) {
  ScratchDir dir;
  EXPECT_EQ(resolve_resume(dir.path().string(), "never"), "");
  EXPECT_EQ(resolve_resume(dir.path().string(), "auto"), "");
  TinyState s(2);
  {
    Checkpointer ck(dir.path().string(), 0, false);
    ck.save(9, checkpoint_items(s.params, s.opt.get()), {{"step", 9}});
  }
  EXPECT_TRUE(has(error_of([&] { resolve_resume(dir.path().string(), "never"); }), "already holds committed"));
  EXPECT_TRUE(has(resolve_resume(dir.path().string(), "auto"), "step-00000009"));
  EXPECT_TRUE(has(error_of([&] { resolve_resume(dir.path().string(), dir / "nope"); }),
                  "is not a committed checkpoint directory"));
  // A committed step is never overwritten.
  Checkpointer ck(dir.path().string(), 0, false);
  EXPECT_TRUE(has(error_of([&] { ck.save(9, checkpoint_items(s.params, s.opt.get()), {}); }),
                  "already exists: a committed checkpoint is never overwritten"));
}

// ---- Hugging Face conversion ----

Qwen3MoeConfig tiny_hf_config(bool tied) {
  Qwen3MoeConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.moe_intermediate_size = 16;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.mlp_only_layers = {0};
  c.tie_word_embeddings = tied;
  return c;
}

// An HF-style folder holding every parameter of `cfg` as random bf16, in two shards with an
// index (or fused experts in one file), with config.json. Returns the tensors by name.
std::map<std::string, Tensor> write_hf_folder(const std::string& dir, const Qwen3MoeConfig& cfg, bool fused) {
  fs::create_directories(dir);
  std::ofstream(fs::path(dir) / "config.json") << cfg.to_hf_json();
  Qwen3MoeModel model(cfg, DType::F32);
  std::map<std::string, Tensor> tensors;
  uint64_t seed = 100;
  for (const Parameter& p : model.parameters()) tensors[p.name] = random_tensor(p.value.shape(), DType::BF16, seed++);
  std::vector<std::string> names;
  for (const auto& [n, t] : tensors) names.push_back(n);
  if (fused) {
    const int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size, H = cfg.hidden_size;
    SafetensorsWriter w;
    std::vector<Tensor> held;
    for (const auto& [n, t] : tensors) {
      if (n.find(".experts.") == std::string::npos) w.add(n, t);
    }
    Tensor gate_up = Tensor::empty({E, 2 * I, H}, DType::BF16), down = Tensor::empty({E, H, I}, DType::BF16);
    for (int64_t e = 0; e < E; ++e) {
      const std::string b = fmt::format("model.layers.1.mlp.experts.{}.", e);
      gate_up.select(e).slice(0, I).copy_from(tensors[b + "gate_proj.weight"]);
      gate_up.select(e).slice(I, 2 * I).copy_from(tensors[b + "up_proj.weight"]);
      down.select(e).copy_from(tensors[b + "down_proj.weight"]);
    }
    w.add("model.layers.1.mlp.experts.gate_up_proj", gate_up);
    w.add("model.layers.1.mlp.experts.down_proj", down);
    w.write((fs::path(dir) / "model.safetensors").string());
    return tensors;
  }
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (int part = 0; part < 2; ++part) {
    const std::string file = fmt::format("model-{:05d}-of-00002.safetensors", part + 1);
    SafetensorsWriter w;
    for (size_t i = part * names.size() / 2; i < (part + 1) * names.size() / 2; ++i) {
      w.add(names[i], tensors[names[i]]);
      index["weight_map"][names[i]] = file;
    }
    w.write((fs::path(dir) / file).string());
  }
  std::ofstream(fs::path(dir) / "model.safetensors.index.json") << index.dump(2);
  return tensors;
}

std::map<std::string, Tensor> read_hf_folder(const std::string& dir) {
  CheckpointReader r(dir);
  EXPECT_TRUE(r.is_hf());
  std::map<std::string, Tensor> out;
  for (const auto& n : r.names()) out[n] = r.read_whole(n);
  return out;
}

TEST(HfConvert, RoundTripIsBitwiseAndTheModelLoadsEitherForm) {
  for (bool tied : {false, true}) {
    ScratchDir dir;
    const Qwen3MoeConfig cfg = tiny_hf_config(tied);
    const auto original = write_hf_folder(dir / "hf", cfg, /*fused=*/false);
    import_hf(dir / "hf", dir / "mt");
    HfExportOptions opt;
    opt.max_shard_bytes = 20000;  // several shards
    export_hf(dir / "mt", dir / "back", opt);
    const auto back = read_hf_folder(dir / "back");
    ASSERT_EQ(back.size(), original.size());
    for (const auto& [name, t] : original) {
      ASSERT_TRUE(back.count(name)) << name;
      EXPECT_TRUE(bytes_equal(back.at(name), t)) << name;
    }
    EXPECT_TRUE(fs::exists(dir.path() / "back" / "model.safetensors.index.json"));
    const auto cfg_in = nlohmann::json::parse(std::ifstream(dir.path() / "hf" / "config.json"));
    const auto cfg_out = nlohmann::json::parse(std::ifstream(dir.path() / "back" / "config.json"));
    EXPECT_EQ(cfg_in, cfg_out);
    // The same weights load into a model from the HF folder and from the checkpoint.
    for (const char* src : {"hf", "mt", "back"}) {
      Qwen3MoeModel m(cfg, DType::F32);
      CheckpointReader r(dir / src);
      load_model_weights(r, m.parameters());
      for (const Parameter& p : m.parameters()) {
        EXPECT_TRUE(bytes_equal(p.value, original.at(p.name).to(DType::F32))) << src << " " << p.name;
      }
    }
    // Never over an existing folder.
    EXPECT_TRUE(has(error_of([&] { import_hf(dir / "hf", dir / "mt"); }), "already exists"));
    EXPECT_TRUE(has(error_of([&] { export_hf(dir / "mt", dir / "back", {}); }), "already exists"));
  }
}

TEST(HfConvert, FusedExpertTensorsAreSplitPerExpert) {
  ScratchDir dir;
  const Qwen3MoeConfig cfg = tiny_hf_config(false);
  const auto original = write_hf_folder(dir / "hf", cfg, /*fused=*/true);
  import_hf(dir / "hf", dir / "mt");
  HfExportOptions opt;
  opt.dtype = DType::F32;
  export_hf(dir / "mt", dir / "back", opt);
  const auto back = read_hf_folder(dir / "back");
  ASSERT_EQ(back.size(), original.size());
  for (const auto& [name, t] : original) EXPECT_TRUE(bytes_equal(back.at(name), t.to(DType::F32))) << name;
  const auto cfg_out = nlohmann::json::parse(std::ifstream(dir.path() / "back" / "config.json"));
  EXPECT_EQ(cfg_out["torch_dtype"], "float32");
}

TEST(HfConvert, AFolderLackingATensorNamesIt) {
  ScratchDir dir;
  Qwen3MoeConfig cfg = tiny_hf_config(false);
  write_hf_folder(dir / "hf", cfg, false);
  cfg.num_hidden_layers = 3;  // the model wants a layer the folder does not have
  Qwen3MoeModel m(cfg, DType::F32);
  CheckpointReader r(dir / "hf");
  const std::string e = error_of([&] { load_model_weights(r, m.parameters()); });
  EXPECT_TRUE(has(e, "no tensor 'model.layers.2.")) << e;
  EXPECT_TRUE(has(error_of([&] { CheckpointReader bad(dir / "nothing"); }), "does not exist"));
  fs::create_directories(dir.path() / "empty");
  EXPECT_TRUE(has(error_of([&] { CheckpointReader bad(dir / "empty"); }),
                  "neither a moetrain checkpoint (index.json) nor a Hugging Face model folder"));
}

// F8_E4M3's values at known codes (OCP FP8 E4M3 "fn"): 1, 1.5, -1, the largest 448, the
// smallest normal 2^-6, the smallest subnormal 2^-9, zero and NaN.
TEST(HfConvert, Fp8E4m3Decodes) {
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x3C), 1.5f);
  EXPECT_EQ(fp8_e4m3_to_float(0xB8), -1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0.015625f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0.001953125f);
  EXPECT_EQ(fp8_e4m3_to_float(0x00), 0.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xFF)));
}

// A DeepSeek FP8 folder: an F8_E4M3 weight of 130 x 260 (blocks of 128 x 128 that do not
// divide it) with its f32 weight_scale_inv [2, 3], beside a bf16 tensor. Import dequantizes
// it to bf16 (W * scale of its block), drops the scales and the config's
// quantization_config; loading the FP8 folder directly is refused, naming convert.
TEST(HfConvert, Fp8WeightsAreDequantizedOnImport) {
  ScratchDir dir;
  fs::create_directories(dir.path() / "hf");
  nlohmann::json cfg = nlohmann::json::parse(DeepseekV3Config().to_hf_json());
  cfg["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                                {"weight_block_size", {128, 128}}};
  std::ofstream(dir.path() / "hf" / "config.json") << cfg.dump(2);
  const int64_t R = 130, C = 260;
  std::vector<uint8_t> w(R * C);
  for (int64_t i = 0; i < R * C; ++i) w[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  for (uint8_t& b : w) {
    if ((b & 0x7F) == 0x7F) b = 0x38;  // no NaN codes
  }
  const std::vector<float> scale{0.5f, 2.0f, 0.25f, 4.0f, 1.0f, 0.125f};
  Tensor norm = testing::random_tensor({64}, DType::F32, 3).to(DType::BF16);
  // The file by hand: the writer only writes dtypes moetrain holds.
  nlohmann::ordered_json header;
  const std::string wname = "model.layers.0.self_attn.kv_b_proj.weight";
  header[wname] = {{"dtype", "F8_E4M3"}, {"shape", {R, C}}, {"data_offsets", {0, R * C}}};
  header[wname + "_scale_inv"] = {{"dtype", "F32"}, {"shape", {2, 3}}, {"data_offsets", {R * C, R * C + 24}}};
  header["model.norm.weight"] = {{"dtype", "BF16"}, {"shape", {64}}, {"data_offsets", {R * C + 24, R * C + 24 + 128}}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  {
    std::ofstream f(dir.path() / "hf" / "model.safetensors", std::ios::binary);
    const uint64_t n = text.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << text;
    f.write(reinterpret_cast<const char*>(w.data()), static_cast<std::streamsize>(w.size()));
    f.write(reinterpret_cast<const char*>(scale.data()), 24);
    f.write(static_cast<const char*>(norm.raw()), 128);
  }
  EXPECT_TRUE(has(error_of([&] { CheckpointReader r(dir / "hf"); }), "moetrain convert"));
  import_hf(dir / "hf", dir / "mt");
  CheckpointReader r(dir / "mt");
  EXPECT_FALSE(r.has(wname + "_scale_inv"));
  EXPECT_TRUE(bytes_equal(r.read_whole("model.norm.weight"), norm));
  const Tensor got = r.read_whole(wname);
  ASSERT_EQ(got.dtype(), DType::BF16);
  ASSERT_EQ(got.shape(), (Shape{R, C}));
  const std::vector<double> v = got.to_double_vector();
  int64_t checked = 0;
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < C; ++j) {
      const float want = static_cast<float>(bf16(fp8_e4m3_to_float(w[i * C + j]) * scale[(i / 128) * 3 + j / 128]));
      ASSERT_EQ(v[i * C + j], static_cast<double>(want)) << i << "," << j;
      ++checked;
    }
  }
  EXPECT_EQ(checked, R * C);
  EXPECT_FALSE(r.trainer_state()["hf_config"].contains("quantization_config"));
  // A scale of the wrong block count is named.
  fs::create_directories(dir.path() / "bad");
  cfg["quantization_config"]["weight_block_size"] = {64, 128};
  std::ofstream(dir.path() / "bad" / "config.json") << cfg.dump(2);
  fs::copy_file(dir.path() / "hf" / "model.safetensors", dir.path() / "bad" / "model.safetensors");
  const std::string e = error_of([&] { import_hf(dir / "bad", dir / "bad-mt"); });
  EXPECT_TRUE(has(e, "_scale_inv") && has(e, "[3, 3]")) << e;
}


// ---- FP8 export (convert --fp8) ----

// A checkpoint of the model of configs/<config_file> at its initial weights (f32) and random
// routing biases, saved as the trainer saves one (hf_config in trainer_state.json). `edit`
// may change a weight first. Returns the tensors by name.
std::map<std::string, Tensor> save_model_checkpoint(const std::string& dir, const std::string& config_file,
                                                    const std::function<void(ParameterList&)>& edit) {
  const RunConfig rc = RunConfig::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + config_file, {});
  std::unique_ptr<Model> model = build_model(*rc.model, DType::F32, Device::cpu(), ModelPlacement{});
  model->init_weights(1234);
  if (edit) edit(model->parameters());
  CheckpointItems items = checkpoint_items(model->parameters(), nullptr);
  std::map<std::string, Tensor> weights;
  for (const Parameter& p : model->parameters()) weights[p.name] = p.value.clone();
  uint64_t seed = 77;
  for (const NamedBuffer& b : model->buffers()) {  // the routing biases, as training moves them
    Tensor v = b.value;
    v.copy_from(random_tensor(v.shape(), v.dtype(), seed++));
    items.model.push_back({b.name, v});
    weights[b.name] = v.clone();
  }
  Checkpointer ck(dir, 1, /*async=*/false);
  ck.save(1, items, {{"step", 1}, {"hf_config", nlohmann::json::parse(rc.model->to_hf_json())}});
  return weights;
}

// The weights DeepSeek's FP8 format quantizes, by name (written here apart from the
// exporter's rule): the linear projections of a decoder layer's attention and MLP.
bool fp8_format_quantizes(const std::string& name) {
  const bool in_block = name.starts_with("model.layers.") &&
                        (name.find(".self_attn.") != std::string::npos || name.find(".mlp.") != std::string::npos);
  return in_block && (name.ends_with("_proj.weight") || name.ends_with(".kv_a_proj_with_mqa.weight"));
}

// An HF folder's tensors as stored, F8_E4M3 ones too (CheckpointReader refuses those).
struct RawFolder {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsEntry*>> entries;
  explicit RawFolder(const fs::path& dir) {
    for (const auto& f : fs::directory_iterator(dir)) {
      if (f.path().extension() != ".safetensors") continue;
      files.push_back(std::make_unique<SafetensorsFile>(f.path().string()));
      for (const SafetensorsEntry& e : files.back()->entries()) entries[e.name] = {files.back().get(), &e};
    }
  }
  const std::pair<const SafetensorsFile*, const SafetensorsEntry*>& at(const std::string& name) const {
    auto it = entries.find(name);
    MT_CHECK(it != entries.end(), "the folder has no tensor '{}'", name);
    return it->second;
  }
  const SafetensorsEntry& entry(const std::string& name) const { return *at(name).second; }
  const uint8_t* bytes(const std::string& name) const { return static_cast<const uint8_t*>(at(name).first->data(entry(name))); }
};

// `convert --fp8` on the initial weights of configs/tiny.toml (Qwen3-MoE) and
// configs/dsv3-tiny.toml (DeepSeek-V3: MLA, a dense first layer, shared experts, an MTP
// module), in several shards: exactly the attention and MLP projections are F8_E4M3, each
// with an f32 <name>_scale_inv of [ceil(R/128), ceil(C/128)] (the tiny models' 48-, 64- and
// 192-row and 32- and 64-column weights end in partial blocks; a zeroed block gets scale 1);
// codes and scales are the CPU quantizer's, recomputed here by hand for one weight; q *
// scale_inv lies within half an e4m3 step of the master and differs from it; every other
// tensor is the master in bf16; the index counts the FP8 bytes; config.json gains
// quantization_config. Import dequantizes the folder back: the quantized weights are
// dequantize(quantize(master)) in bf16, bit for bit, the others the exported bf16, and the
// config loses quantization_config only.
TEST(HfConvert, Fp8ExportQuantizesTheLinearWeightsAndImportReadsThemBack) {
  struct Case {
    const char* config;
    const char* by_hand;  // a weight whose codes and scales are recomputed here
    std::vector<std::string> quantized, kept;  // a few names each, as a reader would look for them
    std::vector<std::string> not_converted;
  };
  const Case cases[] = {
      {"tiny.toml",
       "model.layers.0.self_attn.k_proj.weight",  // [64, 128]
       {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.o_proj.weight",
        "model.layers.2.mlp.experts.7.down_proj.weight"},
       {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
        "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"},
       {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate",
        "model.layers.3.mlp.gate"}},
      {"dsv3-tiny.toml",
       "model.layers.1.self_attn.q_b_proj.weight",  // [192, 64]
       {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.experts.15.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
        "model.layers.4.self_attn.o_proj.weight", "model.layers.4.mlp.experts.0.gate_proj.weight"},
       {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.self_attn.kv_a_layernorm.weight",
        "model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight", "model.layers.4.shared_head.head.weight",
        "model.layers.4.embed_tokens.weight"},
       {"lm_head", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate", "model.layers.3.mlp.gate",
        "model.layers.4.eh_proj", "model.layers.4.mlp.gate", "model.layers.4.shared_head.head"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.config);
    ScratchDir dir;
    const std::string zeroed = "model.layers.1.self_attn.kv_b_proj.weight";  // DeepSeek-V3's [256, 32]
    const auto master = save_model_checkpoint(dir / "ck", c.config, [&](ParameterList& params) {
      for (Parameter& p : params) {
        if (p.name == zeroed) p.value.slice(0, 128).zero_();  // its first block all zeros
      }
    });
    HfExportOptions opt;
    opt.fp8 = true;
    opt.max_shard_bytes = 100000;
    export_hf(dir / "ck", dir / "hf8", opt);
    const fs::path hf8 = dir.path() / "hf8";
    EXPECT_TRUE(has(error_of([&] { CheckpointReader r(hf8.string()); }), "moetrain convert"));
    const RawFolder folder(hf8);
    ASSERT_GT(folder.files.size(), 2u);

    // What was written, and as what.
    const bool qwen = std::string(c.config) == "tiny.toml";
    size_t quantized = 0, kept = 0;
    for (const auto& [name, w] : master) {
      if (qwen && name.ends_with("e_score_correction_bias")) {  // Qwen3MoeForCausalLM has none
        EXPECT_FALSE(folder.entries.count(name)) << name;
        continue;
      }
      ASSERT_TRUE(folder.entries.count(name)) << name;
      const SafetensorsEntry& e = folder.entry(name);
      ASSERT_EQ(e.shape, w.shape()) << name;
      if (!fp8_format_quantizes(name)) {
        ++kept;
        EXPECT_FALSE(e.f8_e4m3) << name;
        EXPECT_FALSE(folder.entries.count(name + "_scale_inv")) << name;
        const Tensor stored = folder.at(name).first->read(name);
        // bf16, but the routing biases, which stay f32 (as in DeepSeek's FP8 release)
        const bool bias = name.ends_with(".e_score_correction_bias");
        EXPECT_TRUE(bytes_equal(stored, bias ? w : w.to(DType::BF16))) << name;
        if (bias) {
          EXPECT_EQ(stored.dtype(), DType::F32) << name;
        }
        continue;
      }
      ++quantized;
      ASSERT_TRUE(e.f8_e4m3) << name;
      ASSERT_TRUE(folder.entries.count(name + "_scale_inv")) << name;
      const SafetensorsEntry& se = folder.entry(name + "_scale_inv");
      const int64_t R = w.size(0), C = w.size(1), RB = (R + 127) / 128, CB = (C + 127) / 128;
      ASSERT_FALSE(se.f8_e4m3);
      ASSERT_EQ(se.dtype, DType::F32) << name;
      ASSERT_EQ(se.shape, (Shape{RB, CB})) << name;
      const uint8_t* q = folder.bytes(name);
      const auto* s = reinterpret_cast<const float*>(folder.bytes(name + "_scale_inv"));
      // The quantizer's codes and scales (its padded scale columns aside).
      const ops::Fp8Tensor ref = ops::quantize_fp8(w, ops::Fp8Blocks::kBlocks);
      ASSERT_EQ(std::memcmp(q, ref.q.raw(), static_cast<size_t>(R * C)), 0) << name;
      for (int64_t i = 0; i < RB; ++i) {
        for (int64_t j = 0; j < CB; ++j) ASSERT_EQ(s[i * CB + j], ref.scale.data<float>()[i * ref.scale.size(1) + j]);
      }
      // q * scale_inv within half an e4m3 step of the master: |x| 2^-4 for a normal code,
      // scale 2^-10 for a subnormal one (and a float rounding's slack); not equal everywhere.
      const std::vector<double> x = w.to_double_vector();
      int64_t differ = 0;
      for (int64_t i = 0; i < R; ++i) {
        for (int64_t j = 0; j < C; ++j) {
          const double scale = s[(i / 128) * CB + j / 128];
          const double back = static_cast<double>(fp8_e4m3_to_float(q[i * C + j])) * scale;
          const double v = x[i * C + j];
          const double bound = std::max(std::abs(v) / 16, scale / 1024) * (1 + 1e-5);
          ASSERT_LE(std::abs(back - v), bound) << name << " [" << i << ", " << j << "] scale " << scale;
          differ += back != v;
        }
      }
      EXPECT_GT(differ, R * C / 4) << name << ": the weight came back unquantized";
    }
    for (const std::string& n : c.quantized) EXPECT_TRUE(folder.entry(n).f8_e4m3) << n;
    for (const std::string& n : c.kept) EXPECT_FALSE(folder.entry(n).f8_e4m3) << n;
    // Only those tensors: each weight and its scales, once.
    EXPECT_EQ(folder.entries.size(), 2 * quantized + kept);
    EXPECT_GT(quantized, 20u);

    // One weight by hand: scale = amax / 448 per 128 x 128 block, q = e4m3(x / scale).
    {
      const Tensor& w = master.at(c.by_hand);
      const int64_t R = w.size(0), C = w.size(1), RB = (R + 127) / 128, CB = (C + 127) / 128;
      ASSERT_TRUE(R % 128 != 0 || C % 128 != 0) << "no partial block";
      const float* x = w.data<float>();
      const uint8_t* q = folder.bytes(c.by_hand);
      const auto* s = reinterpret_cast<const float*>(folder.bytes(std::string(c.by_hand) + "_scale_inv"));
      for (int64_t bi = 0; bi < RB; ++bi) {
        for (int64_t bj = 0; bj < CB; ++bj) {
          float amax = 0;
          for (int64_t i = bi * 128; i < std::min(R, bi * 128 + 128); ++i) {
            for (int64_t j = bj * 128; j < std::min(C, bj * 128 + 128); ++j) amax = std::max(amax, std::abs(x[i * C + j]));
          }
          const float scale = amax / 448.0f;
          ASSERT_EQ(s[bi * CB + bj], scale) << bi << "," << bj;
          for (int64_t i = bi * 128; i < std::min(R, bi * 128 + 128); ++i) {
            for (int64_t j = bj * 128; j < std::min(C, bj * 128 + 128); ++j) {
              ASSERT_EQ(q[i * C + j], float_to_fp8_e4m3(x[i * C + j] / scale)) << i << "," << j;
            }
          }
        }
      }
    }
    if (master.count(zeroed)) {  // an all-zero block: codes 0, scale 1
      const auto* s = reinterpret_cast<const float*>(folder.bytes(zeroed + "_scale_inv"));
      EXPECT_EQ(s[0], 1.0f);
      EXPECT_NE(s[1], 1.0f);
      const uint8_t* q = folder.bytes(zeroed);
      EXPECT_TRUE(std::all_of(q, q + 128 * 32, [](uint8_t b) { return b == 0; }));
    }

    // The index: every tensor, and the bytes the shards hold (a byte per FP8 element).
    const auto index = nlohmann::json::parse(std::ifstream(hf8 / "model.safetensors.index.json"));
    EXPECT_EQ(index["weight_map"].size(), folder.entries.size());
    uint64_t total = 0;
    for (const auto& f : folder.files) {
      uint64_t in_file = 0;
      for (const SafetensorsEntry& e : f->entries()) {
        in_file += e.end - e.begin;
        EXPECT_EQ(index["weight_map"][e.name], fs::path(f->path()).filename().string()) << e.name;
      }
      EXPECT_LE(in_file, opt.max_shard_bytes) << f->path();
      total += in_file;
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);

    // config.json: the checkpoint's, bf16, with DeepSeek's quantization_config.
    auto cfg = nlohmann::json::parse(std::ifstream(hf8 / "config.json"));
    auto source = nlohmann::json::parse(std::ifstream(resolve_step_dir(dir / "ck") + "/config.json"));
    ASSERT_TRUE(cfg.contains("quantization_config"));
    const nlohmann::json want = {{"activation_scheme", "dynamic"},
                                 {"fmt", "e4m3"},
                                 {"quant_method", "fp8"},
                                 {"weight_block_size", {128, 128}},
                                 {"modules_to_not_convert", c.not_converted}};
    EXPECT_EQ(cfg["quantization_config"], want) << cfg["quantization_config"].dump();
    EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
    if (source.contains("dtype")) {
      EXPECT_EQ(cfg["dtype"], "bfloat16");
    }

    // Import: the FP8 weights dequantized to bf16, the rest as exported, the config without
    // quantization_config.
    import_hf(hf8.string(), dir / "back");
    CheckpointReader back(dir / "back");
    size_t read = 0;
    for (const auto& [name, w] : master) {
      if (qwen && name.ends_with("e_score_correction_bias")) continue;
      ASSERT_TRUE(back.has(name)) << name;
      const Tensor t = back.read_whole(name);
      const Tensor want_t = fp8_format_quantizes(name)
                                ? ops::dequantize_fp8(ops::quantize_fp8(w, ops::Fp8Blocks::kBlocks), DType::BF16)
                                : name.ends_with(".e_score_correction_bias") ? w : w.to(DType::BF16);
      EXPECT_TRUE(bytes_equal(t, want_t)) << name;
      ++read;
    }
    EXPECT_EQ(back.names().size(), read);
    nlohmann::json imported = back.trainer_state()["hf_config"];
    EXPECT_FALSE(imported.contains("quantization_config"));
    cfg.erase("quantization_config");
    EXPECT_EQ(imported, cfg);

    // Refused: another dtype beside --fp8, and an HF folder as the source.
    HfExportOptions f32 = opt;
    f32.dtype = DType::F32;
    std::string e = error_of([&] { export_hf(dir / "ck", dir / "x", f32); });
    EXPECT_TRUE(has(e, "--dtype must be bf16 or left out, got f32")) << e;
    e = error_of([&] { export_hf(hf8.string(), dir / "x", opt); });
    EXPECT_TRUE(has(e, "is a Hugging Face folder")) << e;
    EXPECT_FALSE(fs::exists(dir.path() / "x"));
  }
}

}  // namespace
}  // namespace moetrain
