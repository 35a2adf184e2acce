// BpeTokenizer: a Hugging Face tokenizer.json whose model is a byte-level BPE (Qwen2 and
// Qwen3, Llama 3, DeepSeek-V3, GPT-2 style), encoding exactly as the `tokenizers` library:
//
//   1. Added tokens with normalized = false are cut out of the text first, leftmost and
//      longest match first; each becomes its id and is never merged.
//   2. Each span between them goes through the normalizer (normalizer.h: NFC for Qwen,
//      ICU's tables), then the added tokens with normalized = true are cut out of it.
//   3. Every other span goes through the pre-tokenizer: its Split regexes in order (PCRE2
//      with UTF and Unicode properties, JIT-compiled where the library has a JIT), then
//      ByteLevel (GPT-2's regex when use_regex is set).
//   4. Each piece's bytes become byte-level symbols, and adjacent pairs are merged by rank,
//      lowest first (leftmost among equal ranks), until no pair has a merge.
//
// Decoding maps tokens back through the byte-level table; added tokens decode to their
// content. What the library does that this class does not (other normalizers,
// pre-tokenizers and decoders, BPE dropout, other models; see docs/choices.md) is refused
// when the file is loaded, naming the file, the key and the type. The post-processor is
// not applied: encode adds no special tokens.
//
// The merges of each distinct piece are cached per thread, so that the regex split is most
// of the cost of encoding.
#pragma once

#include <memory>

#include "engine/data/tokenizer.h"

namespace moetrain {

class BpeTokenizer final : public Tokenizer {
 public:
  // `path` is a tokenizer.json. `eos_token` names the end-of-text token; when empty, it is
  // "<|endoftext|>" if the vocabulary has that token, else the eos_token of a
  // tokenizer_config.json beside the file. Throws naming the file and key for a missing
  // or malformed file, an unsupported component, or no end-of-text token.
  explicit BpeTokenizer(const std::string& path, const std::string& eos_token = "");
  ~BpeTokenizer() override;
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // Throws when `text` is not well-formed UTF-8, naming the byte offset.
  std::vector<int32_t> encode(std::string_view text) const override;
  // The bytes of the tokens, concatenated (not necessarily UTF-8 when the ids cut a
  // character in two).
  std::string decode(std::span<const int32_t> ids) const override;

  int64_t vocab_size() const override;
  int32_t eos_id() const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::string describe() const override;
  uint64_t fingerprint() const override;

  // The pieces the merges run on, added tokens included as pieces of their own: what
  // steps 1 to 3 above make of `text` (normalized). For tests and for looking into a
  // tokenization.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

  const std::string& path() const;
  const std::string& eos_token() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moetrain
