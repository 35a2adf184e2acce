#include "engine/parallel/peer_arena.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "core/cuda_runtime.h"
#include "core/log.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

// What a rank tells the others about itself: [pid, host, device, arena pointer, IPC handle].
constexpr int64_t kHandleWords = static_cast<int64_t>(cuda::kIpcHandleBytes / 8);
constexpr int64_t kWords = 4 + kHandleWords;
// The signal words' room at the start of each arena (one u32 per rank), keeping the slots
// aligned for any element type.
constexpr size_t kSignalBytes = 4096;

// MOETRAIN_PEER_BARRIER=nccl: the barrier as a one-element NCCL all-reduce (for comparison).
bool env_nccl_barrier() {
  const char* v = std::getenv("MOETRAIN_PEER_BARRIER");
  return v != nullptr && std::string(v) == "nccl";
}

int64_t host_id() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return static_cast<int64_t>(std::hash<std::string>{}(name) & 0x7fffffffffffffff);
}

// Every rank's record, through the group (device tensors: the group is NCCL).
std::vector<int64_t> gather_records(Communicator& group, const std::vector<int64_t>& mine) {
  const Device dev = Device::cuda(cuda::current_device());
  Tensor in = Tensor::from_vector(mine, {static_cast<int64_t>(mine.size())}).to(dev);
  Tensor all = Tensor::empty({group.size() * static_cast<int64_t>(mine.size())}, DType::I64, dev);
  group.all_gather(in, all, cuda::current_stream());
  return all.to_vector<int64_t>();
}

}  // namespace

PeerBuffers open_peer_buffers(Communicator& group, void* mine) {
  const int P = group.size(), rank = group.rank();
  std::vector<int64_t> rec{static_cast<int64_t>(getpid()), host_id(), cuda::current_device(),
                           static_cast<int64_t>(reinterpret_cast<intptr_t>(mine))};
  const std::string handle = cuda::ipc_handle(mine);
  rec.resize(kWords);
  std::memcpy(rec.data() + 4, handle.data(), handle.size());
  const std::vector<int64_t> all = gather_records(group, rec);
  PeerBuffers b;
  b.at.assign(static_cast<size_t>(P), nullptr);
  b.opened.assign(static_cast<size_t>(P), false);
  for (int q = 0; q < P; ++q) {
    const int64_t* r = all.data() + q * kWords;
    if (q == rank) {
      b.at[static_cast<size_t>(q)] = mine;
    } else if (r[0] == rec[0]) {  // a thread of this process: its pointer as it is
      MT_CHECK(cuda::enable_peer_access(static_cast<int>(r[2])), "peer buffers on {}: cuda:{} cannot reach cuda:{}",
               group.name(), cuda::current_device(), r[2]);
      b.at[static_cast<size_t>(q)] = reinterpret_cast<void*>(static_cast<intptr_t>(r[3]));
    } else {
      b.at[static_cast<size_t>(q)] =
          cuda::open_ipc_handle(std::string(reinterpret_cast<const char*>(r + 4), cuda::kIpcHandleBytes));
      b.opened[static_cast<size_t>(q)] = true;
    }
  }
  return b;
}

void close_peer_buffers(PeerBuffers& b) {
  for (size_t q = 0; q < b.at.size(); ++q) {
    if (b.opened[q]) cuda::close_ipc_handle(b.at[q]);
  }
  b = PeerBuffers();
}

bool PeerArena::usable(Communicator& group) {
  if (group.backend() != "nccl") return false;
  const std::vector<int64_t> all =
      gather_records(group, {static_cast<int64_t>(getpid()), host_id(), cuda::current_device()});
  const int P = group.size();
  bool ok = true;
  for (int q = 0; q < P && ok; ++q) {
    ok = all[static_cast<size_t>(q * 3 + 1)] == all[1];  // one host
    if (ok && q != group.rank()) ok = cuda::enable_peer_access(static_cast<int>(all[static_cast<size_t>(q * 3 + 2)]));
  }
  // Every rank must agree (one may lack peer access where another has it).
  std::vector<double> flag{ok ? 1.0 : 0.0};
  all_reduce_doubles(group, flag, Device::cuda(cuda::current_device()), ReduceOp::Sum);
  return flag[0] == static_cast<double>(P);
}

PeerArena::PeerArena(Communicator& group)
    : group_(group),
      P_(group.size()),
      rank_(group.rank()),
      signals_(!env_nccl_barrier() && P_ <= 32),
      signal_timeout_s_(std::chrono::duration<double>(group.options().timeout).count()) {
  MT_CHECK(static_cast<size_t>(P_) * 4 <= kSignalBytes, "peer arena on {}: {} ranks are more than its {} signal words",
           group_.name(), P_, kSignalBytes / 4);
  flag_ = Tensor::zeros({1}, DType::F32, Device::cuda(cuda::current_device()));
}

PeerArena::~PeerArena() {
  try {
    cuda::stream_synchronize(cuda::current_stream());
    for (void* l : lanes_) cuda::stream_synchronize(l);
    release();
    for (void* l : lanes_) cuda::destroy_stream(l);
    for (void* e : joins_) cuda::destroy_event(e);
    if (fork_) cuda::destroy_event(fork_);
  } catch (const std::exception& e) {
    spdlog::error("peer arena on {}: releasing: {}", group_.name(), e.what());
  }
}

void PeerArena::release() {
  close_peer_buffers(mapped_);
  arenas_.clear();
  if (mine_) cuda::shareable_free(mine_);
  mine_ = nullptr;
  block_capacity_ = 0;
}

void PeerArena::reserve(size_t block_bytes) {
  if (block_bytes <= block_capacity_) return;
  // Every rank asks for the same size at the same call: all grow together. Nobody may still
  // be writing into or reading from the old arenas: this rank's work so far is done, then
  // every rank's (the NCCL barrier runs alone: no other stream of this rank still has work
  // that could wait on it).
  cuda::device_synchronize();
  nccl_barrier();
  cuda::stream_synchronize(cuda::current_stream());
  release();
  block_capacity_ = std::max<size_t>(block_bytes, size_t{1} << 20);
  mine_ = cuda::shareable_alloc(kSignalBytes + 2 * static_cast<size_t>(P_) * block_capacity_);
  cuda::memset_device(mine_, 0, kSignalBytes);  // no signal yet (done before the records go out)
  barriers_ = 0;
  mapped_ = open_peer_buffers(group_, mine_);
  arenas_ = mapped_.at;
  slot_ = 0;
  nccl_barrier();  // every rank has mapped every arena before anyone writes
  cuda::stream_synchronize(cuda::current_stream());
}

void PeerArena::copy_all(const std::vector<Copy>& copies) {
  const cuda::Stream current = cuda::current_stream();
  if (!fork_) fork_ = cuda::create_sync_event();
  size_t lanes = 0;
  for (const Copy& c : copies) lanes = std::max(lanes, static_cast<size_t>(c.lane) + 1);
  while (lanes_.size() < lanes) {
    lanes_.push_back(cuda::create_stream());
    joins_.push_back(cuda::create_sync_event());
  }
  cuda::record_event(fork_, current);
  for (size_t l = 0; l < lanes; ++l) cuda::stream_wait_event(lanes_[l], fork_);
  for (const Copy& c : copies) {
    if (c.bytes == 0) continue;
    cuda::CurrentStreamScope on_lane(lanes_[static_cast<size_t>(c.lane)]);
    cuda::copy_device_to_device(c.dst, c.src, c.bytes);
  }
  for (size_t l = 0; l < lanes; ++l) {
    cuda::record_event(joins_[l], lanes_[l]);
    cuda::stream_wait_event(current, joins_[l]);
  }
}

void PeerArena::nccl_barrier() { group_.all_reduce(flag_, ReduceOp::Sum, cuda::current_stream()); }

// Signal every peer that this rank's copies of the exchange are done (the signal follows
// them in stream order), then wait until every peer has signalled this rank: one warp
// (ops::signal_peers_and_wait). The numbers only grow (cyclic compare), so a signal of a
// later exchange also passes the wait.
void PeerArena::barrier() {
  if (!signals_) return nccl_barrier();
  ops::signal_peers_and_wait(arenas_, rank_, ++barriers_, signal_timeout_s_);
}

char* PeerArena::slot_of(int rank) const {
  return static_cast<char*>(arenas_[static_cast<size_t>(rank)]) + kSignalBytes +
         static_cast<size_t>(slot_) * static_cast<size_t>(P_) * block_capacity_;
}

Tensor PeerArena::all_gather(const Tensor& block) { return all_gather(std::vector<Tensor>{block})[0]; }

std::vector<Tensor> PeerArena::all_gather(const std::vector<Tensor>& blocks) {
  // Tensor i's P blocks sit back to back (at this call's size) from offset P * at[i], so each
  // result is one [P n_i, C_i] tensor; the offsets keep 256-byte alignment.
  std::vector<size_t> at;
  size_t bytes = 0;
  for (const Tensor& b : blocks) {
    at.push_back(bytes);
    bytes += (b.nbytes() + 255) / 256 * 256;
  }
  reserve(bytes);
  std::vector<Copy> copies;
  for (int q = 0; q < P_; ++q) {
    for (size_t i = 0; i < blocks.size(); ++i) {
      const size_t n = blocks[i].nbytes();
      copies.push_back(
          {slot_of(q) + static_cast<size_t>(P_) * at[i] + static_cast<size_t>(rank_) * n, blocks[i].raw(), n, q});
    }
  }
  copy_all(copies);
  barrier();
  std::vector<Tensor> out;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Tensor& b = blocks[i];
    out.push_back(Tensor::borrowed(slot_of(rank_) + static_cast<size_t>(P_) * at[i], {P_ * b.size(0), b.size(1)},
                                   b.dtype(), b.device()));
  }
  slot_ ^= 1;
  return out;
}

Tensor PeerArena::reduce_scatter_sum(const Tensor& blocks) {
  const int64_t n = blocks.size(0) / P_;
  const size_t bytes = blocks.nbytes() / static_cast<size_t>(P_);
  reserve(bytes);
  // Peer q's block of this rank's rows goes to q's slot, at this rank's place.
  std::vector<Copy> copies;
  for (int q = 0; q < P_; ++q) {
    if (q != rank_) {
      copies.push_back(
          {slot_of(q) + static_cast<size_t>(rank_) * bytes, blocks.slice(q * n, (q + 1) * n).raw(), bytes, q});
    }
  }
  copy_all(copies);
  barrier();
  // Into this rank's own block (no new tensor), then the peers' in rank order.
  char* mine = slot_of(rank_);
  Tensor sum = blocks.slice(rank_ * n, (rank_ + 1) * n);
  for (int q = 0; q < P_; ++q) {
    if (q == rank_) continue;
    ops::add_(sum, Tensor::borrowed(mine + static_cast<size_t>(q) * bytes, {n, blocks.size(1)}, blocks.dtype(),
                                    blocks.device()));
  }
  slot_ ^= 1;
  return sum;
}

}  // namespace moetrain
