// OrderedTransport: pipeline messages between pipeline ranks over NCCL.
//
// NCCL matches a send with the receive posted in the same order (it has no tags), a send or
// a receive holds its stream until the peer posts its side, and NCCL gives no guarantee that
// two of its operations on different streams or communicators progress independently (its
// documentation on using several communicators at once). An earlier design posted all of a
// step's receives up front, each direction on a communicator and stream of its own; on two
// H100s a rank's posted receive then held back its own sends on the other communicator, and
// every step with more than two micro-batches hung. So now:
//   - one stream per rank, on the pipeline communicator, carries every message of the rank;
//   - all ranks follow one order of the step's messages, taken from a valid execution of the
//     schedule (finish_times in schedule.h, pipeline_message_order in executor.h); each rank
//     issues its part of it in that order, a receive as soon as every message before it is
//     issued, a send once the executor hands over its tensors;
//   - the compute stream waits for a message only when it uses it, and for the stream's
//     sends at the end of the step (sent tensors stay alive until then).
// Why this cannot hang: take the first message in the order that is not done. Every message
// before it is done on both ranks, so both have it next on their streams; its data was
// computed from messages that came earlier (a valid execution receives an op's inputs
// before the op's outputs leave), so the sender has handed it over and it completes.
// A message is a hidden state [rows, H] (activation or gradient) and its router totals
// (f64 [2E + 4]), named by the executor's tag.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace moetrain {

// One pipeline message of a step, as one rank sees it.
struct PipelineMessage {
  int peer;       // pipeline rank it goes to (sending) or comes from
  bool sending;
  uint32_t tag;
  int64_t rows;   // of the hidden state
};

// How a GPU pipeline's hidden states travel between its ranks: over NCCL (OrderedTransport,
// below) or, among the GPUs of one host, by copies into the peer's memory (PeerTransport,
// peer_transport.h).
class PipelineTransport {
 public:
  using Message = PipelineMessage;
  virtual ~PipelineTransport() = default;
  // Starts a step. orders[r]: rank r's messages this step, in the one order every rank
  // shares (pipeline_message_order); every rank's, the same on every rank. `max_rows`: the
  // largest hidden state any rank sends this step. Collective over the pipeline group when
  // max_rows grows.
  virtual void begin_step(const std::vector<std::vector<Message>>& orders, int64_t max_rows) = 0;
  // The received message `tag`: the hidden state, which the compute stream waits for, and
  // the totals, on the host or the device. An Error when it was not expected.
  virtual std::pair<Tensor, Tensor> receive(uint32_t tag) = 0;
  // Hands over the message `tag` to `to` after the compute stream's work so far; the
  // tensors stay alive until end_step.
  virtual void send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) = 0;
  // The compute stream waits for the step's sends; every message must have been sent and
  // every received one used.
  virtual void end_step() = 0;
  // What is still pending, for MOETRAIN_PIPELINE_TRACE.
  virtual std::string pending() const = 0;
};

class OrderedTransport : public PipelineTransport {
 public:
  // `pp`: this rank's pipeline group (NCCL); kept by reference.
  OrderedTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals);
  ~OrderedTransport() override;
  OrderedTransport(const OrderedTransport&) = delete;
  OrderedTransport& operator=(const OrderedTransport&) = delete;

  // Also connects (collectively) every pair of ranks the orders exchange messages between
  // that was not connected yet (a pipeline's head helper talks to a rank that is no
  // neighbour), the same on every rank since every rank has every order.
  void begin_step(const std::vector<std::vector<Message>>& orders, int64_t max_rows) override;
  // Starts a step whose messages on this rank are `order` (this rank's part of the one order
  // every rank follows) and issues the receives that lead it. Collective over the pipeline
  // group when max_rows grows (the links are connected at that size first).
  void begin_step(const std::vector<Message>& order, int64_t max_rows);
  // Also an Error when a send before it in the order has not been handed over. The totals
  // come on the host (the host waits for the message, not for the compute stream).
  std::pair<Tensor, Tensor> receive(uint32_t tag) override;
  // Issues what can go.
  void send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) override;
  void end_step() override;
  // The next message to issue and the received ones not yet used, with whether they have
  // arrived ("next: send 2147483648 to 0 | 524289:in 524290:--").
  std::string pending() const override;

 private:
  struct Slot {
    Message m;
    Tensor hidden, totals;
    cuda::Event ready = nullptr;  // send: handed over (compute stream); receive: arrived
    // A receive's totals copied to pinned host memory on the transport's stream, so that the
    // host reads them once the message is in, without waiting for the compute stream.
    cuda::Event on_host = nullptr;
    Tensor host_totals;
    bool handed = false, issued = false, used = false;
  };
  void issue_ready();  // issues slots in order while the next one can go
  // One hidden state of `rows` each way between every pair of pairs_, collectively.
  void connect(int64_t rows);
  Slot& slot(bool sending, uint32_t tag, const char* what);

  Communicator& pp_;
  Device device_;
  int64_t hidden_, totals_;
  DType dtype_;
  cuda::Stream stream_ = nullptr;
  cuda::Event compute_point_ = nullptr;
  std::vector<void*> pinned_;  // per receive of a step, totals_ f64 each (reused every step)
  std::vector<Slot> slots_;
  std::map<std::pair<bool, uint32_t>, size_t> index_;  // (sending, tag) -> slot
  size_t next_ = 0;                                    // first slot not issued
  int64_t connected_rows_ = 0;
  std::set<std::pair<int, int>> pairs_;  // (lower, higher) ranks that exchange: the neighbours, and more
  bool pairs_grew_ = false;
};

}  // namespace moetrain
