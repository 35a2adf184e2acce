// PeerArena: a buffer on every GPU of a group that the other GPUs write into directly, so
// that all-gathers and reduce-scatters among the GPUs of one host go over NVLink on the
// copy engines instead of NCCL's kernels: no SMs taken from the compute they overlap, and
// at the expert exchange's sizes (tens of MB a rank) about three times NCCL's rate on two
// H100s (a 32 MB copy: 0.10 ms one way, 0.13 ms both ways at once, against 0.34 ms for
// NCCL's all-gather of the same bytes; docs/parallel.md).
//
// Each rank's arena holds two slots of P blocks. An exchange copies this rank's block(s)
// into the peers' current slot (cudaMemcpyAsync to the peer's mapped memory), then passes a
// barrier: once it completes, every rank's copies into this slot are done. The barrier is a
// signal per peer: each rank writes the exchange's number into a word of every peer's arena
// and waits until every peer has written it into its own, in one warp of one kernel
// (ops::signal_peers_and_wait: no shared memory, so it runs beside the compute's kernels
// instead of taking a multiprocessor from them, as NCCL's all-reduce does while it waits
// for the slowest rank; that all-reduce is the fallback past 32 ranks or with
// MOETRAIN_PEER_BARRIER=nccl). Two slots suffice: a rank writes slot s % 2 only after the
// barrier of exchange s - 1, which no peer passes before it has consumed exchange s - 2 (its
// reads come before its next barrier in stream order). So what an exchange returns must be
// consumed on the same stream before the exchange after next: all_gather's result is a
// view of the arena. The copies of one exchange (one per peer, and this rank's own block)
// run at once on side streams, so that several copy engines share them.
//
// Every call is a collective over the group, made in the same order with the same sizes on
// every rank (the arena grows, for all together, to the largest block seen). Processes map
// each other's arenas with CUDA IPC; ranks that are threads of one process (tests) use the
// pointers directly.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace moetrain {

// Every rank's buffer `mine` (from cuda::shareable_alloc) as this process addresses it:
// opened through CUDA IPC for another process's, the pointer itself for a thread of this
// process, `mine` for this rank. Collective over `group` (NCCL); every rank can use every
// buffer once it returns. close_peer_buffers closes what it opened.
struct PeerBuffers {
  std::vector<void*> at;      // per rank
  std::vector<bool> opened;   // mapped through IPC
};
PeerBuffers open_peer_buffers(Communicator& group, void* mine);
void close_peer_buffers(PeerBuffers& b);

class PeerArena {
 public:
  // Collective: whether every rank of `group` is a CUDA rank (NCCL) on this host whose GPU
  // can reach every other's directly. The same answer on every rank.
  static bool usable(Communicator& group);

  explicit PeerArena(Communicator& group);
  ~PeerArena();
  PeerArena(const PeerArena&) = delete;
  PeerArena& operator=(const PeerArena&) = delete;

  // [n, C] on every rank -> [P n, C], the blocks in rank order, on the current stream. A
  // view of the arena: consume it on this stream before the exchange after next.
  Tensor all_gather(const Tensor& block);
  // Several tensors in one exchange (one barrier): tensor i [n_i, C_i] -> [P n_i, C_i].
  std::vector<Tensor> all_gather(const std::vector<Tensor>& blocks);
  // [P n, C] on every rank -> the sum over the ranks of their block r ([n, C]): summed in
  // place into this rank's block of `blocks` (a view of it is returned), the peers' blocks
  // added in rank order.
  Tensor reduce_scatter_sum(const Tensor& blocks);

 private:
  void reserve(size_t block_bytes);  // collective
  void release();
  void barrier();       // after this rank's copies of an exchange (signals, or NCCL)
  void nccl_barrier();  // a one-element all-reduce on the current stream
  // Runs the copies (dst, src, bytes) after the current stream's work so far, those of one
  // lane in order and the lanes at once, each on its own stream (a GPU has several copy
  // engines; one lane per destination rank); the current stream waits for all.
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    int lane;
  };
  void copy_all(const std::vector<Copy>& copies);
  char* slot_of(int rank) const;  // this exchange's slot in `rank`'s arena

  Communicator& group_;
  int P_, rank_;
  size_t block_capacity_ = 0;  // bytes of one rank's block in a slot
  void* mine_ = nullptr;
  std::vector<void*> arenas_;     // every rank's arena as this process addresses it
  PeerBuffers mapped_;
  int slot_ = 0;
  Tensor flag_;
  // The barrier by signals (else NCCL), the signal words sitting at the start of every arena
  // (word q: written by rank q), and the number of the last barrier (restarted at 0 with
  // every new arena, whose words start zeroed).
  bool signals_;
  double signal_timeout_s_;  // the group's timeout: a signal wait past it stops (ops.h)
  uint32_t barriers_ = 0;
  std::vector<void*> lanes_;   // cuda::Stream, one per destination rank
  void* fork_ = nullptr;       // cuda::Event
  std::vector<void*> joins_;   // cuda::Event, one per lane
};

}  // namespace moetrain
