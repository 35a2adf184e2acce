#include "engine/checkpoint/hf_convert.h"

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <map>
#include <regex>
#include <set>

#include "core/log.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/json_file.h"
#include "engine/models/model_config.h"
#include "ops/ops.h"
#include "ops/threads.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

void refuse_existing(const std::string& out_dir) {
  MT_CHECK(!fs::exists(out_dir), "'{}' already exists: conversion writes a new folder and never overwrites", out_dir);
}

// Writes into `<out>.tmp-convert`, then renames to `out`: a failed conversion leaves no
// half-written folder under the name a user would load.
template <typename Fn>
void write_then_rename(const std::string& out_dir, Fn&& write) {
  refuse_existing(out_dir);
  const fs::path tmp = fs::path(out_dir).string() + ".tmp-convert";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write(tmp);
  } catch (...) {
    fs::remove_all(tmp);
    throw;
  }
  fs::rename(tmp, out_dir);
}

// DeepSeek's FP8 checkpoints: each F8_E4M3 weight W [R, C] comes with W_scale_inv
// [ceil(R/br), ceil(C/bc)] (f32 or bf16) for blocks of br x bc (config.json's
// quantization_config.weight_block_size, default 128 x 128), and the weight is
// W[i, j] * scale_inv[i / br, j / bc] (DeepSeek's weight_dequant; the "inverse" names the
// quantizer's side), rounded once to bf16.
class Fp8Weights {
 public:
  Fp8Weights(const std::vector<std::unique_ptr<SafetensorsFile>>& files, const nlohmann::json& config,
             const std::string& config_path) {
    if (config.contains("quantization_config") && config["quantization_config"].contains("weight_block_size")) {
      const auto& b = config["quantization_config"]["weight_block_size"];
      MT_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_unsigned() && b[1].is_number_unsigned() &&
                   b[0].get<int64_t>() > 0 && b[1].get<int64_t>() > 0,
               "{}: quantization_config.weight_block_size must be [rows, cols] of positive integers, got {}",
               config_path, b.dump());
      br_ = b[0].get<int64_t>();
      bc_ = b[1].get<int64_t>();
    }
    for (const auto& f : files) {
      for (const SafetensorsEntry& e : f->entries()) {
        if (e.f8_e4m3) weights_.insert(e.name);
        if (e.name.ends_with("_scale_inv")) scales_[e.name] = {f.get(), &e};
      }
    }
    for (const auto& [name, where] : scales_) {
      const std::string weight = name.substr(0, name.size() - std::string("_scale_inv").size());
      MT_CHECK(weights_.count(weight), "{}: '{}' scales no F8_E4M3 tensor '{}'", where.first->path(), name, weight);
    }
  }
  bool is_scale(const std::string& name) const { return scales_.count(name) > 0; }
  size_t count() const { return weights_.size(); }
  int64_t block_rows() const { return br_; }
  int64_t block_cols() const { return bc_; }

  TensorSlice dequantized(const SafetensorsFile& f, const SafetensorsEntry& e) const {
    auto it = scales_.find(e.name + "_scale_inv");
    MT_CHECK(it != scales_.end(), "{}: F8_E4M3 tensor '{}' has no '{}_scale_inv' to dequantize it with", f.path(),
             e.name, e.name);
    MT_CHECK(e.shape.size() == 2, "{}: F8_E4M3 tensor '{}' has shape {}, expected a matrix", f.path(), e.name,
             shape_str(e.shape));
    const int64_t R = e.shape[0], C = e.shape[1];
    const Shape want{(R + br_ - 1) / br_, (C + bc_ - 1) / bc_};
    const SafetensorsEntry& se = *it->second.second;
    MT_CHECK(!se.f8_e4m3 && se.shape == want, "{}: '{}' has shape {}, expected {} (blocks of {} x {} over {})",
             it->second.first->path(), se.name, shape_str(se.shape), shape_str(want), br_, bc_, shape_str(e.shape));
    const Tensor scale = it->second.first->read(se.name).to(DType::F32);
    const float* s = scale.data<float>();
    const auto* w = static_cast<const uint8_t*>(f.data(e));
    float decode[256];
    for (int b = 0; b < 256; ++b) decode[b] = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    Tensor out = Tensor::empty({R, C}, DType::BF16);
    bf16* y = out.data<bf16>();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t j = 0; j < C; ++j) {
        y[i * C + j] = bf16(decode[w[i * C + j]] * s[(i / br_) * want[1] + j / bc_]);
      }
    }
    return whole_slice(e.name, std::move(out));
  }

 private:
  int64_t br_ = 128, bc_ = 128;
  std::set<std::string> weights_;
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsEntry*>> scales_;
};

// ---- FP8 export (docs/fp8.md, "FP8 export") ----

constexpr int64_t kFp8ExportBlock = 128;  // ops::quantize_fp8's blocks: weight_block_size [128, 128]
int64_t blocks_of(int64_t n) { return (n + kFp8ExportBlock - 1) / kFp8ExportBlock; }

// A weight as DeepSeek's FP8 checkpoints hold it: codes [R, C] and scale_inv
// [ceil(R/128), ceil(C/128)], W ~= q * scale_inv blockwise: ops::quantize_fp8's blocks mode
// (scale = amax / 448, 1 for an all-zero block; q = e4m3(x / scale), nearest even,
// saturating), with its scales' padding columns (cuBLASLt's layout) cut off.
struct Fp8ExportWeight {
  Tensor q, scale_inv;
};
Fp8ExportWeight quantize_for_export(const Tensor& w) {
  ops::Fp8Tensor t = ops::quantize_fp8(w, ops::Fp8Blocks::kBlocks);
  return {std::move(t.q), t.scale.columns(0, blocks_of(w.size(1)))};
}

// The module names config.json's quantization_config.modules_to_not_convert lists: "lm_head"
// and every other matrix that stays bf16 but for the embeddings (the routers mlp.gate, an MTP
// module's eh_proj and shared_head.head), in layer order.
std::vector<std::string> fp8_modules_not_converted(const std::vector<std::pair<std::string, Shape>>& kept) {
  static const std::regex layer_re(R"(model\.layers\.(\d+)\..*)");
  auto layer_of = [](const std::string& n) {
    std::smatch m;
    return std::regex_match(n, m, layer_re) ? std::stoll(m[1].str()) : int64_t{-1};
  };
  std::vector<std::string> modules{"lm_head"};
  for (const auto& [name, shape] : kept) {
    if (shape.size() != 2 || !name.ends_with(".weight") || name.find("embed_tokens") != std::string::npos) continue;
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (std::find(modules.begin(), modules.end(), module) == modules.end()) modules.push_back(module);
  }
  std::stable_sort(modules.begin(), modules.end(), [&](const std::string& a, const std::string& b) {
    return std::make_pair(layer_of(a), a) < std::make_pair(layer_of(b), b);
  });
  return modules;
}

}  // namespace

bool is_fp8_export_weight(const std::string& name, const Shape& shape) {
  static const std::regex linear(
      R"(model\.layers\.\d+\.(self_attn|mlp)\.(.+\.)?([A-Za-z0-9_]+_proj|kv_a_proj_with_mqa)\.weight)");
  return shape.size() == 2 && std::regex_match(name, linear);
}

std::string resolve_step_dir(const std::string& dir) {
  if (is_checkpoint_dir(dir)) return dir;
  const fs::path latest = fs::path(dir) / "latest";
  if (fs::exists(latest)) {
    std::ifstream f(latest);
    std::string name;
    std::getline(f, name);
    const fs::path step = fs::path(dir) / name;
    MT_CHECK(!name.empty() && is_checkpoint_dir(step.string()), "{}: names '{}', which is not a committed checkpoint",
             latest.string(), name);
    return step.string();
  }
  MT_THROW("'{}' is not a moetrain checkpoint (no index.json, no latest pointer)", dir);
}

void import_hf(const std::string& hf_dir, const std::string& out_dir) {
  const fs::path config_path = fs::path(hf_dir) / "config.json";
  MT_CHECK(fs::exists(config_path), "'{}' has no config.json: not a Hugging Face model folder", hf_dir);
  std::unique_ptr<ModelConfig> shape = make_model_config(hf_model_type(config_path.string()), config_path.string());
  shape->load_hf_json(config_path.string());  // refuses architectures moetrain cannot train
  const nlohmann::json hf_config = read_json_file(config_path);

  std::vector<std::string> files;
  const fs::path index_path = fs::path(hf_dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    const nlohmann::json index = read_json_file(index_path);
    MT_CHECK(index.contains("weight_map") && index["weight_map"].is_object(), "{}: no weight_map object",
             index_path.string());
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      const std::string f = it.value().get<std::string>();
      if (std::find(files.begin(), files.end(), f) == files.end()) files.push_back(f);
    }
  } else {
    MT_CHECK(fs::exists(fs::path(hf_dir) / "model.safetensors"),
             "'{}' has neither model.safetensors nor model.safetensors.index.json", hf_dir);
    files.push_back("model.safetensors");
  }

  std::vector<std::unique_ptr<SafetensorsFile>> open;
  for (const std::string& f : files) open.push_back(std::make_unique<SafetensorsFile>((fs::path(hf_dir) / f).string()));
  const Fp8Weights fp8(open, hf_config, config_path.string());
  // One source file's tensors as one rank file of the checkpoint, in turn: an FP8 folder's
  // dequantized weights are held one file at a time (DeepSeek-V3's are ~1.3 TB in bf16).
  const std::regex fused(R"((model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(\.weight)?)");
  auto slices_of = [&](const SafetensorsFile& sf) {
    std::vector<TensorSlice> slices;
    for (const SafetensorsEntry& e : sf.entries()) {
      if (fp8.is_scale(e.name)) continue;  // used by its weight's dequantization
      if (e.f8_e4m3) {
        slices.push_back(fp8.dequantized(sf, e));
        continue;
      }
      const auto* bytes = static_cast<const uint8_t*>(sf.data(e));
      std::smatch m;
      if (!std::regex_match(e.name, m, fused)) {
        slices.push_back(whole_slice(e.name, e.dtype, e.shape, bytes));
        continue;
      }
      // Fused experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
      MT_CHECK(e.shape.size() == 3, "{}: fused expert tensor '{}' has shape {}, expected 3 dims", sf.path(), e.name,
               shape_str(e.shape));
      const int64_t E = e.shape[0];
      const size_t per_expert = static_cast<size_t>(e.shape[1] * e.shape[2]) * dtype_size(e.dtype);
      for (int64_t x = 0; x < E; ++x) {
        const std::string base = fmt::format("{}.{}", m[1].str(), x);
        const uint8_t* p = bytes + per_expert * static_cast<size_t>(x);
        if (m[2] == "down_proj") {
          slices.push_back(whole_slice(base + ".down_proj.weight", e.dtype, {e.shape[1], e.shape[2]}, p));
        } else {
          MT_CHECK(e.shape[1] % 2 == 0, "{}: '{}' has an odd row count {} (gate and up halves expected)", sf.path(),
                   e.name, e.shape[1]);
          const int64_t I = e.shape[1] / 2;
          slices.push_back(whole_slice(base + ".gate_proj.weight", e.dtype, {I, e.shape[2]}, p));
          slices.push_back(whole_slice(base + ".up_proj.weight", e.dtype, {I, e.shape[2]}, p + per_expert / 2));
        }
      }
    }
    return slices;
  };
  nlohmann::json state;
  state["step"] = 0;
  state["source"] = fs::absolute(hf_dir).string();
  state["moetrain_version"] = MOETRAIN_VERSION;
  state["hf_config"] = hf_config;
  if (fp8.count() > 0) {  // the weights are bf16 now: the config must not say FP8
    state["hf_config"].erase("quantization_config");
    spdlog::info("convert: {} FP8 (F8_E4M3) weights dequantized to bf16 with their weight_scale_inv blocks of {} x {}",
                 fp8.count(), fp8.block_rows(), fp8.block_cols());
  }
  size_t tensors = 0;
  write_then_rename(out_dir, [&](const fs::path& tmp) {
    for (size_t i = 0; i < open.size(); ++i) {
      const std::vector<TensorSlice> slices = slices_of(*open[i]);
      write_rank_files(tmp.string(), static_cast<int>(i), slices, {});
      tensors += slices.size();
    }
    write_index(tmp.string(), static_cast<int>(open.size()), state);
  });
  spdlog::info("convert: {} tensors from {} into {}", tensors, hf_dir, out_dir);
}

void export_hf(const std::string& ckpt_in, const std::string& out_dir, const HfExportOptions& opt) {
  if (opt.fp8) {
    MT_CHECK(!is_hf_model_dir(ckpt_in),
             "convert --fp8: '{}' is a Hugging Face folder; --fp8 exports a moetrain checkpoint in DeepSeek's FP8 "
             "format, while an HF folder is imported as it is (an FP8 one dequantized to bf16): leave --fp8 out",
             ckpt_in);
    MT_CHECK(!opt.dtype || *opt.dtype == DType::BF16,
             "convert --fp8: the tensors it does not quantize are written as bf16 (DeepSeek's FP8 format), so "
             "--dtype must be bf16 or left out, got {}",
             dtype_name(*opt.dtype));
  }
  const std::string ckpt = resolve_step_dir(ckpt_in);
  CheckpointReader reader(ckpt);
  nlohmann::json config;
  if (fs::exists(fs::path(ckpt) / "config.json")) {
    config = read_json_file(fs::path(ckpt) / "config.json");
  } else {
    MT_CHECK(reader.trainer_state().contains("hf_config"),
             "checkpoint {} has neither config.json nor hf_config in trainer_state.json", ckpt);
    config = reader.trainer_state()["hf_config"];
  }
  // The dtype of the tensors written as they are: --dtype's, bf16 under --fp8 (but the routing
  // biases, f32 in DeepSeek's FP8 release as in moetrain), else as stored.
  const std::optional<DType> cast = opt.fp8 ? std::optional<DType>(DType::BF16) : opt.dtype;
  auto cast_of = [&](const std::string& name) {
    return opt.fp8 && name.ends_with(".e_score_correction_bias") ? std::nullopt : cast;
  };
  // Qwen3MoeForCausalLM has no routing bias: a model balanced by one (router_bias_update_speed)
  // is exported without it and routes by its router's probabilities alone.
  const bool drops_routing_bias = config.value("model_type", "") == "qwen3_moe";
  int64_t dropped = 0;
  // Plan the shards: tensors in name order, a new file when the next would overflow. An FP8
  // weight counts its codes (a byte each) and its f32 scales, which go in the same file.
  std::set<std::string> quantized;
  std::vector<std::pair<std::string, Shape>> kept;  // written as they are (cast)
  std::vector<std::vector<std::string>> shards(1);
  std::vector<uint64_t> shard_bytes(1, 0);
  uint64_t total = 0;
  for (const std::string& name : reader.names()) {
    const auto& info = reader.info(name);
    if (info.kind != "model") continue;
    if (drops_routing_bias && name.ends_with(".mlp.gate.e_score_correction_bias")) {
      ++dropped;
      continue;
    }
    uint64_t bytes = 0;
    if (opt.fp8 && is_fp8_export_weight(name, info.shape)) {
      quantized.insert(name);
      bytes = static_cast<uint64_t>(shape_numel(info.shape)) +
              static_cast<uint64_t>(blocks_of(info.shape[0]) * blocks_of(info.shape[1])) * sizeof(float);
    } else {
      kept.emplace_back(name, info.shape);
      bytes = static_cast<uint64_t>(shape_numel(info.shape)) * dtype_size(cast_of(name).value_or(info.dtype));
    }
    if (!shards.back().empty() && shard_bytes.back() + bytes > opt.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes.push_back(0);
    }
    shards.back().push_back(name);
    shard_bytes.back() += bytes;
    total += bytes;
  }
  MT_CHECK(!shards.front().empty(), "checkpoint {} holds no model tensors", ckpt);
  if (cast) {
    const char* name = *cast == DType::BF16 ? "bfloat16" : *cast == DType::F32 ? "float32" : "float64";
    config["torch_dtype"] = name;
    if (config.contains("dtype")) config["dtype"] = name;  // transformers 5's spelling
  }
  if (opt.fp8) {
    // DeepSeek-V3's quantization_config; modules_to_not_convert as Qwen3's FP8 releases
    // write it: the matrices left in bf16 that transformers would otherwise make FP8 linears.
    config["quantization_config"] = {{"activation_scheme", "dynamic"},
                                     {"fmt", "e4m3"},
                                     {"quant_method", "fp8"},
                                     {"weight_block_size", {kFp8ExportBlock, kFp8ExportBlock}},
                                     {"modules_to_not_convert", fp8_modules_not_converted(kept)}};
  }
  write_then_rename(out_dir, [&](const fs::path& tmp) {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; ++i) {
      const std::string file =
          n == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
      std::vector<Tensor> held;  // alive until the shard is written
      SafetensorsWriter w;
      // A group of tensors at a time: read in turn, the FP8 weights among them quantized over
      // the CPU's threads (the quantizer takes one thread a tensor), the masters dropped
      // before the next group.
      const std::vector<std::string>& names = shards[i];
      const size_t group = opt.fp8 ? static_cast<size_t>(std::max(1, ops::cpu_threads())) : 1;
      for (size_t g = 0; g < names.size(); g += group) {
        const size_t m = std::min(group, names.size() - g);
        std::vector<Tensor> in(m);
        std::vector<Fp8ExportWeight> fp8(m);
        for (size_t k = 0; k < m; ++k) in[k] = reader.read_whole(names[g + k]);
        std::exception_ptr error;
#pragma omp parallel for schedule(dynamic)
        for (int64_t k = 0; k < static_cast<int64_t>(m); ++k) {
          if (quantized.count(names[g + k]) == 0) continue;
          try {
            fp8[k] = quantize_for_export(in[k]);
          } catch (...) {
#pragma omp critical(fp8_export_error)
            if (!error) error = std::current_exception();
          }
        }
        if (error) std::rethrow_exception(error);
        for (size_t k = 0; k < m; ++k) {
          const std::string& name = names[g + k];
          if (quantized.count(name)) {
            w.add(name, fp8[k].q);
            w.add(name + "_scale_inv", fp8[k].scale_inv);
            held.push_back(std::move(fp8[k].q));
            held.push_back(std::move(fp8[k].scale_inv));
            weight_map[name] = file;
            weight_map[name + "_scale_inv"] = file;
            continue;
          }
          Tensor t = std::move(in[k]);
          if (const std::optional<DType> c = cast_of(name); c && t.dtype() != *c) t = t.to(*c);
          w.add(name, t);
          held.push_back(std::move(t));
          weight_map[name] = file;
        }
      }
      w.set_metadata({{"format", "pt"}});
      w.write((tmp / file).string());
    }
    if (n > 1) {
      nlohmann::ordered_json index;
      index["metadata"] = {{"total_size", total}};
      index["weight_map"] = weight_map;
      std::ofstream(tmp / "model.safetensors.index.json") << index.dump(2) << "\n";
    }
    std::ofstream(tmp / "config.json") << config.dump(2) << "\n";
  });
  if (dropped > 0) {
    spdlog::warn("convert: {} routing biases (aux-loss-free balancing) left out: Hugging Face's Qwen3-MoE has no "
                 "such tensor, so the exported model picks its experts by the router's probabilities alone",
                 dropped);
  }
  size_t count = 0;
  for (const auto& s : shards) count += s.size();
  if (opt.fp8) {
    spdlog::info("convert: {} weights as FP8 (F8_E4M3 with a weight_scale_inv per 128 x 128 block), {} tensors as "
                 "bf16",
                 quantized.size(), kept.size());
  }
  spdlog::info("convert: {} model tensors ({:.1f} MB, {} file{}) from {} into {}", count, total / 1e6,
               shards.size(), shards.size() == 1 ? "" : "s", ckpt, out_dir);
}

}  // namespace moetrain
