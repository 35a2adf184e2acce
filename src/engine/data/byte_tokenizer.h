// ByteTokenizer: text to tokens one byte at a time. Ids 0..255 are the bytes; 256 is the
// end-of-text token (EOS) that follows every document. No vocabulary file, no merges:
// any byte string round-trips exactly.
#pragma once

#include "engine/data/tokenizer.h"

namespace moetrain {

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEos = 256;

  std::vector<int32_t> encode(std::string_view text) const override;
  // Bytes back to text; EOS is rendered as "\n". Throws on an id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const override;

  int32_t eos_id() const override { return kEos; }
  int64_t vocab_size() const override { return 257; }
  // A one-byte string is that byte; "<|endoftext|>" is EOS.
  std::optional<int32_t> token_to_id(std::string_view token) const override;
  std::string describe() const override { return "byte-level (257 tokens: 256 bytes + <|endoftext|>)"; }
  uint64_t fingerprint() const override;
};

}  // namespace moetrain
