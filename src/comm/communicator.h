// Communicator: the collectives and point-to-point transfers one group of ranks runs
// together, on moetrain Tensors. Backends: Gloo (CPU tensors, TCP) and NCCL (CUDA
// tensors, ops enqueued on a stream).
//
// Every rank of the group calls the same collectives in the same order. Tensors are
// contiguous; "rows" are dim-0 slices. A failure (a peer that died, did not join, or
// answers nothing within the timeout) is a moetrain::Error naming the op, the group, the
// rank and where known the peer; nothing hangs past CommOptions::timeout.
//
// Streams: Gloo ops finish before they return and ignore the stream. NCCL ops are
// enqueued on `stream` (nullptr: the communicator's default stream, see
// NcclCommunicator) and return at once; synchronize() waits for them, up to the timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace moetrain {

enum class ReduceOp { Sum, Max };

// A point-to-point transfer started by Communicator::isend / irecv. wait() returns when it
// is done (Gloo: the bytes left / arrived; NCCL: enqueued on its stream, ordered like
// send/recv), throwing an Error naming the op and peer on failure or timeout. Destroying an
// unwaited request waits for it (errors are then only logged).
class P2pRequest {
 public:
  virtual ~P2pRequest() = default;
  virtual void wait() = 0;
};
std::string_view reduce_op_name(ReduceOp op);

struct CommOptions {
  // Longest wait for a peer: rendezvous, one collective, one send/recv, a synchronize.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // NCCL only: when an op fails or times out in the background watchdog, abort the process
  // (after logging why) so the launcher stops the job, instead of leaving the error for the
  // next call on this communicator to throw.
  bool abort_process_on_error = true;
  // Gloo only: the network interface (e.g. "eth0") or the local address its TCP transport
  // listens on. Empty: chosen by the caller (see default_comm_options).
  std::string gloo_iface;
  std::string gloo_host;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // "world", "world/ep", ...: names the group in errors and logs.
  const std::string& name() const { return name_; }
  virtual std::string_view backend() const = 0;

  // In place: every rank ends with the element-wise reduction over all ranks of `t`.
  virtual void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum, cuda::Stream stream = nullptr) = 0;
  // `in` is size() equal chunks; rank r gets in `out` the reduction over ranks of chunk r.
  // in.numel() == size() * out.numel().
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum,
                              cuda::Stream stream = nullptr) = 0;
  // `out` is the ranks' `in` back to back, in rank order. out.numel() == size() * in.numel().
  virtual void all_gather(const Tensor& in, Tensor& out, cuda::Stream stream = nullptr) = 0;
  // `in` holds send_rows[p] rows for peer p, back to back in peer order; `out` receives
  // recv_rows[p] rows from each peer p, in peer order. Counts may be zero; send_rows[p] on
  // this rank must equal recv_rows[this rank] on peer p (the caller exchanges counts first,
  // e.g. with an all_to_all_v of one i64 per peer).
  virtual void all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                            const std::vector<int64_t>& recv_rows, cuda::Stream stream = nullptr) = 0;
  // In place: every rank ends with `root`'s `t`.
  virtual void broadcast(Tensor& t, int root, cuda::Stream stream = nullptr) = 0;
  // Point to point; the peer posts the matching recv/send with the same byte count.
  virtual void send(const Tensor& t, int peer, cuda::Stream stream = nullptr) = 0;
  virtual void recv(Tensor& t, int peer, cuda::Stream stream = nullptr) = 0;
  // Non-blocking point to point, for schedules where both sides have messages in flight
  // (pipeline activations one way, gradients the other). `tag` tells messages between the
  // same two ranks apart: Gloo matches a recv with the send of the same tag in any order;
  // NCCL ignores it and matches in the order posted, so callers post matching pairs in the
  // same order on both sides. The tensor must stay alive until wait().
  virtual std::unique_ptr<P2pRequest> isend(const Tensor& t, int peer, uint32_t tag, cuda::Stream stream = nullptr);
  virtual std::unique_ptr<P2pRequest> irecv(Tensor& t, int peer, uint32_t tag, cuda::Stream stream = nullptr);
  // Sends each of `sends` to rank `to` and receives each of `recvs` from rank `from`, as one
  // batch: NCCL posts them in one group (a ring whose every rank sends before it receives
  // would otherwise deadlock on a blocking send), enqueued on `stream` by the return; Gloo
  // posts them as isend / irecv with tags tag, tag + 1, ... (sends and recvs numbered
  // alike). Every tensor stays alive until the request's wait().
  virtual std::unique_ptr<P2pRequest> send_recv(const std::vector<Tensor>& sends, int to, std::vector<Tensor>& recvs,
                                                int from, uint32_t tag, cuda::Stream stream = nullptr);
  // The request of a transfer already enqueued on its stream (stream-ordered backends):
  // wait() has nothing to do.
  static std::unique_ptr<P2pRequest> enqueued();
  // Returns when every rank has entered it (NCCL: and the ops before it have finished).
  virtual void barrier() = 0;
  // Waits for the ops enqueued on `stream` (nullptr: the default stream) to finish, up to
  // the timeout. A no-op for Gloo.
  virtual void synchronize(cuda::Stream stream = nullptr) = 0;
  // Ends the communicator at once, waiting for no peer (NCCL: ncclCommAbort; ops in flight
  // fail, every later call throws), for one whose peers may be gone, before it is dropped:
  // its destructor would otherwise wait (up to the timeout) for them to finalize. Gloo:
  // nothing (its destructor closes the sockets at once).
  virtual void abort() {}

  // A sub-communicator: ranks that pass the same color form a group, ordered by key (then
  // by rank here). Collective over this communicator: every rank calls it, in the same
  // order. color < 0: this rank joins no group and gets nullptr. `name` is appended to
  // this communicator's name ("world" + "ep" -> "world/ep").
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  const CommOptions& options() const { return options_; }

 protected:
  Communicator(int rank, int size, std::string name, CommOptions options)
      : rank_(rank), size_(size), name_(std::move(name)), options_(std::move(options)) {}

  // "all_reduce on world (rank 2 of 4)": the start of every error message.
  std::string where(std::string_view op) const;
  // Argument checks shared by the backends; they throw naming the op and the tensor.
  void check_same_layout(std::string_view op, const Tensor& a, const Tensor& b) const;
  void check_chunks(std::string_view op, const Tensor& big, const Tensor& small, const char* big_name,
                    const char* small_name) const;
  // Returns the elements per row (product of dims 1..) after checking counts and shapes.
  int64_t check_all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, const Tensor& out,
                             const std::vector<int64_t>& recv_rows) const;
  void check_peer(std::string_view op, int peer) const;

 private:
  int rank_, size_;
  std::string name_;
  CommOptions options_;
};

// Default options: timeout from MOETRAIN_COMM_TIMEOUT (seconds) when set, else 300 s.
// Gloo's address: MOETRAIN_GLOO_IFACE (or GLOO_SOCKET_IFNAME) names an interface;
// MOETRAIN_GLOO_HOST an address; else 127.0.0.1 when every rank runs on this machine, else
// the local address of the route to `master_addr`.
struct LaunchEnv;
CommOptions default_comm_options(const LaunchEnv& env);

// Sums (or takes the max of) a few doubles over `group`, in place, on the device its backend
// reads (`device` for NCCL, the host for Gloo): the small all-reduces of losses, counts and
// flags.
void all_reduce_doubles(Communicator& group, std::vector<double>& values, Device device,
                        ReduceOp op = ReduceOp::Sum);
// `root`'s bytes to every rank of `group` (any length; two broadcasts: the length, then the
// bytes), on the device its backend reads.
void broadcast_bytes(Communicator& group, std::string& bytes, int root, Device device);
// Bytes (a JSON text, say) as a tensor collectives can move: `len` bytes in i32 words (the
// last one zero-padded), on `device`; `bytes` empty: zeros, to receive into. And back.
Tensor bytes_as_words(const std::string& bytes, int64_t len, Device device);
std::string words_as_bytes(const Tensor& words, int64_t len);

}  // namespace moetrain
