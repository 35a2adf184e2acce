#include "engine/telemetry/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace moetrain {
namespace {

std::string clock_str(double seconds) {
  const int64_t s = static_cast<int64_t>(std::max(0.0, seconds));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace

ProgressBar::ProgressBar(int64_t total, bool enabled)
    : total_(std::max<int64_t>(total, 1)),
      enabled_(enabled && isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(int64_t step, const std::string& suffix) {
  if (!enabled_) return;
  constexpr int kWidth = 30;
  const double frac = std::clamp(static_cast<double>(step) / static_cast<double>(total_), 0.0, 1.0);
  const int filled = static_cast<int>(frac * kWidth);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
  const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
  const std::string line = fmt::format("[{}] {}/{} {:5.1f}% {}<{} {}", bar, step, total_, 100 * frac,
                                       clock_str(elapsed), clock_str(eta), suffix);
  // "\x1b[K" erases what a longer previous line left to the right.
  std::fputs(("\r" + line + "\x1b[K").c_str(), stderr);
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::clear() {
  if (!enabled_ || !drawn_) return;
  std::fputs("\r\x1b[K", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  std::fputs("\n", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

}  // namespace moetrain
