// Which half of the L2 cache each multiprocessor of the current GPU sits next to.
//
// An H100's L2 is two partitions joined by a fabric; a line a multiprocessor reads is also
// kept in the partition next to it. When the blocks of a kernel that share operands (the
// grouped expert GEMMs: every row tile of an expert reads that expert's weights) sit in
// both halves, each half fetches its own copy through the fabric, which Nsight Compute
// showed as the limit of those kernels. Knowing the halves, a kernel can hand an expert's
// tiles to blocks of one half.
//
// Measured once per device (about a millisecond): every multiprocessor first-touches a chain
// of its own lines, then one block times a re-read of each chain. Chains touched in the
// reader's half come back from its near partition (~290 cycles on an H100), the others ~30%
// slower; a clear gap splits the multiprocessors in two. The probe holds ~170 MB of device
// memory for that moment. No gap (another GPU), a probe that could not run (its memory, a
// failed launch: logged), or the environment variable MOETRAIN_L2_HALVES=0 give an empty
// map, and the kernels fall back to one queue; results never depend on the map.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace moetrain::ops::cuda {

struct SmHalves {
  const uint8_t* device_map = nullptr;  // [%smid] -> 0 or 1 (device memory); nullptr: unknown
  int count[2] = {0, 0};                // multiprocessors in each half
  bool known() const { return device_map != nullptr; }
};

// The map of the current device, probed on first use (on `stream`, which it waits for).
const SmHalves& sm_l2_halves(cudaStream_t stream);

// The probe's decision from its chain times (one per multiprocessor): two groups split by
// the widest gap of the sorted times, when that gap is at least 10% of the fastest time and
// each group holds a quarter of the multiprocessors or more. half[s] is 0 for the group of
// multiprocessor 0. False (half and count untouched) when there is no such split.
bool split_l2_halves(const std::vector<long long>& cycles, std::vector<uint8_t>& half, int count[2]);

}  // namespace moetrain::ops::cuda
