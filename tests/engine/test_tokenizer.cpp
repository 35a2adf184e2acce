// Tests of the Hugging Face byte-level BPE tokenizer on a tiny tokenizer.json written here
// (tiny_bpe.h): ids expected from reasoning about its merges and Qwen2's regex, round trips
// of multilingual text, added tokens, the other supported shapes, and errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "engine/data/bpe_tokenizer.h"
#include "engine/data/byte_tokenizer.h"
#include "engine/data/tokenizer_factory.h"
#include "engine/data/utf8.h"
#include "engine/scratch_dir.h"
#include "engine/tiny_bpe.h"

namespace fs = std::filesystem;
using namespace moetrain;
using nlohmann::json;
using Ids = std::vector<int32_t>;

namespace {

class BpeTest : public ScratchDirTest {
 protected:
  std::string write(const json& j, const std::string& name = "tokenizer.json") {
    return tiny_bpe::write(path(name), j);
  }
  std::unique_ptr<BpeTokenizer> load(const json& j, const std::string& eos = "") {
    return std::make_unique<BpeTokenizer>(write(j), eos);
  }
  std::string error_of_loading(const json& j) {
    return error_of([&] { load(j); });
  }
  // The tiny tokenizer with `normalizer` in place of its NFC.
  std::unique_ptr<BpeTokenizer> with_normalizer(const json& normalizer) {
    json j = tiny_bpe::tokenizer_json();
    j["normalizer"] = normalizer;
    return load(j);
  }
};

// What the tokenizer makes of `text` before the merges, read back through the ids.
std::string normalized(const BpeTokenizer& tok, const std::string& text) { return tok.decode(tok.encode(text)); }

Ids repeat(int32_t id, int n) { return Ids(static_cast<size_t>(n), id); }
Ids cat(std::initializer_list<Ids> parts) {
  Ids out;
  for (const Ids& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Text that covers the pre-tokenizer's cases: scripts, digits, contractions, emoji
// (with modifiers and joiners), whitespace runs of every kind, newlines.
const std::vector<std::string>& varied_texts() {
  static const std::vector<std::string> t = {
      "The quick brown fox jumps over the lazy dog.",
      "I'm sure they'll say we've done what you'd NEVER'VE thought; it's DON'T and Don't.",
      "Numbers: 3.14159, 1,000,000 and 2024-05-17T12:34:56Z; \xd9\xa3\xd9\xa4 \xe2\x85\xa7 \xc2\xbd",
      "Fran\xc3\xa7" "ais: \xc3\xa0 la fa\xc3\xa7on de caf\xc3\xa9 cr\xc3\xa8me br\xc3\xbbl\xc3\xa9" "e, na\xc3\xafve co\xc3\xb6perate.",
      "Deutsch: Stra\xc3\x9f" "e, \xc3\x84pfel, \xc3\x9c" "bermut; Espa\xc3\xb1ol: \xc2\xbf" "d\xc3\xb3nde est\xc3\xa1 el ni\xc3\xb1o?",
      "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c\xef\xbc\x81 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae"
      "\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88\xe3\x80\x82 \xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xed\x85\x8d\xec\x8a\xa4\xed\x8a\xb8",
      "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82, \xd0\xbc\xd0\xb8\xd1\x80! \xce\x93\xce\xb5\xce\xb9\xce\xac \xcf\x83\xce\xbf\xcf\x85 "
      "\xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d \xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xe0\xa4\xa8\xe0\xa4\xae\xe0\xa4\xb8\xe0\xa5\x8d\xe0\xa4\xa4\xe0\xa5\x87",
      "Emoji: \xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd hi \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 "
      "\xf0\x9f\x87\xab\xf0\x9f\x87\xb7!!! \xf0\x9f\x98\x80\xf0\x9f\x98\x80",
      "  leading spaces, trailing spaces   \n\n\n  indented\tline\r\nwindows\r\n\t\ttabs \xc2\xa0nbsp\xe3\x80\x80ideographic",
      "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\nclass A:\n\tpass\n",
      "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi! <think>hmm</think> ok<|im_end|><|endoftext|>",
      "<|im_sta <|im_end <|endoftext|<|endoftext|>>",
      "\x01\x02\x7f control \xc2\x85 next-line",
      "",
      " ",
      "\n",
  };
  return t;
}

}  // namespace

TEST(ByteLevelTable, KnownCharacters) {
  // GPT-2's table: these are the characters every byte-level vocabulary is written in.
  EXPECT_EQ(tiny_bpe::bl(" "), "\xc4\xa0");   // U+0120 'Ġ'
  EXPECT_EQ(tiny_bpe::bl("\n"), "\xc4\x8a");  // U+010A 'Ċ'
  EXPECT_EQ(tiny_bpe::bl("\xA0"), "\xc5\x82");  // U+0142 'ł'
  EXPECT_EQ(tiny_bpe::bl("\xAD"), "\xc5\x83");  // U+0143 'Ń'
  EXPECT_EQ(tiny_bpe::bl("A~\xA1\xFF"), "A~\xc2\xa1\xc3\xbf");
}

TEST_F(BpeTest, EncodesByRankAfterTheQwenSplit) {
  auto tok = load(tiny_bpe::tokenizer_json());
  EXPECT_EQ(tok->vocab_size(), 305);
  EXPECT_EQ(tok->eos_id(), tiny_bpe::kEndOfText);

  // "the" -> t + he (no "t he" merge); " thing" -> " t" first (rank 0), then in, ing.
  EXPECT_EQ(tok->encode("the thing"), (Ids{'t', 257, 256, 'h', 260}));
  // " the": " t" (0), "he" (1), " the" (2).
  EXPECT_EQ(tok->encode(" the"), (Ids{258}));
  // "her": "he" (rank 1) beats "er" (rank 5), and nothing joins he + r.
  EXPECT_EQ(tok->encode("her"), (Ids{257, 'r'}));
  // "user": only e + r merges.
  EXPECT_EQ(tok->encode("user"), (Ids{'u', 's', 261}));
  // \p{N}: every digit is a piece of its own, so the "1 2" merge never applies.
  EXPECT_EQ(tok->encode("12345"), (Ids{'1', '2', '3', '4', '5'}));
  EXPECT_EQ(tok->encode("x12"), (Ids{'x', '1', '2'}));
  // Contractions are pieces, case-insensitively.
  EXPECT_EQ(tok->encode("don't"), (Ids{'d', 267, 265}));
  EXPECT_EQ(tok->encode("DON'T"), (Ids{'D', 'O', 'N', '\'', 'T'}));
  // Whitespace: "a", "  " (\s+(?!\S) leaves the last space to the word), " b".
  EXPECT_EQ(tok->encode("a   b"), (Ids{'a', 262, ' ', 'b'}));
  EXPECT_EQ(tok->encode("a\n\nb"), (Ids{'a', 266, 'b'}));
  EXPECT_EQ(tok->encode("a \n b"), (Ids{'a', ' ', '\n', ' ', 'b'}));
  // Multi-byte characters: é = C3 A9 merges first (rank 12), then c+a, ca+f, caf+é.
  EXPECT_EQ(tok->encode("caf\xc3\xa9"), (Ids{271}));
  EXPECT_EQ(tok->encode(" caf\xc3\xa9"), (Ids{' ', 271}));
  // 你好: E4 BD A0 -> 你 (two merges); 好 = E5 A5 BD stays bytes.
  EXPECT_EQ(tok->encode("\xe4\xbd\xa0\xe5\xa5\xbd"), (Ids{273, 0xE5, 0xA5, 0xBD}));
}

TEST_F(BpeTest, LongPiecesMergeAsShortOnes) {
  auto tok = load(tiny_bpe::tokenizer_json());
  // 29 and 99 spaces before "b" (the last of the run goes with "b"): pairs merge leftmost
  // first, so n spaces become n/2 "  " (+ " "), then "    " pairs. 99 takes the heap path.
  EXPECT_EQ(tok->encode("a" + std::string(30, ' ') + "b"), cat({{'a'}, repeat(263, 7), {' ', ' ', 'b'}}));
  EXPECT_EQ(tok->encode("a" + std::string(100, ' ') + "b"), cat({{'a'}, repeat(263, 24), {262, ' ', ' ', 'b'}}));
  // A long piece with no merges at all.
  const std::string dashes(200, '-');
  EXPECT_EQ(tok->encode(dashes), repeat('-', 200));
}

TEST_F(BpeTest, PreTokenizerPieces) {
  auto tok = load(tiny_bpe::tokenizer_json());
  using P = std::vector<std::string>;
  EXPECT_EQ(tok->pre_tokenize("Hello, world!"), (P{"Hello", ",", " world", "!"}));
  EXPECT_EQ(tok->pre_tokenize("x  \n\n  y"), (P{"x", "  \n\n", " ", " y"}));
  EXPECT_EQ(tok->pre_tokenize("abc123"), (P{"abc", "1", "2", "3"}));
  // One non-letter may lead a run of letters: the full-width comma joins 世界.
  EXPECT_EQ(tok->pre_tokenize("\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c"),
            (P{"\xe4\xbd\xa0\xe5\xa5\xbd", "\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c"}));
  // Emoji are neither letters nor numbers: they join the punctuation run, with its space.
  EXPECT_EQ(tok->pre_tokenize("hi \xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd!"), (P{"hi", " \xf0\x9f\x91\x8b\xf0\x9f\x8f\xbd!"}));
  EXPECT_EQ(tok->pre_tokenize("end.\n\nNext"), (P{"end", ".\n\n", "Next"}));
}

TEST_F(BpeTest, AddedTokensAreCutOutFirst) {
  auto tok = load(tiny_bpe::tokenizer_json());
  using tiny_bpe::kImEnd, tiny_bpe::kImStart;
  EXPECT_EQ(tok->encode("<|im_start|>user\nhi<|im_end|>"),
            (Ids{kImStart, 'u', 's', 261, '\n', 'h', 'i', kImEnd}));
  // Longest match: "<|im_start|>assistant" is a token of its own.
  EXPECT_EQ(tok->encode("<|im_start|>assistant\nok"), (Ids{tiny_bpe::kImStartAssistant, '\n', 'o', 'k'}));
  EXPECT_EQ(tok->encode("<|im_start|>assist"), (Ids{kImStart, 'a', 's', 's', 'i', 's', 't'}));
  // A non-special added token (matched on the normalized text).
  EXPECT_EQ(tok->encode("a<think>b"), (Ids{'a', tiny_bpe::kThink, 'b'}));
  EXPECT_EQ(tok->encode("x<|endoftext|>"), (Ids{'x', tiny_bpe::kEndOfText}));
  // Not quite a token: ordinary text.
  EXPECT_EQ(tok->encode("<|im_sta"), (Ids{'<', '|', 'i', 'm', '_', 's', 't', 'a'}));
  // Decoding renders them as their content.
  EXPECT_EQ(tok->decode(Ids{kImStart, 'h', 'i', kImEnd, tiny_bpe::kEndOfText}), "<|im_start|>hi<|im_end|><|endoftext|>");
  EXPECT_EQ(tok->token_to_id("<|im_end|>"), kImEnd);
  EXPECT_EQ(tok->token_to_id(tiny_bpe::bl(" the")), 258);
  EXPECT_EQ(tok->token_to_id("nope"), std::nullopt);
}

TEST_F(BpeTest, RoundTripsVariedText) {
  auto tok = load(tiny_bpe::tokenizer_json());
  for (const std::string& text : varied_texts()) {
    const Ids ids = tok->encode(text);
    EXPECT_EQ(tok->decode(ids), text) << text;
    std::string joined;
    for (const std::string& p : tok->pre_tokenize(text)) joined += p;
    EXPECT_EQ(joined, text);  // the pieces cover the text exactly
  }
  // Several threads at once give what one thread gives.
  std::vector<Ids> expected;
  for (const std::string& text : varied_texts()) expected.push_back(tok->encode(text));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 50; ++rep) {
        for (size_t i = 0; i < varied_texts().size(); ++i) mismatches[t] += tok->encode(varied_texts()[i]) != expected[i];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, (std::vector<int>{0, 0, 0, 0}));
}

TEST_F(BpeTest, MergesAsPairsReadTheSame) {
  auto strings = load(tiny_bpe::tokenizer_json(false));
  BpeTokenizer pairs(write(tiny_bpe::tokenizer_json(true), "pairs.json"));
  for (const std::string& text : varied_texts()) EXPECT_EQ(strings->encode(text), pairs.encode(text)) << text;
}

TEST_F(BpeTest, Gpt2StyleByteLevelWithRegexAndPrefixSpace) {
  json j = tiny_bpe::tokenizer_json();
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  j["normalizer"] = nullptr;
  auto tok = load(j);
  // "the thing" -> " the", " thing"; GPT-2's regex keeps digit runs: " 123" -> " ", "12", "3".
  EXPECT_EQ(tok->encode("the thing"), (Ids{258, 256, 'h', 260}));
  EXPECT_EQ(tok->encode("x 123"), (Ids{' ', 'x', ' ', 264, '3'}));
}

TEST_F(BpeTest, DigitsSplitAndIgnoreMerges) {
  json j = tiny_bpe::tokenizer_json();
  // Digits(individual) then a Split on spaces (Removed), then ByteLevel without regex.
  j["pre_tokenizer"]["pretokenizers"] = json::array(
      {{{"type", "Digits"}, {"individual_digits", false}},
       {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}, {"invert", false}},
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}});
  auto tok = load(j);
  EXPECT_EQ(tok->encode("a12 b3"), (Ids{'a', 264, 'b', '3'}));

  // ignore_merges: a piece that is a vocabulary entry is taken whole.
  j = tiny_bpe::tokenizer_json();
  j["model"]["vocab"]["hello"] = 305;
  EXPECT_EQ(load(j)->encode("hello"), (Ids{257, 'l', 'l', 'o'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(j)->encode("hello"), (Ids{305}));
}

TEST_F(BpeTest, AddedTokenStripAndSingleWord) {
  json j = tiny_bpe::tokenizer_json();
  j["added_tokens"].push_back({{"id", 305}, {"content", "<mask>"}, {"lstrip", true}, {"rstrip", true},
                               {"single_word", false}, {"normalized", false}, {"special", true}});
  j["added_tokens"].push_back({{"id", 306}, {"content", "<w>"}, {"lstrip", false}, {"rstrip", false},
                               {"single_word", true}, {"normalized", false}, {"special", true}});
  auto tok = load(j);
  // The spaces around <mask> belong to it.
  EXPECT_EQ(tok->encode("a <mask> b"), (Ids{'a', 305, 'b'}));
  // <w> right after a letter is not a word of its own: plain text there.
  EXPECT_EQ(tok->encode("a<w> <w>"), (Ids{'a', '<', 'w', '>', ' ', 306}));
}

// ---- normalizers: each test's ids or text would differ were the normalizer skipped -------

TEST_F(BpeTest, NfcComposesBeforeTheSplit) {
  json j = tiny_bpe::tokenizer_json();  // NFC, as Qwen2/Qwen3
  // A decomposed accent (e + U+0301) is the same text as é once composed: one "café".
  j["added_tokens"].push_back(tiny_bpe::added_token(305, "<e\xcc\x81>", false));  // normalized = true
  j["added_tokens"].push_back({{"id", 306}, {"content", "<o\xcc\x88>"}, {"normalized", false}, {"special", true}});
  auto tok = load(j);
  EXPECT_EQ(tok->encode("cafe\xcc\x81"), (Ids{271}));
  EXPECT_EQ(tok->encode("caf\xc3\xa9"), (Ids{271}));
  EXPECT_EQ(normalized(*tok, " e\xcc\x81 a\xcc\x8a"), " \xc3\xa9 \xc3\xa5");
  // Normalized text between long ASCII runs, then a decomposed accent further on.
  const std::string a(100, 'a'), b(70, 'b');
  EXPECT_EQ(normalized(*tok, a + " \xc3\xa9 " + b + " \xe4\xbd\xa0 " + a + " e\xcc\x81" + b),
            a + " \xc3\xa9 " + b + " \xe4\xbd\xa0 " + a + " \xc3\xa9" + b);
  // A normalized token matches what the normalizer makes of its content, so either spelling.
  EXPECT_EQ(tok->encode("x<e\xcc\x81>y"), (Ids{'x', 305, 'y'}));
  EXPECT_EQ(tok->encode("x<\xc3\xa9>y"), (Ids{'x', 305, 'y'}));
  // It decodes as the library's byte-level decoder takes its normalized text "<é>": every
  // character is in the byte table (é stands for byte E9), so the bytes 3C E9 3E (which
  // the library then shows as "<\xEF\xBF\xBD>").
  EXPECT_EQ(tok->decode(Ids{305}), "<\xe9>");
  // A raw one (normalized = false) matches the text as given, before NFC.
  EXPECT_EQ(tok->encode("<o\xcc\x88>"), (Ids{306}));
  EXPECT_EQ(tok->encode("<\xc3\xb6>"), (Ids{'<', 0xC3, 0xB6, '>'}));
  // The span after a raw token is normalized on its own: U+0344 (NFC: U+0308 U+0301) does not
  // compose with the token's last letter (t + U+0308 would be U+1E97), unlike NFC of the whole.
  EXPECT_EQ(normalized(*tok, "<|im_start|>assistant\xcd\x84"), "<|im_start|>assistant\xcc\x88\xcc\x81");
  EXPECT_EQ(normalized(*tok, "assistant\xcd\x84"), "assistan\xe1\xba\x97\xcc\x81");

  // Without a normalizer the accent is a piece of its own (U+0301 is not a letter).
  j["normalizer"] = nullptr;
  EXPECT_EQ(load(j)->encode("cafe\xcc\x81"), (Ids{270, 'e', 0xCC, 0x81}));
}

TEST_F(BpeTest, NfdAndNfkdDecompose) {
  auto nfd = with_normalizer({{"type", "NFD"}});
  EXPECT_EQ(nfd->encode("caf\xc3\xa9"), (Ids{270, 'e', 0xCC, 0x81}));
  EXPECT_EQ(normalized(*nfd, "\xc3\xa9\xef\xac\x81"), "e\xcc\x81\xef\xac\x81");  // é -> e + U+0301; ﬁ stays
  auto nfkd = with_normalizer({{"type", "NFKD"}});
  EXPECT_EQ(normalized(*nfkd, "\xc3\xa9\xef\xac\x81"), "e\xcc\x81" "fi");  // and ﬁ -> fi
  EXPECT_EQ(nfkd->encode("\xef\xac\x81"), (Ids{'f', 'i'}));
}

TEST_F(BpeTest, NfkcFoldsCompatibilityCharacters) {
  auto tok = with_normalizer({{"type", "NFKC"}});
  EXPECT_EQ(tok->encode("\xef\xac\x81ne"), (Ids{'f', 259, 'e'}));              // ﬁne -> fine
  EXPECT_EQ(tok->encode("\xef\xbc\xb4\xef\xbd\x88\xef\xbd\x85"), (Ids{'T', 257}));  // full-width Ｔｈｅ
  EXPECT_EQ(tok->encode("x\xc2\xb2"), (Ids{'x', '2'}));                        // x² -> x2
  EXPECT_EQ(tok->encode("cafe\xcc\x81"), (Ids{271}));                          // and it composes
  EXPECT_EQ(with_normalizer(nullptr)->encode("\xef\xac\x81ne"), (Ids{0xEF, 0xAC, 0x81, 'n', 'e'}));
}

TEST_F(BpeTest, LowercaseIsUnicodeOneCharacterAtATime) {
  json j = tiny_bpe::tokenizer_json();
  j["normalizer"] = {{"type", "Lowercase"}};
  j["added_tokens"].push_back(tiny_bpe::added_token(305, "<Tok>", false));  // normalized: looked for as "<tok>"
  j["added_tokens"].push_back({{"id", 306}, {"content", "<Raw>"}, {"normalized", false}, {"special", true}});
  auto tok = load(j);
  EXPECT_EQ(tok->encode("THE THING"), (Ids{'t', 257, 256, 'h', 260}));
  EXPECT_EQ(tok->encode("CAF\xc3\x89"), (Ids{271}));  // CAFÉ
  // As the library (Rust's char::to_lowercase): no final-sigma rule, so ΟΔΟΣ -> οδοσ,
  // not οδος; and İ takes its full mapping, i + U+0307.
  EXPECT_EQ(normalized(*tok, "\xce\x9f\xce\x94\xce\x9f\xce\xa3 \xce\xa3"), "\xce\xbf\xce\xb4\xce\xbf\xcf\x83 \xcf\x83");
  EXPECT_EQ(normalized(*tok, "\xc4\xb0Z"), "i\xcc\x87z");
  EXPECT_EQ(tok->encode("<TOK><tok><Tok>"), (Ids{305, 305, 305}));
  // As in the library, the token decodes as what the normalizer made of it.
  EXPECT_EQ(tok->decode(Ids{305}), "<tok>");
  EXPECT_EQ(tok->encode("a<THINK>"), (Ids{'a', tiny_bpe::kThink}));
  EXPECT_EQ(tok->encode("<Raw>"), (Ids{306}));
  EXPECT_NE(tok->encode("<RAW>"), (Ids{306}));
}

TEST_F(BpeTest, StripRemovesWhiteSpaceAtTheEndsOfEachSpan) {
  auto both = with_normalizer({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}});
  EXPECT_EQ(both->encode(" the "), (Ids{'t', 257}));
  // Unicode White_Space: tab, ideographic space, NBSP.
  EXPECT_EQ(normalized(*both, "\t \xe3\x80\x80the\xc2\xa0\n"), "the");
  EXPECT_EQ(both->encode(" \n "), Ids{});
  // Raw added tokens are cut out first; the spans around them are stripped each.
  EXPECT_EQ(normalized(*both, " a <|im_end|> b "), "a<|im_end|>b");
  EXPECT_EQ(normalized(*with_normalizer({{"type", "Strip"}, {"strip_left", true}, {"strip_right", false}}), "  a  "),
            "a  ");
  EXPECT_EQ(normalized(*with_normalizer({{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}}), "  a  "),
            "  a");
}

TEST_F(BpeTest, ReplaceStringOrRegex) {
  auto replace = [&](const json& pattern, const std::string& content) {
    return with_normalizer({{"type", "Replace"}, {"pattern", pattern}, {"content", content}});
  };
  // SentencePiece-style: spaces become U+2581.
  auto sp = replace({{"String", " "}}, "\xe2\x96\x81");
  EXPECT_EQ(normalized(*sp, "a b  c"), "a\xe2\x96\x81" "b\xe2\x96\x81\xe2\x96\x81" "c");
  EXPECT_EQ(sp->encode("a b"), (Ids{'a', 0xE2, 0x96, 0x81, 'b'}));
  // A String pattern is literal: "." is a dot.
  EXPECT_EQ(normalized(*replace({{"String", "a.c"}}, "X"), "abc a.c"), "abc X");
  EXPECT_EQ(normalized(*replace({{"Regex", "\\s+"}}, " "), "a \t\n\xe3\x80\x80 b"), "a b");
  EXPECT_EQ(normalized(*replace({{"Regex", "\\p{Mn}"}}, ""), "cafe\xcc\x81"), "cafe");
  // A pattern that matches the empty string is refused (the library's Replace panics on
  // it), when the file is loaded or, for what PCRE2 cannot tell beforehand, when it does.
  auto lookahead = replace({{"Regex", "(?=b)"}}, "-");
  const std::string e = error_of([&] { lookahead->encode("abc"); });
  EXPECT_NE(e.find("normalizer.pattern /(?=b)/ matched the empty string"), std::string::npos) << e;
}

TEST_F(BpeTest, PrependPrefixesEachNonEmptySpan) {
  auto tok = with_normalizer({{"type", "Prepend"}, {"prepend", "\xe2\x96\x81"}});
  EXPECT_EQ(tok->encode("a"), (Ids{0xE2, 0x96, 0x81, 'a'}));
  EXPECT_EQ(normalized(*tok, "a<|im_end|>b"), "\xe2\x96\x81" "a<|im_end|>\xe2\x96\x81" "b");
  EXPECT_EQ(tok->encode("<|im_end|>"), (Ids{tiny_bpe::kImEnd}));
  EXPECT_EQ(tok->encode(""), Ids{});
}

TEST_F(BpeTest, SequenceRunsItsStepsInOrder) {
  auto seq = [&](std::initializer_list<json> steps) {
    json list = json::array();
    for (const json& s : steps) list.push_back(s);
    return with_normalizer({{"type", "Sequence"}, {"normalizers", list}});
  };
  // Accents stripped (NFKD, then marks removed), then lowercase.
  auto fold = seq({{{"type", "NFKD"}},
                   {{"type", "Replace"}, {"pattern", {{"Regex", "\\p{Mn}"}}}, {"content", ""}},
                   {{"type", "Lowercase"}}});
  EXPECT_EQ(normalized(*fold, "CAF\xc3\x89 \xef\xac\x81"), "cafe fi");
  EXPECT_EQ(normalized(*seq({{{"type", "Prepend"}, {"prepend", "X"}}, {{"type", "Lowercase"}}}), "a"), "xa");
  EXPECT_EQ(normalized(*seq({{{"type", "Lowercase"}}, {{"type", "Prepend"}, {"prepend", "X"}}}), "a"), "Xa");
  // Nested sequences run as one.
  auto nested = seq({{{"type", "Sequence"}, {"normalizers", json::array({{{"type", "Lowercase"}}})}},
                     {{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}});
  EXPECT_EQ(normalized(*nested, " AB "), "ab");
  // An empty sequence (DeepSeek-V3's) changes nothing.
  EXPECT_EQ(seq({})->encode("cafe\xcc\x81"), (Ids{270, 'e', 0xCC, 0x81}));
}

TEST_F(BpeTest, EndOfTextToken) {
  json j = tiny_bpe::tokenizer_json();
  EXPECT_EQ(load(j, "<|im_end|>")->eos_id(), tiny_bpe::kImEnd);
  try {
    load(j, "<|nope|>");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"<|nope|>\" is not in the vocabulary"), std::string::npos) << e.what();
  }
  // Without <|endoftext|>: the eos_token of tokenizer_config.json, else an error.
  j["added_tokens"].erase(0);
  std::string e = error_of_loading(j);
  EXPECT_NE(e.find("no end-of-text token"), std::string::npos) << e;
  EXPECT_NE(e.find("--eos"), std::string::npos) << e;
  tiny_bpe::write(path("tokenizer_config.json"), {{"eos_token", {{"content", "<|im_end|>"}}}});
  EXPECT_EQ(load(j)->eos_id(), tiny_bpe::kImEnd);
}

TEST_F(BpeTest, DecodeErrors) {
  auto tok = load(tiny_bpe::tokenizer_json());
  auto decode_error = [&](Ids ids) { return error_of([&] { tok->decode(ids); }); };
  std::string e = decode_error({'a', 9999});
  EXPECT_NE(e.find("token 9999 (at position 1)"), std::string::npos) << e;
  EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  EXPECT_NE(decode_error({-1}).find("token -1"), std::string::npos);
  // An id below the vocabulary size that no token has (the gap before the added tokens).
  EXPECT_NE(decode_error({280}).find("token 280"), std::string::npos);
  // Ids that cut a character in two decode to its bytes.
  EXPECT_EQ(tok->decode(Ids{0xE4}), "\xE4");
}

TEST_F(BpeTest, BadTextIsRefused) {
  auto tok = load(tiny_bpe::tokenizer_json());
  for (const std::string bad : {"ab\xff", "\xc3", "\xed\xa0\x80", "\xc0\xaf"}) {
    try {
      tok->encode(bad);
      ADD_FAILURE() << "accepted invalid UTF-8";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
    }
  }
}

TEST_F(BpeTest, BadFilesAreNamed) {
  std::string missing = path("missing.json");
  try {
    BpeTokenizer t(missing);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  {
    std::ofstream(dir_ / "broken.json") << "{\"model\": {\"vocab\": ";
    try {
      BpeTokenizer t(path("broken.json"));
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("broken.json: not valid JSON"), std::string::npos) << e.what();
    }
  }
  struct Case {
    std::function<void(json&)> edit;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["model"]["type"] = "WordPiece"; }, "model.type is \"WordPiece\""},
      {[](json& j) { j["model"].erase("merges"); }, "model has no \"merges\" key"},
      {[](json& j) { j["model"]["merges"][0] = "a"; }, "model.merges[0]"},
      {[](json& j) { j["model"]["merges"][1] = "x y"; }, "model.merges[1]"},
      {[](json& j) { j["model"]["merges"][2] = json::array({1, 2}); }, "model.merges[2]"},
      {[](json& j) { j["model"]["dropout"] = 0.1; }, "model.dropout"},
      {[](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "model.continuing_subword_prefix"},
      {[](json& j) {
         j["model"]["byte_fallback"] = true;
         j["model"]["vocab"].erase(tiny_bpe::byte_char(1));
       },
       "model.byte_fallback is true and the vocabulary has no symbol for byte 0x01"},
      {[](json& j) { j["normalizer"] = {{"type", "BertNormalizer"}}; }, "normalizer.type is \"BertNormalizer\""},
      {[](json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", json::array({{{"type", "NFC"}}, {{"type", "Precompiled"}}})}};
       },
       "normalizer.normalizers[1].type is \"Precompiled\""},
      {[](json& j) { j["normalizer"] = {{"type", "Strip"}, {"strip_right", true}}; },
       "normalizer has no \"strip_left\" key"},
      {[](json& j) {
         j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "(a)(b)"}}}, {"content", "$2$1"}};
       },
       "normalizer.content is \"$2$1\""},
      {[](json& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", "a"}, {"content", "b"}}; },
       "normalizer.pattern must be"},
      {[](json& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "(a"}}}, {"content", "b"}}; },
       "normalizer.pattern: cannot compile the regex"},
      {[](json& j) { j["normalizer"] = {{"type", "Prepend"}}; }, "normalizer has no \"prepend\" key"},
      {[](json& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "x*"}}}, {"content", "-"}}; },
       "normalizer.pattern {\"Regex\":\"x*\"} can match the empty string"},
      {[](json& j) { j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", ""}}}, {"content", "-"}}; },
       "normalizer.pattern {\"String\":\"\"} can match the empty string"},
      {[](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "pre_tokenizer.type is \"Metaspace\""},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["type"] = "Whitespace"; },
       "pre_tokenizer.pretokenizers[0].type is \"Whitespace\""},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext"; },
       "pre_tokenizer.pretokenizers[0].behavior"},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed"; },
       "cannot compile the regex"},
      {[](json& j) { j["pre_tokenizer"]["pretokenizers"].erase(1); }, "no ByteLevel step"},
      {[](json& j) { j["decoder"] = {{"type", "Metaspace"}}; }, "decoder.type is \"Metaspace\""},
      {[](json& j) {
         j["decoder"] = {{"type", "Sequence"},
                         {"decoders", json::array({{{"type", "ByteLevel"}}, {{"type", "Fuse"}}})}};
       },
       "decoder.decoders[1].type is \"Fuse\""},
      {[](json& j) { j["added_tokens"][1]["id"] = "x"; }, "added_tokens[1].id"},
  };
  for (const Case& c : cases) {
    json j = tiny_bpe::tokenizer_json();
    c.edit(j);
    const std::string e = error_of_loading(j);
    EXPECT_NE(e.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << e;
    EXPECT_NE(e.find("tokenizer.json"), std::string::npos) << e;
  }
}

TEST_F(BpeTest, FactoryPicksTheTokenizer) {
  auto byte = make_tokenizer("byte");
  EXPECT_EQ(byte->vocab_size(), 257);
  EXPECT_EQ(byte->eos_id(), 256);
  EXPECT_EQ(byte->token_to_id("<|endoftext|>"), 256);
  EXPECT_EQ(byte->token_to_id("A"), 65);

  write(tiny_bpe::tokenizer_json());
  auto from_folder = make_tokenizer(dir_.string());  // a model folder holding tokenizer.json
  auto from_file = make_tokenizer(path("tokenizer.json"), "<|im_end|>");
  EXPECT_EQ(from_folder->vocab_size(), 305);
  EXPECT_EQ(from_folder->eos_id(), tiny_bpe::kEndOfText);
  EXPECT_EQ(from_file->eos_id(), tiny_bpe::kImEnd);
  EXPECT_EQ(from_folder->fingerprint(), from_file->fingerprint());
  EXPECT_NE(from_folder->fingerprint(), byte->fingerprint());
  EXPECT_EQ(from_folder->encode("the thing"), (Ids{'t', 257, 256, 'h', 260}));

  std::string e = error_of([] { make_tokenizer("no/such/tokenizer.json"); });
  EXPECT_NE(e.find("[data].tokenizer = \"no/such/tokenizer.json\": no such file"), std::string::npos) << e;
  fs::create_directories(dir_ / "empty");
  e = error_of([&] { make_tokenizer(path("empty"), "", "--tokenizer"); });
  EXPECT_NE(e.find("--tokenizer"), std::string::npos) << e;
  EXPECT_NE(e.find("has no tokenizer.json"), std::string::npos) << e;
  e = error_of([] { make_tokenizer("byte", "<|im_end|>"); });
  EXPECT_NE(e.find("<|endoftext|>"), std::string::npos) << e;
}

TEST(Utf8, ValidationAndReplacement) {
  EXPECT_EQ(utf8_valid_prefix("plain ascii text, long enough for the 8-byte path"), 49u);
  EXPECT_EQ(utf8_valid_prefix("caf\xc3\xa9 \xe4\xbd\xa0 \xf0\x9f\x91\x8b"), 14u);
  EXPECT_EQ(utf8_valid_prefix("ab\xc3"), 2u);          // truncated
  EXPECT_EQ(utf8_valid_prefix("ab\xc0\xaf"), 2u);      // overlong
  EXPECT_EQ(utf8_valid_prefix("ab\xed\xa0\x80"), 2u);  // surrogate
  EXPECT_EQ(utf8_valid_prefix("ab\xf4\x90\x80\x80"), 2u);  // above U+10FFFF
  // One U+FFFD per maximal ill-formed subpart, as Python's errors="replace".
  std::string s = "a\xe4\xbd" "b\xff\xfe" "c\xf0\x9f\x91";
  EXPECT_EQ(utf8_replace_invalid(s), 4);
  EXPECT_EQ(s, "a\xef\xbf\xbd" "b\xef\xbf\xbd\xef\xbf\xbd" "c\xef\xbf\xbd");
  std::string ok = "fine \xc3\xa9";
  EXPECT_EQ(utf8_replace_invalid(ok), 0);
  EXPECT_EQ(ok, "fine \xc3\xa9");
}
