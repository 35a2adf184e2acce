// Tests of the data loaders' shared contract (loader.h): data-parallel ranks get their rows
// of the same global batch, loaders are deterministic, and a position taken after N batches
// resumes with exactly the sequences that came next. Also the "shards" kind: streaming
// token shards across shard boundaries, the tail validation split, and its errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "core/rng.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/data_context.h"
#include "engine/data/loader.h"
#include "engine/data/shard_loader.h"
#include "engine/data/tokenize.h"
#include "engine/data/tokenizer_factory.h"
#include "engine/models/qwen3_moe_config.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"
#include "test_files.h"

namespace fs = std::filesystem;
using namespace moetrain;
using Ids = std::vector<int32_t>;

namespace {

Ids iota_tokens(int n) {
  Ids t(n);
  for (int i = 0; i < n; ++i) t[i] = i;
  return t;
}

// All tensors of a batch as one vector, rows in order (inputs, targets, positions, segments).
struct Rows {
  Ids inputs, targets, positions, segments;
  int64_t num_targets = 0;
  void add(const Batch& b) {
    auto put = [](Ids& dst, const Tensor& t) {
      if (!t.defined()) return;
      Ids v = t.to_vector<int32_t>();
      dst.insert(dst.end(), v.begin(), v.end());
    };
    put(inputs, b.inputs);
    put(targets, b.targets);
    put(positions, b.positions);
    put(segments, b.segment_ids);
    num_targets += b.num_targets;
  }
  bool operator==(const Rows&) const = default;
};

using MakeLoader = std::function<std::unique_ptr<DataLoader>(int64_t micro_batch, int rank, int world)>;

// Interleaves the ranks' rows of each micro-batch as one process would hold them.
Rows rows_of_ranks(const MakeLoader& make, int64_t mbs, int world, int batches) {
  std::vector<std::unique_ptr<DataLoader>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(make(mbs, r, world));
  Rows all;
  for (int i = 0; i < batches; ++i) {
    for (int r = 0; r < world; ++r) all.add(ranks[r]->next());
  }
  for (int r = 1; r < world; ++r) EXPECT_EQ(ranks[r]->position(), ranks[0]->position()) << "rank " << r;
  return all;
}

// The contract every loader keeps: ranks together see what one process sees; the position
// is the same on every rank; repeated runs agree; a loader set to the position after
// `cut` batches continues with batch cut + 1 (no repeat, no skip).
void check_loader_contract(const MakeLoader& make) {
  const int batches = 7;
  Rows single = rows_of_ranks(make, 4, 1, batches);
  EXPECT_EQ(single, rows_of_ranks(make, 4, 1, batches)) << "not deterministic";
  EXPECT_EQ(single, rows_of_ranks(make, 2, 2, batches)) << "2 ranks x 2 rows differ from 1 x 4";
  EXPECT_EQ(single, rows_of_ranks(make, 1, 4, batches)) << "4 ranks x 1 row differ from 1 x 4";

  for (const int cut : {1, 3, 5}) {
    auto first = make(2, 1, 2);
    Rows before;
    for (int i = 0; i < cut; ++i) before.add(first->next());
    const nlohmann::json pos = first->position();
    Rows straight = before;
    for (int i = cut; i < batches; ++i) straight.add(first->next());
    auto resumed = make(2, 1, 2);
    resumed->set_position(pos);
    Rows joined = before;
    for (int i = cut; i < batches; ++i) joined.add(resumed->next());
    EXPECT_EQ(joined, straight) << "resumed after " << cut << " batches at " << pos.dump();
  }
  // reset() starts over.
  auto a = make(4, 0, 1);
  Rows once, again;
  for (int i = 0; i < 3; ++i) once.add(a->next());
  a->reset();
  for (int i = 0; i < 3; ++i) again.add(a->next());
  EXPECT_EQ(once, again);
}

}  // namespace

TEST(LoaderContract, BatchLoaderRandom) {
  check_loader_contract([](int64_t mbs, int rank, int world) {
    return std::make_unique<BatchLoader>(iota_tokens(500), mbs, 9, 42, BatchLoader::Mode::Random, rank, world);
  });
}

TEST(LoaderContract, BatchLoaderSequential) {
  check_loader_contract([](int64_t mbs, int rank, int world) {
    return std::make_unique<BatchLoader>(iota_tokens(200), mbs, 9, 0, BatchLoader::Mode::Sequential, rank, world);
  });
}

// One process draws its starts exactly as before ranks existed: rows in order from the
// generator keyed by mix64(seed), so runs and checkpoints of earlier builds are unchanged.
TEST(LoaderContract, SingleProcessStartsAreUnchanged) {
  const int64_t S = 9, B = 3;
  const Ids tokens = iota_tokens(500);
  BatchLoader loader(tokens, B, S, 42, BatchLoader::Mode::Random);
  Rng rng(mix64(42));
  for (int i = 0; i < 4; ++i) {
    const Ids in = loader.next().inputs.to_vector<int32_t>();
    for (int64_t r = 0; r < B; ++r) EXPECT_EQ(in[r * S], static_cast<int32_t>(rng.below(500 - S)));
  }
  EXPECT_EQ(loader.position(), nlohmann::json(rng.counter()));
  const std::string e = moetrain::testing::error_of([&] { loader.set_position(nlohmann::json{{"epoch", 0}}); });
  EXPECT_NE(e.find("not a position of the text loader"), std::string::npos) << e;
}

TEST(LoaderContract, BadRanksAreRefused) {
  const std::string e =
      moetrain::testing::error_of([] { BatchLoader(iota_tokens(50), 2, 4, 0, BatchLoader::Mode::Random, 2, 2); });
  EXPECT_NE(e.find("data rank 2 is not in [0, data_world = 2)"), std::string::npos) << e;
}

// ---- shards ---------------------------------------------------------------------------

namespace {

class ShardLoaderTest : public ScratchDirTest {
 protected:
  // Tokenizes `docs` (one per line) with the byte tokenizer into shards of `shard_tokens`.
  std::string write_shards(const std::vector<std::string>& docs, int64_t shard_tokens,
                           const std::string& name = "shards") {
    std::string text;
    for (const auto& d : docs) text += d + "\n";
    TokenizeOptions o;
    o.inputs = {file(name + ".txt", text)};
    o.out_dir = path(name);
    o.shard_tokens = shard_tokens;
    o.threads = 1;
    o.lines = true;
    o.progress = false;
    o.tokenizer_name = "byte";
    tokenize_corpus(tok_, o);
    return o.out_dir;
  }
  // The byte stream the shards hold: each document's bytes, then end-of-text.
  static Ids stream_of(const std::vector<std::string>& docs) {
    Ids s;
    for (const auto& d : docs) {
      for (unsigned char c : d) s.push_back(c);
      s.push_back(ByteTokenizer::kEos);
    }
    return s;
  }
  ByteTokenizer tok_;
};

std::vector<std::string> numbered_docs(int n) {
  std::vector<std::string> docs;
  for (int i = 0; i < n; ++i) docs.push_back("document " + std::to_string(i) + std::string(i % 5, '!'));
  return docs;
}

}  // namespace

TEST_F(ShardLoaderTest, StreamsAcrossShardBoundariesInOrder) {
  const auto docs = numbered_docs(30);
  const Ids expected = stream_of(docs);
  const std::string dir = write_shards(docs, 37);  // many shards; windows cross their boundaries
  auto stream = std::make_shared<const ShardStream>(std::vector<std::string>{dir}, tok_);
  ASSERT_EQ(stream->num_tokens(), static_cast<int64_t>(expected.size()));
  EXPECT_GT(stream->num_shards(), 5);
  EXPECT_EQ(stream->num_documents(), 30);
  Ids all(expected.size());
  stream->read(0, all);
  EXPECT_EQ(all, expected);

  // Windows of S tokens step by S: inputs [s, s+S), targets one further; every token of the
  // range is a target once per epoch, then the walk starts over.
  const int64_t S = 10, B = 3, n = stream->num_tokens();
  ShardLoader loader(stream, 0, n, B, S);
  const int64_t windows = (n - 1) / S;
  Ids targets;
  for (int64_t w = 0; w < windows; w += B) {
    if (w + B > windows) break;
    Batch b = loader.next();
    EXPECT_EQ(b.num_targets, B * S);
    EXPECT_FALSE(b.segment_ids.defined());
    const Ids in = b.inputs.to_vector<int32_t>(), tg = b.targets.to_vector<int32_t>(),
              pos = b.positions.to_vector<int32_t>();
    for (int64_t r = 0; r < B; ++r) {
      for (int64_t t = 0; t < S; ++t) {
        EXPECT_EQ(in[r * S + t], expected[(w + r) * S + t]);
        EXPECT_EQ(tg[r * S + t], expected[(w + r) * S + t + 1]);
        EXPECT_EQ(pos[r * S + t], t);
      }
    }
    targets.insert(targets.end(), tg.begin(), tg.end());
  }
  EXPECT_EQ(targets, Ids(expected.begin() + 1, expected.begin() + 1 + static_cast<int64_t>(targets.size())));
  // Run to the end of the epoch: the next window starts the stream again.
  ShardLoader wrap(stream, 0, n, 1, S);
  for (int64_t w = 0; w < windows; ++w) wrap.next();
  EXPECT_EQ(wrap.position(), (nlohmann::json{{"epoch", 0}, {"token", windows * S}}));
  EXPECT_EQ(wrap.next().inputs.to_vector<int32_t>(), Ids(expected.begin(), expected.begin() + S));
  EXPECT_EQ(wrap.position(), (nlohmann::json{{"epoch", 1}, {"token", S}}));
}

TEST_F(ShardLoaderTest, KeepsTheLoaderContract) {
  const std::string dir = write_shards(numbered_docs(40), 50);
  auto stream = std::make_shared<const ShardStream>(std::vector<std::string>{dir}, tok_);
  check_loader_contract([&](int64_t mbs, int rank, int world) {
    // a short range, so that 7 global batches of 4 wrap into a second epoch
    return std::make_unique<ShardLoader>(stream, 11, 11 + 200, mbs, 8, rank, world);
  });
}

TEST_F(ShardLoaderTest, DataContextSplitsTheTailForValidation) {
  const auto docs = numbered_docs(60);
  const Ids expected = stream_of(docs);
  RunConfig cfg;
  cfg.data.kind = "shards";
  cfg.data.paths = {write_shards(docs, 100)};
  cfg.data.val_fraction = 0.1;
  cfg.training.seq_len = 16;
  cfg.training.micro_batch_size = 2;
  DataContext d = make_data_context(cfg, 0, 1);
  const auto n = static_cast<int64_t>(expected.size());
  const auto val = static_cast<int64_t>(std::llround(n * 0.1));
  EXPECT_EQ(d.train_tokens, n - val);
  EXPECT_EQ(d.val_tokens, val);
  EXPECT_NE(d.summary.find("for validation"), std::string::npos) << d.summary;
  const Ids first_val = d.val->next().inputs.to_vector<int32_t>();
  EXPECT_EQ(first_val, Ids(expected.begin() + (n - val), expected.begin() + (n - val) + 32));
  // The position travels through a checkpoint as JSON.
  d.train->next();
  EXPECT_EQ(d.train->position(), (nlohmann::json{{"epoch", 0}, {"token", 32}}));

  // Too little for a sequence on either side.
  cfg.training.seq_len = static_cast<int64_t>(n);
  std::string e = error_of([&] { make_data_context(cfg, 0, 1); });
  EXPECT_NE(e.find("fewer than one sequence needs"), std::string::npos) << e;
}

TEST_F(ShardLoaderTest, BadShardsAreNamed) {
  const std::string dir = write_shards(numbered_docs(10), 30);
  // Another tokenizer than the one the shards were written with.
  const std::string tj = tiny_bpe::write(path("tokenizer.json"), tiny_bpe::tokenizer_json());
  auto bpe = make_tokenizer(tj);
  std::string e = error_of([&] { ShardStream({dir}, *bpe); });
  EXPECT_NE(e.find("shard-00000.bin: written with another tokenizer"), std::string::npos) << e;

  // A token outside the vocabulary (a corrupt file): named with its file and position.
  const std::string shard1 = token_shard_path(dir, 1);
  {
    std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(kTokenShardHeaderBytes + 2 * 3);
    const uint16_t bad = 40000;
    f.write(reinterpret_cast<const char*>(&bad), 2);
  }
  auto stream = std::make_shared<const ShardStream>(std::vector<std::string>{dir}, tok_);
  ShardLoader loader(stream, 0, stream->num_tokens(), 1, 40);
  e = error_of([&] { loader.next(); });
  EXPECT_NE(e.find(shard1 + ": token 40000 at position 3 is outside the vocabulary [0, 257)"), std::string::npos) << e;

  // No index.json: the tokenization did not finish.
  fs::remove(fs::path(dir) / "index.json");
  e = error_of([&] { ShardStream({dir}, tok_); });
  EXPECT_NE(e.find("no index.json"), std::string::npos) << e;
  // A folder without shards, a missing folder, a file instead of a folder.
  fs::create_directories(path("empty"));
  e = error_of([&] { ShardStream({path("empty")}, tok_); });
  EXPECT_NE(e.find("no token shards"), std::string::npos) << e;
  e = error_of([&] { ShardStream({path("nowhere")}, tok_); });
  EXPECT_NE(e.find("[data].paths: '" + path("nowhere") + "' does not exist"), std::string::npos) << e;
  e = error_of([&] { ShardStream({file("x.txt", "hi")}, tok_); });
  EXPECT_NE(e.find("is not a folder"), std::string::npos) << e;

  // A checkpoint position of another kind or beyond the data.
  e = error_of([&] { loader.set_position(nlohmann::json(7)); });
  EXPECT_NE(e.find("not a position of the shard loader"), std::string::npos) << e;
  e = error_of([&] { loader.set_position(nlohmann::json{{"epoch", 0}, {"token", 1 << 20}}); });
  EXPECT_NE(e.find("beyond the"), std::string::npos) << e;
}

TEST_F(ShardLoaderTest, TokenizerMustFitTheModel) {
  RunConfig cfg;
  cfg.data.kind = "shards";
  cfg.data.paths = {write_shards(numbered_docs(10), 100)};
  cfg.model.as<Qwen3MoeConfig>().vocab_size = 200;
  const std::string e = error_of([&] { make_data_context(cfg, 0, 1); });
  EXPECT_NE(e.find("[model].vocab_size = 200 is smaller than the vocabulary"), std::string::npos) << e;
}

// Context parallelism's split of a batch: CP rank r holds chunks r and 2cp-1-r of every
// sequence (the zigzag), in order, with their inputs, targets, positions (positions of packed
// documents as they were) and segments; the ranks together hold every token once; their
// targets add up to the batch's; with multi-token prediction, the tokens k places ahead in
// the whole row (across chunk edges, not across documents). A length that does not cut into
// 2 cp chunks is named.
TEST(ZigzagBatch, EachRankHoldsItsTwoChunksAndTheRanksHoldEveryTokenOnce) {
  const int64_t B = 2, S = 12;
  Batch b = Batch::allocate(B, S, /*with_segments=*/true);
  for (int64_t i = 0; i < B * S; ++i) {
    b.inputs.data<int32_t>()[i] = static_cast<int32_t>(100 + i);
    b.targets.data<int32_t>()[i] = i % 5 == 0 ? -100 : static_cast<int32_t>(200 + i);
    b.positions.data<int32_t>()[i] = static_cast<int32_t>(i % S < 7 ? i % S : i % S - 7);  // documents of 7 and 5
    b.segment_ids.data<int32_t>()[i] = i % S < 7 ? 0 : 1;
  }
  b.count_targets();
  EXPECT_EQ(zigzag_places(12, 2, 0), (std::vector<int32_t>{0, 1, 2, 9, 10, 11}));
  EXPECT_EQ(zigzag_places(12, 2, 1), (std::vector<int32_t>{3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(zigzag_places(12, 3, 1), (std::vector<int32_t>{2, 3, 8, 9}));
  for (int64_t cp : {2, 3}) {
    std::vector<int> seen(static_cast<size_t>(B * S), 0);
    int64_t targets = 0;
    for (int64_t r = 0; r < cp; ++r) {
      Tensor places;
      const Batch z = zigzag_batch(b, cp, r, &places, /*mtp_depth=*/2);
      ASSERT_EQ(z.seq, S / cp);
      ASSERT_EQ(z.batch, B);
      ASSERT_EQ(z.ahead_inputs.size(), 2u);
      ASSERT_EQ(z.ahead_targets.size(), 2u);
      for (int64_t i = 0; i < B * z.seq; ++i) {
        const int64_t row = i / z.seq, place = places.data<int32_t>()[i], from = row * S + place;
        for (int64_t k = 1; k <= 2; ++k) {  // k places ahead in the whole row, within its document
          const bool inside = place + k < S && b.segment_ids.data<int32_t>()[from + k] ==
                                                   b.segment_ids.data<int32_t>()[from];
          EXPECT_EQ(z.ahead_inputs[static_cast<size_t>(k - 1)].data<int32_t>()[i],
                    inside ? b.inputs.data<int32_t>()[from + k] : 0);
          EXPECT_EQ(z.ahead_targets[static_cast<size_t>(k - 1)].data<int32_t>()[i],
                    inside ? b.targets.data<int32_t>()[from + k] : -100);
        }
        EXPECT_EQ(z.inputs.data<int32_t>()[i], b.inputs.data<int32_t>()[from]);
        EXPECT_EQ(z.targets.data<int32_t>()[i], b.targets.data<int32_t>()[from]);
        EXPECT_EQ(z.positions.data<int32_t>()[i], b.positions.data<int32_t>()[from]);
        EXPECT_EQ(z.segment_ids.data<int32_t>()[i], b.segment_ids.data<int32_t>()[from]);
        ++seen[static_cast<size_t>(from)];
      }
      targets += z.num_targets;
    }
    for (int s : seen) EXPECT_EQ(s, 1);
    EXPECT_EQ(targets, b.num_targets);
  }
  try {
    zigzag_batch(b, 4, 0, nullptr);
    ADD_FAILURE() << "12 tokens do not cut into 8 chunks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[training].seq_len (12) must be a multiple of 2 x [parallel].cp (8)"),
              std::string::npos)
        << e.what();
  }
}
