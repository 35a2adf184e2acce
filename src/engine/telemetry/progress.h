// ProgressBar: one line on stderr, redrawn in place with '\r', for long loops. It draws
// only when enabled and stderr is a terminal, so logs and pipes never see it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace moetrain {

class ProgressBar {
 public:
  ProgressBar(int64_t total, bool enabled);
  ~ProgressBar();

  // Draws "[#####.....]  40/600  6.7%  0:12<2:48  <suffix>".
  void update(int64_t step, const std::string& suffix = {});
  // Erases the bar so that a log line can be printed; the next update() draws it again.
  void clear();
  // Leaves the last drawing on its own line. Called by the destructor if not before.
  void finish();

  bool active() const { return enabled_; }

 private:
  int64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace moetrain
