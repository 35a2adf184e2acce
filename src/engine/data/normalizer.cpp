#include "engine/data/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/casemap.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>
#include <unicode/utypes.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/data/json_keys.h"
#include "engine/data/regex.h"
#include "engine/data/utf8.h"

using nlohmann::json;

namespace moetrain {

using json_keys::member;
using json_keys::string_at;

namespace {

// The first byte at or after `i` that is not ASCII (s.size() when none), eight at a time.
size_t skip_ascii(std::string_view s, size_t i) {
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    if ((w & 0x8080808080808080ull) != 0) break;
  }
  while (i < s.size() && static_cast<unsigned char>(s[i]) < 0x80) ++i;
  return i;
}

bool is_ascii(std::string_view s) { return skip_ascii(s, 0) == s.size(); }

icu::StringPiece piece_of(std::string_view s) {
  // ICU counts bytes in int32_t; one text (a document between added tokens) of 2 GiB is
  // past anything a corpus holds.
  MT_CHECK(s.size() <= static_cast<size_t>(INT32_MAX), "cannot normalize a text of {} bytes (ICU takes up to 2 GiB)",
           s.size());
  return icu::StringPiece(s.data(), static_cast<int32_t>(s.size()));
}

// Whether `s` is in the form `form` already. ASCII characters are in every form and
// nothing composes with them or moves across them, so the text cuts into pieces that are
// in the form each on its own: ICU's check (a quick check that looks further only where it
// says "maybe") sees the stretches of non-ASCII text, each with the ASCII character before
// it (e + U+0301 composes), and skips the long runs of ASCII between them.
bool is_normalized(const icu::Normalizer2& form, std::string_view s) {
  constexpr size_t kLongAscii = 8 * 8;  // eight ASCII words in a row end a piece
  constexpr uint64_t kHigh = 0x8080808080808080ull;
  size_t i = skip_ascii(s, 0);
  while (i < s.size()) {
    const size_t start = i - 1 + (i == 0);
    // The piece ends where a long run of ASCII starts (words of eight bytes, so that
    // non-ASCII text costs a test per eight bytes here); the next one starts after it.
    size_t end = s.size(), next = s.size(), j = i, run = 0;
    for (; j + 8 <= s.size(); j += 8) {
      uint64_t w;
      std::memcpy(&w, s.data() + j, 8);
      run = (w & kHigh) != 0 ? 0 : run + 1;
      if (run * 8 >= kLongAscii) {
        end = j + 8 - run * 8;  // an ASCII byte
        next = skip_ascii(s, j + 8);
        break;
      }
    }
    UErrorCode err = U_ZERO_ERROR;
    if (!form.isNormalizedUTF8(piece_of(s.substr(start, end - start)), err) || U_FAILURE(err)) return false;
    i = next;
  }
  return true;
}

}  // namespace

struct Normalizer::Step {
  enum class Kind { kUnicode, kLowercase, kStrip, kReplace, kPrepend };
  Kind kind = Kind::kUnicode;
  std::string type;                       // the tokenizer.json type, for messages
  std::string where;                      // its JSON key path, for messages
  const icu::Normalizer2* form = nullptr;  // kUnicode: ICU's NFC/NFD/NFKC/NFKD instance (owned by ICU)
  bool strip_left = false, strip_right = false;
  std::unique_ptr<Regex> pattern;  // kReplace
  std::string content;             // kReplace: the replacement; kPrepend: the prefix
};

Normalizer::Normalizer(const json& n, const std::string& file, const std::string& where) : file_(file) {
  if (!n.is_null()) add(n, where);
  for (const auto& s : steps_) name_ += (name_.empty() ? "" : " + ") + s->type;
  if (name_.empty()) name_ = "none";
}

Normalizer::~Normalizer() = default;

void Normalizer::add(const json& n, const std::string& where) {
  const std::string type = string_at(n, "type", file_, where);
  if (type == "Sequence") {
    // A sequence runs its steps in order on the output of the one before: the same as
    // its steps one after the other here, nested sequences included.
    const json& list = member(n, "normalizers", file_, where);
    MT_CHECK(list.is_array(), "{}: {}.normalizers must be an array, not {}", file_, where, list.type_name());
    for (size_t i = 0; i < list.size(); ++i) add(list[i], fmt::format("{}.normalizers[{}]", where, i));
    return;
  }
  auto step = std::make_unique<Step>();
  step->type = type;
  step->where = where;
  auto required_bool = [&](const char* key) {
    const json& v = member(n, key, file_, where);
    MT_CHECK(v.is_boolean(), "{}: {}.{} must be true or false, not {}", file_, where, key, v.dump());
    return v.get<bool>();
  };
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode err = U_ZERO_ERROR;
    step->form = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
                 : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
                 : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                                  : icu::Normalizer2::getNFKDInstance(err);
    MT_CHECK(U_SUCCESS(err) && step->form != nullptr, "{}: {} is {}, and ICU has no {} data: {}", file_, where, type,
             type, u_errorName(err));
  } else if (type == "Lowercase") {
    step->kind = Step::Kind::kLowercase;
  } else if (type == "Strip") {
    step->kind = Step::Kind::kStrip;
    step->strip_left = required_bool("strip_left");
    step->strip_right = required_bool("strip_right");
  } else if (type == "Replace") {
    step->kind = Step::Kind::kReplace;
    const json& pat = member(n, "pattern", file_, where);
    const bool literal = pat.is_object() && pat.contains("String");
    MT_CHECK(pat.is_object() && pat.size() == 1 && (literal || pat.contains("Regex")),
             "{}: {}.pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}, not {}", file_, where, pat.dump());
    const std::string text = string_at(pat, literal ? "String" : "Regex", file_, where + ".pattern");
    step->content = string_at(n, "content", file_, where);
    // Newer versions of the library expand $1, ${name} and $$ in the content of a Regex
    // Replace, older ones insert it as written: such a file tokenizes by version.
    MT_CHECK(literal || step->content.find('$') == std::string::npos,
             "{}: {}.content is \"{}\": a '$' in the content of a Replace with a Regex pattern (group references, "
             "which versions of the tokenizers library treat differently) is not implemented",
             file_, where, step->content);
    step->pattern = std::make_unique<Regex>(text, literal, fmt::format("{}: {}.pattern", file_, where));
    // Where the pattern matches the empty string the library (0.23) panics, or puts the
    // content in the wrong place of the text it tokenizes: there are no ids to agree with.
    MT_CHECK(step->pattern->min_length() > 0,
             "{}: {}.pattern {} can match the empty string, where the tokenizers library's Replace fails; "
             "moetrain refuses such a pattern",
             file_, where, pat.dump());
  } else if (type == "Prepend") {
    step->kind = Step::Kind::kPrepend;
    step->content = string_at(n, "prepend", file_, where);
  } else {
    MT_THROW("{}: {}.type is \"{}\"; moetrain implements the normalizers NFC, NFD, NFKC, NFKD, Lowercase, Strip, "
             "Replace, Prepend and Sequence",
             file_, where, type);
  }
  steps_.push_back(std::move(step));
}

bool Normalizer::apply(std::string_view text, std::string& out) const {
  if (steps_.size() == 1) return apply_step(*steps_[0], text, out);
  // Each step reads what the last one that changed something wrote.
  std::string buf[2];
  std::string_view cur = text;
  int next = 0;
  bool changed = false;
  for (const auto& s : steps_) {
    if (apply_step(*s, cur, buf[next])) {
      cur = buf[next];
      next ^= 1;
      changed = true;
    }
  }
  if (changed) out.assign(cur);
  return changed;
}

bool Normalizer::apply_step(const Step& s, std::string_view in, std::string& out) const {
  switch (s.kind) {
    case Step::Kind::kUnicode: {
      // Checking costs less than normalizing a text that turns out to be normalized
      // already, as nearly all text is.
      if (is_normalized(*s.form, in)) return false;
      UErrorCode err = U_ZERO_ERROR;
      out.clear();
      out.reserve(in.size() + in.size() / 4 + 16);
      icu::StringByteSink<std::string> sink(&out);
      s.form->normalizeUTF8(0, piece_of(in), sink, nullptr, err);
      MT_CHECK(U_SUCCESS(err), "{}: the normalizer {} failed on a text of {} bytes: {}", file_, s.type, in.size(),
               u_errorName(err));
      return true;
    }
    case Step::Kind::kLowercase: {
      if (is_ascii(in)) {
        if (std::none_of(in.begin(), in.end(), [](char c) { return c >= 'A' && c <= 'Z'; })) return false;
        out.assign(in);
        for (char& c : out) c = (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c;
        return true;
      }
      // The library lowercases one character at a time (Rust's char::to_lowercase: the
      // full mapping, so U+0130 becomes "i" + U+0307, without context). ICU's root-locale
      // lowercasing is the same except for one context rule, Final_Sigma (a capital sigma
      // ending a word becomes U+03C2): so the text is lowercased by ICU between capital
      // sigmas, and each capital sigma becomes U+03C3 on its own.
      out.clear();
      out.reserve(in.size() + 16);
      size_t from = 0;
      while (true) {
        const size_t sigma = in.find("\xCE\xA3", from);  // U+03A3; CE is only ever a lead byte
        const std::string_view chunk = in.substr(from, sigma == std::string_view::npos ? sigma : sigma - from);
        if (!chunk.empty()) {
          UErrorCode err = U_ZERO_ERROR;
          icu::StringByteSink<std::string> sink(&out);
          icu::CaseMap::utf8ToLower("", 0, piece_of(chunk), sink, nullptr, err);  // "": the root locale
          MT_CHECK(U_SUCCESS(err), "{}: Lowercase failed on a text of {} bytes: {}", file_, chunk.size(),
                   u_errorName(err));
        }
        if (sigma == std::string_view::npos) break;
        out += "\xCF\x83";  // U+03C3
        from = sigma + 2;
      }
      return out != in;
    }
    case Step::Kind::kStrip: {
      // Rust's char::is_whitespace, as the library uses: Unicode's White_Space property.
      size_t a = 0, b = in.size();
      while (s.strip_left && a < b) {
        size_t k = a;
        if (!u_isUWhiteSpace(static_cast<UChar32>(utf8_next(in, k)))) break;
        a = k;
      }
      while (s.strip_right && b > a) {
        const size_t c = utf8_char_start_before(in, b);
        size_t k = c;
        if (!u_isUWhiteSpace(static_cast<UChar32>(utf8_next(in, k)))) break;
        b = c;
      }
      if (a == 0 && b == in.size()) return false;
      out.assign(in.substr(a, b - a));
      return true;
    }
    case Step::Kind::kReplace: {
      // Every match, leftmost first and not overlapping, becomes the content.
      thread_local RegexScratch rx;
      bool any = false;
      size_t pos = 0, done = 0;
      while (pos < in.size()) {
        size_t a = 0, b = 0;
        if (!s.pattern->find(in, pos, rx, a, b)) break;
        // A lookahead can match nothing where the pattern's minimum length said otherwise.
        MT_CHECK(b > a,
                 "{}: {}.pattern /{}/ matched the empty string at byte {} of a text, where the tokenizers "
                 "library's Replace fails; moetrain refuses such a pattern",
                 file_, s.where, s.pattern->pattern(), a);
        pos = b;
        if (!any) {
          out.clear();
          out.reserve(in.size() + 16);
          any = true;
        }
        out.append(in.substr(done, a - done));
        out += s.content;
        done = b;
      }
      if (!any) return false;
      out.append(in.substr(done));
      return true;
    }
    case Step::Kind::kPrepend:
      // As the library: only a text that is not empty gets the prefix.
      if (in.empty() || s.content.empty()) return false;
      out.assign(s.content);
      out.append(in);
      return true;
  }
  return false;
}

}  // namespace moetrain
