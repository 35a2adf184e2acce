// libFuzzer harness: a run config (TOML, every section and key, the model family's own keys
// and the cross-section checks) loaded as `moetrain train --config` loads it. Any input must
// end in a clear moetrain::Error or a config that prints back as TOML.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "engine/run_config.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moetrain::fuzz::input_file(data, size, ".toml");
  try {
    moetrain::RunConfig c = moetrain::RunConfig::load(path, {});
    (void)c.to_toml();
  } catch (const moetrain::Error&) {
  }
  return 0;
}
