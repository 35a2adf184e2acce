#include "engine/data/regex.h"

#include "core/error.h"

namespace moetrain {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof(buf));
  return reinterpret_cast<const char*>(buf);
}

RegexScratch::RegexScratch() {
  match = pcre2_match_data_create(16, nullptr);
  context = pcre2_match_context_create(nullptr);
  // The default 32 KiB JIT stack can run out on long runs of one character class.
  jit_stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  MT_CHECK(match && context && jit_stack, "out of memory for PCRE2 match data");
  pcre2_jit_stack_assign(context, nullptr, jit_stack);
}

RegexScratch::~RegexScratch() {
  pcre2_jit_stack_free(jit_stack);
  pcre2_match_context_free(context);
  pcre2_match_data_free(match);
}

Regex::Regex(const std::string& pattern, bool literal, const std::string& where) : pattern_(pattern), where_(where) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2 refuses UCP together with LITERAL, and a literal needs no character classes.
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &offset,
                        nullptr);
  MT_CHECK(code_ != nullptr, "{}: cannot compile the regex /{}/ (PCRE2, at offset {}): {}", where, pattern, offset,
           pcre2_message(err));
  // Without a JIT (some platforms) the interpreter gives the same matches, slower.
  jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(code_); }

uint32_t Regex::min_length() const {
  uint32_t n = 0;
  if (pcre2_pattern_info(code_, PCRE2_INFO_MINLENGTH, &n) != 0) return 0;
  return n;
}

bool Regex::find(std::string_view s, size_t from, RegexScratch& rx, size_t& start, size_t& stop) const {
  const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), from, PCRE2_NO_UTF_CHECK,
                             rx.match, rx.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  MT_CHECK(rc >= 0, "{}: the regex /{}/ failed on a text of {} bytes: {}", where_, pattern_, s.size(),
           pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(rx.match);
  start = ov[0];
  stop = ov[1];
  return true;
}

}  // namespace moetrain
