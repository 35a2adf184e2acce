// ByteTokenizer: text to tokens one byte at a time. Ids 0..255 are the bytes; 256 is the
// end-of-text token (EOS) that follows every document. No vocabulary file, no merges:
// any byte string round-trips exactly.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

class ByteTokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const;
  // Bytes back to text; EOS is rendered as "\n". Throws on an id outside [0, vocab_size()).
  std::string decode(std::span<const int32_t> ids) const;

  static constexpr int32_t eos_id() { return 256; }
  static constexpr int64_t vocab_size() { return 257; }
};

}  // namespace moetrain
