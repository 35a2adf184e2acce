#include "engine/ft/preemption.h"

#include <vector>


namespace moetrain {
namespace {

volatile std::sig_atomic_t g_signal = 0;

void on_preempt(int sig) { g_signal = sig; }

}  // namespace

PreemptionWatch::PreemptionWatch() {
  g_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_preempt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGTERM, &sa, &old_term_);
  ::sigaction(SIGUSR1, &sa, &old_usr1_);
}

PreemptionWatch::~PreemptionWatch() {
  ::sigaction(SIGTERM, &old_term_, nullptr);
  ::sigaction(SIGUSR1, &old_usr1_, nullptr);
}

int PreemptionWatch::signal_received() { return g_signal; }

bool PreemptionWatch::stop_requested(Communicator* world, Device device) const {
  std::vector<double> got{g_signal != 0 ? 1.0 : 0.0};
  if (world != nullptr) all_reduce_doubles(*world, got, device);
  return got[0] > 0;
}

}  // namespace moetrain
