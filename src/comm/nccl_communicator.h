// The NCCL backend: the Communicator on CUDA tensors of one device per rank.
//
// Ops are enqueued on the stream given per call; nullptr means the default stream given
// to connect_nccl, or, when that is nullptr too, the calling thread's current stream
// (cuda::current_stream), which orders them after the kernels that made their inputs.
//
// No hang past the timeout: the communicator is non-blocking (NCCL's config.blocking = 0),
// every call's status is checked, and a watchdog thread follows each enqueued op with a
// CUDA event. An op that fails asynchronously or does not finish within
// CommOptions::timeout makes the watchdog abort the NCCL communicator (so the kernels
// return) and, with CommOptions::abort_process_on_error (the default), log the op, group
// and rank and abort the process, which a launcher turns into stopping the job. Without it,
// the next call on the communicator throws that error.
//
// In a build without CUDA, connect_nccl throws saying so.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace moetrain {

class Store;

// True when this build has the NCCL backend.
bool nccl_built();

// Rank 0 draws NCCL's unique id and publishes it in `store` (key "nccl_id"); every rank
// reads it and joins on CUDA device `device` (made current for the calling thread). Waits
// up to options.timeout for the others. Sub-communicators come from ncclCommSplit.
std::unique_ptr<Communicator> connect_nccl(std::shared_ptr<Store> store, int rank, int size, int device,
                                           const CommOptions& options, const std::string& name = "world",
                                           cuda::Stream default_stream = nullptr);

}  // namespace moetrain
