// Conversion between Hugging Face model folders (every family moetrain builds) and moetrain checkpoints.
//
// Names are the same on both sides (moetrain's canonical names are HF's), so conversion is
// a copy of each tensor under its name, with a dtype change only when asked. Import also
// accepts the fused expert layout of newer transformers versions
// (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) and splits it into
// the per-expert tensors of the Hub format (mlp.experts.<e>.{gate,up,down}_proj.weight);
// export always writes the Hub format. The original config.json travels inside the
// checkpoint, so HF -> moetrain -> HF gives back the same tensors, bit for bit, and the
// same config.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/dtype.h"

namespace moetrain {

// Writes a moetrain checkpoint (weights only, step 0) of the HF folder `hf_dir` into
// `out_dir`, which must not exist. Tensors are written straight from the mapped HF files.
void import_hf(const std::string& hf_dir, const std::string& out_dir);

struct HfExportOptions {
  std::optional<DType> dtype;             // cast every tensor; default: as stored
  uint64_t max_shard_bytes = 5ull << 30;  // per safetensors file, as save_pretrained does
};
// Writes the model tensors of a moetrain checkpoint (a step directory, or a checkpoint
// folder with a `latest` pointer) as an HF folder: config.json, model.safetensors or
// model-0000i-of-0000n.safetensors + model.safetensors.index.json. `out_dir` must not exist.
void export_hf(const std::string& ckpt_dir, const std::string& out_dir, const HfExportOptions& options);

// A step directory for `dir`: dir itself when it holds index.json, else the step its
// `latest` file names. Throws naming dir otherwise.
std::string resolve_step_dir(const std::string& dir);

}  // namespace moetrain
