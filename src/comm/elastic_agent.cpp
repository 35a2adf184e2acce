#include "comm/elastic_agent.h"

#include <unistd.h>

#include <chrono>

#include "core/error.h"
#include "core/log.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;

std::string hostname() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

int run_elastic_agent(const ElasticConfig& cfg, LaunchSpec workers) {
  std::shared_ptr<RendezvousStore> store = open_rendezvous_store(cfg.rendezvous);
  NodeInfo self;
  self.host = hostname();
  self.addr = cfg.local_addr.empty() ? self.host : cfg.local_addr;
  self.nproc = workers.nproc;
  self.agent = fmt::format("{}:{}", self.host, ::getpid());
  Rendezvous rdzv(cfg.rendezvous, store, self);
  const auto base_env = workers.env;
  double failure_at = 0;  // of the failure that ended the previous round
  int last_status = 1;
  while (true) {
    const auto joining = Clock::now();
    // A fresh port for the workers' store each round: the last round's may linger.
    self.store_port = free_tcp_port();
    rdzv.set_node(self);
    RoundAssignment a = rdzv.join();
    if (a.job_done) {
      spdlog::info("launch: the job finished (round {} ended done); this node has nothing left to run", a.round);
      rdzv.leave(a.round, /*member=*/false);
      return 0;
    }
    if (a.failures > cfg.max_restarts) {
      spdlog::error("launch: {} rounds ended in failures, more than --max-restarts {}; giving up", a.failures,
                    cfg.max_restarts);
      return last_status;
    }
    const NodeInfo& master = a.nodes[0];
    workers.rank_offset = a.rank_offset();
    workers.world_size = a.world_size();
    workers.node_rank = a.node_rank;
    workers.master_addr = master.addr;
    workers.master_port = master.store_port;
    workers.worker_store = fmt::format("tcp://{}:{}", master.addr, master.store_port);
    workers.env = base_env;
    for (auto [k, v] : {std::pair<std::string, std::string>{"TORCHELASTIC_RESTART_COUNT", std::to_string(a.round)},
                        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(cfg.max_restarts)},
                        {"TORCHELASTIC_RUN_ID", cfg.rendezvous.run_id},
                        {"MOETRAIN_FAILURE_AT", fmt::format("{:.6f}", failure_at)}}) {
      workers.env.emplace_back(k, v);
    }
    spdlog::info("launch: round {}: node {} of {} ({} workers, ranks {}..{} of {}); rendezvous took {:.2f} s", a.round,
                 a.node_rank, a.nnodes, workers.nproc, workers.rank_offset, workers.rank_offset + workers.nproc - 1,
                 workers.world_size, std::chrono::duration<double>(Clock::now() - joining).count());
    // Between polls of the round: beats of the other members, throttled so that a large
    // job's agents do not flood the store.
    const auto beat_every = std::max(workers.monitor_interval, cfg.rendezvous.keep_alive_timeout / 10);
    auto next_beat = Clock::now();
    std::optional<RoundEnd> seen_end;
    workers.monitor = [&]() -> std::optional<std::string> {
      if (auto e = rdzv.ended(a.round)) {
        if (e->reason != "done") {
          seen_end = e;
          return fmt::format("round {} ended by {} ({}: {})", a.round, e->by, e->reason, e->message);
        }
      }
      if (Clock::now() >= next_beat) {
        next_beat = Clock::now() + beat_every;
        if (auto gone = rdzv.beat(a)) return *gone;
      }
      return std::nullopt;
    };
    LaunchResult r = launch_workers(workers);
    if (r.exit_code == 0) {
      rdzv.end(a.round, "done", fmt::format("node {} ({}): every worker exited 0", a.node_rank, self.host));
      rdzv.leave(a.round, /*member=*/true);
      return 0;
    }
    last_status = r.exit_code;
    if (r.interrupted) {
      rdzv.end(a.round, "failure", fmt::format("the agent of node {} ({}) was stopped: {}", a.node_rank, self.host, r.message));
      std::fprintf(stderr, "moetrain: error: launch: %s\n", r.message.c_str());
      return r.exit_code;
    }
    // This node's failure, or one seen by the monitor (another node's, or a silent member):
    // the round ends for every agent. The first to end it says why, for all.
    RoundEnd end = seen_end ? *seen_end
                            : rdzv.end(a.round, "failure", fmt::format("node {} ({}): {}", a.node_rank, self.host, r.message),
                                       r.failed_at);
    if (end.reason == "done") {  // the job had finished elsewhere before this node's workers failed
      std::fprintf(stderr, "moetrain: error: launch: %s (after the job finished on another node)\n", r.message.c_str());
      rdzv.leave(a.round, /*member=*/true);
      return r.exit_code;
    }
    // The next round's workers measure their downtime from a failure; a scale-up is none.
    failure_at = end.reason == "failure" ? end.at : 0;
    const int failures = a.failures + (end.reason == "failure" ? 1 : 0);
    if (failures > cfg.max_restarts) {
      std::fprintf(stderr, "moetrain: error: launch: %s (after %d restarts: --max-restarts %d reached)\n",
                   end.message.c_str(), failures - 1, cfg.max_restarts);
      return r.exit_code;
    }
    spdlog::warn("launch: round {} ended ({} by {}: {}; seen at t={:.6f}); this node's workers stopped {:.2f} s after; "
                 "joining round {} ({} failures of at most {} so far)",
                 a.round, end.reason, end.by, end.message, end.at, r.stop_s, a.round + 1, failures, cfg.max_restarts);
  }
}

}  // namespace moetrain
