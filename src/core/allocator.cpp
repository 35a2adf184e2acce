#include "core/allocator.h"

#include <atomic>
#include <cstdlib>

#include "core/error.h"

namespace moetrain {
namespace {
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
constexpr size_t kAlign = 64;
}  // namespace

void* host_alloc(size_t bytes) {
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (rounded == 0) rounded = kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  MT_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
  int64_t live = g_live.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}

void host_free(void* p, size_t bytes) {
  if (!p) return;
  std::free(p);
  g_live.fetch_sub(static_cast<int64_t>(bytes));
}

MemoryStats host_memory_stats() { return {g_live.load(), g_peak.load()}; }
void reset_host_peak() { g_peak.store(g_live.load()); }

}  // namespace moetrain
