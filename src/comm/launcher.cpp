#include "comm/launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"

extern char** environ;

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;

// The signal handler's only job: wake the loop through this pipe.
int g_wake_fd = -1;
void on_signal(int sig) {
  char c = static_cast<char>(sig);
  int saved = errno;
  (void)!::write(g_wake_fd, &c, 1);
  errno = saved;
}

struct Worker {
  int rank = 0;   // global
  int local = 0;  // index on this machine
  pid_t pid = -1;
  int fd[3] = {-1, -1, -1};  // [1] stdout, [2] stderr read ends; -1 once closed
  std::string partial[3];
  bool running = false;
};

void emit(const LaunchSpec& spec, int rank, int stream, const std::string& line) {
  if (spec.on_line) {
    spec.on_line(rank, stream, line);
    return;
  }
  std::string out = "[rank " + std::to_string(rank) + "] " + line + "\n";
  (void)!::write(stream, out.data(), out.size());
}

// Reads what is there; hands complete lines on. Returns false at end of file.
bool drain(const LaunchSpec& spec, Worker& w, int stream) {
  char buf[65536];
  ssize_t n = ::read(w.fd[stream], buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) {
    if (!w.partial[stream].empty()) emit(spec, w.rank, stream, w.partial[stream]);
    w.partial[stream].clear();
    ::close(w.fd[stream]);
    w.fd[stream] = -1;
    return false;
  }
  std::string& p = w.partial[stream];
  p.append(buf, static_cast<size_t>(n));
  size_t start = 0, nl;
  while ((nl = p.find('\n', start)) != std::string::npos) {
    emit(spec, w.rank, stream, p.substr(start, nl - start));
    start = nl + 1;
  }
  p.erase(0, start);
  return true;
}

// After a worker exited: what is left in its pipes, for up to `limit` (something it started
// may hold them open).
void drain_to_eof(const LaunchSpec& spec, Worker& w, std::chrono::milliseconds limit) {
  auto until = Clock::now() + limit;
  for (int s : {1, 2}) {
    while (w.fd[s] >= 0 && Clock::now() < until) {
      pollfd p{w.fd[s], POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) drain(spec, w, s);
    }
  }
}

std::string describe_status(const Worker& w, int status) {
  if (WIFSIGNALED(status)) {
    return fmt::format("rank {} (pid {}) was killed by signal {} ({})", w.rank, w.pid, WTERMSIG(status),
                       signal_name(WTERMSIG(status)));
  }
  return fmt::format("rank {} (pid {}) exited with status {}", w.rank, w.pid, WEXITSTATUS(status));
}

// Sends `sig` to each running worker's process group (the worker and what it started).
void signal_all(std::vector<Worker>& ws, int sig) {
  for (Worker& w : ws) {
    if (w.running && ::kill(-w.pid, sig) != 0) ::kill(w.pid, sig);
  }
}

// Installs the handlers for the launch and puts the old ones back after it.
class SignalScope {
 public:
  explicit SignalScope(int wake_fd) {
    g_wake_fd = wake_fd;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGCHLD, &sa, &old_chld_);  // reap at once: the first to die is the one to name
  }
  ~SignalScope() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGCHLD, &old_chld_, nullptr);
    g_wake_fd = -1;
  }

 private:
  struct sigaction old_int_ {}, old_term_ {}, old_chld_ {};
};

}  // namespace

int free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  MT_CHECK(fd >= 0, "launch: socket: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  MT_CHECK(ok, "launch: cannot find a free TCP port: {}", std::strerror(errno));
  return ntohs(a.sin_port);
}

LaunchResult launch_workers(const LaunchSpec& spec) {
  MT_CHECK(spec.nproc >= 1, "launch: -n {} must be at least 1", spec.nproc);
  MT_CHECK(!spec.argv.empty(), "launch: no worker command given (moetrain launch -n N -- COMMAND ...)");
  const int world = spec.world_size > 0 ? spec.world_size : spec.nproc;
  MT_CHECK(spec.rank_offset >= 0 && spec.rank_offset + spec.nproc <= world,
           "launch: ranks {}..{} do not fit a world of {}", spec.rank_offset, spec.rank_offset + spec.nproc - 1, world);
  const int port = spec.master_port != 0 ? spec.master_port : free_tcp_port();

  namespace fs = std::filesystem;
  fs::path parent = spec.store_parent.empty() ? fs::temp_directory_path() : fs::path(spec.store_parent);
  std::error_code ec;
  fs::create_directories(parent, ec);
  std::string tmpl = (parent / "moetrain-launch-XXXXXX").string();
  MT_CHECK(::mkdtemp(tmpl.data()) != nullptr, "launch: cannot create a store directory in {}: {}", parent.string(),
           std::strerror(errno));
  const std::string store_dir = tmpl;

  // Everything the children need is built before fork: between fork and exec only
  // async-signal-safe calls.
  std::vector<std::string> base_env;
  auto overridden = [&](const std::string& entry) {
    static const char* kOurs[] = {"RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",     "LOCAL_WORLD_SIZE=",
                                  "GROUP_RANK=",  "MASTER_ADDR=", "MASTER_PORT=",    "MOETRAIN_STORE=",
                                  "MOETRAIN_HEARTBEAT="};
    for (const char* k : kOurs) {
      if (entry.rfind(k, 0) == 0) return true;
    }
    for (const auto& [k, v] : spec.env) {
      if (entry.rfind(k + "=", 0) == 0) return true;
    }
    return false;
  };
  for (char** e = environ; *e; ++e) {
    if (!overridden(*e)) base_env.emplace_back(*e);
  }
  for (const auto& [k, v] : spec.env) base_env.push_back(k + "=" + v);
  std::vector<char*> argv;
  for (const std::string& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  int wake[2];
  MT_CHECK(::pipe2(wake, O_CLOEXEC | O_NONBLOCK) == 0, "launch: pipe: {}", std::strerror(errno));
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  SignalScope signals(wake[1]);
  const pid_t launcher = ::getpid();

  std::vector<Worker> ws(spec.nproc);
  LaunchResult result;
  for (int r = 0; r < spec.nproc; ++r) {
    Worker& w = ws[r];
    w.rank = spec.rank_offset + r;
    w.local = r;
    std::vector<std::string> env = base_env;
    for (auto [k, v] : {std::pair<std::string, std::string>{"RANK", std::to_string(w.rank)},
                        {"WORLD_SIZE", std::to_string(world)},
                        {"LOCAL_RANK", std::to_string(r)},
                        {"LOCAL_WORLD_SIZE", std::to_string(spec.nproc)},
                        {"GROUP_RANK", std::to_string(spec.node_rank)},
                        {"MASTER_ADDR", spec.master_addr},
                        {"MASTER_PORT", std::to_string(port)},
                        {"MOETRAIN_STORE", spec.worker_store.empty() ? store_dir : spec.worker_store},
                        {"MOETRAIN_HEARTBEAT", store_dir + "/heartbeat-" + std::to_string(r)}}) {
      env.push_back(k + "=" + v);
    }
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out[2], err[2];
    MT_CHECK(::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0, "launch: pipe: {}", std::strerror(errno));
    // Signals stay blocked across fork until the child has dropped our handlers: one that
    // came in between would run our handler in the child and write to our wake pipe.
    sigset_t all, old_mask;
    sigfillset(&all);
    ::pthread_sigmask(SIG_BLOCK, &all, &old_mask);
    pid_t pid = ::fork();
    if (pid == 0) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(SIGINT, &dfl, nullptr);
      ::sigaction(SIGTERM, &dfl, nullptr);
      ::sigaction(SIGCHLD, &dfl, nullptr);
      ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(126);  // the launcher died before prctl took effect
      ::dup2(devnull, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execvpe(argv[0], argv.data(), envp.data());
      const char msg[] = "launch: cannot execute the worker command\n";
      (void)!::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    ::pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    MT_CHECK(pid >= 0, "launch: fork of rank {}: {}", r, std::strerror(errno));
    ::setpgid(pid, pid);  // also here, so a signal sent right away reaches the group
    ::close(out[1]);
    ::close(err[1]);
    w.pid = pid;
    w.fd[1] = out[0];
    w.fd[2] = err[0];
    w.running = true;
  }
  if (devnull >= 0) ::close(devnull);
  spdlog::info("launch: {} workers of '{}' (ranks {}..{} of {}, store {}, MASTER_PORT {})", spec.nproc, spec.argv[0],
               spec.rank_offset, spec.rank_offset + spec.nproc - 1, world,
               spec.worker_store.empty() ? store_dir : spec.worker_store, port);

  bool stopping = false, killed = false;
  Clock::time_point kill_at;
  auto stop = [&](int sig) {
    if (!stopping) {
      stopping = true;
      kill_at = Clock::now() + spec.grace;
    }
    signal_all(ws, sig);
  };
  int running = spec.nproc, exited_clean = 0;
  std::optional<Clock::time_point> failed_at;
  std::optional<Clock::time_point> drain_until;
  Clock::time_point next_monitor = Clock::now() + spec.monitor_interval;
  auto mark_failed = [&] {
    failed_at = Clock::now();
    result.failed_at = epoch_seconds();
  };
  while (true) {
    std::vector<pollfd> fds{{wake[0], POLLIN, 0}};
    std::vector<std::pair<int, int>> who;  // (worker's local index, stream) of fds[i + 1]
    for (Worker& w : ws) {
      for (int s : {1, 2}) {
        if (w.fd[s] >= 0) {
          fds.push_back({w.fd[s], POLLIN, 0});
          who.emplace_back(w.local, s);
        }
      }
    }
    if (running == 0 && (who.empty() || (drain_until && Clock::now() > *drain_until))) break;
    ::poll(fds.data(), fds.size(), 100);
    if (fds[0].revents & POLLIN) {
      char sig = 0;
      while (::read(wake[0], &sig, 1) == 1) {
        if (sig == SIGCHLD) continue;  // the reaping below handles it
        result.interrupted = true;
        if (result.exit_code == 0) {
          result.exit_code = 128 + sig;
          result.message = fmt::format("launch got {}; stopped the workers", signal_name(sig));
        }
        spdlog::warn("launch: got {}; {}", signal_name(sig), stopping ? "killing the workers" : "passing it on to the workers");
        if (stopping) {
          signal_all(ws, SIGKILL);
          killed = true;
        } else {
          stop(sig);
        }
      }
    }
    for (size_t i = 0; i < who.size(); ++i) {
      if (fds[i + 1].revents) drain(spec, ws[who[i].first], who[i].second);
    }
    for (Worker& w : ws) {
      int status = 0;
      if (!w.running || ::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
      w.running = false;
      --running;
      bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (!failed) ++exited_clean;
      if (failed && !stopping) {
        drain_to_eof(spec, w, std::chrono::milliseconds(200));  // its last words before ours
        result.failed_rank = w.rank;
        result.exit_code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        result.message = describe_status(w, status);
        mark_failed();
        spdlog::error("launch: {}; stopping the other workers", result.message);
        // SIGINT, not SIGTERM: a training worker takes SIGTERM as a preemption notice and
        // would try to finish its step with a dead peer; after a failure the survivors'
        // state is of no use (the job resumes from its last committed step), so they stop now.
        stop(SIGINT);
      } else {
        spdlog::debug("launch: {}", describe_status(w, status));
      }
    }
    // A rank that stopped beating (hung in a collective, a dead device) fails the launch as
    // an exit would.
    // The stalest is named: the ranks waiting for a hung one in a collective stop beating too.
    if (spec.heartbeat_timeout.count() > 0 && !stopping) {
      const Worker* stalest = nullptr;
      fs::file_time_type::duration oldest{};
      for (const Worker& w : ws) {
        if (!w.running) continue;
        std::error_code hec;
        const auto beat = fs::last_write_time(store_dir + "/heartbeat-" + std::to_string(w.local), hec);
        if (hec) continue;  // no beat yet: still starting
        const auto age = fs::file_time_type::clock::now() - beat;
        if (age >= spec.heartbeat_timeout && (stalest == nullptr || age > oldest)) {
          stalest = &w;
          oldest = age;
        }
      }
      if (stalest != nullptr) {
        result.failed_rank = stalest->rank;
        result.exit_code = 1;
        result.message = fmt::format("rank {} (pid {}) sent no heartbeat for {:.1f} s", stalest->rank, stalest->pid,
                                     std::chrono::duration<double>(oldest).count());
        mark_failed();
        spdlog::error("launch: {}; stopping every worker", result.message);
        stop(SIGINT);
      }
    }
    if (spec.monitor && !stopping && running > 0 && Clock::now() >= next_monitor) {
      next_monitor = Clock::now() + spec.monitor_interval;
      if (std::optional<std::string> why = spec.monitor()) {
        result.stopped_by_monitor = true;
        result.exit_code = 1;
        result.message = *why;
        mark_failed();
        spdlog::error("launch: {}; stopping this node's workers", *why);
        stop(SIGINT);
      }
    }
    if (stopping && !killed && running > 0 && Clock::now() > kill_at) {
      spdlog::warn("launch: {} workers still running {} s after SIGTERM; sending SIGKILL", running,
                   spec.grace.count() / 1000.0);
      signal_all(ws, SIGKILL);
      killed = true;
    }
    // Something a worker started may keep its pipes open: read for a moment, then go.
    if (running == 0 && !drain_until) drain_until = Clock::now() + std::chrono::seconds(1);
  }
  for (Worker& w : ws) {
    for (int s : {1, 2}) {
      if (w.fd[s] >= 0) ::close(w.fd[s]);
    }
  }
  ::close(wake[0]);
  ::close(wake[1]);
  fs::remove_all(store_dir, ec);
  if (failed_at) result.stop_s = std::chrono::duration<double>(Clock::now() - *failed_at).count();
  // Stopped by a signal that every worker answered by exiting 0 (a preempted run that
  // saved and stopped): the job ended cleanly.
  if (result.interrupted && result.failed_rank < 0 && exited_clean == spec.nproc) {
    spdlog::info("launch: {}; every worker exited 0", result.message);
    result.exit_code = 0;
  }
  return result;
}

}  // namespace moetrain
