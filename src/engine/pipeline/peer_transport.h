// PeerTransport: a GPU pipeline's messages among the GPUs of one host as copies straight into
// the receiver's memory, on the copy engines.
//
// Over NCCL (OrderedTransport) every message is a send and a receive kernel that hold a
// few multiprocessors each from the moment they are issued until the peer's side comes: a
// pipeline rank always has a receive posted, and on two H200s that slowed the compute next
// to it by about a tenth (the bench model's attention 155 against 135 ms a step on the rank
// whose receives waited longest). Here nothing waits on a multiprocessor but the compute
// stream itself, for a message it needs now:
//   - each rank holds an arena (cuda::shareable_alloc, mapped by the others through CUDA
//     IPC) of one slot per message it receives in a step, the slot of a message being its
//     place among the receiver's receives in the step's one order (pipeline_message_order,
//     which every rank computes for every rank), and a signal word per slot;
//   - a send copies the hidden state and the totals into the receiver's slot on a copy
//     stream of that peer (after the compute stream's work so far), then writes the step's
//     number into the slot's word (ops::signal_word, one thread);
//   - a receive makes the compute stream wait for that number in its own word
//     (ops::wait_word, one thread; past the group's timeout it stops with a message), and
//     the host waits for the totals' copy to its memory, made on a stream of their own
//     (both waits begin when the rank asks for the message, so no kernel waits ahead);
//   - a step's end tells every sender that this rank is done with its slots (a word per
//     sender in the sender's arena), and a sender's first copy of the next step waits for
//     it: a slot is never written while it is read.
// Messages need no common order (each has its own slot and word), so they never wait behind
// one another. Chosen by the executor when every pipeline rank is on one host and each GPU
// can reach the others (PeerArena::usable); MOETRAIN_PIPELINE_TRANSPORT=nccl keeps NCCL.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "engine/parallel/peer_arena.h"
#include "engine/pipeline/nccl_transport.h"

namespace moetrain {

class PeerTransport : public PipelineTransport {
 public:
  // `pp`: this rank's pipeline group (NCCL, PeerArena::usable); kept by reference.
  PeerTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals);
  ~PeerTransport() override;
  PeerTransport(const PeerTransport&) = delete;
  PeerTransport& operator=(const PeerTransport&) = delete;

  void begin_step(const std::vector<std::vector<Message>>& orders, int64_t max_rows) override;
  std::pair<Tensor, Tensor> receive(uint32_t tag) override;  // the totals on the host
  void send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) override;
  void end_step() override;
  std::string pending() const override;  // the received messages not yet used

 private:
  struct Msg {
    Message m;
    size_t slot = 0;  // in the receiver's arena
    Tensor hidden, totals;
    cuda::Event on_host = nullptr;  // a receive: its totals copied to `host`
    Tensor host;
    bool done = false;
  };
  // Collective: arenas of `slots` slots of `slot_bytes` on every rank (the same numbers on
  // every rank), the signal words zeroed and the step count restarted.
  void reserve(size_t slots, size_t slot_bytes);
  void release();
  unsigned* words(int rank) const { return static_cast<unsigned*>(peers_.at[static_cast<size_t>(rank)]); }
  char* slot_at(int rank, size_t slot) const;
  size_t freed_word() const { return slots_; }  // + sender rank: "done with your slots up to step n"
  // A slot: the totals (f64, padded to 256 bytes), then the hidden state.
  size_t totals_bytes() const { return (static_cast<size_t>(totals_) * 8 + 255) / 256 * 256; }

  Communicator& pp_;
  Device device_;
  int64_t hidden_, totals_;
  DType dtype_;
  double timeout_s_;
  void* mine_ = nullptr;
  PeerBuffers peers_;
  size_t slots_ = 0, slot_bytes_ = 0, words_bytes_ = 0;
  uint32_t step_ = 0;
  std::vector<cuda::Stream> lanes_;     // per peer: the copies into it
  std::vector<cuda::Event> lane_done_;  // per peer
  std::vector<bool> sent_to_;  // per peer, this step
  cuda::Stream host_lane_ = nullptr;    // the received totals' copies to the host
  cuda::Event ready_ = nullptr;
  std::vector<void*> pinned_;           // per received message of a step
  std::map<std::pair<bool, uint32_t>, Msg> msgs_;
};

}  // namespace moetrain
