// The moetrain command end to end: bad input gives one clear line and a non-zero exit;
// a short run trains, writes metrics, and is bitwise repeatable.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/checkpoint/checkpoint_format.h"
#include "cli_run.h"
#include "comm/launcher.h"
#include "tensorboard_reader.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <regex>
#include <thread>
#include "engine/checkpoint/checkpointer.h"
#include "engine/checkpoint/safetensors.h"

namespace {

namespace fs = std::filesystem;

using Result = moetrain::testing::CliResult;
inline Result run(const std::string& args) { return moetrain::testing::run_moetrain(args); }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moetrain_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "corpus");
    std::ofstream c(dir_ / "corpus" / "text");
    for (int i = 0; i < 400; ++i) {
      c << "The quick brown fox " << i << " jumps over the lazy dog.\n%\n";
    }
  }
  void TearDown() override { fs::remove_all(dir_); }

  // configs/tiny.toml shrunk to a few seconds of work on the test corpus.
  std::string small_run(const std::string& metrics, const std::string& extra = "") {
    return "train --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml --data.paths=" +
           (dir_ / "corpus").string() +
           " --training.steps=6 --training.eval_every=3 --training.eval_batches=2 --training.seq_len=32"
           " --training.micro_batch_size=2 --training.grad_accum_steps=2 --training.sample_tokens=16"
           " --optimizer.warmup_steps=2 --metrics.progress=false --data.val_fraction=0.2 --metrics.dir=" +
           (dir_ / metrics).string() + " " + extra;
  }

  std::string write_config(const std::string& name, const std::string& text) {
    fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

  fs::path dir_;
};

// The error is the last line and names what is wrong.
void expect_one_line_error(const Result& r, const std::string& needle) {
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("moetrain: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << r.output;
}

TEST_F(CliTest, MisspeltKeyIsNamed) {
  std::string cfg = write_config("bad.toml", "[training]\nstpes = 10\n");
  Result r = run("train --config " + cfg);
  expect_one_line_error(r, "stpes");
  EXPECT_NE(r.output.find("steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("bad.toml"), std::string::npos) << r.output;
}

TEST_F(CliTest, NegativeLearningRateIsNamed) {
  std::string cfg = write_config("lr.toml", "[optimizer]\nlr = -0.001\n");
  expect_one_line_error(run("train --config " + cfg), "lr");
  expect_one_line_error(run(small_run("m", "--optimizer.lr=-1")), "lr");
}

TEST_F(CliTest, MissingCorpusIsNamed) {
  std::string cfg = write_config("data.toml", "[data]\npaths = [\"/nonexistent/corpus.txt\"]\n");
  expect_one_line_error(run("train --config " + cfg), "/nonexistent/corpus.txt");
}

TEST_F(CliTest, MissingConfigAndBadOverrideAreNamed) {
  expect_one_line_error(run("train --config /nonexistent/run.toml"), "/nonexistent/run.toml");
  expect_one_line_error(run(small_run("m", "--training.stepz=3")), "stepz");
  expect_one_line_error(run(small_run("m", "--steps")), "--steps");
}

// [training].fp8: a short run trains (the projections in FP8, the loss term and metrics as
// usual), and `bench` measures BF16 first, then FP8, in one run of the command, and sets
// them side by side; its settings name the temporary FP8 switches that are set (here the
// experts' weight gradient in FP8).
TEST_F(CliTest, Fp8TrainsAndBenchComparesItWithBf16) {
  Result a = run(small_run("fp8", "--training.fp8=true"));
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("val loss"), std::string::npos) << a.output;
  ::setenv("MOETRAIN_FP8_EXPERTS_WGRAD", "1", 1);
  Result b = run("bench --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/tiny.toml --data.paths=" +
                 (dir_ / "corpus").string() +
                 " --training.seq_len=32 --training.micro_batch_size=2 --training.fp8=true --warmup 1 --steps 1");
  ::unsetenv("MOETRAIN_FP8_EXPERTS_WGRAD");
  ASSERT_EQ(b.status, 0) << b.output;
  for (const char* part : {"=== BF16", "=== FP8", "FP8 projections (block-scaled e4m3, MOETRAIN_FP8_EXPERTS_WGRAD=1)",
                           "=== FP8 against BF16", "tokens/s", "speedup"}) {
    EXPECT_NE(b.output.find(part), std::string::npos) << part << "\n" << b.output;
  }
  EXPECT_LT(b.output.find("=== BF16"), b.output.find("=== FP8\n")) << "BF16 is measured first";
}

// `moetrain plan`: the config's layout part by part, every layout of --gpus, what fits; a
// size it cannot read is named.
TEST_F(CliTest, PlanPrintsThePartsAndEveryLayout) {
  const std::string cfg = "plan --config " + std::string(MOETRAIN_SOURCE_DIR) + "/configs/bench/q30b-4l.toml";
  Result r = run(cfg + " --gpus 4 --gpu-memory 24GiB --parallel.ep=2");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* part : {"memory plan: pp1 dp2 ep2", "optimizer shards", "activations", "training peak",
                           "every layout of 4:", "pp1 dp4 ep1", "pp2 dp1 ep2 dualpipev", "does not fit", "fits"}) {
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  }
  Result full = run(cfg + " --training.recompute=full --training.grad_accum_steps=1");
  ASSERT_EQ(full.status, 0) << full.output;
  EXPECT_NE(full.output.find("recompute full"), std::string::npos) << full.output;
  expect_one_line_error(run(cfg + " --gpu-memory lots"), "--gpu-memory 'lots'");
}

TEST_F(CliTest, ShortRunTrainsAndIsBitwiseRepeatable) {
  Result a = run(small_run("a"));
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("val loss"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("--- sample ---"), std::string::npos) << a.output;
  Result b = run(small_run("b"));
  ASSERT_EQ(b.status, 0) << b.output;
  auto losses = [](const fs::path& p) {
    std::ifstream f(p);
    std::string line, out;
    int lines = 0;
    while (std::getline(f, line)) {
      ++lines;
      auto i = line.find("\"loss\":");
      out += line.substr(i, line.find(',', i) - i) + ";";
      auto g = line.find("\"grad_norm\":");
      out += line.substr(g, line.find(',', g) - g) + ";";
    }
    EXPECT_EQ(lines, 6);
    return out;
  };
  std::string la = losses(dir_ / "a" / "metrics.jsonl");
  EXPECT_FALSE(la.empty());
  EXPECT_EQ(la, losses(dir_ / "b" / "metrics.jsonl"));

  // The TensorBoard event file of run a: the format version, then per step the scalars (the
  // same loss as metrics.jsonl) and a histogram of tokens per expert for each MoE layer.
  const std::vector<moetrain::tb::Event> ev =
      moetrain::testing::read_tensorboard_events(moetrain::testing::only_event_file(dir_ / "a" / "tb"));
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev[0].file_version(), "brain.Event:2");
  std::map<int64_t, std::map<std::string, double>> scalars;
  std::map<int64_t, int> histograms;
  for (size_t i = 1; i < ev.size(); ++i) {
    for (const auto& v : ev[i].summary().value()) {
      if (v.has_histo()) {
        ++histograms[ev[i].step()];
        EXPECT_EQ(v.tag().rfind("moe/layer", 0), 0u) << v.tag();
        EXPECT_EQ(v.histo().num(), 8) << v.tag();  // tiny.toml: 8 experts
      } else {
        scalars[ev[i].step()][v.tag()] = v.simple_value();
      }
    }
  }
  ASSERT_EQ(scalars.size(), 6u);
  std::ifstream lines(dir_ / "a" / "metrics.jsonl");
  std::string line;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t step = j["step"];
    EXPECT_FLOAT_EQ(static_cast<float>(scalars[step]["train/loss"]), static_cast<float>(j["loss"].get<double>()));
    EXPECT_EQ(scalars[step].count("moe/layer0/load_max_over_mean"), 1u) << "step " << step;
    EXPECT_EQ(histograms[step], static_cast<int>(j["moe"].size())) << "step " << step;
    EXPECT_EQ(scalars[step].count("val/loss"), j["val_loss"].is_null() ? 0u : 1u) << "step " << step;
    // The memory group: live tensors at the step's end, within the peak; the one-process layout.
    EXPECT_GT(j["memory"]["live_bytes"].get<int64_t>(), 0) << "step " << step;
    EXPECT_LE(j["memory"]["live_bytes"].get<int64_t>(), j["memory"]["peak_bytes"].get<int64_t>()) << "step " << step;
    if (step == 1) {
      EXPECT_EQ(j["memory"]["growth_bytes"], 0);
    }
    EXPECT_EQ(j["infra"]["layout"], "pp 1 x dp 1 x cp 1 x tp 1 x ep 1 (1 ranks)");
  }
}

// A run with [metrics].prometheus_port serves its latest step while it trains: a scraper
// polling the endpoint sees steps go by, each page's loss that step's metrics.jsonl loss.
TEST_F(CliTest, PrometheusEndpointIsScrapedDuringARun) {
  const int port = moetrain::free_tcp_port();
  std::atomic<bool> done{false};
  std::map<int64_t, double> seen;  // step -> loss, as scraped
  std::thread scraper([&] {
    httplib::Client c("127.0.0.1", port);
    c.set_connection_timeout(0, 200000);
    while (!done) {
      if (auto r = c.Get("/metrics"); r && r->status == 200) {
        std::smatch step, loss;
        static const std::regex step_re(R"(moetrain_train_step\{[^}]*\} (\S+))"),
            loss_re(R"(moetrain_train_loss\{[^}]*\} (\S+))");
        if (std::regex_search(r->body, step, step_re) && std::regex_search(r->body, loss, loss_re)) {
          seen[std::stoll(step[1])] = std::stod(loss[1]);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  Result r = run(small_run("p", "--training.steps=40 --training.eval_every=40 --metrics.prometheus_bind=127.0.0.1 "
                                "--metrics.prometheus_port=" + std::to_string(port)));
  done = true;
  scraper.join();
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("Prometheus endpoint http://127.0.0.1:" + std::to_string(port) + "/metrics"),
            std::string::npos)
      << r.output;
  ASSERT_GE(seen.size(), 2u) << "the scraper saw fewer than two steps";
  std::map<int64_t, double> logged;
  std::ifstream lines(dir_ / "p" / "metrics.jsonl");
  std::string line;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    logged[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  for (const auto& [step, loss] : seen) {
    ASSERT_TRUE(logged.count(step)) << "scraped step " << step;
    EXPECT_DOUBLE_EQ(loss, logged[step]) << "step " << step;
  }
}

// "loss" and "grad_norm" of each metrics line, by step (the last line of a step wins: a
// resumed run may repeat steps that ran after the last checkpoint).
std::map<int, std::string> step_losses(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  std::map<int, std::string> out;
  while (std::getline(f, line)) {
    const auto s = line.find("\"step\":");
    const int step = std::stoi(line.substr(s + 7));
    auto field = [&](const std::string& key) {
      const auto i = line.find("\"" + key + "\":");
      return line.substr(i, line.find(',', i) - i);
    };
    out[step] = field("loss") + ";" + field("grad_norm");
  }
  return out;
}

// Every tensor (model and optimizer) of two checkpoints, byte for byte.
void expect_same_checkpoint(const std::string& a, const std::string& b) {
  moetrain::CheckpointReader ra(a), rb(b);
  ASSERT_EQ(ra.names(), rb.names());
  ASSERT_FALSE(ra.names().empty());
  for (const std::string& n : ra.names()) {
    moetrain::Tensor ta = ra.read_whole(n), tb = rb.read_whole(n);
    ASSERT_EQ(ta.nbytes(), tb.nbytes()) << n;
    EXPECT_EQ(std::memcmp(ta.raw(), tb.raw(), ta.nbytes()), 0) << n;
  }
  EXPECT_EQ(ra.trainer_state()["step"], rb.trainer_state()["step"]);
  EXPECT_EQ(ra.trainer_state()["data"], rb.trainer_state()["data"]);
  EXPECT_EQ(ra.trainer_state()["optimizer"], rb.trainer_state()["optimizer"]);
}

TEST_F(CliTest, ResumeAfterARestartIsBitwiseEqualToARunStraightThrough) {
  const std::string ck = " --checkpoint.save_final=true --checkpoint.every=2 --checkpoint.keep=0";
  Result straight = run(small_run("straight", ck));
  ASSERT_EQ(straight.status, 0) << straight.output;
  // The same run cut in two processes: 3 steps, exit, then resume (auto) to the end.
  Result first = run(small_run("split", ck + " --training.stop_after_steps=3"));
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_TRUE(fs::exists(dir_ / "split" / "checkpoints" / "step-00000003")) << first.output;
  EXPECT_FALSE(fs::exists(dir_ / "split" / "checkpoints" / "step-00000004"));
  Result second = run(small_run("split", ck));
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  const auto a = step_losses(dir_ / "straight" / "metrics.jsonl");
  const auto b = step_losses(dir_ / "split" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  EXPECT_EQ(a, b);
  expect_same_checkpoint((dir_ / "straight" / "checkpoints" / "step-00000006").string(),
                         (dir_ / "split" / "checkpoints" / "step-00000006").string());
  // A third start finds the run complete and trains nothing more.
  Result third = run(small_run("split", ck));
  ASSERT_EQ(third.status, 0) << third.output;
  EXPECT_NE(third.output.find("done: 0 steps"), std::string::npos) << third.output;
}

// [optimizer].moments = "bf16": the moments are checkpointed as bf16, and a resumed run
// still equals one run straight through (the stochastic rounding is keyed by step and
// element, not by a generator's state).
TEST_F(CliTest, Bf16MomentsAreCheckpointedAndResumeBitwise) {
  const std::string ck =
      " --optimizer.moments=bf16 --checkpoint.save_final=true --checkpoint.every=2 --checkpoint.keep=0";
  Result straight = run(small_run("straight", ck));
  ASSERT_EQ(straight.status, 0) << straight.output;
  Result first = run(small_run("split", ck + " --training.stop_after_steps=3"));
  ASSERT_EQ(first.status, 0) << first.output;
  Result second = run(small_run("split", ck));
  ASSERT_EQ(second.status, 0) << second.output;
  EXPECT_NE(second.output.find("resumed from"), std::string::npos) << second.output;
  EXPECT_EQ(step_losses(dir_ / "straight" / "metrics.jsonl"), step_losses(dir_ / "split" / "metrics.jsonl"));
  const std::string last = (dir_ / "straight" / "checkpoints" / "step-00000006").string();
  expect_same_checkpoint(last, (dir_ / "split" / "checkpoints" / "step-00000006").string());
  moetrain::CheckpointReader r(last);
  int moments = 0;
  for (const std::string& n : r.names()) {
    if (n.size() > 8 && (n.ends_with(".exp_avg") || n.ends_with(".exp_avg_sq"))) {
      EXPECT_EQ(r.read_whole(n).dtype(), moetrain::DType::BF16) << n;
      ++moments;
    }
  }
  EXPECT_GT(moments, 0);
  // A run with f32 moments resumes from it (the moments are widened on load).
  Result widened = run(small_run("split", " --checkpoint.save_final=true --training.steps=8"));
  ASSERT_EQ(widened.status, 0) << widened.output;
  EXPECT_NE(widened.output.find("resumed from"), std::string::npos) << widened.output;
}

TEST_F(CliTest, ConvertExportsAndInitFromStartsFromTheWeights) {
  Result r = run(small_run("base", "--checkpoint.save_final=true"));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string ck = (dir_ / "base" / "checkpoints").string(), hf = (dir_ / "hf").string();
  r = run("convert " + ck + " " + hf + " --dtype bf16");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "hf" / "config.json"));
  // The tiny config balances its routers with a bias (router_bias_update_speed): the
  // checkpoint keeps one per MoE layer, moved by the steps; Qwen3MoeForCausalLM has no such
  // tensor, so the export leaves them out and says so.
  {
    moetrain::CheckpointReader ckr(moetrain::Checkpointer::committed(ck).back().second);
    const std::string bias = "model.layers.3.mlp.gate.e_score_correction_bias";
    ASSERT_TRUE(ckr.has(bias));
    double moved = 0;
    for (double v : ckr.read_whole(bias).to_double_vector()) moved += std::abs(v);
    EXPECT_GT(moved, 0.0) << "six steps left the bias at zero";
    moetrain::SafetensorsFile out((dir_ / "hf" / "model.safetensors").string());
    for (const auto& e : out.entries()) EXPECT_EQ(e.name.find("e_score_correction_bias"), std::string::npos) << e.name;
    EXPECT_NE(out.find("model.layers.3.mlp.gate.weight"), nullptr);
    EXPECT_NE(r.output.find("4 routing biases (aux-loss-free balancing) left out"), std::string::npos) << r.output;
  }
  expect_one_line_error(run("convert " + ck + " " + hf), "already exists");
  expect_one_line_error(run("convert " + (dir_ / "none").string() + " " + (dir_ / "x").string()),
                        "is not a moetrain checkpoint");
  // Fine-tuning from the exported folder: the model shape comes from its config.json.
  r = run(small_run("ft", "--init-from " + hf + " --training.steps=2"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("weights from " + hf + " (Hugging Face folder)"), std::string::npos) << r.output;
  // and scoring it: one JSON line with the loss.
  r = run("score --model " + hf + " --tokens '[72, 101, 108, 108, 111]'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("\"targets\":4"), std::string::npos) << r.output;
  expect_one_line_error(run("score --model " + hf + " --tokens '[1, 9999]'"), "token id 9999 is outside");
  // DeepSeek's FP8 format (docs/fp8.md): moetrain scores it once converted back (FP8 weights
  // dequantized), with a loss near the bf16 export's; --fp8 with another dtype, or from an
  // HF folder, is refused.
  auto loss_of = [](const Result& s) {
    const size_t at = s.output.find("{\"loss\":");
    EXPECT_NE(at, std::string::npos) << s.output;
    return at == std::string::npos ? 0.0 : nlohmann::json::parse(s.output.substr(at, s.output.find('\n', at) - at))["loss"].get<double>();
  };
  const std::string tokens = " --tokens '[72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]'";
  const double bf16_loss = loss_of(run("score --model " + hf + tokens));
  const std::string hf8 = (dir_ / "hf8").string(), back8 = (dir_ / "back8").string();
  r = run("convert " + ck + " " + hf8 + " --fp8");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("weights as FP8"), std::string::npos) << r.output;
  expect_one_line_error(run("score --model " + hf8 + tokens), "moetrain convert");
  r = run("convert " + hf8 + " " + back8);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("FP8 (F8_E4M3) weights dequantized"), std::string::npos) << r.output;
  const double fp8_loss = loss_of(run("score --model " + back8 + tokens));
  EXPECT_NEAR(fp8_loss, bf16_loss, 0.02 * bf16_loss);
  expect_one_line_error(run("convert " + ck + " " + (dir_ / "x").string() + " --fp8 --dtype f32"),
                        "--dtype must be bf16 or left out, got f32");
  expect_one_line_error(run("convert " + hf + " " + (dir_ / "x").string() + " --fp8"), "--fp8 applies to export");
}

}  // namespace
