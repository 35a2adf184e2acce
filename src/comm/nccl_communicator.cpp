#include "comm/nccl_communicator.h"

#include "comm/store.h"
#include "core/error.h"

#if MOETRAIN_WITH_CUDA

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "core/log.h"

namespace moetrain {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::I16: break;  // NCCL has no 16-bit integers
    case DType::F8E4M3: return ncclUint8;  // moved, never reduced (bytes)
  }
  MT_THROW("nccl: no NCCL type for {} tensors", dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

std::string nccl_error(ncclComm_t comm, ncclResult_t r) {
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  return fmt::format("{}{}{}", ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

// Waits for a non-blocking NCCL call (status `r`) to leave ncclInProgress and returns the
// final status; ncclInProgress when `timeout` passed first (the caller aborts). `poll(&state)`
// reads the communicator's async state (ncclCommGetAsyncError) and returns its status.
template <typename Poll>
ncclResult_t settle_polling(Poll&& poll, ncclResult_t r, std::chrono::milliseconds timeout) {
  if (r != ncclSuccess && r != ncclInProgress) return r;
  auto deadline = Clock::now() + timeout;
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t q = poll(&state);
    if (q != ncclSuccess) return q;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) return ncclInProgress;
    if (spins < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}
// For a communicator no other thread uses.
ncclResult_t settle(ncclComm_t comm, ncclResult_t r, std::chrono::milliseconds timeout) {
  return settle_polling([&](ncclResult_t* state) { return ncclCommGetAsyncError(comm, state); }, r, timeout);
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, std::string name, CommOptions options, int device, ncclComm_t comm,
                   cuda::Stream default_stream)
      : Communicator(rank, size, std::move(name), std::move(options)),
        device_(device),
        comm_(comm),
        default_stream_(default_stream) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    if (aborted_) {
      // ncclCommAbort already freed it.
    } else if (settle(comm_, ncclCommFinalize(comm_), options().timeout) == ncclSuccess) {  // the watchdog is gone
      ncclCommDestroy(comm_);
    } else {
      ncclCommAbort(comm_);  // finalize waits on peers; a dead one would block it forever
    }
    for (auto& p : pending_) cudaEventDestroy(p.event);
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  }

  std::string_view backend() const override { return "nccl"; }

  void abort() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.empty()) failure_ = fmt::format("{} was aborted by its owner", name());
    }
    std::lock_guard<std::mutex> lock(api_mu_);
    if (!aborted_) {
      aborted_ = true;
      cudaSetDevice(device_);
      ncclCommAbort(comm_);
    }
  }

  void all_reduce(Tensor& t, ReduceOp op, cuda::Stream stream) override {
    check_device("all_reduce", t, "tensor");
    enqueue("all_reduce", -1, stream, [&](cudaStream_t s) {
      return ncclAllReduce(t.raw(), t.raw(), t.numel(), nccl_type(t.dtype()), nccl_op(op), comm_, s);
    });
  }

  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, cuda::Stream stream) override {
    check_device("reduce_scatter", in, "input");
    check_device("reduce_scatter", out, "output");
    check_chunks("reduce_scatter", in, out, "input", "output");
    enqueue("reduce_scatter", -1, stream, [&](cudaStream_t s) {
      return ncclReduceScatter(in.raw(), out.raw(), out.numel(), nccl_type(in.dtype()), nccl_op(op), comm_, s);
    });
  }

  void all_gather(const Tensor& in, Tensor& out, cuda::Stream stream) override {
    check_device("all_gather", in, "input");
    check_device("all_gather", out, "output");
    check_chunks("all_gather", out, in, "output", "input");
    enqueue("all_gather", -1, stream, [&](cudaStream_t s) {
      return ncclAllGather(in.raw(), out.raw(), in.nbytes(), ncclUint8, comm_, s);
    });
  }

  void all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                    const std::vector<int64_t>& recv_rows, cuda::Stream stream) override {
    check_device("all_to_all_v", in, "input");
    check_device("all_to_all_v", out, "output");
    const size_t row_bytes = check_all_to_all_v(in, send_rows, out, recv_rows) * dtype_size(in.dtype());
    enqueue("all_to_all_v", -1, stream, [&](cudaStream_t s) {
      const char* src = static_cast<const char*>(in.raw());
      char* dst = static_cast<char*>(out.raw());
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; p < size() && (r == ncclSuccess || r == ncclInProgress); ++p) {
        if (send_rows[p] > 0) r = ncclSend(src, send_rows[p] * row_bytes, ncclUint8, p, comm_, s);
        if (recv_rows[p] > 0 && (r == ncclSuccess || r == ncclInProgress)) {
          r = ncclRecv(dst, recv_rows[p] * row_bytes, ncclUint8, p, comm_, s);
        }
        src += send_rows[p] * row_bytes;
        dst += recv_rows[p] * row_bytes;
      }
      ncclResult_t end = ncclGroupEnd();  // always closes the group, even after an error
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
  }

  void broadcast(Tensor& t, int root, cuda::Stream stream) override {
    check_device("broadcast", t, "tensor");
    check_peer("broadcast", root);
    enqueue("broadcast", root, stream, [&](cudaStream_t s) {
      return ncclBroadcast(t.raw(), t.raw(), t.nbytes(), ncclUint8, root, comm_, s);
    });
  }

  void send(const Tensor& t, int peer, cuda::Stream stream) override {
    check_device("send", t, "tensor");
    check_peer("send", peer);
    enqueue("send", peer, stream,
            [&](cudaStream_t s) { return ncclSend(t.raw(), t.nbytes(), ncclUint8, peer, comm_, s); });
  }

  void recv(Tensor& t, int peer, cuda::Stream stream) override {
    check_device("recv", t, "tensor");
    check_peer("recv", peer);
    enqueue("recv", peer, stream,
            [&](cudaStream_t s) { return ncclRecv(t.raw(), t.nbytes(), ncclUint8, peer, comm_, s); });
  }

  std::unique_ptr<P2pRequest> send_recv(const std::vector<Tensor>& sends, int to, std::vector<Tensor>& recvs, int from,
                                        uint32_t, cuda::Stream stream) override {
    for (const Tensor& t : sends) check_device("send_recv", t, "sent tensor");
    for (const Tensor& t : recvs) check_device("send_recv", t, "received tensor");
    check_peer("send_recv", to);
    check_peer("send_recv", from);
    enqueue("send_recv", to, stream, [&](cudaStream_t s) {
      ncclResult_t r = ncclGroupStart();
      for (const Tensor& t : sends) {
        if (r == ncclSuccess || r == ncclInProgress) r = ncclSend(t.raw(), t.nbytes(), ncclUint8, to, comm_, s);
      }
      for (Tensor& t : recvs) {
        if (r == ncclSuccess || r == ncclInProgress) r = ncclRecv(t.raw(), t.nbytes(), ncclUint8, from, comm_, s);
      }
      ncclResult_t end = ncclGroupEnd();  // always closes the group, even after an error
      return r == ncclSuccess || r == ncclInProgress ? end : r;
    });
    return enqueued();  // stream-ordered: the transfers are on `stream` already
  }

  void barrier() override {
    if (!token_.defined()) token_ = Tensor::zeros({1}, DType::I32, Device::cuda(device_));
    all_reduce(token_, ReduceOp::Sum, nullptr);
    synchronize(nullptr);
  }

  void synchronize(cuda::Stream stream) override {
    throw_if_failed();
    cudaStream_t s = stream_for(stream);
    auto deadline = Clock::now() + options().timeout;
    while (true) {
      cudaError_t e = cudaStreamQuery(s);
      if (e == cudaSuccess) return;
      MT_CHECK(e == cudaErrorNotReady, "nccl synchronize on {} (rank {} of {}): CUDA error {}: {}", name(), rank(),
               size(), cudaGetErrorName(e), cudaGetErrorString(e));
      throw_if_failed();
      ncclResult_t state = ncclSuccess;
      std::string error;
      with_comm([&](ncclComm_t c) {
        ncclCommGetAsyncError(c, &state);
        if (state != ncclSuccess && state != ncclInProgress) error = nccl_error(c, state);
      });
      throw_if_failed();
      if (!error.empty()) fail(where("synchronize") + ": " + error, false);
      if (Clock::now() > deadline) {
        fail(fmt::format("{}: the stream's ops did not finish within {} s (a peer may be dead)", where("synchronize"),
                         options().timeout.count() / 1000.0),
             false);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    throw_if_failed();
    MT_CUDA_CHECK(cudaSetDevice(device_));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t sub = nullptr;
    ncclResult_t r = ncclInternalError;
    std::string error;
    with_comm([&](ncclComm_t c) { r = ncclCommSplit(c, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, &cfg); });
    r = sub ? settle(sub, r, options().timeout) : settle_here(r);  // `sub` is this thread's alone
    if (r == ncclInProgress && sub) ncclCommAbort(sub);
    throw_if_failed();
    if (r != ncclSuccess && r != ncclInProgress) {
      error = ncclGetErrorString(r);
      with_comm([&](ncclComm_t c) { error = nccl_error(c, r); });
    }
    MT_CHECK(r == ncclSuccess, "nccl {}: {}", where("split"),
             r == ncclInProgress ? fmt::format("timed out after {} s", options().timeout.count() / 1000.0) : error);
    if (!sub) return nullptr;
    int sub_rank = 0, sub_size = 0;
    MT_CHECK(ncclCommUserRank(sub, &sub_rank) == ncclSuccess && ncclCommCount(sub, &sub_size) == ncclSuccess,
             "nccl {}: cannot read the new communicator's rank and size", where("split"));
    return std::make_unique<NcclCommunicator>(sub_rank, sub_size, this->name() + "/" + name, options(), device_, sub,
                                              default_stream_);
  }

 private:
  struct Pending {
    cudaEvent_t event;
    std::string op;
    Clock::time_point deadline;
  };

  cudaStream_t stream_for(cuda::Stream s) const {
    if (s) return static_cast<cudaStream_t>(s);
    if (default_stream_) return static_cast<cudaStream_t>(default_stream_);
    return static_cast<cudaStream_t>(cuda::current_stream());
  }

  void check_device(std::string_view op, const Tensor& t, const char* what) const {
    MT_CHECK(t.defined(), "nccl {}: {} is an undefined tensor", where(op), what);
    MT_CHECK(t.device() == Device::cuda(device_), "nccl {}: {} is on {}; this communicator uses cuda:{}", where(op),
             what, t.device().str(), device_);
  }

  void throw_if_failed() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) MT_THROW("nccl: {} (the communicator was aborted)", failure_);
  }

  // Runs f(comm_) unless the communicator was aborted (then returns false): the watchdog's
  // abort frees comm_, and waits for `api_mu_` so that it never does so under a call. Lock
  // order: mu_ before api_mu_ (the watchdog holds mu_); nothing holding api_mu_ takes mu_.
  template <typename F>
  bool with_comm(F&& f) {
    std::lock_guard<std::mutex> lock(api_mu_);
    if (aborted_) return false;
    f(comm_);
    return true;
  }

  // settle() for this communicator, holding it only for each poll (aborted: ncclInternalError).
  ncclResult_t settle_here(ncclResult_t r) {
    auto poll = [&](ncclResult_t* state) {
      ncclResult_t q = ncclInternalError;
      with_comm([&](ncclComm_t c) { q = ncclCommGetAsyncError(c, state); });
      return q;
    };
    return settle_polling(poll, r, options().timeout);
  }

  // Calls `call` (one NCCL enqueue), settles it, and hands the op to the watchdog.
  template <typename F>
  void enqueue(std::string_view op, int peer, cuda::Stream stream, F&& call) {
    throw_if_failed();
    cudaStream_t s = stream_for(stream);
    ncclResult_t r = ncclInternalError;
    with_comm([&](ncclComm_t) { r = call(s); });
    r = settle_here(r);
    throw_if_failed();  // aborted meanwhile: the failure's message, not the abort's status
    if (r != ncclSuccess) {
      std::string what = fmt::format("{}{}: ", where(op), peer >= 0 ? fmt::format(", peer {}", peer) : "");
      if (r == ncclInProgress) {
        fail(what + fmt::format("enqueue did not complete within {} s", options().timeout.count() / 1000.0), false);
      }
      std::string error = ncclGetErrorString(r);
      with_comm([&](ncclComm_t c) { error = nccl_error(c, r); });
      MT_THROW("nccl {}{}", what, error);
    }
    cudaEvent_t ev;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (free_events_.empty()) {
        MT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      } else {
        ev = free_events_.back();
        free_events_.pop_back();
      }
    }
    MT_CUDA_CHECK(cudaEventRecord(ev, s));
    std::string label = peer >= 0 ? fmt::format("{} (peer {})", op, peer) : std::string(op);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({ev, std::move(label), Clock::now() + options().timeout});
  }

  // Records the failure, aborts the NCCL communicator so its kernels return, and either
  // aborts the process or throws.
  [[noreturn]] void fail(const std::string& message, bool from_watchdog) {
    if (options().abort_process_on_error) {
      // No ncclCommAbort first: it frees the communicator while the main thread may be inside
      // an NCCL call on it (seen on two H100s: a SIGSEGV instead of this message). The
      // process's end releases the GPU and the peers' watchdogs or the launcher end theirs.
      spdlog::critical("nccl: {}; aborting the process so the job stops", message);
      spdlog::default_logger()->flush();
      std::abort();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.empty()) failure_ = message;
    }
    {
      // Waits for a call on comm_ in another thread to return before freeing it. A host
      // blocked in a CUDA wait holds no lock: the abort is what lets its kernels return.
      std::lock_guard<std::mutex> lock(api_mu_);
      if (!aborted_) {
        aborted_ = true;
        ncclCommAbort(comm_);
      }
    }
    if (from_watchdog) spdlog::error("nccl: {}; the next call on {} throws", message, name());
    if (from_watchdog) throw Error(message, __FILE__, __LINE__);  // caught in watch()
    MT_THROW("nccl: {} (the communicator was aborted)", message);
  }

  // The watchdog: retires finished ops in order, fails on an async error or a deadline.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(100));
      while (!pending_.empty() && failure_.empty()) {
        Pending& p = pending_.front();
        cudaError_t e = cudaEventQuery(p.event);
        if (e == cudaSuccess) {
          free_events_.push_back(p.event);
          pending_.pop_front();
          continue;
        }
        std::string problem, error;
        ncclResult_t state = ncclSuccess;
        with_comm([&](ncclComm_t c) {
          ncclCommGetAsyncError(c, &state);
          if (state != ncclSuccess && state != ncclInProgress) error = nccl_error(c, state);
        });
        if (e != cudaErrorNotReady) problem = fmt::format("CUDA error {}", cudaGetErrorName(e));
        else if (!error.empty()) problem = error;
        else if (Clock::now() > p.deadline)
          problem = fmt::format("did not finish within {} s (a peer may be dead or stuck)",
                                options().timeout.count() / 1000.0);
        if (problem.empty()) break;
        std::string message = fmt::format("{}: {}", where(p.op), problem);
        lock.unlock();
        try {
          fail(message, true);
        } catch (const Error&) {
        }
        lock.lock();
      }
    }
  }

  int device_;
  ncclComm_t comm_;
  cuda::Stream default_stream_;
  Tensor token_;  // barrier's one-element all-reduce
  std::mutex mu_;      // failure_, pending_, free_events_, stop_
  std::mutex api_mu_;  // comm_ and aborted_: see with_comm
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::string failure_;
  bool aborted_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> connect_nccl(std::shared_ptr<Store> store, int rank, int size, int device,
                                           const CommOptions& options, const std::string& name,
                                           cuda::Stream default_stream) {
  MT_CHECK(size >= 1 && rank >= 0 && rank < size, "nccl connect of {}: rank {} of {} is not a valid rank", name,
           rank, size);
  MT_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    MT_CHECK(r == ncclSuccess, "nccl connect of {}: ncclGetUniqueId: {}", name, ncclGetErrorString(r));
    store->set("nccl_id", std::vector<char>(id.internal, id.internal + sizeof id.internal));
  } else {
    std::vector<char> v = store->get("nccl_id");
    MT_CHECK(v.size() == sizeof id.internal, "nccl connect of {}: {} holds an id of {} bytes, expected {}", name,
             store->description(), v.size(), sizeof id.internal);
    std::memcpy(id.internal, v.data(), v.size());
  }
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
  if (comm) r = settle(comm, r, options.timeout);
  if (r == ncclInProgress) ncclCommAbort(comm);
  MT_CHECK(r == ncclSuccess, "nccl connect of {} (rank {} of {}, cuda:{}): {}", name, rank, size, device,
           r == ncclInProgress
               ? fmt::format("peers did not all join within {} s", options.timeout.count() / 1000.0)
               : nccl_error(comm, r));
  spdlog::debug("nccl: {} connected, rank {} of {} on cuda:{}", name, rank, size, device);
  return std::make_unique<NcclCommunicator>(rank, size, name, options, device, comm, default_stream);
}

}  // namespace moetrain

#else  // no CUDA in this build

namespace moetrain {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> connect_nccl(std::shared_ptr<Store>, int, int, int, const CommOptions&,
                                           const std::string& name, cuda::Stream) {
  MT_THROW("nccl connect of {}: this build has no CUDA, so no NCCL backend (use the Gloo backend for CPU tensors)",
           name);
}

}  // namespace moetrain

#endif
