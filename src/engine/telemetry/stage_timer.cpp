#include "engine/telemetry/stage_timer.h"

#include "core/cuda_runtime.h"

namespace moetrain {

std::string_view stage_name(Stage s) {
  static constexpr std::string_view kNames[] = {"attention", "router+permute", "expert GEMMs", "combine",
                                                "norms",     "loss",           "optimizer",    "other"};
  return kNames[static_cast<int>(s)];
}

namespace {
thread_local StageTimer* t_active = nullptr;
}

StageTimer::StageTimer(Device device) : device_(device) {}

StageTimer::~StageTimer() {
  if (t_active == this) t_active = nullptr;
  for (void* e : events_) {
    try {
      cuda::destroy_event(e);
    } catch (...) {
    }
  }
}

void StageTimer::activate(StageTimer* t) { t_active = t; }
StageTimer* StageTimer::active() { return t_active; }

void* StageTimer::event_at(size_t i) {
  while (events_.size() <= i) events_.push_back(cuda::create_event());
  return events_[i];
}

void StageTimer::switch_to(Stage s) {
  if (s == current_ && !marks_.empty()) return;
  Mark m{s, nullptr, {}};
  if (device_.is_cpu()) {
    m.t = std::chrono::steady_clock::now();
  } else {
    m.event = event_at(marks_.size());
    cuda::record_event(m.event, cuda::current_stream());
  }
  marks_.push_back(m);
  current_ = s;
}

std::array<double, kNumStages> StageTimer::totals_ms() {
  std::array<double, kNumStages> out{};
  switch_to(Stage::kOther);  // closes the running stage
  for (size_t i = 0; i + 1 < marks_.size(); ++i) {
    const Mark &a = marks_[i], &b = marks_[i + 1];
    const double ms = device_.is_cpu() ? std::chrono::duration<double, std::milli>(b.t - a.t).count()
                                       : cuda::elapsed_ms(a.event, b.event);
    out[static_cast<int>(a.stage)] += ms;
  }
  return out;
}

void StageTimer::reset() {
  marks_.clear();
  current_ = Stage::kOther;
}

}  // namespace moetrain
