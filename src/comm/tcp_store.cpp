#include "comm/tcp_store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include "core/error.h"
#include "core/log.h"

// Wire format, one request at a time per connection (integers in host byte order: every
// machine of a job shares one architecture):
//   set: 'S' u32 key_len key u32 value_len value  ->  'K' (stored) or 'E' (already set)
//   get: 'G' u32 key_len key                      ->  'F' u32 value_len value, or 'N'
//   add: 'A' u32 key_len key u32 8 i64 delta      ->  'F' u32 8 i64 sum
// A counter's value is its decimal text, so a get reads it as any other key.
// Journal (TcpStoreServer with a path): records u32 key_len key u32 value_len value, each the
// key's value after a change, appended; replayed in order at start (a torn last record,
// from a server killed mid-write, is dropped).
namespace moetrain {
namespace {

constexpr uint32_t kMaxKey = 1 << 16;
constexpr uint32_t kMaxValue = 1 << 26;

void put_u32(std::string& out, uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

uint32_t get_u32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

class TcpStoreServer::Impl {
 public:
  Impl(int port, const std::string& journal_path) {
    if (!journal_path.empty()) replay(journal_path);
    // Dual-stack where the machine has IPv6, IPv4 only where it does not.
    fd_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    int one = 1, zero = 0;
    if (fd_ >= 0) {
      ::setsockopt(fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail_bind(port);
    } else {
      fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
      MT_CHECK(fd_ >= 0, "tcp store: socket: {}", std::strerror(errno));
      ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) fail_bind(port);
    }
    MT_CHECK(::listen(fd_, 1024) == 0, "tcp store: listen on port {}: {}", port, std::strerror(errno));
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    MT_CHECK(::pipe(wake_) == 0, "tcp store: pipe: {}", std::strerror(errno));
    thread_ = std::thread([this] { run(); });
  }

  ~Impl() {
    char c = 0;
    (void)!::write(wake_[1], &c, 1);
    thread_.join();
    if (journal_fd_ >= 0) ::close(journal_fd_);  // after the thread: it writes there
    for (auto& [fd, buf] : conns_) ::close(fd);
    ::close(fd_);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

  int port() const { return port_; }
  size_t keys() {
    std::lock_guard<std::mutex> lock(table_mu_);
    return table_.size();
  }

 private:
  void replay(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f != nullptr) {
      while (true) {
        uint32_t klen, vlen;
        if (std::fread(&klen, 4, 1, f) != 1 || klen > kMaxKey) break;
        std::string key(klen, '\0');
        if (std::fread(key.data(), 1, klen, f) != klen || std::fread(&vlen, 4, 1, f) != 1 || vlen > kMaxValue) break;
        std::vector<char> value(vlen);
        if (std::fread(value.data(), 1, vlen, f) != vlen) break;
        table_[key] = std::move(value);
      }
      std::fclose(f);
    }
    // Rewritten whole from the table: drops a torn record and old values of counters.
    const std::string tmp = path + ".tmp";
    journal_fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MT_CHECK(journal_fd_ >= 0, "tcp store: cannot write the journal {}: {}", tmp, std::strerror(errno));
    for (const auto& [k, v] : table_) journal(k, v);
    MT_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "tcp store: cannot rename {} to {}: {}", tmp, path,
             std::strerror(errno));
  }

  // Appends the key's new value to the journal (when there is one). A write that fails is
  // reported once: the store keeps serving from memory.
  void journal(const std::string& key, const std::vector<char>& value) {
    if (journal_fd_ < 0) return;
    std::string rec;
    put_u32(rec, static_cast<uint32_t>(key.size()));
    rec += key;
    put_u32(rec, static_cast<uint32_t>(value.size()));
    rec.append(value.data(), value.size());
    if (::write(journal_fd_, rec.data(), rec.size()) != static_cast<ssize_t>(rec.size()) && !journal_failed_) {
      journal_failed_ = true;
      std::fprintf(stderr, "tcp store: writing the journal failed (%s); keys from now on live in memory only\n",
                   std::strerror(errno));
    }
  }

  [[noreturn]] void fail_bind(int port) {
    int err = errno;
    ::close(fd_);
    MT_THROW("tcp store: cannot listen on port {}: {} (another job or store on this port? choose another "
             "MASTER_PORT or --rdzv-endpoint port)",
             port, std::strerror(err));
  }

  void run() {
    std::vector<pollfd> fds;
    while (true) {
      fds.clear();
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({fd_, POLLIN, 0});
      for (auto& [fd, buf] : conns_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c >= 0) {
          int one = 1;
          ::setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          conns_[c];
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
          std::lock_guard<std::mutex> lock(table_mu_);
        if (!serve(fds[i].fd)) {
          ::close(fds[i].fd);
          conns_.erase(fds[i].fd);
        }
      }
    }
  }

  // Reads what the client sent and answers every complete request; false: drop it.
  bool serve(int fd) {
    char tmp[65536];
    ssize_t r = ::recv(fd, tmp, sizeof tmp, 0);
    if (r <= 0) return r < 0 && errno == EINTR;
    std::string& buf = conns_[fd];
    buf.append(tmp, static_cast<size_t>(r));
    while (true) {
      if (buf.size() < 5) return true;
      char op = buf[0];
      uint32_t klen = get_u32(buf.data() + 1);
      if (klen > kMaxKey || (op != 'S' && op != 'G' && op != 'A')) return false;
      size_t need = 5 + klen;
      uint32_t vlen = 0;
      if (op == 'S' || op == 'A') {
        if (buf.size() < need + 4) return true;
        vlen = get_u32(buf.data() + need);
        if (vlen > kMaxValue || (op == 'A' && vlen != 8)) return false;
        need += 4 + vlen;
      }
      if (buf.size() < need) return true;
      std::string key = buf.substr(5, klen);
      std::string reply;
      if (op == 'S') {
        auto [it, fresh] = table_.try_emplace(key, buf.begin() + 9 + klen, buf.begin() + need);
        reply.push_back(fresh ? 'K' : 'E');
        if (fresh) journal(key, it->second);
      } else if (op == 'A') {
        int64_t delta;
        std::memcpy(&delta, buf.data() + 9 + klen, 8);
        std::vector<char>& v = table_[key];
        int64_t sum = (v.empty() ? 0 : std::stoll(std::string(v.begin(), v.end()))) + delta;
        std::string text = std::to_string(sum);
        v.assign(text.begin(), text.end());
        journal(key, v);
        reply.push_back('F');
        put_u32(reply, 8);
        reply.append(reinterpret_cast<const char*>(&sum), 8);
      } else if (auto it = table_.find(key); it != table_.end()) {
        reply.push_back('F');
        put_u32(reply, static_cast<uint32_t>(it->second.size()));
        reply.append(it->second.data(), it->second.size());
      } else {
        reply.push_back('N');
      }
      buf.erase(0, need);
      if (!write_all(fd, reply.data(), reply.size())) return false;
    }
  }

  int fd_ = -1, port_ = 0;
  int wake_[2] = {-1, -1};
  int journal_fd_ = -1;
  bool journal_failed_ = false;
  std::map<int, std::string> conns_;  // fd -> bytes received and not yet answered
  std::mutex table_mu_;               // the table: the serving thread writes, keys() reads
  std::map<std::string, std::vector<char>> table_;
  std::thread thread_;
};

TcpStoreServer::TcpStoreServer(int port, const std::string& journal)
    : impl_(std::make_unique<Impl>(port, journal)) {}
TcpStoreServer::~TcpStoreServer() = default;
int TcpStoreServer::port() const { return impl_->port(); }
size_t TcpStoreServer::keys() const { return impl_->keys(); }

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds timeout)
    : host_(host), port_(port), timeout_(timeout) {
  if (serve) {
    server_ = std::make_unique<TcpStoreServer>(port);
    port_ = server_->port();
  }
  connect();
}

void TcpStore::connect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  auto deadline = std::chrono::steady_clock::now() + timeout_;
  std::string last_error = "no address";
  while (fd_ < 0) {
    addrinfo* res = nullptr;
    int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
    if (rc != 0) {
      last_error = gai_strerror(rc);
    } else {
      for (addrinfo* a = res; a && fd_ < 0; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    // The server (rank 0) may not be up yet.
    MT_CHECK(std::chrono::steady_clock::now() < deadline,
             "tcp store {}:{}: cannot connect within {} s: {} (is rank 0 running, and MASTER_ADDR/MASTER_PORT "
             "right?)",
             host_, port_, timeout_.count() / 1000.0, last_error);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A server that stops answering (rank 0 hung) must not hang a client forever.
  timeval tv{static_cast<time_t>(timeout_.count() / 1000), static_cast<suseconds_t>(timeout_.count() % 1000 * 1000)};
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
}

bool TcpStore::request_once(const std::string& msg, char* status, std::vector<char>* out) {
  bool ok = fd_ >= 0 && write_all(fd_, msg.data(), msg.size()) && read_all(fd_, status, 1);
  if (ok && *status == 'F') {
    char len[4];
    ok = read_all(fd_, len, 4);
    if (ok) {
      out->resize(get_u32(len));
      ok = read_all(fd_, out->data(), out->size());
    }
  }
  return ok;
}

bool TcpStore::request(char op, const std::string& key, const std::vector<char>* value, std::vector<char>* out) {
  MT_CHECK(key.size() <= kMaxKey, "tcp store: key of {} bytes is too long", key.size());
  MT_CHECK(!value || value->size() <= kMaxValue, "tcp store: value of key '{}' is too large ({} bytes)", key,
           value->size());
  std::string msg(1, op);
  put_u32(msg, static_cast<uint32_t>(key.size()));
  msg += key;
  if (value) {
    put_u32(msg, static_cast<uint32_t>(value->size()));
    msg.append(value->data(), value->size());
  }
  std::lock_guard<std::mutex> lock(mu_);
  char status = 0;
  bool ok = request_once(msg, &status, out);
  if (!ok && reconnect_) {
    const int err = errno;
    spdlog::warn("tcp store {}:{}: lost the connection during key '{}' ({}); connecting again", host_, port_, key,
                 err ? std::strerror(err) : "closed");
    // A server being killed may still complete a connection and then reset it: connect and
    // ask again until the timeout.
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!ok && std::chrono::steady_clock::now() < deadline) {
      connect();  // throws after the timeout
      ok = request_once(msg, &status, out);
      if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  MT_CHECK(ok, "tcp store {}:{}: lost the connection to the server (rank 0) during key '{}': {}", host_, port_, key,
           errno ? std::strerror(errno) : "closed");
  if (status == 'E' && op == 'S' && out == nullptr) MT_THROW("tcp store {}:{}: key '{}' is already set", host_, port_, key);
  return status == 'F' || status == 'K';
}

bool TcpStore::set_once(const std::string& key, const std::vector<char>& data) {
  std::vector<char> ignored;
  return request('S', key, &data, &ignored);
}

std::optional<std::vector<char>> TcpStore::try_get(const std::string& key) {
  std::vector<char> out;
  if (!request('G', key, nullptr, &out)) return std::nullopt;
  return out;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  std::vector<char> d(8), out;
  std::memcpy(d.data(), &delta, 8);
  request('A', key, &d, &out);
  MT_CHECK(out.size() == 8, "tcp store {}:{}: add to '{}' got a reply of {} bytes, not 8", host_, port_, key, out.size());
  int64_t sum;
  std::memcpy(&sum, out.data(), 8);
  return sum;
}

void TcpStore::set(const std::string& key, const std::vector<char>& data) { request('S', key, &data, nullptr); }

std::vector<char> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  std::vector<char> out;
  request('G', key, nullptr, &out);
  return out;
}

void TcpStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(2);
  std::vector<char> ignored;
  for (const std::string& key : keys) {
    while (!request('G', key, nullptr, &ignored)) {
      MT_CHECK(std::chrono::steady_clock::now() < deadline, "tcp store {}:{}: key '{}' not set within {} s", host_,
               port_, key, timeout.count() / 1000.0);
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  }
}

}  // namespace moetrain
