// Tests of the byte tokenizer, the text corpus (fortune format, split) and the batch loader.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/loader.h"
#include "engine/data/text_corpus.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            fmt::format("moetrain_data_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name, const std::string& text) const {
    fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p.string();
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<int32_t> iota_tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = i;
  return t;
}

}  // namespace

TEST(ByteTokenizer, RoundTrip) {
  ByteTokenizer tok;
  std::string text = "Hello, w\xc3\xb6rld!\n\t\x01\xff";
  std::vector<int32_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'H');
  EXPECT_EQ(ids.back(), 255);
  EXPECT_EQ(tok.decode(ids), text);
  ids.push_back(tok.eos_id());
  EXPECT_EQ(tok.decode(ids), text + "\n");
  EXPECT_EQ(tok.eos_id(), 256);
  EXPECT_EQ(tok.vocab_size(), 257);
  EXPECT_NE(error_of([&] { tok.decode(std::vector<int32_t>{65, 300}); }).find("token 300"), std::string::npos);
}

TEST(TextCorpus, DocumentsAndSplit) {
  TempDir dir;
  ByteTokenizer tok;
  dir.file("f/quotes", "First quote\nline two\n%\nSecond\n%\n%\n   \n%\nThird\r\n%\r\nFourth\n");
  dir.file("f/quotes.dat", "binary index, skipped");
  dir.file("f/off/rude", "skipped\n%\nalso skipped\n");
  dir.file("f/.hidden", "skipped");
  dir.file("f/sub/plain.txt", "a plain file\n\nwith a blank line is one document\n");
  fs::create_symlink(fs::path(dir.str()) / "f/quotes", fs::path(dir.str()) / "f/quotes.u8");

  DataConfig cfg;
  cfg.paths = {dir.str() + "/f"};
  cfg.val_fraction = 0.5;
  Corpus c = load_text_corpus(cfg, tok);
  EXPECT_EQ(c.train_documents + c.val_documents, 5);

  // Decode both splits, documents separated by EOS, and check the documents.
  std::vector<std::string> docs;
  for (const auto* split : {&c.train, &c.val}) {
    std::string cur;
    for (int32_t id : *split) {
      if (id == tok.eos_id()) {
        docs.push_back(cur);
        cur.clear();
      } else {
        cur += static_cast<char>(id);
      }
    }
    EXPECT_TRUE(cur.empty());  // every document ends with EOS
  }
  std::sort(docs.begin(), docs.end());
  EXPECT_EQ(docs, (std::vector<std::string>{"First quote\nline two", "Fourth", "Second", "Third",
                                             "a plain file\n\nwith a blank line is one document"}));
  const int64_t bytes_read = static_cast<int64_t>(fs::file_size(dir.str() + "/f/quotes") +
                                                  fs::file_size(dir.str() + "/f/sub/plain.txt"));
  EXPECT_EQ(c.bytes, bytes_read);

  // The split depends on the text alone: the same documents in other files and order land
  // on the same side.
  dir.file("g/b", "Third\n%\nSecond\n%\nFirst quote\nline two\n");
  dir.file("g/a", "Fourth\n%\na plain file\n\nwith a blank line is one document");
  cfg.paths = {dir.str() + "/g/a", dir.str() + "/g/b"};
  Corpus d = load_text_corpus(cfg, tok);
  EXPECT_EQ(d.train_documents, c.train_documents);
  EXPECT_EQ(d.val_documents, c.val_documents);
  EXPECT_EQ(d.train.size(), c.train.size());
  EXPECT_EQ(d.val.size(), c.val.size());
  // And loading twice gives the same streams.
  Corpus c2 = load_text_corpus(cfg, tok);
  EXPECT_EQ(c2.train, d.train);
  EXPECT_EQ(c2.val, d.val);
}

TEST(TextCorpus, ValFractionSplitsRoughly) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 2000; ++i) text += fmt::format("document number {}\n%\n", i);
  DataConfig cfg;
  cfg.paths = {dir.file("many", text)};
  cfg.val_fraction = 0.1;
  Corpus c = load_text_corpus(cfg, ByteTokenizer());
  EXPECT_EQ(c.train_documents + c.val_documents, 2000);
  EXPECT_GT(c.val_documents, 140);
  EXPECT_LT(c.val_documents, 260);
}

TEST(TextCorpus, Errors) {
  TempDir dir;
  ByteTokenizer tok;
  DataConfig cfg;
  std::string missing = dir.str() + "/missing";
  cfg.paths = {missing};
  EXPECT_EQ(error_of([&] { load_text_corpus(cfg, tok); }), "[data].paths: '" + missing + "' does not exist");

  cfg.paths = {dir.file("empty", "%\n\n%\n")};
  EXPECT_NE(error_of([&] { load_text_corpus(cfg, tok); }).find("hold no documents"), std::string::npos);

  // One short document: one split stays empty.
  cfg.paths = {dir.file("one", "just one document\n")};
  std::string e = error_of([&] { load_text_corpus(cfg, tok); });
  EXPECT_NE(e.find("split has 0 tokens"), std::string::npos) << e;

  // Enough documents, but validation is shorter than one sequence needs.
  std::string text;
  for (int i = 0; i < 200; ++i) text += fmt::format("doc {}\n%\n", i);
  cfg.paths = {dir.file("small", text)};
  cfg.val_fraction = 0.05;
  Corpus c = load_text_corpus(cfg, tok, 8);
  ASSERT_GT(c.val.size(), 8u);
  e = error_of([&] { load_text_corpus(cfg, tok, 10000); });
  EXPECT_NE(e.find("the training split has"), std::string::npos) << e;
  e = error_of([&] { load_text_corpus(cfg, tok, static_cast<int64_t>(c.val.size()) + 1); });
  EXPECT_NE(e.find("the validation split has"), std::string::npos) << e;
  EXPECT_NE(e.find("training.seq_len"), std::string::npos) << e;
}

TEST(BatchLoader, TargetsShiftAndPositions) {
  const int64_t B = 3, S = 5;
  BatchLoader loader(iota_tokens(100), B, S, 7, BatchLoader::Mode::Random);
  for (int rep = 0; rep < 10; ++rep) {
    Batch b = loader.next();
    EXPECT_EQ(b.batch, B);
    EXPECT_EQ(b.seq, S);
    EXPECT_EQ(b.num_targets, B * S);
    EXPECT_EQ(b.inputs.shape(), (Shape{B * S}));
    EXPECT_EQ(b.inputs.dtype(), DType::I32);
    auto in = b.inputs.to_vector<int32_t>(), tg = b.targets.to_vector<int32_t>(), pos = b.positions.to_vector<int32_t>();
    for (int64_t i = 0; i < B; ++i) {
      for (int64_t t = 0; t < S; ++t) {
        EXPECT_EQ(tg[i * S + t], in[i * S + t] + 1);
        EXPECT_EQ(pos[i * S + t], t);
        if (t > 0) {
          EXPECT_EQ(in[i * S + t], in[i * S + t - 1] + 1);
        }
      }
      EXPECT_GE(in[i * S], 0);
      EXPECT_LE(in[i * S] + S, 99);  // the last target exists
    }
  }
}

TEST(BatchLoader, RandomIsDeterministicAndResumes) {
  BatchLoader a(iota_tokens(1000), 4, 16, 42, BatchLoader::Mode::Random);
  BatchLoader b(iota_tokens(1000), 4, 16, 42, BatchLoader::Mode::Random);
  BatchLoader other(iota_tokens(1000), 4, 16, 43, BatchLoader::Mode::Random);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a.next().inputs.to_vector<int32_t>(), b.next().inputs.to_vector<int32_t>());
  }
  EXPECT_NE(a.next().inputs.to_vector<int32_t>(), other.next().inputs.to_vector<int32_t>());

  // Resume: a loader restored to a saved position yields what the original yields next.
  const uint64_t pos = a.position();
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(a.next().inputs.to_vector<int32_t>());
  BatchLoader resumed(iota_tokens(1000), 4, 16, 42, BatchLoader::Mode::Random);
  resumed.set_position(pos);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(resumed.next().inputs.to_vector<int32_t>(), expected[i]);
}

TEST(BatchLoader, SequentialWrapsAndResets) {
  // 23 tokens, S = 5: windows start at 0, 5, 10, 15 (the last target is token 20).
  BatchLoader v(iota_tokens(23), 3, 5, 0, BatchLoader::Mode::Sequential);
  EXPECT_EQ(v.num_windows(), 4);
  auto starts = [](const Batch& b) {
    auto in = b.inputs.to_vector<int32_t>();
    std::vector<int32_t> s;
    for (int64_t i = 0; i < b.batch; ++i) s.push_back(in[i * b.seq]);
    return s;
  };
  EXPECT_EQ(starts(v.next()), (std::vector<int32_t>{0, 5, 10}));
  EXPECT_EQ(starts(v.next()), (std::vector<int32_t>{15, 0, 5}));
  v.reset();
  EXPECT_EQ(starts(v.next()), (std::vector<int32_t>{0, 5, 10}));
  v.set_position(v.position());
  EXPECT_EQ(starts(v.next()), (std::vector<int32_t>{15, 0, 5}));
  // A window ending at the last token works: 21 tokens hold windows at 0, 5, 10, 15.
  BatchLoader exact(iota_tokens(21), 4, 5, 0, BatchLoader::Mode::Sequential);
  Batch b = exact.next();
  EXPECT_EQ(b.targets.to_vector<int32_t>().back(), 20);
}

TEST(BatchLoader, TooShort) {
  std::string e = error_of([] { BatchLoader(iota_tokens(10), 2, 10, 0, BatchLoader::Mode::Random); });
  EXPECT_NE(e.find("has 10 tokens, fewer than seq_len + 1 = 11"), std::string::npos) << e;
  BatchLoader ok(iota_tokens(11), 2, 10, 0, BatchLoader::Mode::Random);
  auto in = ok.next().inputs.to_vector<int32_t>();
  EXPECT_EQ(in[0], 0);  // the one possible start
}
