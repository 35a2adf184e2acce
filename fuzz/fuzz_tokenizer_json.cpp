// libFuzzer harness: loading a Hugging Face tokenizer.json (BpeTokenizer, engine/data/
// bpe_tokenizer.h) from arbitrary bytes, then encoding and decoding a text that touches its
// regexes, added tokens and merges. Any input must end in a clear moetrain::Error or a
// tokenizer whose ids lie inside its vocabulary.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "engine/data/bpe_tokenizer.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moetrain::fuzz::input_file(data, size, "-tokenizer.json");
  try {
    moetrain::BpeTokenizer tok(path);
    const std::string text = "<|im_start|>user\nI'm caf\xc3\xa9 12 the  \xe4\xbd\xa0<think>!</think><|endoftext|>";
    const std::vector<int32_t> ids = tok.encode(text);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) std::abort();
    }
    (void)tok.decode(ids);
    if (tok.eos_id() < 0 || tok.eos_id() >= tok.vocab_size()) std::abort();
  } catch (const moetrain::Error&) {
  }
  return 0;
}
