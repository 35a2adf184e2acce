// Declarative configuration: each subsystem's *Config lists its keys once in a
// describe(ConfigFields&) method; that one table loads the TOML section, applies
// `--section.key=value` overrides, checks each value and prints the config back.
//
// Unknown keys, wrong types and out-of-range values are errors that name the file,
// section and key (and suggest the closest known key for a misspelling).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace toml {
inline namespace v3 {
class table;
}
}  // namespace toml

namespace moetrain {

class ConfigFields {
 public:
  using Target = std::variant<int64_t*, double*, bool*, std::string*, std::vector<int64_t>*,
                              std::vector<std::string>*>;
  // Returns an error text ("must be > 0") or nullopt when the value is fine.
  using Check = std::function<std::optional<std::string>()>;

  struct Field {
    std::string key;
    Target target;
    std::string help;
    Check check;
  };

  explicit ConfigFields(std::string section) : section_(std::move(section)) {}

  template <typename T>
  void add(std::string key, T* target, std::string help, Check check = {}) {
    fields_.push_back({std::move(key), Target(target), std::move(help), std::move(check)});
  }

  const std::string& section() const { return section_; }
  const std::vector<Field>& fields() const { return fields_; }
  const Field* find(const std::string& key) const;

  // Reads every key of `table` into its target. `origin` names the file for errors.
  void load(const toml::table& table, const std::string& origin) const;
  // Sets one key from its command-line text ("100", "3e-4", "true", "[1, 2]", "a,b").
  void set_from_string(const std::string& key, const std::string& text, const std::string& origin) const;
  // Runs every field's check; the first failure throws naming section.key.
  void validate(const std::string& origin) const;
  // "key = value" lines, TOML syntax.
  std::string to_toml() const;

 private:
  std::string section_;
  std::vector<Field> fields_;
};

// Common checks, for describe() methods.
ConfigFields::Check positive(const int64_t* v);
ConfigFields::Check positive(const double* v);
ConfigFields::Check non_negative(const int64_t* v);
ConfigFields::Check non_negative(const double* v);
ConfigFields::Check in_range(const double* v, double lo, double hi);  // lo <= v <= hi
ConfigFields::Check in_range(const int64_t* v, int64_t lo, int64_t hi);  // lo <= v <= hi
ConfigFields::Check one_of(const std::string* v, std::vector<std::string> allowed);

// The closest of `candidates` to `word` by edit distance, when close enough to be a typo.
std::optional<std::string> closest_match(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace moetrain
