// Regex: one PCRE2 pattern (UTF, Unicode properties, JIT-compiled where the library has a
// JIT), shared by the tokenizer's pre-tokenizer splits and its Replace normalizer; and
// RegexScratch, what one thread needs to run patterns.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain {

// PCRE2's text for an error code.
std::string pcre2_message(int code);

// Match data and a JIT stack: PCRE2 does not share these between threads, so each thread
// keeps its own (thread_local) and hands it to every match.
struct RegexScratch {
  pcre2_match_data* match = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  RegexScratch();
  ~RegexScratch();
  RegexScratch(const RegexScratch&) = delete;
  RegexScratch& operator=(const RegexScratch&) = delete;
};

// One compiled pattern. PCRE2 code is read-only once compiled and JIT-compiled, so one
// Regex serves every thread.
class Regex {
 public:
  // `literal`: the pattern is a plain string. `where` names the file and key, for errors.
  Regex(const std::string& pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The leftmost match in s starting at or after byte `from` (a character boundary):
  // true with its bytes [start, stop), or false. `s` must be valid UTF-8 (not checked
  // again here). Throws naming `where` when PCRE2 fails (a JIT stack too small, say).
  bool find(std::string_view s, size_t from, RegexScratch& rx, size_t& start, size_t& stop) const;

  // The fewest characters a subject needs for a match (PCRE2's computed lower bound; 0
  // when the pattern can match the empty string, and for some patterns it cannot tell).
  uint32_t min_length() const;

  const pcre2_code* code() const { return code_; }
  const std::string& pattern() const { return pattern_; }
  bool jit() const { return jit_; }

 private:
  pcre2_code* code_ = nullptr;
  std::string pattern_;
  std::string where_;
  bool jit_ = false;
};

}  // namespace moetrain
