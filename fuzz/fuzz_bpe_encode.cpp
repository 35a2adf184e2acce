// libFuzzer harness: byte-level BPE encoding of arbitrary bytes with a Qwen-shaped tokenizer
// (tests/engine/tiny_bpe.h: NFC, Qwen2's split regex, merges, special and normalized added
// tokens). Text that is not UTF-8 must be refused with a moetrain::Error; text that is must
// round-trip as the tokenizer promises: decode(encode(x)) is canonically equivalent to x (the
// same NFC form), and every id lies inside the vocabulary. Not byte-equal to NFC(x): special
// tokens are cut out of the raw text before each span between them is normalized on its own
// (as the library does), so a combining mark right after "<|im_start|>assistant" stays
// decomposed rather than composing with its 't'.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/data/bpe_tokenizer.h"
#include "engine/data/normalizer.h"
#include "engine/tiny_bpe.h"

using namespace moetrain;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string file = "/dev/shm/moetrain-fuzz-" + std::to_string(::getpid()) + "-bpe.json";
  static const BpeTokenizer tok(tiny_bpe::write(file, tiny_bpe::tokenizer_json()));
  static const int removed = std::remove(file.c_str());  // loaded: the file is not needed again
  (void)removed;
  static const Normalizer nfc(nlohmann::json{{"type", "NFC"}}, file);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const Error&) {
    return 0;  // not UTF-8: refused, naming the offset
  }
  for (int32_t id : ids) {
    if (id < 0 || id >= tok.vocab_size()) std::abort();
  }
  const auto nfc_of = [&](std::string_view s) {
    std::string out;
    if (!nfc.apply(s, out)) out = std::string(s);
    return out;
  };
  if (nfc_of(tok.decode(ids)) != nfc_of(text)) std::abort();
  return 0;
}
