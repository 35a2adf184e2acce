// The moetrain command. Thin: parse the command line, load the config, call the engine.
//
//   moetrain train --config configs/tiny.toml [--section.key=value ...] [--print-config]
//   moetrain launch -n N -- train --config configs/tiny.toml   (N local ranks)
//   moetrain convert SRC DST        (HF folder <-> moetrain checkpoint)
//   moetrain score --model DIR --tokens "[...]"   (logits and loss)
//   moetrain tokenize --tokenizer TOKENIZER --out DIR INPUTS...
#include <csignal>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "app/checkpoint_commands.h"
#include "app/launch.h"
#include "engine/telemetry/dashboard.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/log.h"
#include "app/plan_command.h"
#include "engine/bench.h"
#include "engine/data/tokenize.h"
#include "engine/data/tokenizer_factory.h"
#include "engine/run_config.h"
#include "engine/trainer.h"

namespace {

// "--training.steps=100" -> "training.steps=100". Anything else is not an override.
std::vector<std::string> overrides_from(const std::vector<std::string>& extras) {
  std::vector<std::string> out;
  for (const std::string& a : extras) {
    if (a.rfind("--", 0) != 0 || a.find('=') == std::string::npos || a.find('.') == std::string::npos) {
      MT_THROW("command line: '{}' is not an option; overrides look like --section.key=value", a);
    }
    out.push_back(a.substr(2));
  }
  return out;
}

int run_train(const std::string& config_path, const std::vector<std::string>& extras, bool print_only) {
  moetrain::RunConfig cfg = moetrain::RunConfig::load(config_path, overrides_from(extras));
  if (print_only) {
    std::fputs(cfg.to_toml().c_str(), stdout);
    return 0;
  }
  moetrain::TrainSummary s = moetrain::train(cfg);
  spdlog::info("done: {} steps in {:.1f} s | val loss {:.4f} -> {:.4f} ({:+.1f}%) | {:.0f} tokens/s", s.steps,
               s.seconds, s.first_val_loss, s.last_val_loss,
               100.0 * (s.last_val_loss - s.first_val_loss) / s.first_val_loss, s.tokens_per_s);
  if (!s.sample.empty()) std::printf("\n--- sample ---\n%s\n--------------\n", s.sample.c_str());
  return 0;
}

int run_bench(const std::string& config_path, const std::vector<std::string>& extras,
              const moetrain::BenchOptions& opt) {
  moetrain::RunConfig cfg = moetrain::RunConfig::load(config_path, overrides_from(extras));
  if (!cfg.training.fp8) {
    moetrain::BenchReport r = moetrain::run_bench(cfg, opt);
    if (r.rank == 0) std::fputs(moetrain::format_bench(r).c_str(), stdout);
    return 0;
  }
  // FP8 against BF16 in one run of the command, on the same card: BF16 first.
  moetrain::RunConfig bf16 = cfg;
  bf16.training.fp8 = false;
  const moetrain::BenchReport base = moetrain::run_bench(bf16, opt);
  const moetrain::BenchReport fp8 = moetrain::run_bench(cfg, opt);
  if (fp8.rank == 0) {
    std::printf("=== BF16\n%s=== FP8\n%s=== FP8 against BF16 (this process, this card)\n%s",
                moetrain::format_bench(base).c_str(), moetrain::format_bench(fp8).c_str(),
                moetrain::format_bench_comparison(base, "BF16", fp8, "FP8").c_str());
  }
  return 0;
}

// moetrain tokenize: corpus -> token shards; or, with --encode-text / --decode-ids, one
// file's ids as JSON (or ids back to text), for comparing with other implementations.
int run_tokenize(moetrain::TokenizeOptions opt, const std::string& spec, const std::string& eos,
                 const std::string& encode_text, const std::string& decode_ids) {
  std::unique_ptr<moetrain::Tokenizer> tok = moetrain::make_tokenizer(spec, eos, "--tokenizer");
  if (!encode_text.empty()) {
    std::fputs(moetrain::encode_file_to_json(*tok, encode_text).c_str(), stdout);
    return 0;
  }
  if (!decode_ids.empty()) {
    const std::string text = moetrain::decode_json_file(*tok, decode_ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  }
  opt.tokenizer_name = spec;
  spdlog::info("{}", moetrain::format_tokenize_summary(moetrain::tokenize_corpus(*tok, opt)));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A peer that died closes its sockets: a write to one must fail as an error (EPIPE) that the
  // communicator reports and fault tolerance handles, not kill this process with SIGPIPE
  // (seen once in the replica chaos suite: a surviving rank killed by SIGPIPE mid-heal).
  std::signal(SIGPIPE, SIG_IGN);
  moetrain::keep_host_heap();
  moetrain::init_logging();
  CLI::App app{"moetrain: train Mixture-of-Experts language models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("moetrain ") + MOETRAIN_VERSION);

  std::string config_path;
  bool print_config = false;
  CLI::App* train = app.add_subcommand("train", "train a model from a TOML run config");
  train->add_option("-c,--config", config_path, "run config (TOML)")->required();
  train->add_flag("--print-config", print_config, "print the resolved config and exit");
  std::string init_from;
  train->add_option("--init-from", init_from,
                    "start from these weights (HF folder or moetrain checkpoint; sets [checkpoint].init_from, and "
                    "[model] from its config.json)");
  train->allow_extras();
  train->footer("Any config key can be overridden: --section.key=value (e.g. --training.steps=100).");

  std::string bench_config;
  moetrain::BenchOptions bench_opt;
  CLI::App* bench = app.add_subcommand("bench", "time training steps on synthetic tokens: tokens/s, TFLOP/s, MFU, stages");
  bench->add_option("-c,--config", bench_config, "run config (TOML)")->required();
  bench->add_option("--warmup", bench_opt.warmup_steps, "untimed steps first")->capture_default_str();
  bench->add_option("--steps", bench_opt.steps, "timed steps (the median is reported)")->capture_default_str();
  bench->add_option("--peak-tflops", bench_opt.peak_tflops, "peak for MFU (H100 SXM dense bf16: 989)")
      ->capture_default_str();
  bench->allow_extras();

  std::string plan_config;
  moetrain::app::PlanOptions plan_opt;
  CLI::App* plan = app.add_subcommand(
      "plan", "memory per GPU by part (weights, gradients, optimizer, activations, ...) for a config's layout and "
              "every layout of N GPUs, and whether each fits");
  plan->add_option("-c,--config", plan_config, "run config (TOML)")->required();
  plan->add_option("--gpus", plan_opt.gpus, "GPUs of the job (default: the config's layout)");
  plan->add_option("--gpu-memory", plan_opt.gpu_memory, "one GPU's memory, e.g. 80GiB or 141GB")
      ->capture_default_str();
  plan->allow_extras();
  plan->footer("Any config key can be overridden: --section.key=value (e.g. --training.recompute=full).");

  moetrain::TokenizeOptions tok_opt;
  std::string tok_spec, tok_eos, tok_encode, tok_decode;
  bool tok_no_progress = false;
  CLI::App* tokenize = app.add_subcommand("tokenize", "text / JSONL files or folders -> token shards");
  tokenize->add_option("inputs", tok_opt.inputs, "text or JSONL (*.jsonl) files, or folders of them");
  tokenize->add_option("--tokenizer", tok_spec, "\"byte\", a tokenizer.json, or a folder holding one")->required();
  tokenize->add_option("-o,--out", tok_opt.out_dir, "output folder: shard-NNNNN.bin and index.json");
  tokenize->add_option("--eos", tok_eos, "end-of-text token after each document (default <|endoftext|>)");
  tokenize->add_option("--shard-tokens", tok_opt.shard_tokens, "tokens per shard")->capture_default_str();
  tokenize->add_option("--threads", tok_opt.threads, "worker threads (0: one per core)")->capture_default_str();
  tokenize->add_option("--text-field", tok_opt.text_field, "JSONL key of the text")->capture_default_str();
  tokenize->add_flag("--lines", tok_opt.lines, "plain text: a document per line, not per file");
  tokenize->add_flag("--overwrite", tok_opt.overwrite, "replace the shards already in --out");
  tokenize->add_flag("--no-progress", tok_no_progress, "no progress bar");
  tokenize->add_option("--encode-text", tok_encode, "print the ids of FILE's text as a JSON array, and exit");
  tokenize->add_option("--decode-ids", tok_decode, "print the text of FILE's JSON array of ids, and exit");

  std::vector<std::string> plot_runs;
  std::string plot_out;
  CLI::App* plot = app.add_subcommand("plot", "draw runs' metrics.jsonl as one PNG dashboard (several runs overlaid)");
  plot->add_option("runs", plot_runs, "metrics folders ([metrics].dir of each run)")->required();
  plot->add_option("-o,--out", plot_out, "the PNG to write (default: <first run>/dashboard.png)");

  // launch (N local workers) and the hidden comm-selftest: src/app/launch.cpp.
  std::function<int()> run_launch_commands = moetrain::app::add_launch_commands(app);
  // convert and score: src/app/checkpoint_commands.cpp.
  std::function<int()> run_checkpoint_commands = moetrain::app::add_checkpoint_commands(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (int rc = run_launch_commands(); rc >= 0) return rc;
    if (int rc = run_checkpoint_commands(); rc >= 0) return rc;
    if (train->parsed()) {
      std::vector<std::string> extras = train->remaining();
      if (!init_from.empty()) extras.push_back("--checkpoint.init_from=" + init_from);
      return run_train(config_path, extras, print_config);
    }
    if (bench->parsed()) return run_bench(bench_config, bench->remaining(), bench_opt);
    if (plan->parsed()) return moetrain::app::run_plan(plan_config, overrides_from(plan->remaining()), plan_opt);
    if (plot->parsed()) {
      std::vector<moetrain::RunSeries> runs;
      for (const std::string& dir : plot_runs) runs.push_back(moetrain::read_run(dir));
      const std::string out = plot_out.empty() ? plot_runs.front() + "/dashboard.png" : plot_out;
      moetrain::write_dashboard(runs, out);
      std::printf("plot: %s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
      return 0;
    }
    if (tokenize->parsed()) {
      tok_opt.progress = !tok_no_progress;
      return run_tokenize(tok_opt, tok_spec, tok_eos, tok_encode, tok_decode);
    }
  } catch (const std::exception& e) {  // moetrain::Error and anything from the libraries
    std::fprintf(stderr, "moetrain: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
