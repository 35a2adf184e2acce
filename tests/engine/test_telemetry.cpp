// Tests of the metrics writer (JSON lines), the human log line and the progress bar.
#include <cairo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>
#include <set>
#include <sstream>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/telemetry/dashboard.h"
#include "engine/telemetry/metrics.h"
#include "engine/telemetry/progress.h"
#include "engine/telemetry/prometheus.h"
#include "engine/telemetry/tensorboard.h"
#include "tensorboard_reader.h"

#include <httplib.h>

#include <regex>

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
  // The multi-token prediction loss beside the main one; the router terms only in the files.
  m.loss_terms = {{"aux_loss", 0.01}, {"mtp_loss", 0.8125}};
  EXPECT_NE(human_line(m, 600).find("loss 2.8312 | mtp 0.8125 | val"), std::string::npos) << human_line(m, 600);
  EXPECT_EQ(human_line(m, 600).find("0.0100"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(metrics_json(m));
  EXPECT_DOUBLE_EQ(j["loss_terms"]["mtp_loss"].get<double>(), 0.8125);
  EXPECT_DOUBLE_EQ(j["loss_terms"]["aux_loss"].get<double>(), 0.01);
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

namespace moetrain {
namespace {

// ---- TensorBoard -------------------------------------------------------------------------

TEST(TensorBoard, Crc32cOfTheStandardCheckString) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // CRC-32C's published check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const uint32_t c = crc32c("a", 1);
  EXPECT_EQ(masked_crc32c("a", 1), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TensorBoard, ScalarsAndHistogramsReadBack) {
  const auto dir = std::filesystem::temp_directory_path() / ("moetrain_tb_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w((dir / "tb").string());
    path = w.path();
    w.scalars(7, {{"train/loss", 2.5}, {"train/lr", 3e-4}, {"skipped", std::nan("")}});
    w.histogram(7, "moe/layer0/tokens_per_expert", {0, 3, 3, 10, 41});
    w.scalars(8, {{"train/loss", 2.25}});
  }
  EXPECT_EQ(testing::only_event_file(dir / "tb"), path);
  const std::vector<tb::Event> ev = testing::read_tensorboard_events(path);
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].file_version(), "brain.Event:2");
  EXPECT_GT(ev[0].wall_time(), 1.7e9);
  ASSERT_TRUE(ev[1].has_summary());
  EXPECT_EQ(ev[1].step(), 7);
  ASSERT_EQ(ev[1].summary().value_size(), 2);  // the NaN is left out
  EXPECT_EQ(ev[1].summary().value(0).tag(), "train/loss");
  EXPECT_FLOAT_EQ(ev[1].summary().value(0).simple_value(), 2.5f);
  EXPECT_EQ(ev[1].summary().value(1).tag(), "train/lr");
  EXPECT_FLOAT_EQ(ev[1].summary().value(1).simple_value(), 3e-4f);
  const tb::HistogramProto& h = ev[2].summary().value(0).histo();
  EXPECT_EQ(ev[2].summary().value(0).tag(), "moe/layer0/tokens_per_expert");
  EXPECT_EQ(h.min(), 0);
  EXPECT_EQ(h.max(), 41);
  EXPECT_EQ(h.num(), 5);
  EXPECT_EQ(h.sum(), 57);
  EXPECT_EQ(h.sum_squares(), 0 + 9 + 9 + 100 + 1681);
  ASSERT_EQ(h.bucket_size(), h.bucket_limit_size());
  ASSERT_GT(h.bucket_size(), 1);
  double counted = 0;
  for (int i = 0; i < h.bucket_size(); ++i) {
    counted += h.bucket(i);
    if (i > 0) {
      EXPECT_GT(h.bucket_limit(i), h.bucket_limit(i - 1));
    }
  }
  EXPECT_EQ(counted, 5);
  EXPECT_GE(h.bucket_limit(h.bucket_limit_size() - 1), 41);
  EXPECT_EQ(h.bucket(0), 1);  // the 0 alone below the first limit
  EXPECT_EQ(ev[3].step(), 8);
  std::filesystem::remove_all(dir);
}

TEST(TensorBoard, UnwritableDirIsNamed) {
  try {
    TensorBoardWriter w("/proc/moetrain_no_such/tb");
    ADD_FAILURE() << "writer made a folder under /proc";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/moetrain_no_such/tb"), std::string::npos) << e.what();
  }
}

// The per-layer expert load: max/mean, coefficient of variation, idle experts; and the
// scalars' names.
TEST(Metrics, ExpertLoadAndScalarNames) {
  const ExpertLoad l = expert_load({0, 2, 2, 4});
  EXPECT_DOUBLE_EQ(l.max_over_mean, 2.0);
  EXPECT_NEAR(l.cv, std::sqrt(2.0) / 2.0, 1e-12);
  EXPECT_EQ(l.idle, 1);
  StepMetrics m;
  m.loss = 1.5;
  m.expert_tokens = {{1, 1}, {0, 2}};
  m.val_loss = 1.75;
  const auto v = metrics_scalars(m);
  auto find = [&](const std::string& tag) -> double {
    for (const auto& [t, x] : v) {
      if (t == tag) return x;
    }
    ADD_FAILURE() << "no scalar " << tag;
    return -1;
  };
  EXPECT_EQ(find("train/loss"), 1.5);
  EXPECT_EQ(find("val/loss"), 1.75);
  EXPECT_EQ(find("moe/layer0/load_max_over_mean"), 1.0);
  EXPECT_EQ(find("moe/layer1/idle_experts"), 1.0);
  const nlohmann::json j = nlohmann::json::parse(metrics_json(m));
  ASSERT_EQ(j["moe"].size(), 2u);
  EXPECT_EQ(j["moe"][1]["idle_experts"], 1);
  EXPECT_EQ(j["moe"][1]["tokens_per_expert"], nlohmann::json({0, 2}));
  // The memory and infra groups.
  m.reserved_memory_bytes = 7;
  m.memory_growth_bytes = -3;
  m.layout = "pp 1 x dp 2";
  const nlohmann::json k = nlohmann::json::parse(metrics_json(m));
  EXPECT_EQ(k["memory"]["reserved_bytes"], 7);
  EXPECT_EQ(k["memory"]["growth_bytes"], -3);
  EXPECT_EQ(k["infra"]["layout"], "pp 1 x dp 2");
  EXPECT_EQ(k["infra"]["world_size"], 1);
}

// ---- Prometheus ---------------------------------------------------------------------------

// Every sample line is `name{labels} value` with a valid metric name; every name has its HELP
// and TYPE lines before its samples.
void expect_exposition_format(const std::string& text) {
  const std::regex sample(R"(^[a-zA-Z_:][a-zA-Z0-9_:]*\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\} \S+$)");
  std::set<std::string> typed;
  std::istringstream in(text);
  std::string line;
  int samples = 0;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      typed.insert(line.substr(7, line.find(' ', 7) - 7));
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) continue;
    EXPECT_TRUE(std::regex_match(line, sample)) << "not a sample line: " << line;
    EXPECT_TRUE(typed.count(line.substr(0, line.find('{')))) << "no TYPE before: " << line;
    ++samples;
  }
  EXPECT_GT(samples, 10);
}

TEST(Prometheus, ServesTheLatestStepInTheExpositionFormat) {
  PrometheusExporter p("127.0.0.1", 0, "runs/a\"b");
  ASSERT_GT(p.port(), 0);
  StepMetrics m;
  m.step = 12;
  m.loss = 2.375;
  m.tokens_per_s = 1234.5;
  m.expert_tokens = {{3, 1}, {0, 4}};
  p.publish(m.step, metrics_scalars(m));
  httplib::Client c("127.0.0.1", p.port());
  auto r = c.Get("/metrics");
  ASSERT_TRUE(r) << "no answer from the endpoint";
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type").rfind("text/plain; version=0.0.4", 0), 0u);
  const std::string& t = r->body;
  expect_exposition_format(t);
  EXPECT_NE(t.find("moetrain_train_step{run=\"runs/a\\\"b\"} 12\n"), std::string::npos) << t;
  EXPECT_NE(t.find("moetrain_train_loss{run=\"runs/a\\\"b\"} 2.375\n"), std::string::npos) << t;
  EXPECT_NE(t.find("moetrain_perf_tokens_per_s{run=\"runs/a\\\"b\"} 1234.5\n"), std::string::npos) << t;
  EXPECT_NE(t.find("moetrain_moe_idle_experts{run=\"runs/a\\\"b\",moe_layer=\"1\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("moetrain_moe_load_max_over_mean{run=\"runs/a\\\"b\",moe_layer=\"0\"} 1.5\n"), std::string::npos)
      << t;
  // One HELP/TYPE block for the two layers' samples.
  size_t types = 0;
  for (size_t at = 0; (at = t.find("# TYPE moetrain_moe_load_cv ", at)) != std::string::npos; ++at) ++types;
  EXPECT_EQ(types, 1u);
  // A newer step replaces the page.
  m.step = 13;
  p.publish(m.step, metrics_scalars(m));
  r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_NE(r->body.find("moetrain_train_step{run=\"runs/a\\\"b\"} 13\n"), std::string::npos);
  EXPECT_EQ(c.Get("/other")->status, 404);
}

TEST(Prometheus, ATakenPortIsNamed) {
  PrometheusExporter first("127.0.0.1", 0, "a");
  try {
    PrometheusExporter second("127.0.0.1", first.port(), "b");
    ADD_FAILURE() << "two exporters on port " << first.port();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("127.0.0.1:{}", first.port())), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[metrics].prometheus_port"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moetrain

// `moetrain plot`: two runs written by the real MetricsWriter, read back and drawn; the PNG
// has the dashboard's size and both runs' colours, the heatmap shows the skewed layer, and
// a damaged record is named by file and line.
TEST(Dashboard, TwoRunsAreDrawnFromTheirMetrics) {
  const fs::path root = temp_dir("dashboard");
  fs::remove_all(root);
  for (const char* name : {"a", "b"}) {
    MetricsWriter w((root / name).string());
    for (int s = 1; s <= 30; ++s) {
      StepMetrics m = sample();
      m.step = s;
      m.loss = 5.0 / s + (name[0] == 'b' ? 0.3 : 0.0);
      if (s % 10 == 0) m.val_loss = m.loss + 0.1;
      m.expert_tokens = {{10, 10, 10, 10}, {40, 0, 0, 0}};  // layer 1 collapsed onto one expert
      w.write(m);
    }
  }
  const RunSeries a = read_run((root / "a").string());
  EXPECT_EQ(a.name, "a");
  ASSERT_EQ(a.step.size(), 30u);
  EXPECT_EQ(a.val_step, (std::vector<double>{10, 20, 30}));
  ASSERT_EQ(a.layer_load[0].size(), 2u);
  EXPECT_DOUBLE_EQ(a.layer_load[0][1], 4.0);
  const std::string png = (root / "dash.png").string();
  write_dashboard({a, read_run((root / "b").string())}, png);
  cairo_surface_t* s = cairo_image_surface_create_from_png(png.c_str());
  ASSERT_EQ(cairo_surface_status(s), CAIRO_STATUS_SUCCESS);
  EXPECT_EQ(cairo_image_surface_get_width(s), 40 + 2 * (760 + 40));
  EXPECT_EQ(cairo_image_surface_get_height(s), 70 + 4 * (380 + 40));
  // Count pixels near each run's colour (blue, red) and the heatmap's darkest red.
  cairo_surface_flush(s);
  const unsigned char* px = cairo_image_surface_get_data(s);
  const int stride = cairo_image_surface_get_stride(s);
  auto count = [&](int r, int g, int b) {
    int n = 0;
    for (int y = 0; y < cairo_image_surface_get_height(s); ++y) {
      for (int x = 0; x < cairo_image_surface_get_width(s); ++x) {
        const unsigned char* p = px + y * stride + 4 * x;  // BGRx
        n += std::abs(p[2] - r) < 12 && std::abs(p[1] - g) < 12 && std::abs(p[0] - b) < 12 ? 1 : 0;
      }
    }
    return n;
  };
  EXPECT_GT(count(31, 120, 181), 500);   // run a
  EXPECT_GT(count(214, 38, 41), 500);    // run b
  EXPECT_GT(count(166, 13, 13), 10000);  // the collapsed layer's row of the heatmap
  cairo_surface_destroy(s);
  std::ofstream(root / "a" / "metrics.jsonl", std::ios::app) << "{not json\n";
  try {
    read_run((root / "a").string());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:31 is not a JSON record"), std::string::npos) << e.what();
  }
  fs::remove_all(root);
}

// The record's detailed groups: collectives by kind (kinds that did not run left out), the
// router entropy per MoE layer, the checkpoint's stall and commit; each also as a scalar.
TEST(Metrics, CollectivesEntropyAndCommitInTheRecord) {
  StepMetrics m = sample();
  std::array<CollectiveTotals, kNumCollectives> c{};
  c[static_cast<int>(Collective::kDispatch)] = {8.0, 2.0, 4, 1e6};
  c[static_cast<int>(Collective::kReduceScatter)] = {3.0, 3.0, 2, 5e5};
  m.collectives = c;
  m.expert_tokens = {{3, 1, 0, 4}, {2, 2, 2, 2}};
  m.router_entropy = {0.25, 1.3};
  m.checkpoint_stall_s = 0.012;
  m.checkpoint_commit = StepMetrics::Commit{30, 1.5, 4096};
  const nlohmann::json j = nlohmann::json::parse(metrics_json(m));
  ASSERT_TRUE(j.contains("collective"));
  EXPECT_EQ(j["collective"].size(), 2u);  // dispatch and reduce_scatter only
  EXPECT_DOUBLE_EQ(j["collective"]["dispatch"]["ms"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(j["collective"]["dispatch"]["exposed_ms"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(j["collective"]["dispatch"]["hidden"].get<double>(), 0.75);
  EXPECT_EQ(j["collective"]["dispatch"]["count"], 4);
  EXPECT_DOUBLE_EQ(j["collective"]["reduce_scatter"]["hidden"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(j["moe"][0]["router_entropy"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(j["moe"][1]["router_entropy"].get<double>(), 1.3);
  EXPECT_DOUBLE_EQ(j["infra"]["checkpoint_stall_ms"].get<double>(), 12.0);
  EXPECT_EQ(j["infra"]["checkpoint_commit"]["saved_step"], 30);
  EXPECT_DOUBLE_EQ(j["infra"]["checkpoint_commit"]["ms"].get<double>(), 1500.0);
  EXPECT_EQ(j["infra"]["checkpoint_commit"]["bytes"], 4096);
  std::set<std::string> tags;
  for (const auto& [tag, value] : metrics_scalars(m)) tags.insert(tag);
  for (const char* want : {"collective/dispatch/ms", "collective/dispatch/hidden", "collective/reduce_scatter/ms",
                           "moe/layer1/router_entropy", "infra/checkpoint_commit_ms"}) {
    EXPECT_TRUE(tags.count(want)) << want;
  }
  EXPECT_FALSE(tags.count("collective/combine/ms"));
  // Without them: no group at all.
  const nlohmann::json plain = nlohmann::json::parse(metrics_json(sample()));
  EXPECT_FALSE(plain.contains("collective"));
  EXPECT_FALSE(plain["infra"].contains("checkpoint_commit"));
}

// A layer whose busiest expert stays at 2x the mean or more for `steps` steps in a row is
// named once per stretch; a balanced step ends the stretch.
TEST(Metrics, ExpertLoadWatchWarnsOnceAStretch) {
  ExpertLoadWatch watch(2.0, 3);
  StepMetrics m = sample();
  m.expert_tokens = {{10, 10, 10, 10}, {40, 0, 0, 0}};  // layer 1: 4x the mean
  EXPECT_EQ(watch.observe(m), "");
  EXPECT_EQ(watch.observe(m), "");
  const std::string w = watch.observe(m);
  EXPECT_NE(w.find("MoE layer 1 "), std::string::npos) << w;
  EXPECT_NE(w.find("router_bias_update_speed"), std::string::npos) << w;
  EXPECT_EQ(watch.observe(m), "");  // said once
  m.expert_tokens[1] = {10, 10, 10, 10};
  EXPECT_EQ(watch.observe(m), "");
  m.expert_tokens = {{40, 0, 0, 0}, {40, 0, 0, 0}};
  EXPECT_EQ(watch.observe(m), "");
  EXPECT_EQ(watch.observe(m), "");
  const std::string both = watch.observe(m);
  EXPECT_NE(both.find("MoE layers 0, 1 "), std::string::npos) << both;
}

// The collective timer on the CPU: spans timed by the host clock, all exposed (Gloo is
// synchronous), counted by kind; take() resets; with no active timer a scope does nothing.
TEST(CollectiveTimer, CpuSpansByKind) {
  CollectiveTimer t(Device::cpu());
  { CollectiveScope s(Collective::kAllGather, nullptr, false); }  // not active: nothing
  CollectiveTimer::activate(&t);
  {
    CollectiveScope s(Collective::kAllGather, nullptr, false);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  { CollectiveScope s(Collective::kPipeline, nullptr, true); }
  CollectiveTimer::count_bytes(Collective::kAllGather, 123);
  CollectiveTimer::activate(nullptr);
  CollectiveTimer::count_bytes(Collective::kAllGather, 1000);  // not active: not counted
  auto totals = t.take();
  const CollectiveTotals& g = totals[static_cast<int>(Collective::kAllGather)];
  EXPECT_EQ(g.count, 1);
  EXPECT_GE(g.ms, 4.0);
  EXPECT_DOUBLE_EQ(g.exposed_ms, g.ms);
  EXPECT_DOUBLE_EQ(g.bytes, 123.0);
  EXPECT_EQ(totals[static_cast<int>(Collective::kPipeline)].count, 1);
  EXPECT_EQ(totals[static_cast<int>(Collective::kDispatch)].count, 0);
  EXPECT_DOUBLE_EQ(totals[static_cast<int>(Collective::kDispatch)].hidden(), 1.0);
  for (const CollectiveTotals& c : t.take()) EXPECT_EQ(c.count, 0);
  EXPECT_EQ(collective_name(Collective::kReduceScatter), "reduce_scatter");
}
