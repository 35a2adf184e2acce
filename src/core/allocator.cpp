#include "core/allocator.h"

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "core/error.h"

namespace moetrain {
namespace {
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};
constexpr size_t kAlign = 64;
}  // namespace

void keep_host_heap() {
  // Every block from the heap (never mmap, whose blocks go back on free), and a heap that is
  // never trimmed. Both settings also turn off glibc's dynamic thresholds.
  constexpr int kNever = 1 << 30;
  (void)mallopt(M_MMAP_THRESHOLD, kNever);
  (void)mallopt(M_TRIM_THRESHOLD, kNever);
}

// Aligned by hand (malloc's 16 bytes, up to 64, the block's own address kept just before the
// pointer) rather than with aligned_alloc: glibc's aligned allocations ask for the alignment
// on top of the size, so a block freed by one step could not serve the same request the
// next step, and the heap grew instead.
void* host_alloc(size_t bytes) {
  size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  if (rounded == 0) rounded = kAlign;
  void* block = std::malloc(rounded + kAlign);
  MT_CHECK(block != nullptr, "out of host memory allocating {} bytes", bytes);
  const uintptr_t at = (reinterpret_cast<uintptr_t>(block) + sizeof(void*) + kAlign - 1) & ~uintptr_t(kAlign - 1);
  void* p = reinterpret_cast<void*>(at);
  static_cast<void**>(p)[-1] = block;
  int64_t live = g_live.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}

void host_free(void* p, size_t bytes) {
  if (!p) return;
  std::free(static_cast<void**>(p)[-1]);
  g_live.fetch_sub(static_cast<int64_t>(bytes));
}

MemoryStats host_memory_stats() { return {g_live.load(), g_peak.load()}; }
void reset_host_peak() { g_peak.store(g_live.load()); }

}  // namespace moetrain
