// Preemption: SIGTERM or SIGUSR1 (what SLURM and Kubernetes send before they take a node)
// asks a training run to stop cleanly. While a PreemptionWatch lives, those signals only
// set a flag; the step loop asks stop_requested() after each step, and every rank agrees
// (a rank that got the signal stops them all at the same step), then the run saves a
// checkpoint and returns, so the process exits 0 with its last step committed.
#pragma once

#include <csignal>

#include "comm/communicator.h"
#include "core/device.h"

namespace moetrain {

class PreemptionWatch {
 public:
  PreemptionWatch();   // installs the handlers
  ~PreemptionWatch();  // puts the previous ones back
  PreemptionWatch(const PreemptionWatch&) = delete;
  PreemptionWatch& operator=(const PreemptionWatch&) = delete;

  // Whether any rank of `world` (nullptr: this process alone) got the signal; a collective
  // when `world` is given (one tiny all-reduce a step).
  bool stop_requested(Communicator* world, Device device) const;
  // The signal this process got (0: none).
  static int signal_received();

 private:
  struct sigaction old_term_ {}, old_usr1_ {};
};

}  // namespace moetrain
