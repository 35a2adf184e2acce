// GlooCommunicator: the Communicator on CPU tensors, over Gloo's TCP transport.
//
// Every op finishes before it returns. Data moves as bytes through Gloo's all-to-all-v,
// all-gather(v), broadcast and unbound-buffer send/recv; reductions are done here, after an
// all-to-all that hands each rank one chunk from every rank: each element is then reduced
// over ranks in rank order (bf16 accumulated in f32, rounded once). So an all-reduce gives
// every rank the same bits, equal to a single process adding the ranks' tensors in order.
// Max propagates NaN, so a max over per-rank health values sees a NaN anywhere.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace moetrain {

class Store;

class GlooCommunicator final : public Communicator {
 public:
  // Rendezvous of `rank` of `size` through `store`: every rank publishes its address under
  // the store's keys and connects to every other (a full mesh of TCP pairs). A rank that
  // does not join within options.timeout is an Error naming it. A second communicator on
  // the same store needs its own prefix (Store::prefixed).
  static std::unique_ptr<GlooCommunicator> connect(std::shared_ptr<Store> store, int rank, int size,
                                                   const CommOptions& options, const std::string& name = "world");
  ~GlooCommunicator() override;

  std::string_view backend() const override { return "gloo"; }
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum, cuda::Stream stream = nullptr) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum,
                      cuda::Stream stream = nullptr) override;
  void all_gather(const Tensor& in, Tensor& out, cuda::Stream stream = nullptr) override;
  void all_to_all_v(const Tensor& in, const std::vector<int64_t>& send_rows, Tensor& out,
                    const std::vector<int64_t>& recv_rows, cuda::Stream stream = nullptr) override;
  void broadcast(Tensor& t, int root, cuda::Stream stream = nullptr) override;
  void send(const Tensor& t, int peer, cuda::Stream stream = nullptr) override;
  void recv(Tensor& t, int peer, cuda::Stream stream = nullptr) override;
  std::unique_ptr<P2pRequest> isend(const Tensor& t, int peer, uint32_t tag, cuda::Stream stream = nullptr) override;
  std::unique_ptr<P2pRequest> irecv(Tensor& t, int peer, uint32_t tag, cuda::Stream stream = nullptr) override;
  void barrier() override;
  void synchronize(cuda::Stream) override {}
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  struct State;  // gloo's context and device, the store, counters (gloo_communicator.cpp)
  class Request;  // an isend / irecv in flight

 private:
  GlooCommunicator(int rank, int size, std::string name, CommOptions options, std::unique_ptr<State> state);
  // Runs one Gloo call, turning its exceptions into an Error naming op, rank and peer.
  template <typename F>
  void guarded(std::string_view op, int peer, F&& f);
  // Chunk `rank()` of `in` (size() chunks of `chunk` elements) reduced over ranks into `out`.
  void reduce_chunks(std::string_view op_name, const Tensor& in, const std::vector<int64_t>& chunk_elems,
                     Tensor& out, ReduceOp op);
  void check_cpu(std::string_view op, const Tensor& t, const char* what) const;
  // send (sending) or recv into `t` (not sending): the tensor is written through its handle.
  void point_to_point(std::string_view op, const Tensor& t, int peer, bool sending);

  std::unique_ptr<State> state_;
};

}  // namespace moetrain
