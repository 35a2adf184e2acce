// launch_workers: runs N workers of one command on this machine (`moetrain launch -n N`),
// the single-node part of what torchrun does, and brings the job down fast when one fails.
//
// Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT and MOETRAIN_STORE (a fresh store directory made for this launch and removed
// after it, or the spec's worker_store),
// stdin from /dev/null, and its own process group. Their output comes back line by line.
// SIGINT/SIGTERM to the launcher go to every worker (a second one: SIGKILL); when every
// worker then exits 0 (a training run saves and stops on SIGTERM) the launch succeeds. When a worker
// exits non-zero or is killed, the others get SIGINT (SIGTERM is a training worker's
// preemption notice: finish the step, save, exit), then SIGKILL after the grace period;
// the result names the first worker that failed and how. Workers die with the launcher
// (PR_SET_PDEATHSIG), so none outlives a killed launcher.
//
// Each worker also gets MOETRAIN_HEARTBEAT, a file in the store directory it may touch to
// say it is alive (see LaunchSpec::heartbeat_timeout).
//
// One launch at a time per process (it owns SIGINT/SIGTERM while it runs).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moetrain {

struct LaunchSpec {
  int nproc = 1;  // workers on this machine
  // Many nodes (the elastic agent, comm/rendezvous.h): this node's place in the job. Worker i
  // here is global rank rank_offset + i of world_size (0: nproc), with GROUP_RANK = node_rank.
  int rank_offset = 0, world_size = 0, node_rank = 0;
  std::vector<std::string> argv;  // the worker command; argv[0] is looked up in PATH
  std::vector<std::pair<std::string, std::string>> env;  // more variables for the workers
  // MOETRAIN_STORE for the workers; empty: the fresh store directory (one machine).
  std::string worker_store;
  std::string store_parent;       // where the fresh store directory goes; empty: the temp dir
  std::string master_addr = "127.0.0.1";
  int master_port = 0;            // 0: a free port
  std::chrono::milliseconds grace{std::chrono::seconds(10)};  // SIGTERM -> SIGKILL
  // > 0: a worker whose heartbeat file (MOETRAIN_HEARTBEAT, which the training loop touches
  // at every step) has not been touched for this long, once it has been touched at all,
  // counts as failed: a hung rank is stopped like a dead one.
  std::chrono::milliseconds heartbeat_timeout{0};
  // Called about every monitor_interval while the workers run: a message stops them all
  // (SIGINT, then SIGKILL after the grace) as a failure would, the message saying why
  // (another node's workers failed, say). Empty function: not called.
  std::function<std::optional<std::string>()> monitor;
  std::chrono::milliseconds monitor_interval{100};
  // Each complete line a worker writes (without its newline); stream 1 = stdout, 2 = stderr.
  // Default: the line, prefixed "[rank R] ", on this process's stdout or stderr.
  std::function<void(int rank, int stream, const std::string& line)> on_line;
};

struct LaunchResult {
  // 0 when every worker exited 0; else the first failure's exit status (128 + signal for a
  // worker killed by a signal, or for a launcher stopped by one).
  int exit_code = 0;
  int failed_rank = -1;  // the first worker that failed; -1 when none did
  std::string message;   // "rank 1 (pid 4242) was killed by signal 9 (SIGKILL)", or empty
  bool interrupted = false;  // the launcher itself got SIGINT/SIGTERM (not a worker's failure)
  bool stopped_by_monitor = false;  // LaunchSpec::monitor stopped the workers (message: its reason)
  double failed_at = 0;  // when the first failure was seen (seconds since the epoch), 0 if none
  double stop_s = 0;         // from the first failure seen to the last worker gone
};

LaunchResult launch_workers(const LaunchSpec& spec);

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_tcp_port();

}  // namespace moetrain
