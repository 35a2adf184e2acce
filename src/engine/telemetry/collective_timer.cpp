#include "engine/telemetry/collective_timer.h"

#include <algorithm>

#include "core/cuda_runtime.h"

namespace moetrain {

std::string_view collective_name(Collective c) {
  static constexpr std::string_view kNames[] = {"dispatch", "combine", "all_gather", "reduce_scatter", "all_reduce",
                                                "pipeline", "context_ring", "tensor_parallel"};
  return kNames[static_cast<int>(c)];
}

namespace {
thread_local CollectiveTimer* t_active = nullptr;
double ms_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
}  // namespace

CollectiveTimer::CollectiveTimer(Device device) : device_(device) {}

CollectiveTimer::~CollectiveTimer() {
  if (t_active == this) t_active = nullptr;
  for (const Span& s : spans_) {
    for (void* e : {s.start, s.stop}) {
      if (e) free_events_.push_back(e);
    }
  }
  for (void* e : free_events_) {
    try {
      cuda::destroy_event(e);
    } catch (...) {  // a destructor must not throw
    }
  }
}

void CollectiveTimer::activate(CollectiveTimer* t) { t_active = t; }
CollectiveTimer* CollectiveTimer::active() { return t_active; }

void* CollectiveTimer::compute_stream() const { return device_.is_cpu() ? nullptr : cuda::current_stream(); }

void* CollectiveTimer::event() {
  if (free_events_.empty()) return cuda::create_event();
  void* e = free_events_.back();
  free_events_.pop_back();
  return e;
}

int64_t CollectiveTimer::begin(Collective k, void* stream, bool on_compute, bool continues) {
  Span s{k, on_compute || device_.is_cpu(), false, continues, nullptr, nullptr, {}, {}};
  if (device_.is_cpu()) {
    s.t0 = std::chrono::steady_clock::now();
  } else {
    s.start = event();
    cuda::record_event(s.start, stream);
  }
  spans_.push_back(s);
  return static_cast<int64_t>(spans_.size()) - 1;
}

void CollectiveTimer::end(int64_t handle, void* stream) {
  if (handle < 0 || handle >= static_cast<int64_t>(spans_.size())) return;  // taken meanwhile
  Span& s = spans_[static_cast<size_t>(handle)];
  if (device_.is_cpu()) {
    s.t1 = std::chrono::steady_clock::now();
  } else {
    s.stop = event();
    cuda::record_event(s.stop, stream);
  }
}

void CollectiveTimer::wait(Collective k, void* compute, void* done) {
  CollectiveTimer* t = active();
  if (t == nullptr || t->device_.is_cpu()) {
    cuda::stream_wait_event(compute, done);
    return;
  }
  Span s{k, false, true, false, t->event(), nullptr, {}, {}};
  cuda::record_event(s.start, compute);
  cuda::stream_wait_event(compute, done);
  s.stop = t->event();
  cuda::record_event(s.stop, compute);
  t->spans_.push_back(s);
}

std::array<CollectiveTotals, kNumCollectives> CollectiveTimer::take() {
  std::array<CollectiveTotals, kNumCollectives> out = totals_;
  for (Span& s : spans_) {
    CollectiveTotals& t = out[static_cast<int>(s.kind)];
    double ms = 0;
    if (device_.is_cpu()) {
      ms = s.t1 > s.t0 ? ms_between(s.t0, s.t1) : 0.0;  // a span never ended (an exception) counts nothing
    } else if (s.stop != nullptr) {
      ms = cuda::elapsed_ms(s.start, s.stop);
    }
    if (s.is_wait) {
      t.exposed_ms += ms;
    } else {
      t.ms += ms;
      if (!s.continues) ++t.count;
      if (s.exposed_all) t.exposed_ms += ms;
    }
    for (void* e : {s.start, s.stop}) {
      if (e) free_events_.push_back(e);
    }
  }
  spans_.clear();
  totals_ = {};
  // A wait may outlast the collective's own run (it also covers the compute stream catching
  // up with work queued before it): never more exposed than ran.
  for (CollectiveTotals& t : out) t.exposed_ms = std::min(t.exposed_ms, t.ms);
  return out;
}

}  // namespace moetrain
