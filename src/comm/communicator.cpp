#include "comm/communicator.h"

#include <cstring>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <numeric>

#include "comm/launch_env.h"
#include "core/error.h"

namespace moetrain {

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

std::string Communicator::where(std::string_view op) const {
  return fmt::format("{} on {} (rank {} of {})", op, name_, rank_, size_);
}

void Communicator::check_same_layout(std::string_view op, const Tensor& a, const Tensor& b) const {
  MT_CHECK(a.dtype() == b.dtype(), "{}: input is {} but output is {}", where(op), dtype_name(a.dtype()),
           dtype_name(b.dtype()));
  MT_CHECK(a.device() == b.device(), "{}: input is on {} but output on {}", where(op), a.device().str(),
           b.device().str());
}

void Communicator::check_chunks(std::string_view op, const Tensor& big, const Tensor& small, const char* big_name,
                                const char* small_name) const {
  check_same_layout(op, big, small);
  MT_CHECK(big.numel() == small.numel() * size_,
           "{}: {} has {} elements, expected {} ({} elements of the {} x {} ranks)", where(op), big_name, big.numel(),
           small.numel() * size_, small.numel(), small_name, size_);
}

int64_t Communicator::check_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, const Tensor& out,
                                         const std::vector<int64_t>& recv_rows) const {
  const std::string w = where("all_to_all_v");
  check_same_layout("all_to_all_v", in, out);
  MT_CHECK(in.ndim() >= 1 && out.ndim() >= 1, "{}: input {} and output {} need a row dimension", w, in.str(),
           out.str());
  MT_CHECK(static_cast<int>(send_rows.size()) == size_ && static_cast<int>(recv_rows.size()) == size_,
           "{}: {} send counts and {} receive counts given, expected one per rank ({})", w, send_rows.size(),
           recv_rows.size(), size_);
  for (int p = 0; p < size_; ++p) {
    MT_CHECK(send_rows[p] >= 0 && recv_rows[p] >= 0, "{}: negative count for peer {} (send {}, receive {})", w, p,
             send_rows[p], recv_rows[p]);
  }
  MT_CHECK(send_rows[rank_] == recv_rows[rank_], "{}: sends {} rows to itself but expects {}", w, send_rows[rank_],
           recv_rows[rank_]);
  const int64_t send_total = std::accumulate(send_rows.begin(), send_rows.end(), int64_t{0});
  const int64_t recv_total = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  MT_CHECK(in.size(0) == send_total, "{}: input {} has {} rows but the send counts add up to {}", w, in.str(),
           in.size(0), send_total);
  MT_CHECK(out.size(0) == recv_total, "{}: output {} has {} rows but the receive counts add up to {}", w, out.str(),
           out.size(0), recv_total);
  Shape in_row(in.shape().begin() + 1, in.shape().end()), out_row(out.shape().begin() + 1, out.shape().end());
  MT_CHECK(in_row == out_row, "{}: input rows {} and output rows {} differ", w, shape_str(in_row),
           shape_str(out_row));
  return shape_numel(in_row);
}

void Communicator::check_peer(std::string_view op, int peer) const {
  MT_CHECK(peer >= 0 && peer < size_, "{}: peer {} is not a rank of this group (0 to {})", where(op), peer,
           size_ - 1);
}

namespace {

// The local address of the route to `host`: a UDP "connect" sends nothing but makes the
// kernel pick the outgoing interface.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  MT_CHECK(::getaddrinfo(host.c_str(), "9", &hints, &res) == 0 && res,
           "gloo: cannot resolve MASTER_ADDR '{}' to choose the local address (set MOETRAIN_GLOO_HOST or "
           "MOETRAIN_GLOO_IFACE)",
           host);
  std::string out;
  int fd = ::socket(res->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char buf[INET6_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      const void* a = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                  : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (::inet_ntop(local.ss_family, a, buf, sizeof buf)) out = buf;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  MT_CHECK(!out.empty(), "gloo: no route to MASTER_ADDR '{}' to choose the local address (set MOETRAIN_GLOO_HOST)",
           host);
  return out;
}

std::string env_or(const char* a, const char* b = nullptr) {
  if (const char* v = std::getenv(a)) return v;
  if (b) {
    if (const char* v = std::getenv(b)) return v;
  }
  return "";
}

}  // namespace

CommOptions default_comm_options(const LaunchEnv& env) {
  CommOptions o;
  if (std::string t = env_or("MOETRAIN_COMM_TIMEOUT"); !t.empty()) {
    double seconds = 0;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), seconds);
    MT_CHECK(ec == std::errc() && end == t.data() + t.size() && seconds > 0,
             "environment: MOETRAIN_COMM_TIMEOUT='{}' is not a positive number of seconds", t);
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }
  o.gloo_iface = env_or("MOETRAIN_GLOO_IFACE", "GLOO_SOCKET_IFNAME");
  o.gloo_host = env_or("MOETRAIN_GLOO_HOST");
  if (o.gloo_iface.empty() && o.gloo_host.empty()) {
    if (env.single_node()) {
      o.gloo_host = "127.0.0.1";
    } else if (!env.master_addr.empty()) {
      o.gloo_host = local_address_towards(env.master_addr);
    } else {
      char name[256] = {};
      ::gethostname(name, sizeof name - 1);
      o.gloo_host = name;
    }
  }
  return o;
}

namespace {
// Stream-ordered backends: the transfer is enqueued by the time the call returns.
class DoneRequest final : public P2pRequest {
 public:
  void wait() override {}
};
}  // namespace

std::unique_ptr<P2pRequest> Communicator::enqueued() { return std::make_unique<DoneRequest>(); }

std::unique_ptr<P2pRequest> Communicator::isend(const Tensor& t, int peer, uint32_t, cuda::Stream stream) {
  send(t, peer, stream);
  return enqueued();
}

std::unique_ptr<P2pRequest> Communicator::irecv(Tensor& t, int peer, uint32_t, cuda::Stream stream) {
  recv(t, peer, stream);
  return enqueued();
}

namespace {
// Several requests waited for as one.
class Requests final : public P2pRequest {
 public:
  explicit Requests(std::vector<std::unique_ptr<P2pRequest>> all) : all_(std::move(all)) {}
  void wait() override {
    for (auto& r : all_) r->wait();
    all_.clear();
  }

 private:
  std::vector<std::unique_ptr<P2pRequest>> all_;
};
}  // namespace

std::unique_ptr<P2pRequest> Communicator::send_recv(const std::vector<Tensor>& sends, int to,
                                                    std::vector<Tensor>& recvs, int from, uint32_t tag,
                                                    cuda::Stream stream) {
  std::vector<std::unique_ptr<P2pRequest>> all;
  for (size_t i = 0; i < sends.size(); ++i) all.push_back(isend(sends[i], to, tag + static_cast<uint32_t>(i), stream));
  for (size_t i = 0; i < recvs.size(); ++i) all.push_back(irecv(recvs[i], from, tag + static_cast<uint32_t>(i), stream));
  return std::make_unique<Requests>(std::move(all));
}

void all_reduce_doubles(Communicator& group, std::vector<double>& values, Device device, ReduceOp op) {
  if (values.empty() || group.size() == 1) return;
  Tensor t = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  if (group.backend() != "gloo" && !device.is_cpu()) t = t.to(device);
  group.all_reduce(t, op);
  values = t.to_double_vector();
}

void broadcast_bytes(Communicator& group, std::string& bytes, int root, Device device) {
  if (group.size() == 1) return;
  const Device where = group.backend() == "gloo" ? Device::cpu() : device;
  Tensor n = Tensor::from_vector(std::vector<int64_t>{static_cast<int64_t>(bytes.size())}, {1}).to(where);
  group.broadcast(n, root);
  const int64_t len = n.to(Device::cpu()).data<int64_t>()[0];
  Tensor t = bytes_as_words(group.rank() == root ? bytes : std::string(), len, where);
  if (t.numel() > 0) group.broadcast(t, root);
  bytes = words_as_bytes(t, len);
}

Tensor bytes_as_words(const std::string& bytes, int64_t len, Device device) {
  std::vector<int32_t> words(static_cast<size_t>((len + 3) / 4), 0);
  std::memcpy(words.data(), bytes.data(), std::min(bytes.size(), static_cast<size_t>(len)));
  return Tensor::from_vector(words, {static_cast<int64_t>(words.size())}).to(device);
}

std::string words_as_bytes(const Tensor& words, int64_t len) {
  const Tensor host = words.to(Device::cpu());
  return std::string(reinterpret_cast<const char*>(host.raw()), static_cast<size_t>(len));
}

}  // namespace moetrain
