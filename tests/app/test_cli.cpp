// The moetrain command end to end: bad input gives one clear line and a non-zero exit;
// a short run trains, writes metrics, and is bitwise repeatable.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

namespace fs = std::filesystem;

struct Result {
  int status;
  std::string output;  // stdout and stderr
};

Result run(const std::string& args) {
  std::string cmd = std::string(MOETRAIN_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int status = pclose(p);
  return {WEXITSTATUS(status), out};
}

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
}

}  // namespace
