// Tokenizer: what the data pipeline needs from any tokenizer. Text to ids and back, the
// vocabulary size the model's embedding must cover, and the end-of-text id that separates
// documents. Implementations: ByteTokenizer (bytes, no files) and BpeTokenizer (a Hugging
// Face tokenizer.json); make_tokenizer() (tokenizer_factory.h) picks one from a config
// string. All methods are const and safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Never adds BOS/EOS: callers place EOS where documents end.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws naming the id and its position when an id is not in the vocabulary.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  // One more than the largest id: the rows an embedding needs.
  virtual int64_t vocab_size() const = 0;
  virtual int32_t eos_id() const = 0;
  // The id of a token given by its text (a special token such as "<|im_start|>", or a
  // vocabulary entry as the file spells it); nullopt when there is none.
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;

  // A short description for logs: kind, source, vocabulary size.
  virtual std::string describe() const = 0;
  // Identifies the vocabulary (a hash of the tokenizer file), so that token shards can be
  // checked against the tokenizer a run is configured with.
  virtual uint64_t fingerprint() const = 0;
};

}  // namespace moetrain
