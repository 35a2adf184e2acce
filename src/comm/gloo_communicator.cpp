#include "comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "comm/store.h"
#include "core/log.h"

namespace moetrain {
namespace {

// Slot prefixes of point-to-point messages: above the ones gloo's collectives use (1-8).
// Blocking send/recv use slot 0 of the first; isend/irecv put their tag in the second.
constexpr uint8_t kP2pSlotPrefix = 0x20;
constexpr uint8_t kTaggedP2pSlotPrefix = 0x21;

// A buffer gloo can point at when a tensor holds no bytes.
char g_empty_byte;

char* bytes_of(const Tensor& t) { return t.nbytes() == 0 ? &g_empty_byte : static_cast<char*>(t.raw()); }

template <typename T>
T max_of(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b > a ? b : a;
}

// out[i] = op over p of chunks[p * n + i], p in rank order, accumulated in Acc.
template <typename T, typename Acc>
void reduce_rows(const T* chunks, int ranks, int64_t n, T* out, ReduceOp op) {
  for (int64_t i = 0; i < n; ++i) {
    Acc acc = static_cast<Acc>(chunks[i]);
    for (int p = 1; p < ranks; ++p) {
      Acc x = static_cast<Acc>(chunks[p * n + i]);
      acc = op == ReduceOp::Sum ? acc + x : max_of(acc, x);
    }
    out[i] = static_cast<T>(acc);
  }
}

void reduce_typed(DType dt, const void* chunks, int ranks, int64_t n, void* out, ReduceOp op) {
  switch (dt) {
    case DType::F32: return reduce_rows<float, float>(static_cast<const float*>(chunks), ranks, n, static_cast<float*>(out), op);
    case DType::F64: return reduce_rows<double, double>(static_cast<const double*>(chunks), ranks, n, static_cast<double*>(out), op);
    case DType::BF16: return reduce_rows<bf16, float>(static_cast<const bf16*>(chunks), ranks, n, static_cast<bf16*>(out), op);
    case DType::I32: return reduce_rows<int32_t, int32_t>(static_cast<const int32_t*>(chunks), ranks, n, static_cast<int32_t*>(out), op);
    case DType::I64: return reduce_rows<int64_t, int64_t>(static_cast<const int64_t*>(chunks), ranks, n, static_cast<int64_t*>(out), op);
    case DType::I16: return reduce_rows<int16_t, int32_t>(static_cast<const int16_t*>(chunks), ranks, n, static_cast<int16_t*>(out), op);
    case DType::F8E4M3: break;  // FP8 operands are moved, never summed
  }
  MT_THROW("gloo: no reduction of {} tensors", dtype_name(dt));
}

std::shared_ptr<gloo::transport::Device> make_device(const CommOptions& o) {
  gloo::transport::tcp::attr attr;
  if (!o.gloo_iface.empty()) attr.iface = o.gloo_iface;
  else attr.hostname = o.gloo_host.empty() ? "127.0.0.1" : o.gloo_host;
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    MT_THROW("gloo: cannot open a TCP device on {} '{}': {} (set MOETRAIN_GLOO_IFACE or MOETRAIN_GLOO_HOST)",
             o.gloo_iface.empty() ? "address" : "interface", o.gloo_iface.empty() ? attr.hostname : o.gloo_iface,
             e.what());
  }
}

}  // namespace

struct GlooCommunicator::State {
  std::shared_ptr<Store> store;  // this communicator's key space; splits live under it
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::Context> context;
  uint32_t next_tag = 0;
  int next_split = 0;
};

GlooCommunicator::GlooCommunicator(int rank, int size, std::string name, CommOptions options,
                                   std::unique_ptr<State> state)
    : Communicator(rank, size, std::move(name), std::move(options)), state_(std::move(state)) {}

GlooCommunicator::~GlooCommunicator() = default;

namespace {

std::unique_ptr<GlooCommunicator::State> rendezvous(std::shared_ptr<Store> store,
                                                    std::shared_ptr<gloo::transport::Device> device, int rank,
                                                    int size, const CommOptions& options, const std::string& name) {
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "gloo rendezvous of {}: rank {} of {} is not a valid rank", name,
           rank, size);
  auto st = std::make_unique<GlooCommunicator::State>();
  st->store = store;
  st->device = std::move(device);
  // Our own roll call first, so a missing rank is named in the error; gloo's rendezvous
  // then finds every address already published.
  auto deadline = std::chrono::steady_clock::now() + options.timeout;
  store->set("joined/" + std::to_string(rank), {'1'});
  for (int r = 0; r < size; ++r) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    try {
      store->wait({"joined/" + std::to_string(r)}, std::max(left, std::chrono::milliseconds(1)));
    } catch (const Error& e) {
      MT_THROW("gloo rendezvous of {} (rank {} of {}): rank {} did not join within {} s (not started, crashed, "
               "or using another store than {})",
               name, rank, size, r, options.timeout.count() / 1000.0, store->description());
    }
  }
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(options.timeout);
  try {
    ctx->connectFullMesh(store->gloo_view(), st->device);
  } catch (const std::exception& e) {
    MT_THROW("gloo rendezvous of {} (rank {} of {}) through {} failed: {}", name, rank, size, store->description(),
             e.what());
  }
  st->context = std::move(ctx);
  return st;
}

}  // namespace

std::unique_ptr<GlooCommunicator> GlooCommunicator::connect(std::shared_ptr<Store> store, int rank, int size,
                                                            const CommOptions& options, const std::string& name) {
  auto st = rendezvous(std::move(store), make_device(options), rank, size, options, name);
  spdlog::debug("gloo: {} connected, rank {} of {}", name, rank, size);
  return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(rank, size, name, options, std::move(st)));
}

template <typename F>
void GlooCommunicator::guarded(std::string_view op, int peer, F&& f) {
  try {
    f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    MT_THROW("gloo {}{} failed: {} (timeout {} s; after a failure this communicator is unusable)", where(op),
             peer >= 0 ? fmt::format(", peer {}", peer) : std::string(), e.what(),
             options().timeout.count() / 1000.0);
  }
}

void GlooCommunicator::check_cpu(std::string_view op, const Tensor& t, const char* what) const {
  MT_CHECK(t.defined(), "{}: {} is an undefined tensor", where(op), what);
  MT_CHECK(t.device().is_cpu(), "{}: {} is on {}; the Gloo backend takes CPU tensors", where(op), what,
           t.device().str());
}

void GlooCommunicator::reduce_chunks(std::string_view op_name, const Tensor& in,
                                     const std::vector<int64_t>& chunk_elems, Tensor& out, ReduceOp op) {
  const int P = size();
  const int64_t mine = chunk_elems[rank()];
  const size_t es = dtype_size(in.dtype());
  // Every rank's copy of my chunk, in rank order.
  Tensor gathered = Tensor::empty({P * mine}, in.dtype());
  std::vector<int64_t> send_bytes(P), recv_bytes(P, mine * static_cast<int64_t>(es));
  for (int p = 0; p < P; ++p) send_bytes[p] = chunk_elems[p] * static_cast<int64_t>(es);
  guarded(op_name, -1, [&] {
    gloo::AlltoallvOptions o(state_->context);
    o.setInput<char>(bytes_of(in), send_bytes);
    o.setOutput<char>(bytes_of(gathered), recv_bytes);
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::alltoallv(o);
  });
  if (mine > 0) reduce_typed(in.dtype(), gathered.raw(), P, mine, out.raw(), op);
}

void GlooCommunicator::all_reduce(Tensor& t, ReduceOp op, cuda::Stream) {
  check_cpu("all_reduce", t, "tensor");
  const int P = size();
  const int64_t n = t.numel();
  if (n == 0) return;  // every rank has the same (empty) size: nothing to reduce
  std::vector<int64_t> chunk(P);
  for (int p = 0; p < P; ++p) chunk[p] = n / P + (p < n % P ? 1 : 0);
  Tensor mine = Tensor::empty({chunk[rank()]}, t.dtype());
  reduce_chunks("all_reduce", t, chunk, mine, op);
  std::vector<size_t> bytes(P);
  for (int p = 0; p < P; ++p) bytes[p] = static_cast<size_t>(chunk[p]) * dtype_size(t.dtype());
  guarded("all_reduce", -1, [&] {
    gloo::AllgathervOptions o(state_->context);
    o.setInput<char>(bytes_of(mine), bytes[rank()]);
    o.setOutput<char>(bytes_of(t), bytes);
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::allgatherv(o);
  });
}

void GlooCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, cuda::Stream) {
  check_cpu("reduce_scatter", in, "input");
  check_cpu("reduce_scatter", out, "output");
  check_chunks("reduce_scatter", in, out, "input", "output");
  reduce_chunks("reduce_scatter", in, std::vector<int64_t>(size(), out.numel()), out, op);
}

void GlooCommunicator::all_gather(const Tensor& in, Tensor& out, cuda::Stream) {
  check_cpu("all_gather", in, "input");
  check_cpu("all_gather", out, "output");
  check_chunks("all_gather", out, in, "output", "input");
  if (in.numel() == 0) return;  // every rank has the same (empty) size: nothing to move
  guarded("all_gather", -1, [&] {
    gloo::AllgatherOptions o(state_->context);
    o.setInput<char>(bytes_of(in), in.nbytes());
    o.setOutput<char>(bytes_of(out), out.nbytes());
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::allgather(o);
  });
}

void GlooCommunicator::all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                                    const std::vector<int64_t>& recv_rows, cuda::Stream) {
  check_cpu("all_to_all_v", in, "input");
  check_cpu("all_to_all_v", out, "output");
  const int64_t row_bytes = check_all_to_all_v(in, send_rows, out, recv_rows) * dtype_size(in.dtype());
  std::vector<int64_t> send_bytes(size()), recv_bytes(size());
  for (int p = 0; p < size(); ++p) {
    send_bytes[p] = send_rows[p] * row_bytes;
    recv_bytes[p] = recv_rows[p] * row_bytes;
  }
  guarded("all_to_all_v", -1, [&] {
    gloo::AlltoallvOptions o(state_->context);
    o.setInput<char>(bytes_of(in), send_bytes);
    o.setOutput<char>(bytes_of(out), recv_bytes);
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::alltoallv(o);
  });
}

void GlooCommunicator::broadcast(Tensor& t, int root, cuda::Stream) {
  check_cpu("broadcast", t, "tensor");
  check_peer("broadcast", root);
  if (t.numel() == 0) return;
  guarded("broadcast", root, [&] {
    gloo::BroadcastOptions o(state_->context);
    o.setOutput<char>(bytes_of(t), t.nbytes());
    o.setRoot(root);
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::broadcast(o);
  });
}

void GlooCommunicator::send(const Tensor& t, int peer, cuda::Stream) { point_to_point("send", t, peer, true); }

void GlooCommunicator::recv(Tensor& t, int peer, cuda::Stream) { point_to_point("recv", t, peer, false); }

void GlooCommunicator::point_to_point(std::string_view op, const Tensor& t, int peer, bool sending) {
  check_cpu(op, t, "tensor");
  check_peer(op, peer);
  MT_CHECK(peer != rank(), "{}: the peer is this rank itself", where(op));
  if (t.nbytes() == 0) return;
  guarded(op, peer, [&] {
    auto buf = state_->context->createUnboundBuffer(t.raw(), t.nbytes());
    if (sending) {
      buf->send(peer, gloo::Slot::build(kP2pSlotPrefix, 0));
      buf->waitSend(options().timeout);
    } else {
      buf->recv(peer, gloo::Slot::build(kP2pSlotPrefix, 0));
      buf->waitRecv(options().timeout);
    }
  });
}

class GlooCommunicator::Request final : public P2pRequest {
 public:
  Request(GlooCommunicator& comm, std::string_view op, int peer, uint32_t tag, Tensor t, bool sending)
      : comm_(comm), op_(op), peer_(peer), tag_(tag), tensor_(std::move(t)), sending_(sending) {
    if (tensor_.nbytes() == 0) return;
    comm_.guarded(op_, peer_, [&] {
      buf_ = comm_.state_->context->createUnboundBuffer(tensor_.raw(), tensor_.nbytes());
      const gloo::Slot slot = gloo::Slot::build(kTaggedP2pSlotPrefix, tag_);
      if (sending_) buf_->send(peer_, slot);
      else buf_->recv(peer_, slot);
    });
  }
  ~Request() override {
    try {
      wait();
    } catch (const std::exception& e) {
      spdlog::error("{}", e.what());
    }
  }
  void wait() override {
    if (!buf_) return;
    auto buf = std::move(buf_);
    comm_.guarded(fmt::format("{} (tag {})", op_, tag_), peer_, [&] {
      if (sending_) buf->waitSend(comm_.options().timeout);
      else buf->waitRecv(comm_.options().timeout);
    });
  }

 private:
  GlooCommunicator& comm_;
  std::string op_;
  int peer_;
  uint32_t tag_;
  Tensor tensor_;  // keeps the bytes alive while gloo reads or writes them
  bool sending_;
  std::unique_ptr<gloo::transport::UnboundBuffer> buf_;
};

std::unique_ptr<P2pRequest> GlooCommunicator::isend(const Tensor& t, int peer, uint32_t tag, cuda::Stream) {
  check_cpu("isend", t, "tensor");
  check_peer("isend", peer);
  MT_CHECK(peer != rank(), "{}: the peer is this rank itself", where("isend"));
  return std::make_unique<Request>(*this, "isend", peer, tag, t, true);
}

std::unique_ptr<P2pRequest> GlooCommunicator::irecv(Tensor& t, int peer, uint32_t tag, cuda::Stream) {
  check_cpu("irecv", t, "tensor");
  check_peer("irecv", peer);
  MT_CHECK(peer != rank(), "{}: the peer is this rank itself", where("irecv"));
  return std::make_unique<Request>(*this, "irecv", peer, tag, t, false);
}

void GlooCommunicator::barrier() {
  guarded("barrier", -1, [&] {
    gloo::BarrierOptions o(state_->context);
    o.setTag(state_->next_tag++);
    o.setTimeout(options().timeout);
    gloo::barrier(o);
  });
}

std::unique_ptr<Communicator> GlooCommunicator::split(int color, int key, const std::string& name) {
  // Everyone learns everyone's (color, key): each group's size and order follow.
  Tensor mine = Tensor::from_vector<int64_t>({color, key}, {2});
  Tensor all = Tensor::empty({2 * size()}, DType::I64);
  all_gather(mine, all);
  const int id = state_->next_split++;
  if (color < 0) return nullptr;
  const int64_t* ck = all.data<int64_t>();
  std::vector<int> members;
  for (int r = 0; r < size(); ++r) {
    if (ck[2 * r] == color) members.push_back(r);
  }
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return ck[2 * a + 1] < ck[2 * b + 1]; });
  const int sub_rank = static_cast<int>(std::find(members.begin(), members.end(), rank()) - members.begin());
  const int sub_size = static_cast<int>(members.size());
  std::string sub_name = this->name() + "/" + name;
  auto store = state_->store->prefixed(fmt::format("split{}.{}", id, color));
  auto st = rendezvous(std::move(store), state_->device, sub_rank, sub_size, options(), sub_name);
  return std::unique_ptr<Communicator>(new GlooCommunicator(sub_rank, sub_size, sub_name, options(), std::move(st)));
}

}  // namespace moetrain
