#include "engine/data/utf8.h"

#include <cstring>

namespace moetrain {
namespace {

// Checks the sequence at p[0..n): returns its length when well-formed, else 0 and sets
// `bad` to the length of the maximal ill-formed subpart (at least 1). The second byte's
// range depends on the lead byte (Unicode table 3-7); later bytes are 80..BF.
int check_sequence(const unsigned char* p, size_t n, int& bad) {
  const unsigned char c = p[0];
  int len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    bad = 1;
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    const bool ok = static_cast<size_t>(k) < n && p[k] >= (k == 1 ? lo : 0x80) && p[k] <= (k == 1 ? hi : 0xBF);
    if (!ok) {
      bad = k;
      return 0;
    }
  }
  return len;
}

// Bytes from i on that are ASCII, eight at a time.
size_t skip_ascii(const unsigned char* p, size_t i, size_t n) {
  while (i + 8 <= n) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w & 0x8080808080808080ull) break;
    i += 8;
  }
  while (i < n && p[i] < 0x80) ++i;
  return i;
}

}  // namespace

size_t utf8_valid_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (true) {
    i = skip_ascii(p, i, n);
    if (i == n) return n;
    int bad = 0;
    const int len = check_sequence(p + i, n - i, bad);
    if (len == 0) return i;
    i += static_cast<size_t>(len);
  }
}

int64_t utf8_replace_invalid(std::string& s) {
  size_t first_bad = utf8_valid_prefix(s);
  if (first_bad == s.size()) return 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  std::string out(s, 0, first_bad);
  int64_t replaced = 0;
  size_t i = first_bad;
  while (i < n) {
    int bad = 0;
    const int len = check_sequence(p + i, n - i, bad);
    if (len > 0) {
      out.append(s, i, static_cast<size_t>(len));
      i += static_cast<size_t>(len);
    } else {
      out += "\xEF\xBF\xBD";
      ++replaced;
      i += static_cast<size_t>(bad);
    }
  }
  s = std::move(out);
  return replaced;
}

uint32_t utf8_next(std::string_view s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t len = utf8_char_length(c);
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace moetrain
