// Normalizer: the "normalizer" of a Hugging Face tokenizer.json, applied to text before
// the pre-tokenizer as the `tokenizers` library applies it. Implemented: NFC, NFD, NFKC,
// NFKD (ICU's tables), Lowercase (Unicode, one character at a time), Strip (Unicode
// White_Space), Replace (a string, or a regex run by PCRE2 where the library runs
// Oniguruma), Prepend, and Sequence of these. Any other type, or an option that would
// change the output and is not implemented, is refused when the file is loaded, naming
// the file, the key path and the type: tokenizing differently without a word would be
// worse. docs/choices.md#tokenizers says what may differ from the library and why.
//
// Text that needs nothing is not copied: the Unicode forms skip ASCII (which all four
// leave alone) and ask ICU whether the non-ASCII stretches are normalized already before
// they normalize anything.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

class Normalizer {
 public:
  // `n` is the normalizer object of tokenizer.json `file` (JSON key path `where`). Throws
  // naming the file, the key path and the type for what is not implemented.
  Normalizer(const nlohmann::json& n, const std::string& file, const std::string& where = "normalizer");
  ~Normalizer();
  Normalizer(const Normalizer&) = delete;
  Normalizer& operator=(const Normalizer&) = delete;

  // True when it changes no text (an empty Sequence, as DeepSeek-V3 has).
  bool empty() const { return steps_.empty(); }

  // Normalizes `text` (valid UTF-8). Returns false when the text stays as it is (nothing
  // is written then); else true, with the normalized text in `out`. Thread-safe.
  bool apply(std::string_view text, std::string& out) const;

  // The steps in order, for logs: "NFC", "Replace + Prepend", ...
  const std::string& describe() const { return name_; }

 private:
  struct Step;
  void add(const nlohmann::json& n, const std::string& where);
  bool apply_step(const Step& s, std::string_view in, std::string& out) const;

  std::vector<std::unique_ptr<Step>> steps_;  // a Sequence, flattened
  std::string file_;
  std::string name_;
};

}  // namespace moetrain
