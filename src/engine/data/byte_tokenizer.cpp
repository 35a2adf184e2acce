#include "engine/data/byte_tokenizer.h"

#include "core/error.h"
#include "core/rng.h"

namespace moetrain {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id == eos_id()) {
      out += '\n';
    } else {
      MT_CHECK(id >= 0 && id < 256, "ByteTokenizer::decode: token {} (at {}) is outside [0, {})", id, i,
               vocab_size());
      out += static_cast<char>(static_cast<unsigned char>(id));
    }
  }
  return out;
}

std::optional<int32_t> ByteTokenizer::token_to_id(std::string_view token) const {
  if (token.size() == 1) return static_cast<unsigned char>(token[0]);
  if (token == "<|endoftext|>") return kEos;
  return std::nullopt;
}

uint64_t ByteTokenizer::fingerprint() const { return hash_string("moetrain byte tokenizer, 257 ids"); }

}  // namespace moetrain
