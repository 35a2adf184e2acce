// The lighthouse (DESIGN.md section 6, level 2): one small server per training run that the
// managers of its data-parallel replica groups talk to over gRPC (lighthouse.proto). It
// keeps who is alive from their heartbeats, forms each step's quorum by the rules of
// quorum.h, and serves the TCP store where the groups of a quorum meet to build their
// cross-group communicator.
//
// It holds no state a run cannot rebuild: when it restarts, the groups' calls fail until it
// is back, then they ask again with their steps, and the first quorum after the restart
// starts from the highest step among them (store keys carry the lighthouse's incarnation, so
// a new quorum never meets an old one's keys).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "engine/ft/quorum.h"

namespace moetrain {

inline constexpr uint32_t kLighthouseProtocol = 1;

struct LighthouseOptions {
  std::string bind = "0.0.0.0";
  int port = 0;        // 0: any free port (port() tells which)
  int store_port = 0;  // the cross-group store's port; 0: any free port
  QuorumRules rules;
};

class LighthouseServer {
 public:
  explicit LighthouseServer(const LighthouseOptions& opt);  // listening when it returns
  ~LighthouseServer();
  LighthouseServer(const LighthouseServer&) = delete;
  LighthouseServer& operator=(const LighthouseServer&) = delete;
  int port() const;
  int store_port() const;
  // Blocks until shutdown() (from another thread or a signal handler's thread).
  void wait();
  void shutdown();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// What a replica group's manager learns from a quorum (the reply of lighthouse.proto).
struct QuorumAnswer {
  Quorum quorum;
  int index = -1;         // this group's index among the members
  int recover_from = -1;  // the member this group copies its state from (-1: none)
  std::vector<int> recover_to;
  std::string store;      // "tcp://HOST:PORT" of the lighthouse's store
  std::string store_prefix;
};

// A replica group's connection to the lighthouse at "HOST:PORT". A background thread sends
// a heartbeat every `heartbeat_interval` from construction to destruction. `planned_groups`:
// the run's [fault_tolerance].replica_groups (0: unknown), sent with every request.
class LighthouseClient {
 public:
  LighthouseClient(const std::string& address, std::string replica_id, std::chrono::milliseconds heartbeat_interval,
                   int planned_groups = 0);
  ~LighthouseClient();
  LighthouseClient(const LighthouseClient&) = delete;
  LighthouseClient& operator=(const LighthouseClient&) = delete;

  // Asks for the next quorum and waits for it. While the lighthouse cannot be reached (it
  // restarts), asks again until `timeout`; then an Error naming the lighthouse's address.
  QuorumAnswer quorum(uint64_t incarnation, int64_t step, int32_t group_size, std::chrono::milliseconds timeout);
  // Makes a quorum() waiting in another thread return at once with an Error (the run ends).
  void cancel();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moetrain
