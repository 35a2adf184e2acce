// libFuzzer harness: the safetensors reader (engine/checkpoint/safetensors.h) on arbitrary
// bytes. Any input must end in a clear moetrain::Error or a file whose every tensor reads
// back within its bounds; a crash, a sanitizer report or a read past the mapping is a bug.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "engine/checkpoint/safetensors.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moetrain::fuzz::input_file(data, size, ".safetensors");
  try {
    moetrain::SafetensorsFile f(path);
    for (const moetrain::SafetensorsEntry& e : f.entries()) {
      if (e.end - e.begin > (64u << 20)) continue;  // a valid header may name large tensors: not read
      moetrain::Tensor t = f.read(e.name);
      if (t.nbytes() != e.end - e.begin) std::abort();
    }
    (void)f.checksum();
  } catch (const moetrain::Error&) {
  }
  return 0;
}
