// Host memory for tensors: 64-byte aligned blocks, with live and peak byte counts that
// telemetry reports as the run's memory use.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moetrain {

// Keeps the C heap from handing memory back to the kernel between steps: glibc trims the
// top of its heap once 128 KB or more is free there and serves large blocks by mmap, so a
// training step, which frees and allocates the same large tensors every micro-batch, paid
// page faults to zero the same memory again and again (1.3-1.5 s of kernel time in 30 steps
// of the tiny model on the CPU, against 0.3 s without). The process's resident memory stays
// at its peak instead, as it does on the GPU with the stream-ordered pool. Called once at
// start by the moetrain program (not by libraries or tests).
void keep_host_heap();

void* host_alloc(size_t bytes);
void host_free(void* p, size_t bytes);

struct MemoryStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
};
MemoryStats host_memory_stats();
void reset_host_peak();

}  // namespace moetrain
