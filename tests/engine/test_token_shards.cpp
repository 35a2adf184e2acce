// Tests of the token shard format (writer, reader, header checks) and of tokenize_corpus
// (inputs, JSONL, determinism across thread counts, errors naming file and line).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "engine/data/bpe_tokenizer.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/token_shards.h"
#include "engine/data/tokenize.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"

namespace fs = std::filesystem;
using namespace moetrain;
using Ids = std::vector<int32_t>;

namespace {

using ShardTest = ScratchDirTest;

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Ids read_stream(const std::string& dir) {
  Ids all;
  for (const std::string& p : list_token_shards(dir)) {
    Ids part = TokenShardReader(p).read_all();
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// The documents of a token stream: decoded text between end-of-text ids.
std::vector<std::string> documents(const Tokenizer& tok, const Ids& stream) {
  std::vector<std::string> docs;
  Ids cur;
  for (int32_t id : stream) {
    if (id == tok.eos_id()) {
      docs.push_back(tok.decode(cur));
      cur.clear();
    } else {
      cur.push_back(id);
    }
  }
  EXPECT_TRUE(cur.empty()) << "the stream must end with end-of-text";
  return docs;
}

}  // namespace

TEST_F(ShardTest, WriteReadRoundTrip) {
  const std::string out = path("out");
  Ids stream;
  for (int i = 0; i < 25; ++i) stream.push_back(i % 7 == 6 ? 299 : (i * 37) % 299);
  {
    TokenShardWriter w({out, 10, 300, 299, 0xABCDEF});
    EXPECT_EQ(w.token_bytes(), 2u);
    // Uneven appends: shard boundaries cut through them.
    w.append(std::span(stream).subspan(0, 7));
    w.append(std::span(stream).subspan(7, 0));
    w.append(std::span(stream).subspan(7, 11));
    w.append(std::span(stream).subspan(18));
    const auto& shards = w.finish();
    ASSERT_EQ(shards.size(), 3u);
    EXPECT_EQ(shards[2].num_tokens, 5);
  }
  const std::vector<std::string> paths = list_token_shards(out);
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0], token_shard_path(out, 0));
  EXPECT_EQ(fs::path(paths[1]).filename(), "shard-00001.bin");
  int64_t docs = 0;
  for (int s = 0; s < 3; ++s) {
    TokenShardReader r(paths[s]);
    EXPECT_EQ(r.header().version, kTokenShardVersion);
    EXPECT_EQ(r.header().token_bytes, 2u);
    EXPECT_EQ(r.header().vocab_size, 300);
    EXPECT_EQ(r.header().eos_id, 299);
    EXPECT_EQ(r.header().first_token, 10 * s);
    EXPECT_EQ(r.header().tokenizer_fingerprint, 0xABCDEFu);
    EXPECT_EQ(r.num_tokens(), s < 2 ? 10 : 5);
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(paths[s])), kTokenShardHeaderBytes + 2 * r.num_tokens());
    docs += r.header().num_documents;
    // A window from the middle.
    if (s == 1) {
      Ids mid(4);
      r.read(3, mid);
      EXPECT_EQ(mid, Ids(stream.begin() + 13, stream.begin() + 17));
      EXPECT_NE(error_of([&] { r.read(8, mid); }).find("outside the shard's 10 tokens"), std::string::npos);
    }
  }
  EXPECT_EQ(docs, std::count(stream.begin(), stream.end(), 299));
  EXPECT_EQ(read_stream(out), stream);
  EXPECT_FALSE(fs::exists(paths[0] + ".tmp"));
}

TEST_F(ShardTest, WideVocabulariesUseFourBytes) {
  const std::string out = path("wide");
  EXPECT_EQ(token_bytes_for_vocab(65536), 2u);
  EXPECT_EQ(token_bytes_for_vocab(65537), 4u);
  Ids stream = {0, 65535, 65536, 151642, 151643, 7};
  {
    TokenShardWriter w({out, 100, 151665, 151643, 1});
    EXPECT_EQ(w.token_bytes(), 4u);
    w.append(stream);
    w.finish();
  }
  TokenShardReader r(token_shard_path(out, 0));
  EXPECT_EQ(r.header().token_bytes, 4u);
  EXPECT_EQ(r.header().num_documents, 1);
  EXPECT_EQ(r.read_all(), stream);
}

TEST_F(ShardTest, AnUnfinishedWriterLeavesNothing) {
  const std::string out = path("partial");
  {
    TokenShardWriter w({out, 4, 300, 299, 0});
    w.append(Ids{1, 2, 3, 4, 5, 6});
    std::string e = error_of([&] { w.append(Ids{7, 300}); });
    EXPECT_NE(e.find("token 300 at stream position 7 is outside the vocabulary [0, 300)"), std::string::npos) << e;
  }
  EXPECT_TRUE(fs::is_empty(out));
}

TEST_F(ShardTest, BadShardsAreNamed) {
  const std::string out = path("good");
  {
    TokenShardWriter w({out, 100, 300, 299, 0});
    w.append(Ids{5, 6, 7, 299});
    w.finish();
  }
  const std::string good = bytes_of(token_shard_path(out, 0));
  auto error_for = [&](const std::string& name, const std::string& bytes) {
    const std::string p = file(name, bytes);
    std::string e = error_of([&] { TokenShardReader r(p); });
    EXPECT_NE(e.find(p), std::string::npos) << e;
    return e;
  };
  EXPECT_NE(error_for("short.bin", "MTTOK").find("shorter than the 64-byte header"), std::string::npos);
  std::string bad = good;
  bad[0] = 'X';
  EXPECT_NE(error_for("magic.bin", bad).find("bad magic"), std::string::npos);
  bad = good;
  bad[8] = 2;
  EXPECT_NE(error_for("version.bin", bad).find("format version 2"), std::string::npos);
  bad = good;
  bad[16] = 3;
  EXPECT_NE(error_for("width.bin", bad).find("token width 3"), std::string::npos);
  EXPECT_NE(error_for("truncated.bin", good.substr(0, good.size() - 1)).find("truncated"), std::string::npos);
  EXPECT_NE(error_for("long.bin", good + "xx").find("truncated or overwritten"), std::string::npos);
  bad = good;
  bad[64] = static_cast<char>(0x2C);  // token 0x012C = 300: not below the vocabulary size
  bad[65] = 1;
  const std::string p = file("corrupt.bin", bad);
  TokenShardReader r(p);
  EXPECT_NE(error_of([&] { r.read_all(); }).find("token 300 at position 0 is outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([&] { list_token_shards(path("nowhere")); }).find("not a folder of token shards"),
            std::string::npos);
  fs::create_directories(path("none"));
  EXPECT_NE(error_of([&] { list_token_shards(path("none")); }).find("no token shards"), std::string::npos);
}

// ---- tokenize_corpus --------------------------------------------------------------------

class TokenizeTest : public ShardTest {
 protected:
  void SetUp() override {
    ShardTest::SetUp();
    tok_ = std::make_unique<BpeTokenizer>(tiny_bpe::write(path("tokenizer.json"), tiny_bpe::tokenizer_json()));
    // Sorted order: a.txt, c.txt, sub/b.jsonl; .hidden is skipped; c.txt is empty.
    file("corpus/a.txt", "the thing\nis a caf\xc3\xa9.\n");
    file("corpus/c.txt", "");
    file("corpus/.hidden", "never read");
    std::string jsonl;
    for (int i = 0; i < 40; ++i) {
      jsonl += fmt::format("{{\"id\": {}, \"text\": \"doc {} says \\u4f60\\u597d\\n<|im_start|>ok\"}}\n", i, i);
      if (i == 5) jsonl += "\n";                           // blank lines are skipped
      if (i == 9) jsonl += "{\"id\": 99, \"text\": \"\"}\n";  // an empty document is skipped
    }
    file("corpus/sub/b.jsonl", jsonl);
  }

  TokenizeOptions options(const std::string& out, int threads) const {
    TokenizeOptions o;
    o.inputs = {path("corpus")};
    o.out_dir = path(out);
    o.threads = threads;
    o.shard_tokens = 97;
    o.chunk_bytes = 100;  // many small chunks, so that threads interleave
    o.progress = false;
    return o;
  }

  std::unique_ptr<BpeTokenizer> tok_;
};

TEST_F(TokenizeTest, SameShardsForAnyThreadCount) {
  const TokenizeSummary one = tokenize_corpus(*tok_, options("one", 1));
  const TokenizeSummary two = tokenize_corpus(*tok_, options("two", 2));
  const TokenizeSummary four = tokenize_corpus(*tok_, options("four", 4));
  EXPECT_EQ(one.files, 3);
  EXPECT_EQ(one.documents, 41);  // a.txt + 40 lines
  EXPECT_EQ(one.empty_documents, 2);
  EXPECT_EQ(one.input_bytes, static_cast<int64_t>(fs::file_size(path("corpus/a.txt")) +
                                                   fs::file_size(path("corpus/sub/b.jsonl"))));
  ASSERT_GT(one.shards.size(), 2u);
  EXPECT_EQ(two.tokens, one.tokens);
  ASSERT_EQ(two.shards.size(), one.shards.size());
  ASSERT_EQ(four.shards.size(), one.shards.size());
  for (size_t i = 0; i < one.shards.size(); ++i) {
    EXPECT_EQ(bytes_of(one.shards[i]), bytes_of(two.shards[i])) << i;
    EXPECT_EQ(bytes_of(one.shards[i]), bytes_of(four.shards[i])) << i;
  }

  const Ids stream = read_stream(path("two"));
  EXPECT_EQ(static_cast<int64_t>(stream.size()), one.tokens);
  const std::vector<std::string> docs = documents(*tok_, stream);
  ASSERT_EQ(docs.size(), 41u);
  EXPECT_EQ(docs[0], "the thing\nis a caf\xc3\xa9.\n");
  EXPECT_EQ(docs[1], "doc 0 says \xe4\xbd\xa0\xe5\xa5\xbd\n<|im_start|>ok");
  EXPECT_EQ(docs[40], "doc 39 says \xe4\xbd\xa0\xe5\xa5\xbd\n<|im_start|>ok");
  // The special token in the text is the token, not its characters.
  EXPECT_EQ(std::count(stream.begin(), stream.end(), tiny_bpe::kImStart), 40);

  std::ifstream idx(path("two") + "/index.json");
  const nlohmann::json index = nlohmann::json::parse(idx);
  EXPECT_EQ(index["num_tokens"], one.tokens);
  EXPECT_EQ(index["num_documents"], 41);
  EXPECT_EQ(index["token_bytes"], 2);
  EXPECT_EQ(index["shards"].size(), one.shards.size());
  EXPECT_EQ(index["eos_id"], tiny_bpe::kEndOfText);
  EXPECT_NE(format_tokenize_summary(two).find("MB/s"), std::string::npos);
}

TEST_F(TokenizeTest, LinesAndInvalidUtf8) {
  file("lines/x.txt", "first line\r\n\nsecond \xff line\nthird");
  TokenizeOptions o = options("lines_out", 2);
  o.inputs = {path("lines/x.txt")};
  o.lines = true;
  const TokenizeSummary s = tokenize_corpus(*tok_, o);
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.invalid_utf8, 1);
  EXPECT_EQ(documents(*tok_, read_stream(o.out_dir)),
            (std::vector<std::string>{"first line", "second \xef\xbf\xbd line", "third"}));

  // The byte tokenizer through the same path.
  ByteTokenizer bytes;
  o.out_dir = path("bytes_out");
  tokenize_corpus(bytes, o);
  EXPECT_EQ(TokenShardReader(token_shard_path(o.out_dir, 0)).header().vocab_size, 257);
}

TEST_F(TokenizeTest, BadJsonlNamesFileAndLine) {
  const std::string bad = file("bad/x.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"no end}\n");
  TokenizeOptions o = options("bad_out", 2);
  o.inputs = {bad};
  std::string e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find(bad + ":3: malformed JSON line"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(path("bad_out/index.json")));
  EXPECT_FALSE(fs::exists(token_shard_path(o.out_dir, 0)));

  file("bad/x.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"ok\", \"id\": 3}\n");
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find(bad + ":2: no \"text\" field (the line has: body, id)"), std::string::npos) << e;

  file("bad/x.jsonl", "[1, 2]\n");
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find(bad + ":1: expected a JSON object"), std::string::npos) << e;

  file("bad/x.jsonl", "{\"text\": 42}\n");
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find(bad + ":1: \"text\" is a number, expected a string"), std::string::npos) << e;

  // With --text-field the other key is read.
  file("bad/x.jsonl", "{\"body\": \"the\"}\n");
  o.text_field = "body";
  tokenize_corpus(*tok_, o);
  EXPECT_EQ(read_stream(o.out_dir), (Ids{'t', 257, tiny_bpe::kEndOfText}));
}

TEST_F(TokenizeTest, ErrorsForEmptyCorpusMissingInputsAndOldShards) {
  file("empty/a.txt", "");
  file("empty/b.jsonl", "\n{\"text\": \"\"}\n");
  TokenizeOptions o = options("empty_out", 2);
  o.inputs = {path("empty")};
  std::string e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find("hold no documents"), std::string::npos) << e;
  EXPECT_NE(e.find("2 empty documents"), std::string::npos) << e;

  o.inputs = {path("missing.txt")};
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find(path("missing.txt") + ": no such file or folder"), std::string::npos) << e;

  o.inputs = {file("z/data.jsonl.gz", "\x1f\x8b")};
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find("data.jsonl.gz: compressed"), std::string::npos) << e;

  // A folder that already holds shards is refused, unless overwrite.
  o = options("again", 2);
  tokenize_corpus(*tok_, o);
  e = error_of([&] { tokenize_corpus(*tok_, o); });
  EXPECT_NE(e.find("already holds token shards"), std::string::npos) << e;
  EXPECT_NE(e.find("--overwrite"), std::string::npos) << e;
  o.overwrite = true;
  o.shard_tokens = 1'000'000;
  const TokenizeSummary s = tokenize_corpus(*tok_, o);
  EXPECT_EQ(s.shards.size(), 1u);
  EXPECT_EQ(list_token_shards(o.out_dir).size(), 1u);

  // The output folder inside an input folder is not read as input.
  o = options("corpus/tokens", 2);
  const TokenizeSummary inside = tokenize_corpus(*tok_, o);
  o.overwrite = true;
  EXPECT_EQ(tokenize_corpus(*tok_, o).files, inside.files);
}

TEST_F(TokenizeTest, EncodeAndDecodeFilesForComparisons) {
  const std::string text = file("t.txt", "the thing <|im_end|>");
  EXPECT_EQ(encode_file_to_json(*tok_, text), "[116,257,256,104,260,32,302]\n");
  const std::string ids = file("ids.json", "[116,257,256,104,260,32,302]");
  EXPECT_EQ(decode_json_file(*tok_, ids), "the thing <|im_end|>");
  EXPECT_NE(error_of([&] { decode_json_file(*tok_, file("bad.json", "[1, \"x\"]")); }).find("element 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { decode_json_file(*tok_, file("big.json", "[1, 5000]")); }).find("token 5000"),
            std::string::npos);
  EXPECT_NE(error_of([&] { encode_file_to_json(*tok_, file("bad.txt", "a\xff")); }).find("not valid UTF-8"),
            std::string::npos);
}
