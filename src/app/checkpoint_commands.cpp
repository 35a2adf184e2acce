#include "app/checkpoint_commands.h"

#include <CLI/CLI.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint/checkpoint_format.h"
#include "engine/checkpoint/hf_convert.h"
#include "engine/checkpoint/safetensors.h"
#include "engine/eval/score.h"

namespace moetrain::app {
namespace {

struct ConvertArgs {
  std::string src, dst, dtype;
  double max_shard_gb = 5.0;
  bool fp8 = false;
};

int run_convert(const ConvertArgs& a) {
  if (is_hf_model_dir(a.src)) {
    MT_CHECK(!a.fp8, "convert: --fp8 applies to export (moetrain checkpoint -> HF folder in DeepSeek's FP8 format); "
             "'{}' is a Hugging Face folder, which import reads as it is (an FP8 one dequantized to bf16)", a.src);
    MT_CHECK(a.dtype.empty(), "convert: --dtype applies to export (moetrain -> HF); import keeps the HF dtype");
    import_hf(a.src, a.dst);
    return 0;
  }
  HfExportOptions opt;
  if (!a.dtype.empty()) {
    DType t;
    MT_CHECK(parse_dtype(a.dtype, &t) && is_floating(t), "convert: --dtype must be bf16, f32 or f64, got '{}'", a.dtype);
    opt.dtype = t;
  }
  opt.fp8 = a.fp8;
  MT_CHECK(a.max_shard_gb > 0, "convert: --max-shard-size must be > 0 GB, got {}", a.max_shard_gb);
  opt.max_shard_bytes = static_cast<uint64_t>(a.max_shard_gb * (1ull << 30));
  export_hf(a.src, a.dst, opt);
  return 0;
}

struct ScoreArgs {
  std::string model, tokens, tokens_file, out, device = "cpu";
};

std::vector<int32_t> parse_ids(const std::string& text, const std::string& origin) {
  std::vector<int32_t> ids;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    MT_CHECK(j.is_array(), "{}: expected a JSON array of token ids", origin);
    for (const auto& v : j) {
      MT_CHECK(v.is_number_integer(), "{}: expected integer token ids, got {}", origin, v.dump());
      ids.push_back(v.get<int32_t>());
    }
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not a JSON array of token ids: {}", origin, e.what());
  }
  return ids;
}

int run_score(const ScoreArgs& a) {
  // stdout carries the JSON result: whatever is logged (a config's warning) goes to stderr.
  spdlog::set_default_logger(spdlog::stderr_color_mt("score"));
  std::vector<int32_t> ids;
  if (!a.tokens_file.empty()) {
    std::ifstream f(a.tokens_file);
    MT_CHECK(f.is_open(), "score: cannot open --tokens-file '{}'", a.tokens_file);
    std::stringstream ss;
    ss << f.rdbuf();
    ids = parse_ids(ss.str(), a.tokens_file);
  } else {
    MT_CHECK(!a.tokens.empty(), "score: give --tokens '[1, 2, ...]' or --tokens-file FILE");
    ids = parse_ids(a.tokens, "--tokens");
  }
  ScoreResult r = score_tokens(a.model, ids, a.device);
  if (!a.out.empty()) {
    SafetensorsWriter w;
    w.add("logits", r.logits);
    w.write(a.out, /*sync=*/false);
  }
  nlohmann::json j = {{"loss", r.loss}, {"targets", r.targets}, {"tokens", ids.size()}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace

std::function<int()> add_checkpoint_commands(CLI::App& app) {
  auto convert_args = std::make_shared<ConvertArgs>();
  CLI::App* convert = app.add_subcommand(
      "convert", "Hugging Face model folder -> moetrain checkpoint, or moetrain checkpoint -> HF folder");
  convert->add_option("src", convert_args->src, "HF folder (config.json + *.safetensors), or a moetrain checkpoint "
                      "(a step directory, or a checkpoint folder with a latest pointer)")->required();
  convert->add_option("dst", convert_args->dst, "new folder to write (must not exist)")->required();
  convert->add_option("--dtype", convert_args->dtype, "export: cast tensors to bf16, f32 or f64 (default: as stored)");
  convert->add_option("--max-shard-size", convert_args->max_shard_gb, "export: GB per safetensors file")
      ->capture_default_str();
  convert->add_flag("--fp8", convert_args->fp8,
                    "export in DeepSeek's FP8 format: the decoder layers' linear weights as F8_E4M3 with a "
                    "weight_scale_inv per 128 x 128 block, every other tensor bf16 (docs/fp8.md)");

  auto score_args = std::make_shared<ScoreArgs>();
  CLI::App* score = app.add_subcommand("score", "logits and next-token loss of a token sequence under a saved model");
  score->add_option("--model", score_args->model, "HF folder or moetrain checkpoint")->required();
  score->add_option("--tokens", score_args->tokens, "token ids as a JSON array, e.g. '[1, 2, 3]'");
  score->add_option("--tokens-file", score_args->tokens_file, "file holding a JSON array of token ids");
  score->add_option("--out", score_args->out, "write the f32 logits [S, V] to this safetensors file");
  score->add_option("--device", score_args->device, "cpu (f32) or cuda (bf16)")->capture_default_str();

  return [=]() -> int {
    if (convert->parsed()) return run_convert(*convert_args);
    if (score->parsed()) return run_score(*score_args);
    return -1;
  };
}

}  // namespace moetrain::app
