#include "ops/cuda/l2_halves.h"

#include "ops/cuda/kernels.cuh"
#include "ops/cuda/l2_halves_launch.h"

namespace moetrain::ops::cuda {
namespace {

constexpr int kLines = kL2ProbeLines;
constexpr size_t kLineWords = (4096 + 128) / 4;  // words between a chain's lines (spread over slices)

// L2 only (no L1), so a re-read is an L2 hit and not an L1 one.
__device__ __forceinline__ unsigned load_cg(const unsigned* p) {
  unsigned v;
  asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The first block to run on each multiprocessor writes that multiprocessor's chain (line k
// holds the word offset of line (97 k + 13) mod kLines: a permutation, so the chase visits
// every line) and chases it once, so its lines sit in that multiprocessor's half.
__global__ void touch_kernel(unsigned* buf, int* claimed, unsigned* sink) {
  const unsigned s = sm_id();
  if (threadIdx.x != 0 || s >= kMaxSms || atomicCAS(&claimed[s], 0, 1) != 0) return;
  unsigned* chain = buf + static_cast<size_t>(s) * kLines * kLineWords;
  for (int k = 0; k < kLines; ++k) {
    chain[k * kLineWords] = static_cast<unsigned>(((k * 97 + 13) % kLines) * kLineWords);
  }
  __threadfence();
  unsigned at = 0;
  for (int k = 0; k < kLines; ++k) at = load_cg(chain + at);
  sink[s] = at;
}

// One thread chases every chain in turn; the chase serialises the loads, so the time of a
// chain is kLines L2 round trips from this multiprocessor.
__global__ void reread_kernel(const unsigned* buf, int sms, long long* cycles, unsigned* sink) {
  if (threadIdx.x != 0) return;
  for (int s = 0; s < sms; ++s) {
    const unsigned* chain = buf + static_cast<size_t>(s) * kLines * kLineWords;
    unsigned at = 0;
    const long long t0 = clock64();
    for (int k = 0; k < kLines; ++k) at = load_cg(chain + at);
    sink[kMaxSms + s] = at;  // the chase's end is used before the clock is read again
    cycles[s] = clock64() - t0;
  }
}

}  // namespace

void launch_l2_probe(int sms, unsigned* chains, int* claimed, unsigned* sink, long long* cycles, cudaStream_t stream) {
  touch_kernel<<<sms * 8, 32, 0, stream>>>(chains, claimed, sink);
  reread_kernel<<<1, 32, 0, stream>>>(chains, sms, cycles, sink);
}

size_t l2_probe_chain_bytes() { return static_cast<size_t>(kMaxSms) * kLines * kLineWords * 4; }

}  // namespace moetrain::ops::cuda
