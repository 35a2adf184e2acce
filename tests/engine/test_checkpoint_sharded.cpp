// Checkpoints written and read by many ranks: element ranges cut into boxes, flat-sharded
// items saved by several simulated ranks (threads, each with its own Checkpointer) and read
// back whole and under another sharding, a missing rank, async saves with pruning.
#include <gtest/gtest.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <thread>

#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/checkpointer.h"
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


// Elements [begin, end) of `full`, as a 1-D copy.
Tensor piece_of(const Tensor& full, int64_t begin, int64_t end) {
  return full.view({full.numel()}).slice(begin, end).clone();
}

// ---- element ranges as boxes ----

int64_t flat_index(const Shape& shape, const Shape& idx) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Whether elements [a, b) of a tensor of `shape` form a box (then each box is contiguous).
bool range_is_box(const Shape& shape, int64_t a, int64_t b) {
  const size_t nd = shape.size();
  if (nd == 0) return b - a == 1;
  Shape lo(nd, std::numeric_limits<int64_t>::max()), hi(nd, -1);
  for (int64_t f = a; f < b; ++f) {
    int64_t rem = f;
    for (size_t d = nd; d-- > 0;) {
      const int64_t i = rem % shape[d];
      rem /= shape[d];
      lo[d] = std::min(lo[d], i);
      hi[d] = std::max(hi[d], i);
    }
  }
  int64_t vol = 1;
  for (size_t d = 0; d < nd; ++d) vol *= hi[d] - lo[d] + 1;
  return vol == b - a;
}

// The fewest contiguous boxes that tile [b, e), by dynamic programming over every cut.
int64_t fewest_boxes(const Shape& shape, int64_t b, int64_t e) {
  std::vector<int64_t> best(e - b + 1, std::numeric_limits<int64_t>::max() / 2);
  best[e - b] = 0;
  for (int64_t p = e - 1; p >= b; --p) {
    for (int64_t q = p + 1; q <= e; ++q) {
      if (range_is_box(shape, p, q)) best[p - b] = std::min(best[p - b], 1 + best[q - b]);
    }
  }
  return best[0];
}

TEST(CheckpointSharded, ElementRangesBecomeTheFewestContiguousBoxesInOrder) {
  const std::vector<Shape> shapes = {{5},          {3, 4},       {2, 3, 4}, {1, 1, 7}, {4, 1, 3},
                                     {2, 2, 2, 3}, {2, 1, 3, 2}, {},        {0, 3}};
  int64_t checked = 0;
  for (const Shape& shape : shapes) {
    const int64_t n = shape_numel(shape);
    const size_t nd = shape.size();
    for (int64_t b = 0; b <= n; ++b) {
      for (int64_t e = b; e <= n; ++e) {
        const std::string where = fmt::format("shape {} range [{}, {})", shape_str(shape), b, e);
        const std::vector<std::pair<Shape, Shape>> boxes = element_range_boxes(shape, b, e);
        std::vector<int> seen(n, 0);
        int64_t at = b;  // in memory order: each box starts where the previous one ended
        for (const auto& [start, box] : boxes) {
          ASSERT_EQ(start.size(), nd) << where;
          ASSERT_EQ(box.size(), nd) << where;
          const int64_t vol = shape_numel(box);
          ASSERT_GT(vol, 0) << where;
          for (size_t d = 0; d < nd; ++d) {
            ASSERT_TRUE(start[d] >= 0 && start[d] + box[d] <= shape[d]) << where;
          }
          ASSERT_EQ(flat_index(shape, start), at) << where;
          // Contiguous: the box's elements are exactly [at, at + vol).
          Shape idx = start;
          for (int64_t k = 0; k < vol; ++k) {
            const int64_t f = flat_index(shape, idx);
            ASSERT_EQ(f, at + k) << where;
            ++seen[f];
            for (size_t d = nd; d-- > 0;) {  // next index inside the box
              if (++idx[d] < start[d] + box[d]) break;
              idx[d] = start[d];
            }
          }
          at += vol;
        }
        ASSERT_EQ(at, e) << where;
        for (int64_t f = 0; f < n; ++f) ASSERT_EQ(seen[f], f >= b && f < e ? 1 : 0) << where << " element " << f;
        ASSERT_EQ(static_cast<int64_t>(boxes.size()), fewest_boxes(shape, b, e)) << where;
        ASSERT_LE(boxes.size(), std::max<size_t>(1, 2 * nd - 1)) << where;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 800);
  EXPECT_TRUE(has(error_of([] { element_range_boxes({3, 4}, 5, 13); }), "[5, 13)"));
  EXPECT_TRUE(has(error_of([] { element_range_boxes({3, 4}, 6, 5); }), "[6, 5)"));
}

// Flat pieces written by hand: the index refuses overlapping pieces and a rank's file that
// is missing or of another size than its manifest says.
TEST(CheckpointSharded, TheIndexChecksFlatPiecesAndTheRanksFiles) {
  ScratchDir dir;
  const Tensor full = random_tensor({4, 5}, DType::F32, 3);
  auto piece = [&](int64_t b, int64_t e) {
    TensorSlice s = whole_slice("w", piece_of(full, b, e));
    s.global_shape = full.shape();
    s.flat_begin = b;
    return s;
  };
  const std::string d = dir.path().string();
  write_rank_files(d, 0, {piece(0, 7)}, {});
  write_rank_files(d, 1, {piece(7, 20)}, {});
  write_index(d, 2, {});
  {
    CheckpointReader r(d);
    EXPECT_TRUE(bytes_equal(r.read_whole("w"), full));
    EXPECT_EQ(r.info("w").slices.size(), 4u);  // [0, 7): a row, 2 of the next; [7, 20): 3 of a row, 2 rows
  }
  write_rank_files(d, 1, {piece(6, 20)}, {});  // claims element 6, which rank 0 holds
  std::string e = error_of([&] { write_index(d, 2, {}); });
  EXPECT_TRUE(has(e, "tensor 'w': slices in") && has(e, "overlap")) << e;
  write_rank_files(d, 1, {piece(7, 20)}, {});
  fs::resize_file(dir.path() / "model-r00001.safetensors", 10);
  e = error_of([&] { write_index(d, 2, {}); });
  EXPECT_TRUE(has(e, "rank 1's file model-r00001.safetensors has 10 bytes, its manifest says")) << e;
  fs::remove(dir.path() / "model-r00001.safetensors");
  e = error_of([&] { write_index(d, 2, {}); });
  EXPECT_TRUE(has(e, "rank 1's manifest lists model-r00001.safetensors, which does not exist")) << e;
}

// ---- a flat-sharded "model" saved by several ranks ----

struct Spec {
  std::string name;
  Shape shape;
  DType dtype;
  int expert_owner;  // -1: dense (every rank holds it); else the EP rank that holds it
};

// Dense tensors (one of fewer elements than there are ranks) and the experts of two EP
// ranks; bf16 and f32 model tensors, f32 optimizer moments.
const std::vector<Spec>& model_specs() {
  static const std::vector<Spec> specs = {
      {"model.embed_tokens.weight", {7, 5}, DType::BF16, -1},
      {"model.norm.weight", {3}, DType::F32, -1},
      {"model.layers.0.self_attn.q_proj.weight", {2, 3, 4}, DType::BF16, -1},
      {"model.layers.0.mlp.gate.weight", {1, 1, 7}, DType::F32, -1},
      {"lm_head.weight", {6, 5}, DType::BF16, -1},
      {"model.layers.0.mlp.experts.0.down_proj.weight", {3, 4}, DType::BF16, 0},
      {"model.layers.0.mlp.experts.1.down_proj.weight", {4, 3}, DType::BF16, 0},
      {"model.layers.0.mlp.experts.2.down_proj.weight", {3, 4}, DType::BF16, 1},
      {"model.layers.0.mlp.experts.3.down_proj.weight", {4, 3}, DType::BF16, 1},
  };
  return specs;
}

// What step `step` holds for each tensor (model values and their Adam moment), by name.
std::map<std::string, Tensor> reference(int64_t step) {
  std::map<std::string, Tensor> out;
  uint64_t seed = 1000 * static_cast<uint64_t>(step);
  for (const Spec& s : model_specs()) {
    out[s.name] = random_tensor(s.shape, s.dtype, ++seed);
    out[s.name + ".exp_avg"] = random_tensor(s.shape, DType::F32, ++seed);
  }
  return out;
}

// A piece a rank owns: elements [begin, end) of the flattened tensor `spec`.
struct Piece {
  const Spec* spec;
  int64_t begin, end;
};

// Flat sharding over n ranks: `members` lie back to back in one buffer of N elements, rank r
// owns [r S, (r + 1) S) with S = ceil(N / n). Empty pieces are kept (a rank may own nothing
// of a small tensor: its item is then empty).
std::vector<Piece> flat_pieces(const std::vector<const Spec*>& members, int n, int r) {
  int64_t total = 0;
  for (const Spec* s : members) total += shape_numel(s->shape);
  const int64_t S = (total + n - 1) / n;
  const int64_t lo = r * S, hi = std::min(total, (r + 1) * S);
  std::vector<Piece> out;
  int64_t at = 0;
  for (const Spec* s : members) {
    const int64_t numel = shape_numel(s->shape);
    const int64_t b = std::clamp(lo - at, int64_t{0}, numel), e = std::clamp(hi - at, int64_t{0}, numel);
    out.push_back({s, b, std::max(b, e)});
    at += numel;
  }
  return out;
}

// The training layout: world 4 = dp 2 x ep 2 (rank = dp * 2 + ep). Dense tensors form one
// bucket sharded over all 4 ranks; EP rank e's experts one bucket sharded over its 2 dp ranks.
std::vector<Piece> training_layout(int rank) {
  std::vector<const Spec*> dense, experts;
  const int ep = rank % 2, dp = rank / 2;
  for (const Spec& s : model_specs()) {
    if (s.expert_owner < 0) dense.push_back(&s);
    if (s.expert_owner == ep) experts.push_back(&s);
  }
  std::vector<Piece> out = flat_pieces(dense, 4, rank);
  for (const Piece& p : flat_pieces(experts, 2, dp)) out.push_back(p);
  return out;
}

// Another layout: n ranks, no expert parallelism, every tensor in one bucket in reverse order.
std::vector<Piece> other_layout(int n, int rank) {
  std::vector<const Spec*> all;
  for (const Spec& s : model_specs()) all.push_back(&s);
  std::reverse(all.begin(), all.end());
  return flat_pieces(all, n, rank);
}


// The items of one rank holding `pieces` of the tensors in `ref` (copies: the live state).
CheckpointItems items_for(const std::vector<Piece>& pieces, const std::map<std::string, Tensor>& ref) {
  CheckpointItems items;
  for (const Piece& p : pieces) {
    const std::string& n = p.spec->name;
    items.model.push_back({n, piece_of(ref.at(n), p.begin, p.end), p.spec->shape, p.begin});
    items.optimizer.push_back(
        {n + ".exp_avg", piece_of(ref.at(n + ".exp_avg"), p.begin, p.end), p.spec->shape, p.begin});
  }
  return items;
}

// Empty items of the same pieces, to load into.
CheckpointItems zeros_like(const CheckpointItems& items) {
  CheckpointItems out = items;
  for (auto* list : {&out.model, &out.optimizer}) {
    for (CheckpointItem& it : *list) it.data = Tensor::zeros(it.data.shape(), it.data.dtype());
  }
  return out;
}

// Runs fn(rank) on `world` threads at once; rethrows the first error.
void on_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

void save_on_ranks(const std::string& dir, int world, int64_t step,
                   std::chrono::seconds timeout = std::chrono::seconds(60)) {
  const auto ref = reference(step);
  on_ranks(world, [&](int r) {
    Checkpointer ck(dir, /*keep=*/0, /*async=*/r % 2 == 1, r, world, timeout);
    ck.save(step, items_for(training_layout(r), ref), {{"step", step}});
    ck.wait();
  });
}

std::string read_latest(const fs::path& dir) {
  std::ifstream f(dir / "latest");
  std::string s;
  f >> s;
  return s;
}

TEST(CheckpointSharded, FourRanksSaveFlatShardsThatLoadWholeAndUnderAnotherSharding) {
  ScratchDir dir;
  save_on_ranks(dir.path().string(), 4, 7);
  const auto ref = reference(7);
  const auto all = Checkpointer::committed(dir.path().string());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(read_latest(dir.path()), "step-00000007");
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(fs::exists(fs::path(all[0].second) / fmt::format("manifest-r{:05d}.json", r))) << r;
  }

  // (a) Whole, in one process: bit for bit.
  CheckpointReader reader(all[0].second);
  EXPECT_EQ(reader.trainer_state()["step"], 7);
  for (const auto& [name, t] : ref) EXPECT_TRUE(bytes_equal(reader.read_whole(name), t)) << name;
  // A tensor of 3 elements lies with one rank: the others own nothing of it.
  EXPECT_EQ(reader.info("model.norm.weight").slices.size(), 1u);
  // load_slices with whole items, as one process would.
  {
    std::vector<CheckpointItem> whole;
    for (const auto& [name, t] : ref) whole.push_back({name, Tensor::zeros(t.shape(), t.dtype())});
    load_slices(reader, whole);
    for (const CheckpointItem& it : whole) EXPECT_TRUE(bytes_equal(it.data, ref.at(it.name))) << it.name;
  }

  // (b) Under 3 ranks with another flat sharding, and under the training layout itself.
  for (int n : {3, 4}) {
    for (int r = 0; r < n; ++r) {
      const std::vector<Piece> pieces = n == 3 ? other_layout(3, r) : training_layout(r);
      const CheckpointItems want = items_for(pieces, ref);
      CheckpointItems got = zeros_like(want);
      load_slices(reader, got.model);
      load_slices(reader, got.optimizer);
      for (size_t i = 0; i < want.model.size(); ++i) {
        EXPECT_TRUE(bytes_equal(got.model[i].data, want.model[i].data))
            << n << " ranks, rank " << r << ": " << want.model[i].name;
        EXPECT_TRUE(bytes_equal(got.optimizer[i].data, want.optimizer[i].data)) << want.optimizer[i].name;
      }
    }
  }
  // Box items (a 2 x 2 block split of one tensor) and a dtype conversion on the way.
  {
    const Tensor& full = ref.at("model.embed_tokens.weight");  // [7, 5] bf16
    Tensor block = Tensor::zeros({3, 2}, DType::F32);
    CheckpointItem it{"model.embed_tokens.weight", block, {7, 5}};
    it.start = {4, 3};
    load_slices(reader, {it});
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        EXPECT_EQ(block.item(i * 2 + j), full.item((4 + i) * 5 + 3 + j)) << i << "," << j;
      }
    }
  }
  // A piece of a tensor of another shape is refused, naming both shapes.
  CheckpointItem wrong{"model.layers.0.mlp.gate.weight", Tensor::zeros({4}, DType::F32), {7}, 2};
  const std::string e = error_of([&] { load_slices(reader, {wrong}); });
  EXPECT_TRUE(has(e, "tensor 'model.layers.0.mlp.gate.weight' has shape [1, 1, 7], expected [7]")) << e;
  EXPECT_TRUE(has(error_of([&] { load_slices(reader, {{"nope", Tensor::zeros({2}, DType::F32)}}); }),
                  "no tensor 'nope'"));
}

TEST(CheckpointSharded, BoxItemsAreSavedToo) {
  // Two ranks each save half of a tensor's columns as a box; a third tensor is whole on rank 1.
  ScratchDir dir;
  const Tensor full = random_tensor({4, 6}, DType::F32, 5), other = random_tensor({3}, DType::BF16, 6);
  on_ranks(2, [&](int r) {
    Checkpointer ck(dir.path().string(), 0, false, r, 2, std::chrono::seconds(60));
    Tensor half = Tensor::empty({4, 3}, DType::F32);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 3; ++j) half.data<float>()[i * 3 + j] = full.data<float>()[i * 6 + 3 * r + j];
    }
    CheckpointItems items;
    CheckpointItem it{"w", half, {4, 6}};
    it.start = {0, 3 * r};
    items.model.push_back(it);
    if (r == 1) items.model.push_back({"v", other});
    ck.save(1, items, {{"step", 1}});
  });
  CheckpointReader reader(Checkpointer::committed(dir.path().string()).back().second);
  EXPECT_TRUE(bytes_equal(reader.read_whole("w"), full));
  EXPECT_TRUE(bytes_equal(reader.read_whole("v"), other));
  EXPECT_EQ(reader.info("w").slices.size(), 2u);
}

// The files ranks poll for (manifests, failure notes) appear whole or not at all: the final
// name is never created and then written, it only arrives by a rename (inotify sees
// IN_MOVED_TO for it, never IN_CREATE or IN_MODIFY; written in place, a reader once found a
// note created and still empty), with the whole text.
TEST(CheckpointSharded, FilesOtherRanksPollForAppearWhole) {
  ScratchDir dir;
  const int fd = inotify_init1(IN_NONBLOCK);
  ASSERT_GE(fd, 0);
  ASSERT_GE(inotify_add_watch(fd, dir.path().c_str(), IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO), 0);
  const std::string text(100000, 'n');
  write_text_whole(dir.path() / "note.txt", text);
  alignas(struct inotify_event) char buf[64 * 1024];
  std::vector<std::string> on_final;
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) {
    for (char* p = buf; p < buf + n;) {
      const auto* ev = reinterpret_cast<const struct inotify_event*>(p);
      if (ev->len > 0 && std::string(ev->name) == "note.txt") {
        on_final.push_back(ev->mask & IN_MOVED_TO ? "moved in" : ev->mask & IN_CREATE ? "created" : "written");
      }
      p += sizeof(struct inotify_event) + ev->len;
    }
  }
  close(fd);
  EXPECT_EQ(on_final, std::vector<std::string>{"moved in"});
  std::ifstream in(dir.path() / "note.txt", std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), text);
  for (const auto& e : fs::directory_iterator(dir.path())) EXPECT_EQ(e.path().filename(), "note.txt");
}

TEST(CheckpointSharded, AMissingRankFailsTheCommitNamingItAndKeepsTheEarlierCheckpoints) {
  ScratchDir dir;
  save_on_ranks(dir.path().string(), 4, 1);
  // Step 2: rank 3 never writes. Rank 0 waits 1 s for its manifest, then gives up.
  const auto ref = reference(2);
  // Ranks 1 and 2 save synchronously: they wait for the commit and learn of its failure.
  std::string err, err_sync[3];
  on_ranks(3, [&](int r) {
    Checkpointer ck(dir.path().string(), /*keep=*/1, /*async=*/r == 0, r, 4, std::chrono::seconds(1));
    if (r == 0) {
      ck.save(2, items_for(training_layout(r), ref), {{"step", 2}});
      err = error_of([&] { ck.wait(); });
    } else {
      err_sync[r] = error_of([&] { ck.save(2, items_for(training_layout(r), ref), {{"step", 2}}); });
    }
  });
  EXPECT_TRUE(has(err, "rank 3 (manifest-r00003.json)")) << err;
  EXPECT_TRUE(has(err, "not committed")) << err;
  for (int r : {1, 2}) {
    EXPECT_TRUE(has(err_sync[r], "rank 0 says")) << err_sync[r];
    EXPECT_TRUE(has(err_sync[r], "rank 3 (manifest-r00003.json)")) << err_sync[r];
  }
  const auto all = Checkpointer::committed(dir.path().string());
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].first, 1);
  EXPECT_EQ(read_latest(dir.path()), "step-00000001");
  CheckpointReader reader(all[0].second);
  for (const auto& [name, t] : reference(1)) EXPECT_TRUE(bytes_equal(reader.read_whole(name), t)) << name;
  // The half-written step stays a .tmp-* folder, which only rank 0's resolve_resume removes.
  EXPECT_TRUE(fs::exists(dir.path() / ".tmp-step-00000002"));
  EXPECT_TRUE(has(resolve_resume(dir.path().string(), "auto", /*remove_stale=*/false), "step-00000001"));
  EXPECT_TRUE(fs::exists(dir.path() / ".tmp-step-00000002"));
  EXPECT_TRUE(has(resolve_resume(dir.path().string(), "auto", /*remove_stale=*/true), "step-00000001"));
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-00000002"));
}

// A synchronous save returns on every rank only once the step is committed: a node lost
// right after its ranks' saves returned cannot take the step with it (rank 0, still
// committing, would be stopped with the job).
TEST(CheckpointSharded, SynchronousSavesReturnOnEveryRankOnceTheStepIsCommitted) {
  ScratchDir dir;
  const auto ref = reference(1);
  std::atomic<int> returned_uncommitted{0};
  on_ranks(4, [&](int r) {
    Checkpointer ck(dir.path().string(), /*keep=*/0, /*async=*/false, r, 4, std::chrono::seconds(60));
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 comes last
    ck.save(1, items_for(training_layout(r), ref), {{"step", 1}});
    if (Checkpointer::committed(dir.path().string()).size() != 1) ++returned_uncommitted;
  });
  EXPECT_EQ(returned_uncommitted.load(), 0);
}

TEST(CheckpointSharded, AsyncSavesOfFourRanksCommitInOrderAndKeepTheLastTwo) {
  ScratchDir dir;
  std::atomic<int> returned_early{0};
  on_ranks(4, [&](int r) {
    Checkpointer ck(dir.path().string(), /*keep=*/2, /*async=*/true, r, 4, std::chrono::seconds(60));
    const std::vector<Piece> pieces = training_layout(r);
    CheckpointItems live = items_for(pieces, reference(1));
    for (int64_t step = 1; step <= 4; ++step) {
      // The live state of this step; the snapshot is taken in save(), then training moves on.
      const CheckpointItems now = items_for(pieces, reference(step));
      for (size_t i = 0; i < live.model.size(); ++i) {
        live.model[i].data.copy_from(now.model[i].data);
        live.optimizer[i].data.copy_from(now.optimizer[i].data);
      }
      ck.save(step, live, {{"step", step}});
      for (auto* list : {&live.model, &live.optimizer}) {
        for (CheckpointItem& it : *list) it.data.fill_(-1.0);  // overwritten at once
      }
    }
    ck.wait();  // rank 0: step 4 committed; the others: their files written
    if (r != 0 && !fs::exists(dir.path() / "step-00000004")) ++returned_early;
  });
  const auto all = Checkpointer::committed(dir.path().string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 3);
  EXPECT_EQ(all[1].first, 4);
  EXPECT_EQ(read_latest(dir.path()), "step-00000004");
  for (const auto& [step, path] : all) {
    CheckpointReader reader(path);
    EXPECT_EQ(reader.trainer_state()["step"], step);
    for (const auto& [name, t] : reference(step)) EXPECT_TRUE(bytes_equal(reader.read_whole(name), t)) << step << name;
  }
  for (const auto& e : fs::directory_iterator(dir.path())) {
    EXPECT_NE(e.path().filename().string().rfind(".tmp-", 0), 0u) << e.path();
  }
  SUCCEED() << returned_early.load() << " non-zero ranks returned before step 4 was committed";
}

// A rank r > 0 is done with a save once its own files are written: it may run ahead of rank
// 0's commits (here rank 0 has not even started) and never commits or prunes.
TEST(CheckpointSharded, OtherRanksRunAheadOfRankZerosCommit) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  {
    Checkpointer ck(d, /*keep=*/1, /*async=*/true, 1, 2, std::chrono::seconds(60));
    for (int64_t step = 1; step <= 2; ++step) ck.save(step, items_for(other_layout(2, 1), reference(step)), {});
    ck.wait();
  }
  EXPECT_TRUE(fs::exists(dir.path() / ".tmp-step-00000001" / "manifest-r00001.json"));
  EXPECT_TRUE(fs::exists(dir.path() / ".tmp-step-00000002" / "manifest-r00001.json"));
  EXPECT_TRUE(Checkpointer::committed(d).empty());
  EXPECT_FALSE(fs::exists(dir.path() / "latest"));
  {
    Checkpointer ck(d, /*keep=*/1, /*async=*/true, 0, 2, std::chrono::seconds(60));
    for (int64_t step = 1; step <= 2; ++step) {
      ck.save(step, items_for(other_layout(2, 0), reference(step)), {{"step", step}});
    }
    ck.wait();
  }
  const auto all = Checkpointer::committed(d);
  ASSERT_EQ(all.size(), 1u);  // keep = 1: step 1 was committed, then pruned
  EXPECT_EQ(all[0].first, 2);
  CheckpointReader reader(all[0].second);
  for (const auto& [name, t] : reference(2)) EXPECT_TRUE(bytes_equal(reader.read_whole(name), t)) << name;
}

// The trainer's path: a sharded optimizer's segments (ShardSegment) and shard parameters.
TEST(CheckpointSharded, ShardedOptimizerStateRoundTripsUnderAnotherRankCount) {
  ScratchDir dir;
  // Whole parameters (their shapes) and 2 ranks' flat shards of one bucket of all of them.
  ParameterList params;
  uint64_t seed = 50;
  for (const Spec& s : model_specs()) {
    Parameter p;
    p.name = s.name;
    p.value = random_tensor(s.shape, DType::F32, ++seed);
    params.push_back(p);
  }
  std::vector<const Spec*> all;
  for (const Spec& s : model_specs()) all.push_back(&s);
  auto shard = [&](int n, int r, std::vector<ShardSegment>* segs, ParameterList* shard_params) {
    const auto pieces = flat_pieces(all, n, r);
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (pieces[i].begin == pieces[i].end) continue;
      segs->push_back({i, pieces[i].begin, pieces[i].end});
      Parameter sp;
      sp.name = params[i].name;
      sp.value = piece_of(params[i].value, pieces[i].begin, pieces[i].end);
      sp.grad = random_tensor(sp.value.shape(), DType::F32, 900 + i);
      shard_params->push_back(sp);
    }
  };
  std::vector<std::vector<ShardSegment>> segs(2);
  std::vector<ParameterList> shards(2);
  std::vector<std::unique_ptr<AdamW>> opts;
  for (int r = 0; r < 2; ++r) {
    shard(2, r, &segs[r], &shards[r]);
    opts.push_back(std::make_unique<AdamW>(shards[r], AdamWConfig{}));
    opts[r]->step(shards[r], 1e-2);
  }
  on_ranks(2, [&](int r) {
    Checkpointer ck(dir.path().string(), 0, true, r, 2, std::chrono::seconds(60));
    ck.save(3, sharded_checkpoint_items(params, shards[r], segs[r], *opts[r]), {{"step", 3}});
  });
  CheckpointReader reader(Checkpointer::committed(dir.path().string()).back().second);
  // Load under 3 ranks: each shard's values and moments equal the saved elements.
  for (int r = 0; r < 3; ++r) {
    std::vector<ShardSegment> s3;
    ParameterList p3;
    shard(3, r, &s3, &p3);
    for (Parameter& p : p3) p.value.zero_();
    AdamW opt3(p3, AdamWConfig{});
    load_sharded_state(reader, params, p3, s3, &opt3);
    for (size_t i = 0; i < s3.size(); ++i) {
      const Tensor whole_value = reader.read_whole(p3[i].name);
      const Tensor whole_m = reader.read_whole(p3[i].name + ".exp_avg");
      EXPECT_TRUE(bytes_equal(p3[i].value, piece_of(whole_value, s3[i].begin, s3[i].end))) << p3[i].name;
      EXPECT_TRUE(bytes_equal(opt3.exp_avg()[i], piece_of(whole_m, s3[i].begin, s3[i].end))) << p3[i].name;
    }
  }
  // And the saved values are the shards the two ranks held.
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < segs[r].size(); ++i) {
      const Tensor whole_value = reader.read_whole(shards[r][i].name);
      EXPECT_TRUE(bytes_equal(piece_of(whole_value, segs[r][i].begin, segs[r][i].end), shards[r][i].value));
    }
  }
}

}  // namespace
}  // namespace moetrain
