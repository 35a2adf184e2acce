// Launcher of the L2 half probe's kernels (l2_halves.cu); the host side is l2_halves.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace moetrain::ops::cuda {

constexpr int kL2ProbeLines = 64;  // lines in each multiprocessor's chain
constexpr int kMaxSms = 256;

// Bytes of `chains` the probe needs (kMaxSms chains).
size_t l2_probe_chain_bytes();
// The first block on each multiprocessor s (claimed[s] 0 -> 1; zero it first) writes and
// chases chain s; then one block times a chase of each chain: cycles[s] for chains 0..sms-1.
// sink: 2 * kMaxSms words the chases' ends go to.
void launch_l2_probe(int sms, unsigned* chains, int* claimed, unsigned* sink, long long* cycles, cudaStream_t stream);

}  // namespace moetrain::ops::cuda
