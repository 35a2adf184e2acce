// OrderedTransport: pipeline messages between neighbouring pipeline ranks over NCCL.
//
// NCCL matches a send with the receive posted in the same order (it has no tags), a send
// holds its stream until the peer receives, and the ops of one communicator run one after
// another. So, unlike Gloo's tagged messages, pipeline traffic needs an order both sides
// agree on and streams that cannot wait on each other:
//   - one communicator per direction per neighbouring pair (r -> r+1 and r+1 -> r), each on
//     a stream of its own, so each carries one-way FIFO traffic;
//   - at the start of a step the receiver posts every receive of the step, in the order the
//     sender will send (the executor computes it from the schedule, which every rank has), so
//     a send always finds its receive already posted and never blocks its stream for long;
//   - the compute stream waits for a message's event only when it uses it; sent tensors stay
//     alive until the end of the step, when the compute stream waits for the sends.
// A message is a hidden state [rows, H] (activation or gradient) and its router totals
// (f64 [2E + 2]), named by the executor's tag.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace moetrain {

class OrderedTransport {
 public:
  // Collective over `pp` (NCCL, this rank's pipeline group): splits it into the pair links.
  OrderedTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals);
  ~OrderedTransport();
  OrderedTransport(const OrderedTransport&) = delete;
  OrderedTransport& operator=(const OrderedTransport&) = delete;

  struct Expected {
    int from;       // pipeline rank
    uint32_t tag;
    int64_t rows;   // of the hidden state
  };
  // Posts every receive of the step; `incoming` in each sender's send order.
  void begin_step(const std::vector<Expected>& incoming);
  // The message `tag`: the compute stream waits for it. An Error when it was not expected.
  std::pair<Tensor, Tensor> receive(uint32_t tag);
  // Sends after the compute stream's work so far (`to` is a neighbouring pipeline rank).
  void send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals);
  // The compute stream waits for the step's sends; every expected message must have been used.
  void end_step();

 private:
  struct Link {
    std::shared_ptr<Communicator> comm;  // two ranks, the lower pipeline rank first; null: none
    cuda::Stream stream = nullptr;
    bool used = false;                    // sent on this step
  };
  struct Arrival {
    Tensor hidden, totals;
    cuda::Event ready = nullptr;
  };
  Link& link(int peer, bool sending);
  int peer_in(const Link& l) const { return 1 - l.comm->rank(); }

  int rank_, size_;
  Device device_;
  int64_t hidden_, totals_;
  DType dtype_;
  Link up_send_, up_recv_, down_send_, down_recv_;  // to r+1, from r-1, to r-1, from r+1
  std::map<uint32_t, Arrival> arrivals_;
  std::vector<Tensor> in_flight_;
  cuda::Event compute_point_ = nullptr;
};

}  // namespace moetrain
