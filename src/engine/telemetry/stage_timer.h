// StageTimer: where a training step's time goes, by stage (attention, router+permute,
// expert GEMMs, combine, norms, loss, optimizer). On the GPU it records CUDA events on the
// current stream at every stage switch, so timing adds no synchronisation until totals are
// read; on the CPU it reads a steady clock.
//
// Code marks its stages with StageScope, which does nothing unless a timer is active on
// the thread (the trainer activates one only for `moetrain bench`).
#pragma once

#include <array>
#include <chrono>
#include <string_view>
#include <vector>

#include "core/device.h"

namespace moetrain {

enum class Stage { kAttention, kRouterPermute, kExpertGemm, kCombine, kNorms, kLoss, kOptimizer, kOther, kCount };
constexpr int kNumStages = static_cast<int>(Stage::kCount);
std::string_view stage_name(Stage s);

class StageTimer {
 public:
  explicit StageTimer(Device device);
  ~StageTimer();
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

  // Makes this the thread's active timer (nullptr deactivates).
  static void activate(StageTimer* t);
  static StageTimer* active();

  // Ends the running stage (if any) and starts `s`.
  void switch_to(Stage s);
  Stage current() const { return current_; }
  // Milliseconds per stage since the last reset (waits for the device).
  std::array<double, kNumStages> totals_ms();
  void reset();

 private:
  struct Mark {
    Stage stage;
    void* event;  // GPU: cudaEvent_t recorded when the stage started
    std::chrono::steady_clock::time_point t;  // CPU
  };
  void* event_at(size_t i);
  Device device_;
  Stage current_ = Stage::kOther;
  std::vector<Mark> marks_;
  std::vector<void*> events_;  // pool, reused across resets
};

// Runs its scope as stage `s` on the active timer, restoring the previous stage at exit.
class StageScope {
 public:
  explicit StageScope(Stage s) : timer_(StageTimer::active()) {
    if (timer_) {
      previous_ = timer_->current();
      timer_->switch_to(s);
    }
  }
  ~StageScope() {
    if (timer_) timer_->switch_to(previous_);
  }
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

 private:
  StageTimer* timer_;
  Stage previous_ = Stage::kOther;
};

}  // namespace moetrain
