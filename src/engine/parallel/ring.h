// Ring: a group of ranks passing tensors round, each to the next rank, while they compute:
// what context parallelism's ring attention and tensor parallelism's overlapped gathers and
// reduce-scatters share. A hop's transfers (one NCCL group of sends and receives, or Gloo
// isend / irecv) run on the ring's own stream on a GPU, after the compute stream's work so
// far; Hop::wait() makes the compute stream (not the host) wait for them, and a hop keeps its
// tensors until then so that the stream-ordered allocator reuses none under a transfer.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/cuda_runtime.h"
#include "engine/telemetry/collective_timer.h"

namespace moetrain {

class Ring {
 public:
  // `group`: the ranks in ring order (rank r sends to r + 1). Transfers are timed as `kind`.
  Ring(Communicator& group, Collective kind) : group_(group), kind_(kind) {}
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  int size() const { return group_.size(); }
  int rank() const { return group_.rank(); }
  Communicator& group() const { return group_; }

  // Tensors on their way from the previous rank while the ones in hand leave for the next.
  class Hop {
   public:
    Hop() = default;
    Hop(Hop&& o) noexcept;
    Hop& operator=(Hop&& o) noexcept;
    ~Hop();
    // The compute stream waits for the transfers (a no-op for an empty hop); the tensors go.
    void wait();

   private:
    friend class Ring;
    void finish() noexcept;
    std::unique_ptr<P2pRequest> request_;
    cuda::Event arrived_ = nullptr;
    std::vector<Tensor> keep_;
    Collective kind_ = Collective::kContextRing;
  };
  // Sends `sends` to the next rank and receives the previous rank's into `recvs` (the same
  // shapes in the same order), tags first_tag, first_tag + 1, ... (Gloo matches by tag).
  Hop pass_on(std::vector<Tensor> sends, std::vector<Tensor> recvs, uint32_t first_tag) const;

 private:
  Communicator& group_;
  Collective kind_;
  mutable cuda::Stream stream_ = nullptr;  // the transfers on a GPU, made at first use
};

}  // namespace moetrain
