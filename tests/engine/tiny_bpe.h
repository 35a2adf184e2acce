// A tiny Qwen-style tokenizer.json that tests write for themselves: the 256 byte-level
// symbols (id = byte value), a few merges (id = 256 + rank), and added tokens with a gap
// of unused ids before them. Tests reason about its merges to know the ids to expect.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace tiny_bpe {

// GPT-2's byte-to-character table, written out from its definition (the bytes that print
// stand for themselves; the others take U+0100, U+0101, ... in byte order), so that the
// tests check the tokenizer's own table rather than share it.
inline std::string byte_char(unsigned char b) {
  auto prints = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE; };
  uint32_t cp = b;
  if (!prints(b)) {
    cp = 256;
    for (int c = 0; c < b; ++c) cp += prints(c) ? 0 : 1;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

inline std::string bl(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) s += byte_char(b);
  return s;
}

// The merges as raw byte strings, in rank order; merge r makes token 256 + r.
inline const std::vector<std::pair<std::string, std::string>>& merges() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {" ", "t"},            // 256 " t"
      {"h", "e"},            // 257 "he"
      {" t", "he"},          // 258 " the"
      {"i", "n"},            // 259 "in"
      {"in", "g"},           // 260 "ing"
      {"e", "r"},            // 261 "er"
      {" ", " "},            // 262 "  "
      {"  ", "  "},          // 263 "    "
      {"1", "2"},            // 264 "12" (the Qwen regex splits digits, so never used there)
      {"'", "t"},            // 265 "'t"
      {"\n", "\n"},          // 266 "\n\n"
      {"o", "n"},            // 267 "on"
      {"\xC3", "\xA9"},      // 268 "é"
      {"c", "a"},            // 269 "ca"
      {"ca", "f"},           // 270 "caf"
      {"caf", "\xC3\xA9"},   // 271 "café"
      {"\xE4", "\xBD"},      // 272 first two bytes of 你
      {"\xE4\xBD", "\xA0"},  // 273 "你"
  };
  return m;
}

constexpr int32_t kEndOfText = 300, kImStart = 301, kImEnd = 302, kImStartAssistant = 303, kThink = 304;

// Qwen2's pre-tokenizer regex.
inline const char* qwen_pattern() {
  return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
}

inline nlohmann::json added_token(int32_t id, const std::string& content, bool special) {
  return {{"id", id},          {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},   {"normalized", !special}, {"special", special}};
}

// The whole tokenizer.json; tests edit the object before writing it to try other shapes.
inline nlohmann::json tokenizer_json(bool merges_as_pairs = false) {
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(static_cast<unsigned char>(b))] = b;
  json merge_list = json::array();
  for (size_t r = 0; r < merges().size(); ++r) {
    const auto& [a, b] = merges()[r];
    vocab[bl(a + b)] = static_cast<int>(256 + r);
    if (merges_as_pairs) {
      merge_list.push_back(json::array({bl(a), bl(b)}));
    } else {
      merge_list.push_back(bl(a) + " " + bl(b));
    }
  }
  json added = json::array({added_token(kEndOfText, "<|endoftext|>", true), added_token(kImStart, "<|im_start|>", true),
                            added_token(kImEnd, "<|im_end|>", true),
                            added_token(kImStartAssistant, "<|im_start|>assistant", true),
                            added_token(kThink, "<think>", false)});
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", qwen_pattern()}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                       {"use_regex", false}}})}}},
      {"post_processor",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
}

inline std::string write(const std::string& path, const nlohmann::json& j) {
  std::ofstream(path) << j.dump(1);
  return path;
}

}  // namespace tiny_bpe
