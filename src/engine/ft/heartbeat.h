// Heartbeat: a training worker says it is alive by touching the file its launcher named in
// MOETRAIN_HEARTBEAT (`moetrain launch --heartbeat-timeout`), once a step, so that a hung
// rank (stuck in a collective, on a dead device) is stopped and the job restarted like a
// dead one. No variable: nothing happens.
#pragma once

namespace moetrain {

class Heartbeat {
 public:
  Heartbeat();   // opens (creates) the file when the variable is set
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  void beat();   // sets the file's modification time to now

 private:
  int fd_ = -1;
};

}  // namespace moetrain
