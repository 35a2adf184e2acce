// UTF-8 checks for text on its way to a tokenizer. Well-formed means what Unicode calls
// well-formed (no overlong forms, no surrogates, nothing above U+10FFFF), which is what
// PCRE2 and Hugging Face tokenizers (Rust strings) accept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain {

// The length of the longest well-formed prefix of `s` (s.size() when all of it is).
size_t utf8_valid_prefix(std::string_view s);

// Replaces each maximal ill-formed subsequence by U+FFFD, as Python's
// bytes.decode("utf-8", errors="replace") does; returns how many were replaced.
int64_t utf8_replace_invalid(std::string& s);

// The length of the character that starts at s[i] (1..4), for a well-formed string.
inline size_t utf8_char_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// The start of the character that ends at s[end - 1], in a well-formed string (end > 0).
inline size_t utf8_char_start_before(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Decodes the character at s[i] of a well-formed string and advances i past it.
uint32_t utf8_next(std::string_view s, size_t& i);

// Appends code point `cp` (< 0x110000, not a surrogate) to `out`.
void utf8_append(std::string& out, uint32_t cp);

}  // namespace moetrain
