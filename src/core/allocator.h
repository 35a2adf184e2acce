// Host memory for tensors: 64-byte aligned blocks, with live and peak byte counts that
// telemetry reports as the run's memory use.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moetrain {

void* host_alloc(size_t bytes);
void host_free(void* p, size_t bytes);

struct MemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
MemoryStats host_memory_stats();
void reset_host_peak();

}  // namespace moetrain
