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
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace moetrain {

class OrderedTransport {
 public:
  // `pp`: this rank's pipeline group (NCCL); kept by reference.
  OrderedTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals);
  ~OrderedTransport();
  OrderedTransport(const OrderedTransport&) = delete;
  OrderedTransport& operator=(const OrderedTransport&) = delete;

  struct Message {
    int peer;       // pipeline rank it goes to (sending) or comes from
    bool sending;
    uint32_t tag;
    int64_t rows;   // of the hidden state
  };
  // Starts a step whose messages on this rank are `order` (this rank's part of the one order
  // every rank follows) and issues the receives that lead it. `max_rows`: the largest hidden
  // state any rank of the pipeline sends this step (the same on every rank). Collective over
  // the pipeline group when max_rows grows (the links are connected at that size first).
  void begin_step(const std::vector<Message>& order, int64_t max_rows);
  // The received message `tag`: the compute stream waits for it. An Error when it was not
  // expected, or when a send before it in the order has not been handed over.
  std::pair<Tensor, Tensor> receive(uint32_t tag);
  // Hands over the message `tag` to `to` after the compute stream's work so far, and issues
  // what can go.
  void send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals);
  // The compute stream waits for the step's sends; every message must have been issued and
  // every received one used.
  void end_step();
  // The next message to issue and the received ones not yet used, with whether they have
  // arrived ("next: send 2147483648 to 0 | 524289:in 524290:--"), for MOETRAIN_PIPELINE_TRACE.
  std::string pending() const;

 private:
  struct Slot {
    Message m;
    Tensor hidden, totals;
    cuda::Event ready = nullptr;  // send: handed over (compute stream); receive: arrived
    bool handed = false, issued = false, used = false;
  };
  void issue_ready();  // issues slots in order while the next one can go
  // One hidden state of `rows` each way with every rank this one talks to, collectively.
  void connect(int64_t rows);
  Slot& slot(bool sending, uint32_t tag, const char* what);

  Communicator& pp_;
  Device device_;
  int64_t hidden_, totals_;
  DType dtype_;
  cuda::Stream stream_ = nullptr;
  cuda::Event compute_point_ = nullptr;
  std::vector<Slot> slots_;
  std::map<std::pair<bool, uint32_t>, size_t> index_;  // (sending, tag) -> slot
  size_t next_ = 0;                                    // first slot not issued
  int64_t connected_rows_ = 0;
};

}  // namespace moetrain
