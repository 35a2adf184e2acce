#include "app/launch.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <functional>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/elastic_agent.h"
#include "comm/gloo_communicator.h"
#include "comm/launch_env.h"
#include "comm/launcher.h"
#include "comm/nccl_communicator.h"
#include "comm/store.h"
#include "comm/tcp_store.h"
#include "engine/ft/lighthouse.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

namespace moetrain::app {
namespace {

struct LaunchArgs {
  int nproc = 0;
  // Many nodes (an elastic agent per node): torchrun's options.
  std::string nnodes = "1";         // N or MIN:MAX
  std::string rdzv_backend = "c10d";
  std::string rdzv_endpoint;        // host:port; empty: one node, no agents
  std::string rdzv_id = "none";
  std::string rdzv_conf;            // key=value,...: join_timeout, last_call_timeout, keep_alive_timeout, journal
  double monitor_interval_s = 0.1;
  std::string local_addr;
  std::string store_dir;
  double grace_s = 10;
  int master_port = 0;
  int max_restarts = 0;
  double heartbeat_timeout_s = 0;
  std::string command;  // the worker's subcommand; its arguments come in remaining()
};

struct SelftestArgs {
  std::string backend = "gloo";
  int fail_rank = -1;
  double bandwidth_mb = 0;  // > 0: also time collectives on this many MB per rank
};

// Times all-to-all-v (an even split: the MoE dispatch of balanced tokens), all-reduce and
// all-gather on `mb` MB per rank, bf16; rank 0 prints each one's median time and the bytes
// each rank sends over it (all-to-all: (P-1)/P of the buffer; all-reduce: the ring's
// 2(P-1)/P; all-gather: (P-1)/P of the output).
void time_collectives(Communicator& world, Device dev, double mb) {
  const int P = world.size();
  const int64_t row = 2048;  // elements per row: a Qwen3-30B-A3B hidden state
  const int64_t rows = std::max<int64_t>(P, static_cast<int64_t>(mb * 1e6 / (row * 2)) / P * P);
  Tensor in = Tensor::zeros({rows, row}, DType::BF16, dev), out = Tensor::zeros({rows, row}, DType::BF16, dev);
  Tensor gathered = Tensor::zeros({rows * P, row}, DType::BF16, dev);
  const std::vector<int64_t> split(P, rows / P);
  const double bytes = static_cast<double>(in.nbytes());
  struct Case {
    const char* name;
    double sent;  // bytes each rank sends
    std::function<void()> run;
  };
  const std::vector<Case> cases{
      {"all_to_all_v", bytes * (P - 1) / P, [&] { world.all_to_all_v(in, split, out, split); }},
      {"all_reduce", 2 * bytes * (P - 1) / P, [&] { world.all_reduce(in); }},
      {"all_gather", bytes * (P - 1), [&] { world.all_gather(in, gathered); }}};
  for (const Case& c : cases) {
    std::vector<double> ms;
    for (int i = 0; i < 13; ++i) {
      world.barrier();
      world.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      c.run();
      world.synchronize();
      if (i >= 3) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    if (world.rank() == 0) {
      std::printf("comm-selftest: %-12s %8.1f MB per rank, %d ranks: %8.3f ms median of %zu, %7.2f GB/s sent per rank\n",
                  c.name, bytes / 1e6, P, med, ms.size(), c.sent / (med * 1e6));
    }
  }
}

// "4" -> (4, 4); "2:4" -> (2, 4).
std::pair<int, int> parse_nnodes(const std::string& text) {
  auto number = [&](const std::string& t) {
    size_t used = 0;
    int v = -1;
    try {
      v = std::stoi(t, &used);
    } catch (const std::exception&) {
    }
    MT_CHECK(v >= 1 && used == t.size(), "launch: --nnodes '{}' is not N or MIN:MAX (positive integers)", text);
    return v;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) return {number(text), number(text)};
  const int lo = number(text.substr(0, colon)), hi = number(text.substr(colon + 1));
  MT_CHECK(lo <= hi, "launch: --nnodes {}: MIN is above MAX", text);
  return {lo, hi};
}

// --rdzv-conf "join_timeout=600,last_call_timeout=30,keep_alive_timeout=30,journal=FILE".
RendezvousConfig rendezvous_config(const LaunchArgs& a, int min_nodes, int max_nodes) {
  RendezvousConfig c;
  c.backend = a.rdzv_backend;
  c.endpoint = a.rdzv_endpoint;
  c.run_id = a.rdzv_id;
  c.min_nodes = min_nodes;
  c.max_nodes = max_nodes;
  c.poll = std::chrono::milliseconds(std::max<int64_t>(10, static_cast<int64_t>(a.monitor_interval_s * 1000)));
  std::string rest = a.rdzv_conf;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    const size_t eq = item.find('=');
    MT_CHECK(eq != std::string::npos, "launch: --rdzv-conf item '{}' is not KEY=VALUE", item);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "journal") {
      c.journal = value;
      continue;
    }
    double seconds = -1;
    try {
      seconds = std::stod(value);
    } catch (const std::exception&) {
    }
    MT_CHECK(seconds >= 0, "launch: --rdzv-conf {}={}: not a number of seconds", key, value);
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    if (key == "join_timeout") {
      c.join_timeout = ms;
    } else if (key == "last_call_timeout") {
      c.last_call = ms;
    } else if (key == "keep_alive_timeout") {
      c.keep_alive_timeout = ms;
    } else {
      MT_THROW("launch: --rdzv-conf key '{}' is not one of join_timeout, last_call_timeout, keep_alive_timeout, "
               "journal",
               key);
    }
  }
  return c;
}

// Runs the workers; when one fails (not when the launcher itself is stopped), stops the
// others and starts them all again, up to max_restarts times, each time as a new restart
// generation with a fresh rendezvous: the workers resume from the newest committed
// checkpoint ([checkpoint].resume = "auto"). They see the generation as
// TORCHELASTIC_RESTART_COUNT, as under torchrun.
int run_launch(const LaunchArgs& a, const std::vector<std::string>& worker_args) {
  MT_CHECK(!worker_args.empty(), "launch: no worker command: moetrain launch -n N -- train --config X ...");
  LaunchSpec spec;
  spec.nproc = a.nproc;
  spec.argv = {std::filesystem::read_symlink("/proc/self/exe").string()};
  spec.argv.insert(spec.argv.end(), worker_args.begin(), worker_args.end());
  spec.store_parent = a.store_dir;
  spec.grace = std::chrono::milliseconds(static_cast<int64_t>(a.grace_s * 1000));
  spec.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.heartbeat_timeout_s * 1000));
  spec.monitor_interval = std::chrono::milliseconds(static_cast<int64_t>(a.monitor_interval_s * 1000));
  const auto [min_nodes, max_nodes] = parse_nnodes(a.nnodes);
  if (!a.rdzv_endpoint.empty()) {
    ElasticConfig ec;
    ec.rendezvous = rendezvous_config(a, min_nodes, max_nodes);
    ec.max_restarts = a.max_restarts;
    ec.local_addr = a.local_addr;
    return run_elastic_agent(ec, spec);
  }
  MT_CHECK(max_nodes == 1, "launch: --nnodes {} needs --rdzv-endpoint HOST:PORT where the nodes' agents meet", a.nnodes);
  double failure_at = 0;  // of the failure that ended the previous generation
  for (int generation = 0;; ++generation) {
    spec.master_port = generation == 0 ? a.master_port : 0;  // a fresh port: the old one may linger
    spec.env = {{"TORCHELASTIC_RESTART_COUNT", std::to_string(generation)},
                {"TORCHELASTIC_MAX_RESTARTS", std::to_string(a.max_restarts)},
                {"MOETRAIN_FAILURE_AT", fmt::format("{:.6f}", failure_at)}};
    const auto started = SteadyClock::now();
    LaunchResult r = launch_workers(spec);
    if (r.exit_code == 0) return 0;
    failure_at = r.failed_at;
    const double ran_s = seconds_since(started);
    if (r.interrupted || generation >= a.max_restarts) {
      const std::string why = r.interrupted || a.max_restarts == 0
                                  ? std::string()
                                  : fmt::format(" (after {} restarts: --max-restarts {} reached)", generation,
                                                a.max_restarts);
      std::fprintf(stderr, "moetrain: error: launch: %s%s\n", r.message.c_str(), why.c_str());
      return r.exit_code;
    }
    spdlog::warn("launch: {} after {:.1f} s; every worker stopped {:.2f} s after it; restarting every worker "
                 "(restart {} of at most {}, generation {})",
                 r.message, ran_s, r.stop_s, generation + 1, a.max_restarts, generation + 1);
  }
}

// Serves the store until SIGINT or SIGTERM.
int run_rdzv_server(int port, const std::string& journal) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before the server's thread starts: it inherits the mask
  TcpStoreServer s(port, journal);
  std::printf("rdzv-server: serving the TCP store on port %d (%zu keys%s)\n", s.port(), s.keys(),
              journal.empty() ? "" : (", journal " + journal).c_str());
  std::fflush(stdout);
  int sig = 0;
  ::sigwait(&stop, &sig);
  std::printf("rdzv-server: stopped by %s\n", signal_name(sig).c_str());
  return 0;
}

// The lighthouse of live fault tolerance until SIGINT or SIGTERM (engine/ft/lighthouse.h).
int run_lighthouse(const LighthouseOptions& opt) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &stop, nullptr);  // before gRPC's threads start: they inherit the mask
  LighthouseServer s(opt);
  spdlog::info("lighthouse: listening on {}:{}, replica groups' store on port {}; min_replicas {}, join_timeout {} "
               "ms, heartbeat_timeout {} ms",
               opt.bind, s.port(), s.store_port(), opt.rules.min_replicas, opt.rules.join_timeout.count(),
               opt.rules.heartbeat_timeout.count());
  int sig = 0;
  ::sigwait(&stop, &sig);
  spdlog::info("lighthouse: stopped by {}", signal_name(sig));
  s.shutdown();
  return 0;
}

// Every collective once, on values whose result is known, then a barrier.
int run_selftest(const SelftestArgs& a) {
  MT_CHECK(a.backend == "gloo" || a.backend == "nccl", "comm-selftest: --backend '{}' is not gloo or nccl",
           a.backend);
  LaunchEnv env = LaunchEnv::from_environment();
  CommOptions opt = default_comm_options(env);
  auto store = Store::open(default_store_spec(env), env.rank, opt.timeout)->prefixed("selftest");
  auto start = std::chrono::steady_clock::now();
  const bool nccl = a.backend == "nccl";
  std::unique_ptr<Communicator> world = nccl ? connect_nccl(store, env.rank, env.world_size, env.local_rank, opt)
                                             : GlooCommunicator::connect(store, env.rank, env.world_size, opt);
  if (env.rank == a.fail_rank) {
    spdlog::error("comm-selftest: rank {} fails on purpose (--fail-rank)", env.rank);
    return 3;
  }
  const Device dev = nccl ? Device::cuda(env.local_rank) : Device::cpu();
  const int P = world->size(), r = world->rank();
  auto check = [&](const Tensor& t, const std::vector<double>& want, const char* what) {
    MT_CHECK(t.to(Device::cpu()).to_double_vector() == want, "comm-selftest: {} gave a wrong result on rank {}", what,
             r);
  };
  Tensor sum = Tensor::full({1 << 20}, r + 1, DType::F32, dev);
  world->all_reduce(sum);
  Tensor first = sum.slice(0, 1);
  check(first, {P * (P + 1) / 2.0}, "all_reduce");
  Tensor mx = Tensor::full({3}, r, DType::I64, dev);
  world->all_reduce(mx, ReduceOp::Max);
  check(mx, {P - 1.0, P - 1.0, P - 1.0}, "all_reduce max");
  Tensor gathered = Tensor::empty({P}, DType::I32, dev);
  world->all_gather(Tensor::full({1}, r, DType::I32, dev), gathered);
  std::vector<double> ranks(P);
  for (int p = 0; p < P; ++p) ranks[p] = p;
  check(gathered, ranks, "all_gather");
  // Peer p gets p rows from every rank, each holding the sender's rank.
  std::vector<int64_t> send(P), recv(P, r);
  std::vector<double> rows, want;
  for (int p = 0; p < P; ++p) {
    send[p] = p;
    rows.insert(rows.end(), p, r);
    want.insert(want.end(), r, p);
  }
  Tensor out = Tensor::empty({static_cast<int64_t>(want.size())}, DType::F64, dev);
  world->all_to_all_v(Tensor::from_vector<double>(rows, {static_cast<int64_t>(rows.size())}).to(dev), send, out,
                      recv);
  check(out, want, "all_to_all_v");
  world->barrier();
  world->synchronize();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (a.bandwidth_mb > 0) time_collectives(*world, dev, a.bandwidth_mb);
  std::printf("comm-selftest: rank %d of %d ok (%s, %s, %.0f ms)\n", r, P, a.backend.c_str(),
              store->description().c_str(), ms);
  return 0;
}

}  // namespace

std::function<int()> add_launch_commands(CLI::App& app) {
  auto la = std::make_shared<LaunchArgs>();
  CLI::App* launch = app.add_subcommand("launch", "run N workers of a moetrain command on this machine");
  launch->add_option("-n,--nproc,--nproc-per-node,--nproc_per_node", la->nproc, "number of workers (ranks) on this node")
      ->required()
      ->check(CLI::PositiveNumber);
  launch->add_option("--nnodes", la->nnodes,
                     "nodes in the job: N, or MIN:MAX for an elastic job that goes on with at least MIN when nodes "
                     "are lost (needs --rdzv-endpoint)")
      ->capture_default_str();
  launch->add_option("--rdzv-endpoint,--rdzv_endpoint", la->rdzv_endpoint,
                     "HOST:PORT where every node's agent meets (c10d: the TCP store, served by the agent on HOST "
                     "or by `moetrain rdzv-server`; etcd: its client URL)");
  launch->add_option("--rdzv-backend,--rdzv_backend", la->rdzv_backend, "c10d (the TCP store) or etcd")->capture_default_str();
  launch->add_option("--rdzv-id,--rdzv_id", la->rdzv_id, "the job's id: its keys in the store (use the scheduler's job id)")
      ->capture_default_str();
  launch->add_option("--rdzv-conf,--rdzv_conf", la->rdzv_conf,
                     "KEY=VALUE,...: join_timeout, last_call_timeout, keep_alive_timeout (seconds), journal (a file "
                     "for the TCP store this agent serves)");
  launch->add_option("--monitor-interval,--monitor_interval", la->monitor_interval_s,
                     "seconds between the agent's checks of the round (another node's failure) while workers run")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  launch->add_option("--local-addr,--local_addr", la->local_addr, "address the other nodes reach this one at (default: hostname)");
  launch->add_option("--store-dir", la->store_dir, "where the fresh rendezvous directory is made (default: the temp dir)");
  launch->add_option("--grace", la->grace_s, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  launch->add_option("--master-port", la->master_port, "MASTER_PORT for the workers (default: a free port)");
  launch->add_option("--max-restarts,--max_restarts", la->max_restarts,
                     "when a worker fails, stop the others and start them all again (resuming from the newest "
                     "committed checkpoint) up to N times")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  launch->add_option("--heartbeat-timeout", la->heartbeat_timeout_s,
                     "seconds without a training step after which a worker counts as hung and is stopped like a "
                     "failed one (0: off; set it above a step plus a validation and a save)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  // Everything after the first word of the worker command (or after "--") is the worker's.
  launch->add_option("command", la->command, "the moetrain subcommand each worker runs, then its arguments");
  launch->prefix_command();
  launch->footer("Example: moetrain launch -n 4 -- train --config configs/tiny.toml\n"
                 "Many nodes (run on each): moetrain launch -n 8 --nnodes 2:4 --rdzv-endpoint node0:29400 "
                 "--rdzv-id JOB --max-restarts 5 -- train --config C\n"
                 "Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT "
                 "and MOETRAIN_STORE; when one fails, the others are stopped. torchrun's underscore spellings "
                 "(--nproc_per_node, --rdzv_endpoint, ...) are accepted too.");

  auto server_port = std::make_shared<int>(0);
  auto server_journal = std::make_shared<std::string>();
  CLI::App* server = app.add_subcommand("rdzv-server", "serve the TCP rendezvous store on its own (elastic jobs)");
  server->add_option("--port", *server_port, "port to listen on, all interfaces")->required();
  server->add_option("--journal", *server_journal,
                     "keep every key in this file too: a server restarted on it comes back with them");

  auto lh = std::make_shared<LighthouseOptions>();
  auto lh_join_ms = std::make_shared<int64_t>(100), lh_heartbeat_ms = std::make_shared<int64_t>(5000);
  CLI::App* lighthouse =
      app.add_subcommand("lighthouse", "serve the quorum of live fault tolerance's replica groups ([fault_tolerance])");
  lighthouse->add_option("--port", lh->port, "gRPC port the replica groups' [fault_tolerance].lighthouse names")
      ->required();
  lighthouse->add_option("--bind", lh->bind, "address to listen on")->capture_default_str();
  lighthouse->add_option("--store-port", lh->store_port,
                         "port of the store where a quorum's groups connect (0: any free port)")
      ->capture_default_str();
  lighthouse->add_option("--min-replicas", lh->rules.min_replicas, "fewest replica groups a quorum may have")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  lighthouse->add_option("--join-timeout-ms", *lh_join_ms,
                         "how long a quorum waits for alive groups that have not asked yet (a group that failed and "
                         "still heartbeats, a slow one)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  lighthouse->add_option("--heartbeat-timeout-ms", *lh_heartbeat_ms,
                         "a group not heard from for this long is dead: quorums stop waiting for it")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto lh_verbose = std::make_shared<bool>(false);
  lighthouse->add_flag("--verbose", *lh_verbose, "log every request and why a quorum waits");
  lighthouse->footer("Example: moetrain lighthouse --port 29510 --min-replicas 1, then each replica group: moetrain launch -n 8 "
                     "-- train -c run.toml --fault_tolerance.lighthouse=HOST:29510 --fault_tolerance.replica_id=I");

  auto sa = std::make_shared<SelftestArgs>();
  CLI::App* selftest = app.add_subcommand("comm-selftest", "check rendezvous and collectives across the ranks");
  selftest->group("");  // hidden: a diagnostic, and the launcher tests' worker
  selftest->add_option("--backend", sa->backend, "gloo (CPU) or nccl (GPU local_rank)")->capture_default_str();
  selftest->add_option("--fail-rank", sa->fail_rank, "this rank exits with status 3 after rendezvous");
  selftest->add_option("--bandwidth", sa->bandwidth_mb,
                       "also time all-to-all-v, all-reduce and all-gather on this many MB (bf16) per rank");

  return [launch, selftest, server, server_port, server_journal, la, sa, lighthouse, lh, lh_join_ms,
          lh_heartbeat_ms, lh_verbose]() -> int {
    if (server->parsed()) return run_rdzv_server(*server_port, *server_journal);
    if (lighthouse->parsed()) {
      lh->rules.join_timeout = std::chrono::milliseconds(*lh_join_ms);
      lh->rules.heartbeat_timeout = std::chrono::milliseconds(*lh_heartbeat_ms);
      if (*lh_verbose) spdlog::set_level(spdlog::level::debug);
      return run_lighthouse(*lh);
    }
    if (launch->parsed()) {
      // CLI11 keeps a "--" before the command among the remaining arguments: not the worker's.
      std::vector<std::string> rest = launch->remaining();
      if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
      std::vector<std::string> worker;
      if (!la->command.empty()) worker.push_back(la->command);
      worker.insert(worker.end(), rest.begin(), rest.end());
      return run_launch(*la, worker);
    }
    if (selftest->parsed()) return run_selftest(*sa);
    return -1;
  };
}

}  // namespace moetrain::app
