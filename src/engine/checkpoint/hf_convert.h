// Conversion between Hugging Face model folders (every family moetrain builds) and moetrain checkpoints.
//
// Names are the same on both sides (moetrain's canonical names are HF's), so conversion is
// a copy of each tensor under its name, with a dtype change only when asked. Import also
// accepts the fused expert layout of newer transformers versions
// (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) and splits it into
// the per-expert tensors of the Hub format (mlp.experts.<e>.{gate,up,down}_proj.weight);
// export always writes the Hub format. The original config.json travels inside the
// checkpoint, so HF -> moetrain -> HF gives back the same tensors, bit for bit, and the
// same config. Export can also write DeepSeek's FP8 format (HfExportOptions::fp8), which
// import reads back, dequantized to bf16 (docs/fp8.md, "FP8 export").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/dtype.h"
#include "core/tensor.h"

namespace moetrain {

// Writes a moetrain checkpoint (weights only, step 0) of the HF folder `hf_dir` into
// `out_dir`, which must not exist. Tensors are written straight from the mapped HF files.
void import_hf(const std::string& hf_dir, const std::string& out_dir);

struct HfExportOptions {
  std::optional<DType> dtype;             // cast every tensor; default: as stored
  uint64_t max_shard_bytes = 5ull << 30;  // per safetensors file, as save_pretrained does
  // DeepSeek's fine-grained FP8 format (DeepSeek-V3's and Qwen3's FP8 releases; transformers'
  // quant_method "fp8"): each linear weight of the decoder layers (is_fp8_export_weight) as
  // F8_E4M3 codes with `<name>_scale_inv` (f32, one per 128 x 128 block: W ~= q * scale_inv),
  // quantized by ops::quantize_fp8; every other tensor bf16; config.json gains
  // quantization_config. dtype, when given, must be bf16.
  bool fp8 = false;
};
// Writes the model tensors of a moetrain checkpoint (a step directory, or a checkpoint
// folder with a `latest` pointer) as an HF folder: config.json, model.safetensors or
// model-0000i-of-0000n.safetensors + model.safetensors.index.json. `out_dir` must not exist.
void export_hf(const std::string& ckpt_dir, const std::string& out_dir, const HfExportOptions& options);

// Whether the FP8 export quantizes the tensor `name` of shape `shape`: a matrix named
// model.layers.<N>.{self_attn,mlp}.<...>_proj.weight or ...self_attn.kv_a_proj_with_mqa.weight
// (attention's projections, MLA's included; the dense MLP; routed and shared experts), in every
// decoder layer, a multi-token prediction module's too. Not the embeddings, the head, the
// norms, the routers (mlp.gate), the routing bias, nor an MTP module's own eh_proj and
// shared_head.
bool is_fp8_export_weight(const std::string& name, const Shape& shape);

// A step directory for `dir`: dir itself when it holds index.json, else the step its
// `latest` file names. Throws naming dir otherwise.
std::string resolve_step_dir(const std::string& dir);

}  // namespace moetrain
