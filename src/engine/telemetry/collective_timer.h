// CollectiveTimer: how long a step's collectives take, by kind, and how much of it the
// compute waited for (the rest ran hidden behind compute on a communication stream).
//
// The code that enqueues a collective brackets it with begin()/end() on the stream it runs
// on, and wherever the compute stream waits for a collective running elsewhere it calls
// wait(). On the GPU these record CUDA events (no synchronisation until take() reads
// them); on the CPU (Gloo, synchronous) a steady clock times the call, all of it exposed.
// A collective enqueued on the compute stream itself counts as exposed too.
//
// Nothing happens unless a timer is active on the thread (the trainer activates one per
// run, `moetrain bench` one for its timed steps).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/device.h"

namespace moetrain {

enum class Collective {
  kDispatch,       // expert parallelism: the dispatch's exchanges, forward and backward
  kCombine,        // expert parallelism: the combine's exchanges, forward and backward
  kAllGather,      // FSDP: weights gathered from their shards
  kReduceScatter,  // FSDP: gradients reduced onto their shards
  kAllReduce,      // HSDP and live fault tolerance: gradients summed across replica groups
  kPipeline,       // pipeline: receiving activations and their gradients (the wait includes the bubble)
  kContextRing,    // context parallelism: key/value blocks (and their gradient sums) passed round the ring
  kTensorParallel, // tensor parallelism: token rows gathered before split layers, partial sums reduce-scattered after
  kCount
};
constexpr int kNumCollectives = static_cast<int>(Collective::kCount);
std::string_view collective_name(Collective c);  // "dispatch", "combine", "all_gather", ...

struct CollectiveTotals {
  double ms = 0;          // time the collectives ran (on their streams)
  double exposed_ms = 0;  // time the compute stream waited for them (<= ms, or = ms on the compute stream)
  int64_t count = 0;
  double bytes = 0;       // sent to other ranks, where the caller counts them
  // Share of `ms` hidden behind compute, in [0, 1] (1 when nothing ran).
  double hidden() const { return ms > 0 ? std::max(0.0, 1.0 - exposed_ms / ms) : 1.0; }
};

class CollectiveTimer {
 public:
  explicit CollectiveTimer(Device device);
  ~CollectiveTimer();
  CollectiveTimer(const CollectiveTimer&) = delete;
  CollectiveTimer& operator=(const CollectiveTimer&) = delete;

  // Makes this the thread's active timer (nullptr deactivates).
  static void activate(CollectiveTimer* t);
  static CollectiveTimer* active();

  // A collective of kind k enqueued on `stream` (a cuda::Stream; ignored on the CPU) from
  // begin() to end(); `on_compute`: the compute stream runs it, so all of it is exposed.
  // Returns a handle for end(). `continues`: the second half of a collective already
  // counted (a dispatch started in one call and finished in another): its time adds, its
  // count does not.
  int64_t begin(Collective k, void* stream, bool on_compute, bool continues = false);
  void end(int64_t handle, void* stream);
  // The compute stream `compute` is about to wait for event `done` of a kind-k collective:
  // the wait is timed as exposed. Makes the stream wait (with or without a timer: callers
  // use this in place of cuda::stream_wait_event).
  static void wait(Collective k, void* compute, void* done);
  // Bytes a kind-k collective sends to other ranks, on the active timer (nothing without one).
  static void count_bytes(Collective k, double bytes) {
    if (CollectiveTimer* t = active()) t->totals_[static_cast<int>(k)].bytes += bytes;
  }
  // The thread's current stream on a GPU, nullptr on the CPU.
  void* compute_stream() const;

  // Totals since the last take() (waits for the device), then starts afresh.
  std::array<CollectiveTotals, kNumCollectives> take();

 private:
  struct Span {
    Collective kind;
    bool exposed_all;  // ran on the compute stream (or the CPU)
    bool is_wait;      // a wait of the compute stream, not a run
    bool continues;    // the rest of a collective counted before
    void *start, *stop;
    std::chrono::steady_clock::time_point t0, t1;
  };
  void* event();
  Device device_;
  std::vector<Span> spans_;
  std::vector<void*> free_events_;
  std::array<CollectiveTotals, kNumCollectives> totals_{};  // host-timed parts and bytes
};

// Brackets one collective on the active timer, if any.
class CollectiveScope {
 public:
  // On `stream` (a GPU's communication stream).
  CollectiveScope(Collective k, void* stream, bool on_compute, bool continues = false)
      : timer_(CollectiveTimer::active()), stream_(stream) {
    if (timer_) handle_ = timer_->begin(k, stream, on_compute, continues);
  }
  // On the compute stream (the current one on a GPU; the host clock on the CPU): all exposed.
  explicit CollectiveScope(Collective k, bool continues = false) : timer_(CollectiveTimer::active()) {
    if (timer_) {
      stream_ = timer_->compute_stream();
      handle_ = timer_->begin(k, stream_, /*on_compute=*/true, continues);
    }
  }
  ~CollectiveScope() {
    try {
      if (timer_) timer_->end(handle_, stream_);
    } catch (...) {  // a destructor must not throw; a broken stream surfaces at the next use
    }
  }
  CollectiveScope(const CollectiveScope&) = delete;
  CollectiveScope& operator=(const CollectiveScope&) = delete;

 private:
  CollectiveTimer* timer_;
  void* stream_ = nullptr;
  int64_t handle_ = -1;
};

}  // namespace moetrain
