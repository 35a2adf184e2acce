// Rendezvous: how the elastic agents of a job (one `moetrain launch` per node) meet, agree on
// who is in the next round of workers, and learn when a round is over.
//
// Rounds are numbered from 0; round r is restart generation r. In a round:
//   1. each agent takes a place with an atomic add (the join order is the node rank) and
//      publishes its node (address, workers, a port for the workers' store);
//   2. the round closes its membership when max_nodes have joined, or when at least
//      min_nodes have and no one else came for `last_call` ("final" is set once: whoever
//      decides first decides for all);
//   3. agents beyond the membership are spares: they wait for the round to end, and when
//      the round has room (fewer than max_nodes) they end it at once so that the next
//      round takes them in (scale-up);
//   4. an agent whose workers fail, or that sees a member stop beating, closes the round
//      ("closed" is set once, with the reason); every agent then stops its workers and
//      joins round r + 1. A finished job marks its round done, which ends the spares too.
// Agents that join late scan forward past the closed rounds, so a restarted agent finds
// the current one. The store is the TCP store (`c10d`, as torchrun's default backend) or etcd.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace moetrain {

// The few operations the protocol needs from a table shared by the agents.
class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // Sets the key unless it is set; false when it was.
  virtual bool set_once(const std::string& key, const std::string& value) = 0;
  virtual std::optional<std::string> get(const std::string& key) = 0;
  // Adds to the integer at key (absent: 0) atomically; returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  virtual std::string description() const = 0;
  // Whether this process serves the table (it must then outlive the other agents' use of it).
  virtual bool serves() const { return false; }
};

struct RendezvousConfig {
  std::string backend = "c10d";  // "c10d" (TCP store; "tcp" too) or "etcd"
  std::string endpoint;          // host:port of the store (c10d) or of etcd's client URL
  std::string run_id = "none";   // keys of different jobs on one store never meet
  int min_nodes = 1, max_nodes = 1;
  std::chrono::milliseconds last_call{std::chrono::seconds(30)};  // wait for more after min_nodes
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};  // for min_nodes to come
  // A member whose agent has not beaten for this long has gone (its node, say).
  std::chrono::milliseconds keep_alive_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds poll{std::chrono::milliseconds(100)};
  std::string journal;  // c10d, when this agent hosts the store: its journal file (may be empty)
};

// Opens the store of `cfg`. c10d: when the endpoint's host is this machine and nothing
// listens on its port yet, this agent serves the store (as torchrun's agents do); otherwise
// it connects, reconnecting when the server restarts.
std::unique_ptr<RendezvousStore> open_rendezvous_store(const RendezvousConfig& cfg);

struct NodeInfo {
  std::string host;       // hostname, for messages
  std::string addr;       // where the other nodes reach this one
  int nproc = 0;          // workers on it
  int store_port = 0;     // a free port for the workers' store, used when this node is rank 0
  std::string agent;      // "host:pid", unique per agent
  bool operator==(const NodeInfo&) const = default;
};

struct RoundAssignment {
  int round = 0;
  bool job_done = false;  // a round ended with the job finished: nothing to run
  int node_rank = 0, nnodes = 0;
  std::vector<NodeInfo> nodes;  // by node rank
  int failures = 0;             // rounds before this one that ended in a failure
  int world_size() const;
  int rank_offset() const;  // global rank of this node's first worker
};

struct RoundEnd {
  std::string reason;   // "failure", "scale-up" or "done"
  std::string by;       // the agent that ended it
  std::string message;  // what happened, for the logs
  double at = 0;        // when (seconds since the epoch, the closer's clock)
};

class Rendezvous {
 public:
  Rendezvous(RendezvousConfig cfg, std::shared_ptr<RendezvousStore> store, NodeInfo self);

  // Joins the first open round at or after the last one seen and returns when its
  // membership is final with this node in it, or the job is done. Throws when min_nodes do
  // not come within join_timeout.
  RoundAssignment join();
  // How `round` ended, once it has (polled by the agent while its workers run).
  std::optional<RoundEnd> ended(int round);
  // Ends `round` (no-op when another agent ended it first); returns how it ended. `at`:
  // when the cause was seen (seconds since the epoch; 0: now).
  RoundEnd end(int round, const std::string& reason, const std::string& message, double at = 0);
  // Says this agent is alive and checks the others: the message naming a member that has
  // not beaten for keep_alive_timeout, or nullopt. Call it every poll while workers run.
  std::optional<std::string> beat(const RoundAssignment& a);

  // When the job is over: says this agent (a member of `round`, or a spare) is leaving; an
  // agent that serves the store then waits (up to `limit`) for every member to leave, so
  // none loses the store while it still writes its end of the round.
  void leave(int round, bool member, std::chrono::milliseconds limit = std::chrono::seconds(60));

  // This node's record for the rounds it joins from now on (a fresh store port, say).
  void set_node(NodeInfo self) { self_ = std::move(self); }

  const RendezvousConfig& config() const { return cfg_; }
  std::string description() const;

 private:
  std::string key(int round, const std::string& what) const;

  RendezvousConfig cfg_;
  std::shared_ptr<RendezvousStore> store_;
  NodeInfo self_;
  int next_round_ = 0;
  int failures_ = 0;  // failure-ended rounds before next_round_
  // Keep-alive bookkeeping of the current round: last value seen per member, and when it changed.
  std::vector<int64_t> seen_beats_;
  std::vector<std::chrono::steady_clock::time_point> seen_at_;
};

std::string to_json(const NodeInfo& n);
NodeInfo node_from_json(const std::string& text, const std::string& what);

}  // namespace moetrain
