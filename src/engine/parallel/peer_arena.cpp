#include "engine/parallel/peer_arena.h"

#include <unistd.h>

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

PeerArena::PeerArena(Communicator& group) : group_(group), P_(group.size()), rank_(group.rank()) {
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
  for (int q = 0; q < static_cast<int>(arenas_.size()); ++q) {
    if (mapped_[static_cast<size_t>(q)]) cuda::close_ipc_handle(arenas_[static_cast<size_t>(q)]);
  }
  arenas_.clear();
  mapped_.clear();
  if (mine_) cuda::shareable_free(mine_);
  mine_ = nullptr;
  block_capacity_ = 0;
}

void PeerArena::reserve(size_t block_bytes) {
  if (block_bytes <= block_capacity_) return;
  // Every rank asks for the same size at the same call: all grow together. Nobody may still
  // be writing into or reading from the old arenas.
  barrier();
  cuda::device_synchronize();
  release();
  block_capacity_ = std::max<size_t>(block_bytes, size_t{1} << 20);
  mine_ = cuda::shareable_alloc(2 * static_cast<size_t>(P_) * block_capacity_);
  std::vector<int64_t> rec{static_cast<int64_t>(getpid()), host_id(), cuda::current_device(),
                           static_cast<int64_t>(reinterpret_cast<intptr_t>(mine_))};
  const std::string handle = cuda::ipc_handle(mine_);
  rec.resize(kWords);
  std::memcpy(rec.data() + 4, handle.data(), handle.size());
  const std::vector<int64_t> all = gather_records(group_, rec);
  arenas_.assign(static_cast<size_t>(P_), nullptr);
  mapped_.assign(static_cast<size_t>(P_), false);
  for (int q = 0; q < P_; ++q) {
    const int64_t* r = all.data() + q * kWords;
    if (q == rank_) {
      arenas_[static_cast<size_t>(q)] = mine_;
    } else if (r[0] == rec[0]) {  // a thread of this process: its pointer as it is
      MT_CHECK(cuda::enable_peer_access(static_cast<int>(r[2])), "peer arena on {}: cuda:{} cannot reach cuda:{}",
               group_.name(), cuda::current_device(), r[2]);
      arenas_[static_cast<size_t>(q)] = reinterpret_cast<void*>(static_cast<intptr_t>(r[3]));
    } else {
      arenas_[static_cast<size_t>(q)] =
          cuda::open_ipc_handle(std::string(reinterpret_cast<const char*>(r + 4), cuda::kIpcHandleBytes));
      mapped_[static_cast<size_t>(q)] = true;
    }
  }
  slot_ = 0;
  barrier();  // every rank has mapped every arena before anyone writes
  cuda::stream_synchronize(cuda::current_stream());
}

void PeerArena::copy_all(const std::vector<Copy>& copies) {
  const cuda::Stream current = cuda::current_stream();
  if (!fork_) fork_ = cuda::create_sync_event();
  while (lanes_.size() < copies.size()) {
    lanes_.push_back(cuda::create_stream());
    joins_.push_back(cuda::create_sync_event());
  }
  cuda::record_event(fork_, current);
  for (size_t i = 0; i < copies.size(); ++i) {
    cuda::stream_wait_event(lanes_[i], fork_);
    {
      cuda::CurrentStreamScope on_lane(lanes_[i]);
      if (copies[i].bytes > 0) cuda::copy_device_to_device(copies[i].dst, copies[i].src, copies[i].bytes);
    }
    cuda::record_event(joins_[i], lanes_[i]);
  }
  for (size_t i = 0; i < copies.size(); ++i) cuda::stream_wait_event(current, joins_[i]);
}

void PeerArena::barrier() { group_.all_reduce(flag_, ReduceOp::Sum, cuda::current_stream()); }

char* PeerArena::slot_of(int rank) const {
  return static_cast<char*>(arenas_[static_cast<size_t>(rank)]) +
         static_cast<size_t>(slot_) * static_cast<size_t>(P_) * block_capacity_;
}

Tensor PeerArena::all_gather(const Tensor& block) {
  const size_t bytes = block.nbytes();
  reserve(bytes);
  // The blocks sit back to back (at this call's size), so the slot is one [P n, C] tensor.
  std::vector<Copy> copies;
  for (int q = 0; q < P_; ++q) copies.push_back({slot_of(q) + static_cast<size_t>(rank_) * bytes, block.raw(), bytes});
  copy_all(copies);
  barrier();
  Tensor out = Tensor::borrowed(slot_of(rank_), {P_ * block.size(0), block.size(1)}, block.dtype(), block.device());
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
    if (q != rank_) copies.push_back({slot_of(q) + static_cast<size_t>(rank_) * bytes, blocks.slice(q * n, (q + 1) * n).raw(), bytes});
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
