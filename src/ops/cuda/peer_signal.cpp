#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/peer_signal_launch.h"

namespace moetrain::ops::cuda {

void signal_peers_and_wait(const std::vector<void*>& peer_words, int rank, uint32_t value, double timeout_s) {
  MT_CHECK(peer_words.size() <= static_cast<size_t>(kMaxSignalRanks), "signal_peers_and_wait: {} ranks, at most {}",
           peer_words.size(), kMaxSignalRanks);
  SignalArgs a{};
  a.ranks = static_cast<int>(peer_words.size());
  a.rank = rank;
  a.value = value;
  a.timeout_ns = static_cast<unsigned long long>(timeout_s * 1e9);
  for (int q = 0; q < a.ranks; ++q) a.words[q] = static_cast<unsigned*>(peer_words[static_cast<size_t>(q)]);
  launch_signal_peers_and_wait(a, stream());
  check_launch("signal_wait_kernel");
}

void signal_word(void* word, uint32_t value) {
  launch_signal_word(static_cast<unsigned*>(word), value, stream());
  check_launch("signal_word_kernel");
}

void wait_word(const void* word, uint32_t value, double timeout_s) {
  launch_wait_word(static_cast<const unsigned*>(word), value, static_cast<unsigned long long>(timeout_s * 1e9),
                   stream());
  check_launch("wait_word_kernel");
}

}  // namespace moetrain::ops::cuda
