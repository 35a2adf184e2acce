#include "comm/rendezvous.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "comm/etcd_store.h"
#include "comm/store.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;

// Whether `host` names this machine: its name, a loopback address or one of its interfaces'.
bool is_this_machine(const std::string& host) {
  char name[256] = {};
  if (host == "localhost" || (::gethostname(name, sizeof name - 1) == 0 && host == name)) return true;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  ifaddrs* ifs = nullptr;
  ::getifaddrs(&ifs);
  bool local = false;
  for (addrinfo* a = res; a && !local; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) local = true;
    }
    for (ifaddrs* i = ifs; i && !local; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != a->ai_family) continue;
      if (a->ai_family == AF_INET) {
        local = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr ==
                reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr;
      } else if (a->ai_family == AF_INET6) {
        local = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr,
                            &reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr, sizeof(in6_addr)) == 0;
      }
    }
  }
  if (ifs) ::freeifaddrs(ifs);
  ::freeaddrinfo(res);
  return local;
}

class TcpRendezvousStore : public RendezvousStore {
 public:
  explicit TcpRendezvousStore(const RendezvousConfig& cfg) {
    auto [host, port] = split_host_port(fmt::format("--rdzv-endpoint '{}'", cfg.endpoint), cfg.endpoint, 0);
    if (is_this_machine(host)) {
      try {
        server_ = std::make_unique<TcpStoreServer>(port, cfg.journal);
        spdlog::info("rendezvous: this agent serves the TCP store on port {}{}", port,
                     cfg.journal.empty() ? "" : " (journal " + cfg.journal + ")");
      } catch (const Error&) {
        // Another agent on this machine (or a standalone `moetrain rdzv-server`) serves it.
      }
    }
    desc_ = "tcp store " + cfg.endpoint;
    client_ = std::make_unique<TcpStore>(host, port, false, cfg.join_timeout);
    client_->set_reconnect(true);
  }
  bool set_once(const std::string& key, const std::string& value) override {
    return client_->set_once(key, std::vector<char>(value.begin(), value.end()));
  }
  std::optional<std::string> get(const std::string& key) override {
    auto v = client_->try_get(key);
    if (!v) return std::nullopt;
    return std::string(v->begin(), v->end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return client_->add(key, delta); }
  std::string description() const override { return desc_; }
  bool serves() const override { return server_ != nullptr; }

 private:
  std::unique_ptr<TcpStoreServer> server_;  // before the client: it must outlive it
  std::unique_ptr<TcpStore> client_;
  std::string desc_;
};

RoundEnd round_end_from_json(const std::string& text) {
  RoundEnd e;
  try {
    auto j = nlohmann::json::parse(text);
    e.reason = j.at("reason").get<std::string>();
    e.by = j.value("by", "");
    e.message = j.value("message", "");
    e.at = j.value("at", 0.0);
  } catch (const std::exception& ex) {
    MT_THROW("rendezvous: a round's end record '{}' is not what moetrain writes: {}", text, ex.what());
  }
  return e;
}

}  // namespace

std::unique_ptr<RendezvousStore> open_rendezvous_store(const RendezvousConfig& cfg) {
  MT_CHECK(!cfg.endpoint.empty(), "rendezvous: no --rdzv-endpoint given");
  if (cfg.backend == "c10d" || cfg.backend == "tcp") return std::make_unique<TcpRendezvousStore>(cfg);
  if (cfg.backend == "etcd" || cfg.backend == "etcd-v2") return open_etcd_store(cfg.endpoint, cfg.join_timeout);
  MT_THROW("--rdzv-backend '{}' is not one of c10d (the TCP store) or etcd", cfg.backend);
}

std::string to_json(const NodeInfo& n) {
  return nlohmann::json{{"host", n.host}, {"addr", n.addr}, {"nproc", n.nproc}, {"store_port", n.store_port},
                        {"agent", n.agent}}
      .dump();
}

NodeInfo node_from_json(const std::string& text, const std::string& what) {
  NodeInfo n;
  try {
    auto j = nlohmann::json::parse(text);
    n.host = j.at("host").get<std::string>();
    n.addr = j.at("addr").get<std::string>();
    n.nproc = j.at("nproc").get<int>();
    n.store_port = j.at("store_port").get<int>();
    n.agent = j.at("agent").get<std::string>();
  } catch (const std::exception& e) {
    MT_THROW("rendezvous: {} holds '{}', not a node record: {}", what, text, e.what());
  }
  return n;
}

int RoundAssignment::world_size() const {
  int w = 0;
  for (const NodeInfo& n : nodes) w += n.nproc;
  return w;
}

int RoundAssignment::rank_offset() const {
  int r = 0;
  for (int i = 0; i < node_rank; ++i) r += nodes[i].nproc;
  return r;
}

Rendezvous::Rendezvous(RendezvousConfig cfg, std::shared_ptr<RendezvousStore> store, NodeInfo self)
    : cfg_(std::move(cfg)), store_(std::move(store)), self_(std::move(self)) {
  MT_CHECK(cfg_.min_nodes >= 1 && cfg_.min_nodes <= cfg_.max_nodes, "--nnodes {}:{}: need 1 <= MIN <= MAX",
           cfg_.min_nodes, cfg_.max_nodes);
}

std::string Rendezvous::key(int round, const std::string& what) const {
  return "moetrain/" + cfg_.run_id + "/round/" + std::to_string(round) + "/" + what;
}

std::string Rendezvous::description() const {
  return fmt::format("{} (run id '{}', {}:{} nodes)", store_->description(), cfg_.run_id, cfg_.min_nodes,
                     cfg_.max_nodes);
}

std::optional<RoundEnd> Rendezvous::ended(int round) {
  auto v = store_->get(key(round, "end"));
  if (!v) return std::nullopt;
  return round_end_from_json(*v);
}

RoundEnd Rendezvous::end(int round, const std::string& reason, const std::string& message, double at) {
  const std::string rec = nlohmann::json{
      {"reason", reason}, {"by", self_.agent}, {"message", message}, {"at", at > 0 ? at : epoch_seconds()}}
                              .dump();
  store_->set_once(key(round, "end"), rec);
  return *ended(round);
}

RoundAssignment Rendezvous::join() {
  const auto started = Clock::now();
  while (true) {
    // Past the rounds that have ended (a restarted agent starts at 0).
    while (auto e = ended(next_round_)) {
      if (e->reason == "done") {
        RoundAssignment a;
        a.round = next_round_;
        a.job_done = true;
        return a;
      }
      if (e->reason == "failure") ++failures_;
      ++next_round_;
    }
    const int r = next_round_;
    const int place = static_cast<int>(store_->add(key(r, "joined"), 1)) - 1;
    NodeInfo me = self_;
    store_->set_once(key(r, "node/" + std::to_string(place)), to_json(me));
    spdlog::info("rendezvous: joined round {} as node {} ({})", r, place, description());
    Clock::time_point min_seen{};  // when this agent first saw min_nodes joined (epoch: not yet)
    int final_nodes = -1;
    while (final_nodes < 0) {
      if (auto f = store_->get(key(r, "final"))) {
        final_nodes = std::stoi(*f);
        break;
      }
      if (ended(r)) break;  // ended while forming (a failure, or the job done)
      const int joined = static_cast<int>(store_->add(key(r, "joined"), 0));
      if (joined >= cfg_.max_nodes) {
        store_->set_once(key(r, "final"), std::to_string(cfg_.max_nodes));
        continue;
      }
      if (joined >= cfg_.min_nodes) {
        if (min_seen == Clock::time_point{}) min_seen = Clock::now();
        if (Clock::now() - min_seen >= cfg_.last_call) store_->set_once(key(r, "final"), std::to_string(joined));
        continue;  // read "final" back: whoever set it first decided
      }
      min_seen = Clock::time_point{};
      MT_CHECK(Clock::now() - started < cfg_.join_timeout,
               "rendezvous: only {} of at least {} nodes joined round {} within {} s ({}); are the other nodes' "
               "`moetrain launch` running with the same --rdzv-endpoint and --rdzv-id?",
               joined, cfg_.min_nodes, r, cfg_.join_timeout.count() / 1000.0, description());
      std::this_thread::sleep_for(cfg_.poll);
    }
    if (final_nodes > place) {
      RoundAssignment a;
      a.round = r;
      a.node_rank = place;
      a.nnodes = final_nodes;
      a.failures = failures_;
      for (int i = 0; i < final_nodes; ++i) {
        const std::string k = key(r, "node/" + std::to_string(i));
        std::optional<std::string> v;
        // A member publishes its record right after it takes its place; one that died in
        // between leaves a hole, and the round cannot start.
        const auto until = Clock::now() + std::chrono::seconds(10);
        while (!(v = store_->get(k)) && Clock::now() < until) std::this_thread::sleep_for(cfg_.poll);
        if (!v) {
          end(r, "failure", fmt::format("node {} took a place in round {} and never said who it is", i, r));
          break;
        }
        a.nodes.push_back(node_from_json(*v, k));
      }
      if (static_cast<int>(a.nodes.size()) == final_nodes) {
        seen_beats_.assign(final_nodes, -1);
        seen_at_.assign(final_nodes, Clock::now());
        return a;  // the next join starts here: it counts how this round ended
      }
    } else if (final_nodes >= 0) {
      // Too late for round r: a spare. With room in the group, end the round now so that
      // the next one takes this node in; else wait for it to end.
      if (final_nodes < cfg_.max_nodes) {
        end(r, "scale-up", fmt::format("node {} ({}) arrived after round {} formed with {} of at most {} nodes",
                                       place, self_.host, r, final_nodes, cfg_.max_nodes));
      } else {
        spdlog::info("rendezvous: round {} is full ({} nodes); this node waits as a spare", r, final_nodes);
      }
      while (!ended(r)) std::this_thread::sleep_for(cfg_.poll);
    }
    // The round ended before or while this node joined: on to the next.
  }
}

void Rendezvous::leave(int round, bool member, std::chrono::milliseconds limit) {
  const auto f = store_->get(key(round, "final"));
  const int members = f ? std::stoi(*f) : 0;
  int left = static_cast<int>(store_->add(key(round, "left"), member ? 1 : 0));
  if (!store_->serves()) return;
  const auto until = Clock::now() + limit;
  while (left < members && Clock::now() < until) {
    std::this_thread::sleep_for(cfg_.poll);
    left = static_cast<int>(store_->add(key(round, "left"), 0));
  }
}

std::optional<std::string> Rendezvous::beat(const RoundAssignment& a) {
  store_->add(key(a.round, "beat/" + std::to_string(a.node_rank)), 1);
  const auto now = Clock::now();
  for (int i = 0; i < a.nnodes; ++i) {
    if (i == a.node_rank) continue;
    const auto v = store_->get(key(a.round, "beat/" + std::to_string(i)));
    const int64_t beats = v ? std::stoll(*v) : 0;
    if (beats != seen_beats_[i]) {
      seen_beats_[i] = beats;
      seen_at_[i] = now;
    } else if (now - seen_at_[i] >= cfg_.keep_alive_timeout) {
      return fmt::format("node {} ({}, agent {}) has not beaten for {:.1f} s", i, a.nodes[i].host, a.nodes[i].agent,
                         std::chrono::duration<double>(now - seen_at_[i]).count());
    }
  }
  return std::nullopt;
}

}  // namespace moetrain
