// Tests of the metrics writer (JSON lines), the human log line and the progress bar.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/telemetry/metrics.h"
#include "engine/telemetry/progress.h"

namespace fs = std::filesystem;
using namespace moetrain;

namespace {

StepMetrics sample() {
  StepMetrics m;
  m.step = 40;
  m.loss = 2.83124;
  m.aux_loss = 0.0123;
  m.lr = 3e-3;
  m.grad_norm = 0.9132;
  m.tokens_per_s = 2345.4;
  m.tflops = 0.01234;
  m.step_time_s = 0.437;
  m.expert_load_max_over_mean = 1.4231;
  m.peak_memory_bytes = 210'000'000;
  m.tokens = 40960;
  return m;
}

fs::path temp_dir(const char* name) {
  return fs::temp_directory_path() / fmt::format("moetrain_tel_{}_{}", ::getpid(), name);
}

}  // namespace

TEST(Metrics, JsonLinesParseBack) {
  fs::path dir = temp_dir("json") / "nested" / "run";
  fs::remove_all(dir.parent_path().parent_path());
  {
    MetricsWriter w(dir.string());
    EXPECT_EQ(w.path(), (dir / "metrics.jsonl").string());
    StepMetrics m = sample();
    w.write(m);
    m.step = 41;
    m.val_loss = 2.9;
    w.write(m);
  }
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 2u);
  const auto& j = rows[0];
  EXPECT_EQ(j["step"], 40);
  EXPECT_DOUBLE_EQ(j["loss"].get<double>(), 2.83124);
  EXPECT_DOUBLE_EQ(j["aux_loss"].get<double>(), 0.0123);
  EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 3e-3);
  EXPECT_DOUBLE_EQ(j["grad_norm"].get<double>(), 0.9132);
  EXPECT_DOUBLE_EQ(j["tokens_per_s"].get<double>(), 2345.4);
  EXPECT_DOUBLE_EQ(j["tflops"].get<double>(), 0.01234);
  EXPECT_DOUBLE_EQ(j["step_time_s"].get<double>(), 0.437);
  EXPECT_DOUBLE_EQ(j["expert_load_max_over_mean"].get<double>(), 1.4231);
  EXPECT_EQ(j["peak_memory_bytes"], 210000000);
  EXPECT_EQ(j["tokens"], 40960);
  EXPECT_TRUE(j["val_loss"].is_null());
  EXPECT_EQ(rows[1]["step"], 41);
  EXPECT_DOUBLE_EQ(rows[1]["val_loss"].get<double>(), 2.9);

  // append = true keeps the lines; the default starts afresh.
  { MetricsWriter(dir.string(), true).write(sample()); }
  EXPECT_EQ(std::count(std::istreambuf_iterator<char>(std::ifstream(dir / "metrics.jsonl").rdbuf()), {}, '\n'), 3);
  { MetricsWriter w(dir.string()); }
  EXPECT_EQ(fs::file_size(dir / "metrics.jsonl"), 0u);
  fs::remove_all(dir.parent_path().parent_path());
}

TEST(Metrics, UnwritableDir) {
  fs::path base = temp_dir("unwritable");
  fs::remove_all(base);
  fs::create_directories(base);
  std::ofstream(base / "file") << "x";  // a file where the folder should go
  std::string dir = (base / "file" / "run").string();
  try {
    MetricsWriter w(dir);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
  fs::remove_all(base);
}

TEST(Metrics, HumanLine) {
  StepMetrics m = sample();
  EXPECT_EQ(human_line(m, 600),
            "step 40/600 | loss 2.8312 | lr 3.00e-03 | gnorm 0.91 | 2,345 tok/s | 0.012 TFLOP/s | "
            "load max/mean 1.42 | mem 210 MB");
  m.val_loss = 2.95;
  EXPECT_NE(human_line(m, 600).find("| val 2.9500 |"), std::string::npos);
  EXPECT_EQ(thousands(0), "0");
  EXPECT_EQ(thousands(999), "999");
  EXPECT_EQ(thousands(1000), "1,000");
  EXPECT_EQ(thousands(-1234567), "-1,234,567");
}

TEST(Progress, SilentWhenNotATerminal) {
  // Test output is not a terminal (and if it is, enabled = false must still be silent).
  ::testing::internal::CaptureStderr();
  {
    ProgressBar off(10, false);
    off.update(3, "loss 1.0");
    off.finish();
    EXPECT_FALSE(off.active());
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "");
  ProgressBar on(10, true);
  EXPECT_EQ(on.active(), isatty(STDERR_FILENO) == 1);
}
