// `moetrain tokenize` end to end: shards and a throughput line from a JSONL file, ids as
// JSON for comparisons, and one clear error line naming file:line for bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cli_run.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"

namespace {

namespace fs = std::filesystem;

class TokenizeCli : public ScratchDirTest {
 protected:
  void SetUp() override {
    ScratchDirTest::SetUp();
    tokenizer_ = tiny_bpe::write(path("tokenizer.json"), tiny_bpe::tokenizer_json());
  }

  // Runs `moetrain tokenize --tokenizer <tiny> ARGS`; returns the exit status, and the
  // stdout and stderr in `out` / `err`.
  int tokenize(const std::string& args, std::string& out, std::string& err) {
    const std::string o = path("stdout"), e = path("stderr");
    const std::string cmd = moetrain::testing::moetrain_binary() + " tokenize --tokenizer " + tokenizer_ + " " + args + " >" +
                            o + " 2>" + e;
    const int status = std::system(cmd.c_str());
    auto slurp = [](const std::string& p) {
      std::ifstream in(p);
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    };
    out = slurp(o);
    err = slurp(e);
    return WEXITSTATUS(status);
  }

  std::string tokenizer_;
};

TEST_F(TokenizeCli, WritesShardsAndThroughput) {
  const std::string in = file("docs.jsonl", "{\"text\": \"the thing\"}\n{\"text\": \"her caf\\u00e9\"}\n");
  std::string out, err;
  ASSERT_EQ(tokenize("--out " + path("shards") + " --threads 2 --no-progress " + in, out, err), 0) << err;
  const std::string log = out + err;  // the log goes to stdout
  EXPECT_NE(log.find("tokenized 1 files"), std::string::npos) << log;
  EXPECT_NE(log.find("2 documents"), std::string::npos) << log;
  EXPECT_NE(log.find("MB/s"), std::string::npos) << log;
  EXPECT_NE(log.find("M tokens/s"), std::string::npos) << log;
  // "the thing" (5 tokens) <eos> "her" (2) " café" (2) <eos>: 11 tokens of 2 bytes after the header.
  EXPECT_TRUE(fs::exists(dir_ / "shards" / "index.json"));
  EXPECT_EQ(fs::file_size(dir_ / "shards" / "shard-00000.bin"), 64u + 2u * 11u);
}

TEST_F(TokenizeCli, PrintsIdsAsJson) {
  const std::string text = file("t.txt", "the thing");
  std::string out, err;
  ASSERT_EQ(tokenize("--encode-text " + text, out, err), 0) << err;
  EXPECT_EQ(out, "[116,257,256,104,260]\n");
  const std::string ids = file("ids.json", out);
  ASSERT_EQ(tokenize("--decode-ids " + ids, out, err), 0) << err;
  EXPECT_EQ(out, "the thing");
}

TEST_F(TokenizeCli, BadInputIsOneClearLine) {
  const std::string in = file("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": oops}\n");
  std::string out, err;
  EXPECT_EQ(tokenize("--out " + path("shards") + " --no-progress " + in, out, err), 2);
  EXPECT_NE(err.find("moetrain: error: " + in + ":2: malformed JSON line"), std::string::npos) << err;

  EXPECT_EQ(tokenize("--out " + path("shards") + " " + path("nothing"), out, err), 2);
  EXPECT_NE(err.find("no such file or folder"), std::string::npos) << err;
}

}  // namespace
