#include "engine/telemetry/dashboard.h"

#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace moetrain {

RunSeries read_run(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "metrics.jsonl").string();
  std::ifstream in(path);
  MT_CHECK(in.good(), "plot: cannot read {} (a run's metrics folder holds metrics.jsonl)", path);
  RunSeries r;
  r.name = std::filesystem::path(dir).filename().string();
  if (r.name.empty()) r.name = std::filesystem::path(dir).parent_path().filename().string();
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      MT_THROW("plot: {}:{} is not a JSON record: {}", path, n, e.what());
    }
    auto num = [&](const nlohmann::json& v) { return v.is_number() ? v.get<double>() : std::nan(""); };
    const double step = num(j.value("step", nlohmann::json()));
    MT_CHECK(std::isfinite(step), "plot: {}:{} has no step", path, n);
    r.step.push_back(step);
    r.loss.push_back(num(j.value("loss", nlohmann::json())));
    r.lr.push_back(num(j.value("lr", nlohmann::json())));
    r.grad_norm.push_back(num(j.value("grad_norm", nlohmann::json())));
    r.tokens_per_s.push_back(num(j.value("tokens_per_s", nlohmann::json())));
    r.tflops.push_back(num(j.value("tflops", nlohmann::json())));
    r.load.push_back(num(j.value("expert_load_max_over_mean", nlohmann::json())));
    const nlohmann::json mem = j.value("memory", nlohmann::json::object());
    r.peak_gb.push_back(num(mem.value("peak_bytes", nlohmann::json())) / 1e9);
    r.reserved_gb.push_back(num(mem.value("reserved_bytes", nlohmann::json())) / 1e9);
    if (j.contains("val_loss") && j["val_loss"].is_number()) {
      r.val_step.push_back(step);
      r.val_loss.push_back(j["val_loss"].get<double>());
    }
    std::vector<double> layers;
    for (const auto& l : j.value("moe", nlohmann::json::array())) layers.push_back(num(l.value("load_max_over_mean", nlohmann::json())));
    r.layer_load.push_back(std::move(layers));
  }
  MT_CHECK(!r.step.empty(), "plot: {} holds no step", path);
  return r;
}

namespace {

constexpr int kPanelW = 760, kPanelH = 380, kCols = 2, kRows = 4, kMargin = 40, kTitleH = 70;

struct Rgb {
  double r, g, b;
};
// Distinct on white, in order of the runs given.
const Rgb kColors[] = {{0.12, 0.47, 0.71}, {0.84, 0.15, 0.16}, {0.17, 0.63, 0.17},
                       {0.58, 0.40, 0.74}, {1.00, 0.50, 0.05}, {0.55, 0.34, 0.29}};
Rgb color_of(size_t i) { return kColors[i % (sizeof kColors / sizeof kColors[0])]; }

// About five round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / mag < 1.5 ? mag : raw / mag < 3.5 ? 2 * mag : raw / mag < 7.5 ? 5 * mag : 10 * mag;
  std::vector<double> t;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) t.push_back(v);
  return t;
}

std::string tick_label(double v) {
  const double a = std::fabs(v);
  if (a == 0) return "0";
  if (a >= 1e6) return fmt::format("{:.3g}M", v / 1e6);
  if (a >= 1e4) return fmt::format("{:.3g}k", v / 1e3);
  if (a < 1e-2) return fmt::format("{:.1e}", v);
  return fmt::format("{:.3g}", v);
}

// A panel's plotting area and its data range.
struct Frame {
  double x0, y0, w, h;           // pixels of the plotting area
  double xlo, xhi, ylo, yhi;     // data range
  double px(double x) const { return x0 + (x - xlo) / (xhi - xlo) * w; }
  double py(double y) const { return y0 + h - (y - ylo) / (yhi - ylo) * h; }
};

void text(cairo_t* c, double x, double y, const std::string& s, double size, bool center = false, bool right = false) {
  cairo_set_font_size(c, size);
  cairo_text_extents_t e;
  cairo_text_extents(c, s.c_str(), &e);
  cairo_move_to(c, center ? x - e.width / 2 - e.x_bearing : right ? x - e.width - e.x_bearing : x, y);
  cairo_show_text(c, s.c_str());
}

// The axes, ticks and title of panel (col, row), for data in [xlo, xhi] x [ylo, yhi].
Frame frame(cairo_t* c, int col, int row, const std::string& title, double xlo, double xhi, double ylo, double yhi,
            bool y_ticks = true) {
  if (!(xhi > xlo)) xhi = xlo + 1;
  if (!(yhi > ylo)) {
    const double pad = std::max(std::fabs(ylo) * 0.05, 1e-9);
    ylo -= pad;
    yhi += pad;
  } else {
    const double pad = (yhi - ylo) * 0.05;
    ylo = ylo >= 0 && ylo - pad < 0 ? 0 : ylo - pad;
    yhi += pad;
  }
  const double left = kMargin + col * (kPanelW + kMargin), top = kTitleH + row * (kPanelH + kMargin);
  Frame f{left + 70, top + 30, kPanelW - 90.0, kPanelH - 70.0, xlo, xhi, ylo, yhi};
  cairo_set_source_rgb(c, 0, 0, 0);
  text(c, left + kPanelW / 2.0, top + 18, title, 16, true);
  cairo_set_line_width(c, 1);
  cairo_rectangle(c, f.x0, f.y0, f.w, f.h);
  cairo_stroke(c);
  for (double y : y_ticks ? ticks(ylo, yhi) : std::vector<double>{}) {
    cairo_set_source_rgb(c, 0.9, 0.9, 0.9);
    cairo_move_to(c, f.x0, f.py(y));
    cairo_line_to(c, f.x0 + f.w, f.py(y));
    cairo_stroke(c);
    cairo_set_source_rgb(c, 0, 0, 0);
    text(c, f.x0 - 6, f.py(y) + 4, tick_label(y), 11, false, true);
  }
  for (double x : ticks(xlo, xhi)) {
    cairo_set_source_rgb(c, 0, 0, 0);
    text(c, f.px(x), f.y0 + f.h + 16, tick_label(x), 11, true);
  }
  text(c, f.x0 + f.w / 2, f.y0 + f.h + 34, "step", 12, true);
  return f;
}

void line(cairo_t* c, const Frame& f, const std::vector<double>& xs, const std::vector<double>& ys, Rgb col,
          bool dashed = false, bool dots = false) {
  cairo_save(c);
  cairo_rectangle(c, f.x0, f.y0, f.w, f.h);
  cairo_clip(c);
  cairo_set_source_rgb(c, col.r, col.g, col.b);
  cairo_set_line_width(c, 1.6);
  if (dashed) {
    const double d[] = {6, 4};
    cairo_set_dash(c, d, 2, 0);
  }
  bool pen = false;
  for (size_t i = 0; i < xs.size() && i < ys.size(); ++i) {
    if (!std::isfinite(ys[i])) {
      pen = false;
      continue;
    }
    if (dots) cairo_arc(c, f.px(xs[i]), f.py(ys[i]), 3, 0, 2 * M_PI), cairo_fill(c);
    if (pen) cairo_line_to(c, f.px(xs[i]), f.py(ys[i]));
    else cairo_move_to(c, f.px(xs[i]), f.py(ys[i]));
    pen = true;
  }
  cairo_stroke(c);
  cairo_restore(c);
}

void range_of(const std::vector<double>& v, double& lo, double& hi) {
  for (double x : v) {
    if (!std::isfinite(x)) continue;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
}

// A panel of one series (and optionally a second, dashed) per run.
void series_panel(cairo_t* c, const std::vector<RunSeries>& runs, int col, int row, const std::string& title,
                  const std::function<const std::vector<double>&(const RunSeries&)>& y,
                  const std::function<const std::vector<double>*(const RunSeries&)>& dashed = {}) {
  double xlo = 1e300, xhi = -1e300, ylo = 1e300, yhi = -1e300;
  for (const RunSeries& r : runs) {
    range_of(r.step, xlo, xhi);
    range_of(y(r), ylo, yhi);
    if (dashed && dashed(r)) range_of(*dashed(r), ylo, yhi);
  }
  if (ylo > yhi) ylo = 0, yhi = 1;
  const Frame f = frame(c, col, row, title, xlo, xhi, ylo, yhi);
  for (size_t i = 0; i < runs.size(); ++i) {
    line(c, f, runs[i].step, y(runs[i]), color_of(i));
    if (dashed && dashed(runs[i])) line(c, f, runs[i].step, *dashed(runs[i]), color_of(i), true);
  }
}

// Loss: training lines, validation as dots joined by a dashed line.
void loss_panel(cairo_t* c, const std::vector<RunSeries>& runs) {
  double xlo = 1e300, xhi = -1e300, ylo = 1e300, yhi = -1e300;
  for (const RunSeries& r : runs) {
    range_of(r.step, xlo, xhi);
    range_of(r.loss, ylo, yhi);
    range_of(r.val_loss, ylo, yhi);
  }
  const Frame f = frame(c, 0, 0, "loss (line: training; dots: validation)", xlo, xhi, ylo, yhi);
  for (size_t i = 0; i < runs.size(); ++i) {
    line(c, f, runs[i].step, runs[i].loss, color_of(i));
    line(c, f, runs[i].val_step, runs[i].val_loss, color_of(i), true, true);
  }
}

// The first run's per-layer load (busiest expert / mean) as colours: white at 1 (balanced),
// dark red at the top of the scale.
void heatmap_panel(cairo_t* c, const RunSeries& r) {
  size_t layers = 0;
  double hi = 1;
  for (const auto& s : r.layer_load) {
    layers = std::max(layers, s.size());
    for (double v : s) hi = std::isfinite(v) ? std::max(hi, v) : hi;
  }
  double xlo = 1e300, xhi = -1e300;
  range_of(r.step, xlo, xhi);
  const std::string title = fmt::format("{}: busiest expert / mean, per MoE layer (1 = balanced, dark = {:.2f})",
                                        r.name, hi);
  Frame f = frame(c, 1, 3, title, xlo, xhi, 0, std::max<double>(layers, 1), /*y_ticks=*/false);
  f.ylo = 0;
  f.yhi = std::max<double>(layers, 1);
  if (layers == 0) {
    text(c, f.x0 + f.w / 2, f.y0 + f.h / 2, "no MoE layer in this run", 14, true);
    return;
  }
  const double cell_w = f.w / std::max<double>(r.step.size(), 1), cell_h = f.h / static_cast<double>(layers);
  for (size_t t = 0; t < r.layer_load.size(); ++t) {
    for (size_t l = 0; l < r.layer_load[t].size(); ++l) {
      const double v = r.layer_load[t][l];
      const double a = std::isfinite(v) && hi > 1 ? std::clamp((v - 1) / (hi - 1), 0.0, 1.0) : 0;
      cairo_set_source_rgb(c, 1 - 0.35 * a, 1 - 0.95 * a, 1 - 0.95 * a);
      cairo_rectangle(c, f.x0 + t * cell_w, f.y0 + f.h - (l + 1) * cell_h, cell_w + 0.5, cell_h + 0.5);
      cairo_fill(c);
    }
  }
  cairo_set_source_rgb(c, 0, 0, 0);
  for (size_t l = 0; l < layers; ++l) text(c, f.x0 - 6, f.y0 + f.h - (l + 0.5) * cell_h + 4, std::to_string(l), 11, false, true);
  cairo_rectangle(c, f.x0, f.y0, f.w, f.h);
  cairo_stroke(c);
}

}  // namespace

void write_dashboard(const std::vector<RunSeries>& runs, const std::string& png) {
  MT_CHECK(!runs.empty(), "plot: no run to draw");
  const int width = kMargin + kCols * (kPanelW + kMargin), height = kTitleH + kRows * (kPanelH + kMargin);
  cairo_surface_t* s = cairo_image_surface_create(CAIRO_FORMAT_RGB24, width, height);
  cairo_t* c = cairo_create(s);
  cairo_set_source_rgb(c, 1, 1, 1);
  cairo_paint(c);
  cairo_select_font_face(c, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  // The legend: each run's name in its colour.
  double x = kMargin;
  cairo_set_source_rgb(c, 0, 0, 0);
  text(c, x, 32, "moetrain runs:", 18);
  x += 150;
  for (size_t i = 0; i < runs.size(); ++i) {
    const Rgb col = color_of(i);
    cairo_set_source_rgb(c, col.r, col.g, col.b);
    cairo_rectangle(c, x, 20, 24, 14);
    cairo_fill(c);
    text(c, x + 30, 32, fmt::format("{} ({} steps)", runs[i].name, runs[i].step.size()), 16);
    cairo_text_extents_t e;
    cairo_text_extents(c, runs[i].name.c_str(), &e);
    x += 30 + e.x_advance + 140;
  }
  loss_panel(c, runs);
  series_panel(c, runs, 1, 0, "learning rate", [](const RunSeries& r) -> const std::vector<double>& { return r.lr; });
  series_panel(c, runs, 0, 1, "gradient norm (before clipping)",
               [](const RunSeries& r) -> const std::vector<double>& { return r.grad_norm; });
  series_panel(c, runs, 1, 1, "tokens/s", [](const RunSeries& r) -> const std::vector<double>& { return r.tokens_per_s; });
  series_panel(c, runs, 0, 2, "TFLOP/s (achieved)",
               [](const RunSeries& r) -> const std::vector<double>& { return r.tflops; });
  series_panel(
      c, runs, 1, 2, "memory, GB (line: peak; dashed: reserved)",
      [](const RunSeries& r) -> const std::vector<double>& { return r.peak_gb; },
      [](const RunSeries& r) -> const std::vector<double>* { return &r.reserved_gb; });
  series_panel(c, runs, 0, 3, "expert load: busiest expert / mean, worst layer (1 = balanced)",
               [](const RunSeries& r) -> const std::vector<double>& { return r.load; });
  heatmap_panel(c, runs[0]);
  cairo_destroy(c);
  const cairo_status_t st = cairo_surface_write_to_png(s, png.c_str());
  cairo_surface_destroy(s);
  MT_CHECK(st == CAIRO_STATUS_SUCCESS, "plot: cannot write {}: {}", png, cairo_status_to_string(st));
}

}  // namespace moetrain
