// The signal between the GPUs of one host (ops.h: signal_peers_and_wait), as one warp.
#include "ops/cuda/peer_signal_launch.h"

#include <cstdio>

namespace moetrain::ops::cuda {
namespace {

// Lane q writes rank q's word `rank`, then waits for its own word q. The release store
// (system scope) orders what this stream finished before the kernel (the exchange's copies)
// ahead of the signal; the acquire load orders the peers' copies ahead of what follows.
__global__ void signal_wait_kernel(SignalArgs a) {
  const int q = static_cast<int>(threadIdx.x);
  if (q >= a.ranks || q == a.rank) return;
  unsigned* theirs = a.words[q] + a.rank;
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(theirs), "r"(a.value) : "memory");
  const unsigned* mine = a.words[a.rank] + q;
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
    if (static_cast<int>(v - a.value) >= 0) break;
    __nanosleep(32);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > a.timeout_ns) {  // a peer that never signals: stop, never hang
      printf("moetrain: peer exchange barrier %u: rank %d waited more than %llu s for rank %d's signal "
             "(MOETRAIN_COMM_TIMEOUT); stopping the kernel\n",
             a.value, a.rank, a.timeout_ns / 1000000000ull, q);
      __trap();
    }
  }
}

__global__ void signal_word_kernel(unsigned* word, unsigned value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(word), "r"(value) : "memory");
}

__global__ void wait_word_kernel(const unsigned* word, unsigned value, unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(word) : "memory");
    if (static_cast<int>(v - value) >= 0) break;
    __nanosleep(64);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {  // a peer that never signals: stop, never hang
      printf("moetrain: pipeline message %u: waited more than %llu s for a peer's signal (MOETRAIN_COMM_TIMEOUT); "
             "stopping the kernel\n", value, timeout_ns / 1000000000ull);
      __trap();
    }
  }
}

}  // namespace

void launch_signal_word(unsigned* word, unsigned value, cudaStream_t stream) {
  signal_word_kernel<<<1, 1, 0, stream>>>(word, value);
}

void launch_wait_word(const unsigned* word, unsigned value, unsigned long long timeout_ns, cudaStream_t stream) {
  wait_word_kernel<<<1, 1, 0, stream>>>(word, value, timeout_ns);
}

void launch_signal_peers_and_wait(const SignalArgs& a, cudaStream_t stream) {
  signal_wait_kernel<<<1, 32, 0, stream>>>(a);
}

}  // namespace moetrain::ops::cuda
