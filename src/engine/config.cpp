#include "engine/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <toml++/toml.h>

#include "core/error.h"

namespace moetrain {
namespace {

// ---- Type names and value formatting ----------------------------------------------------

const char* expected_name(const ConfigFields::Target& t) {
  struct V {
    const char* operator()(int64_t*) const { return "an integer"; }
    const char* operator()(double*) const { return "a number"; }
    const char* operator()(bool*) const { return "a boolean (true or false)"; }
    const char* operator()(std::string*) const { return "a string"; }
    const char* operator()(std::vector<int64_t>*) const { return "a list of integers"; }
    const char* operator()(std::vector<std::string>*) const { return "a list of strings"; }
  };
  return std::visit(V{}, t);
}

const char* toml_type_name(toml::node_type t) {
  switch (t) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

// A double as TOML: shortest round-trip digits, always with a '.' or exponent.
std::string format_double(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          out += fmt::format("\\u{:04X}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string format_value(const ConfigFields::Target& t) {
  struct V {
    std::string operator()(int64_t* p) const { return fmt::format("{}", *p); }
    std::string operator()(double* p) const { return format_double(*p); }
    std::string operator()(bool* p) const { return *p ? "true" : "false"; }
    std::string operator()(std::string* p) const { return quote(*p); }
    std::string operator()(std::vector<int64_t>* p) const { return fmt::format("[{}]", fmt::join(*p, ", ")); }
    std::string operator()(std::vector<std::string>* p) const {
      std::vector<std::string> q;
      for (const auto& s : *p) q.push_back(quote(s));
      return fmt::format("[{}]", fmt::join(q, ", "));
    }
  };
  return std::visit(V{}, t);
}

// ---- Parsing command-line text ------------------------------------------------------------

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string unquote(const std::string& s) {
  if (s.size() >= 2 && (s.front() == '"' || s.front() == '\'') && s.back() == s.front()) {
    return s.substr(1, s.size() - 2);
  }
  return s;
}

bool parse_int(const std::string& text, int64_t* out) {
  std::string s;
  for (char c : text) {
    if (c != '_') s += c;  // TOML allows 1_000_000
  }
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+') ++b;
  if (b == e) return false;
  auto [ptr, ec] = std::from_chars(b, e, *out);
  return ec == std::errc() && ptr == e;
}

bool parse_double(const std::string& text, double* out) {
  std::string s;
  for (char c : text) {
    if (c != '_') s += c;
  }
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  *out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && errno != ERANGE;
}

// "[a, 'b,c', d]" or "a,b" -> items; quotes protect commas.
std::vector<std::string> split_list(const std::string& text) {
  std::string s = trim(text);
  if (s.size() >= 2 && s.front() == '[' && s.back() == ']') s = trim(std::string_view(s).substr(1, s.size() - 2));
  std::vector<std::string> items;
  if (s.empty()) return items;
  std::string cur;
  char in_quote = 0;
  for (char c : s) {
    if (in_quote) {
      if (c == in_quote) in_quote = 0;
      cur += c;
    } else if (c == '"' || c == '\'') {
      in_quote = c;
      cur += c;
    } else if (c == ',') {
      items.push_back(trim(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  items.push_back(trim(cur));
  // A trailing comma ("[1, 2,]") leaves one empty item at the end; TOML allows it.
  if (items.size() > 1 && items.back().empty()) items.pop_back();
  return items;
}

std::string double_str(double v) { return fmt::format("{}", v); }

// "file:line:col" when the node knows where it came from.
std::string where(const std::string& origin, const toml::source_region& src) {
  if (src.begin.line == 0) return origin;
  return fmt::format("{}:{}:{}", origin, src.begin.line, src.begin.column);
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                                          std::tolower(static_cast<unsigned char>(b[j - 1]))
                                      ? 0
                                      : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

std::optional<std::string> closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  const size_t threshold = std::max<size_t>(2, word.size() / 3);
  std::optional<std::string> best;
  size_t best_d = threshold + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

const ConfigFields::Field* ConfigFields::find(const std::string& key) const {
  for (const auto& f : fields_) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

namespace {

[[noreturn]] void throw_unknown_key(const std::string& at, const std::string& section, const std::string& key,
                                   const std::vector<ConfigFields::Field>& fields) {
  std::vector<std::string> keys;
  for (const auto& f : fields) keys.push_back(f.key);
  if (auto m = closest_match(key, keys)) {
    MT_THROW("{}: unknown key [{}].{} (did you mean '{}'?)", at, section, key, *m);
  }
  MT_THROW("{}: unknown key [{}].{} (known keys: {})", at, section, key, fmt::join(keys, ", "));
}

}  // namespace

void ConfigFields::load(const toml::table& table, const std::string& origin) const {
  for (auto&& [k, node] : table) {
    const std::string key(k.str());
    const Field* f = find(key);
    if (f == nullptr) throw_unknown_key(where(origin, k.source()), section_, key, fields_);
    const std::string at = where(origin, node.source());
    auto type_error = [&](const char* got) {
      MT_THROW("{}: [{}].{} expects {}, got {}", at, section_, key, expected_name(f->target), got);
    };
    const char* got = toml_type_name(node.type());
    struct Loader {
      const toml::node& node;
      const std::function<void(const char*)>& fail;
      const char* got;
      void operator()(int64_t* p) const {
        if (!node.is_integer()) fail(got);
        *p = node.as_integer()->get();
      }
      void operator()(double* p) const {
        if (node.is_integer()) {
          *p = static_cast<double>(node.as_integer()->get());
        } else if (node.is_floating_point()) {
          *p = node.as_floating_point()->get();
        } else {
          fail(got);
        }
      }
      void operator()(bool* p) const {
        if (!node.is_boolean()) fail(got);
        *p = node.as_boolean()->get();
      }
      void operator()(std::string* p) const {
        // A key of a few named values may take true/false among them (shard_weights = true).
        if (node.is_boolean()) {
          *p = node.as_boolean()->get() ? "true" : "false";
          return;
        }
        if (!node.is_string()) fail(got);
        *p = node.as_string()->get();
      }
      void operator()(std::vector<int64_t>* p) const {
        std::vector<int64_t> out;
        if (node.is_integer()) {
          out.push_back(node.as_integer()->get());  // a single value is a one-item list
        } else if (const toml::array* arr = node.as_array()) {
          for (const auto& item : *arr) {
            if (!item.is_integer()) fail(fmt::format("a list holding a {}", toml_type_name(item.type())).c_str());
            out.push_back(item.as_integer()->get());
          }
        } else {
          fail(got);
        }
        *p = std::move(out);
      }
      void operator()(std::vector<std::string>* p) const {
        std::vector<std::string> out;
        if (node.is_string()) {
          out.push_back(node.as_string()->get());
        } else if (const toml::array* arr = node.as_array()) {
          for (const auto& item : *arr) {
            if (!item.is_string()) fail(fmt::format("a list holding a {}", toml_type_name(item.type())).c_str());
            out.push_back(item.as_string()->get());
          }
        } else {
          fail(got);
        }
        *p = std::move(out);
      }
    };
    std::function<void(const char*)> fail = type_error;
    std::visit(Loader{node, fail, got}, f->target);
  }
}

void ConfigFields::set_from_string(const std::string& key, const std::string& text, const std::string& origin) const {
  const Field* f = find(key);
  if (f == nullptr) throw_unknown_key(origin, section_, key, fields_);
  auto fail = [&]() {
    MT_THROW("{}: [{}].{} expects {}, got '{}'", origin, section_, key, expected_name(f->target), text);
  };
  const std::string t = trim(text);
  struct Setter {
    const std::string& t;
    const std::function<void()>& fail;
    void operator()(int64_t* p) const {
      int64_t v = 0;
      if (!parse_int(t, &v)) fail();
      *p = v;
    }
    void operator()(double* p) const {
      double v = 0;
      if (!parse_double(t, &v)) fail();
      *p = v;
    }
    void operator()(bool* p) const {
      if (t == "true") {
        *p = true;
      } else if (t == "false") {
        *p = false;
      } else {
        fail();
      }
    }
    void operator()(std::string* p) const { *p = unquote(t); }
    void operator()(std::vector<int64_t>* p) const {
      std::vector<int64_t> out;
      for (const auto& item : split_list(t)) {
        int64_t v = 0;
        if (!parse_int(item, &v)) fail();
        out.push_back(v);
      }
      *p = std::move(out);
    }
    void operator()(std::vector<std::string>* p) const {
      std::vector<std::string> out;
      for (const auto& item : split_list(t)) out.push_back(unquote(item));
      *p = std::move(out);
    }
  };
  std::function<void()> fail_fn = fail;
  std::visit(Setter{t, fail_fn}, f->target);
}

void ConfigFields::validate(const std::string& origin) const {
  for (const auto& f : fields_) {
    if (!f.check) continue;
    if (auto err = f.check()) MT_THROW("{}: [{}].{} {}", origin, section_, f.key, *err);
  }
}

std::string ConfigFields::to_toml() const {
  std::string out;
  for (const auto& f : fields_) out += fmt::format("{} = {}\n", f.key, format_value(f.target));
  return out;
}

// ---- Checks ---------------------------------------------------------------------------------

ConfigFields::Check positive(const int64_t* v) {
  return [v]() -> std::optional<std::string> {
    if (*v > 0) return std::nullopt;
    return fmt::format("must be > 0, got {}", *v);
  };
}

ConfigFields::Check positive(const double* v) {
  return [v]() -> std::optional<std::string> {
    if (*v > 0) return std::nullopt;  // NaN fails too
    return fmt::format("must be > 0, got {}", double_str(*v));
  };
}

ConfigFields::Check non_negative(const int64_t* v) {
  return [v]() -> std::optional<std::string> {
    if (*v >= 0) return std::nullopt;
    return fmt::format("must be >= 0, got {}", *v);
  };
}

ConfigFields::Check non_negative(const double* v) {
  return [v]() -> std::optional<std::string> {
    if (*v >= 0) return std::nullopt;
    return fmt::format("must be >= 0, got {}", double_str(*v));
  };
}

ConfigFields::Check in_range(const int64_t* v, int64_t lo, int64_t hi) {
  return [v, lo, hi]() -> std::optional<std::string> {
    if (*v >= lo && *v <= hi) return std::nullopt;
    return fmt::format("must be in [{}, {}], got {}", lo, hi, *v);
  };
}

ConfigFields::Check in_range(const double* v, double lo, double hi) {
  return [v, lo, hi]() -> std::optional<std::string> {
    if (*v >= lo && *v <= hi) return std::nullopt;
    return fmt::format("must be in [{}, {}], got {}", double_str(lo), double_str(hi), double_str(*v));
  };
}

ConfigFields::Check one_of(const std::string* v, std::vector<std::string> allowed) {
  return [v, allowed = std::move(allowed)]() -> std::optional<std::string> {
    if (std::find(allowed.begin(), allowed.end(), *v) != allowed.end()) return std::nullopt;
    std::string msg = fmt::format("must be one of {}, got '{}'", fmt::join(allowed, ", "), *v);
    if (auto m = closest_match(*v, allowed)) msg += fmt::format(" (did you mean '{}'?)", *m);
    return msg;
  };
}

}  // namespace moetrain
