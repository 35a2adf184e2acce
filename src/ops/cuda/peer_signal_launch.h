// Launcher of the signal between the GPUs of one host (peer_signal.cu); the host side, with
// the checks, is peer_signal.cpp (ops.h: signal_peers_and_wait).
#pragma once

#include <cuda_runtime.h>

namespace moetrain::ops::cuda {

constexpr int kMaxSignalRanks = 32;

struct SignalArgs {
  unsigned* words[kMaxSignalRanks];  // rank q's signal words, as this GPU addresses them
  int ranks, rank;
  unsigned value;
  unsigned long long timeout_ns;  // a wait longer than this stops the kernel (a trap)
};

void launch_signal_peers_and_wait(const SignalArgs& a, cudaStream_t stream);
void launch_signal_word(unsigned* word, unsigned value, cudaStream_t stream);
void launch_wait_word(const unsigned* word, unsigned value, unsigned long long timeout_ns, cudaStream_t stream);

}  // namespace moetrain::ops::cuda
