// libFuzzer harness: reading a Hugging Face config.json as each model family does
// (ModelConfig::load_hf_json, engine/models/hf_config.h), then validating the shape. Any input
// must end in a clear moetrain::Error or a config that validates.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "engine/models/model_config.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = moetrain::fuzz::input_file(data, size, "-config.json");
  try {
    std::unique_ptr<moetrain::ModelConfig> c = moetrain::make_model_config("qwen3_moe", "fuzz");
    c->load_hf_json(path);
    c->validate("fuzz");
    (void)c->to_hf_json();
  } catch (const moetrain::Error&) {
  }
  return 0;
}
