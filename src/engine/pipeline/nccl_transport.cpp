#include "engine/pipeline/nccl_transport.h"

#include "core/error.h"
#include "core/log.h"

namespace moetrain {

OrderedTransport::OrderedTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals)
    : rank_(pp.rank()), size_(pp.size()), device_(device), hidden_(hidden), totals_(totals), dtype_(dtype) {
  MT_CHECK(!device.is_cpu(), "pipeline transport over {}: needs a GPU", pp.name());
  // Pairs {2k + parity, 2k + parity + 1}: every rank is in one pair of each parity (or none at
  // the ends). Four splits (two parities x two directions), each collective over pp.
  const int r = rank_, P = size_;
  auto split = [&](int parity, const char* name) {
    int color = r - parity >= 0 ? (r - parity) / 2 : -1;
    if (color >= 0 && 2 * color + parity + 1 >= P) color = -1;  // the partner does not exist
    return std::shared_ptr<Communicator>(pp.split(color, r, name));
  };
  std::shared_ptr<Communicator> even_up = split(0, "even_up"), even_down = split(0, "even_down");
  std::shared_ptr<Communicator> odd_up = split(1, "odd_up"), odd_down = split(1, "odd_down");
  // With r + 1 this rank pairs at parity r % 2, with r - 1 at parity (r - 1) % 2.
  const bool even_with_next = r % 2 == 0;
  up_send_.comm = r + 1 < P ? (even_with_next ? even_up : odd_up) : nullptr;
  down_recv_.comm = r + 1 < P ? (even_with_next ? even_down : odd_down) : nullptr;
  up_recv_.comm = r > 0 ? (even_with_next ? odd_up : even_up) : nullptr;
  down_send_.comm = r > 0 ? (even_with_next ? odd_down : even_down) : nullptr;
  for (Link* l : {&up_send_, &up_recv_, &down_send_, &down_recv_}) {
    if (l->comm) l->stream = cuda::create_stream();
  }
  compute_point_ = cuda::create_sync_event();
  // NCCL connects two ranks for point to point at their first exchange, and a rank's host
  // waits there until the peer makes the same connection (NVIDIA/nccl#783). A step posts
  // its receives first, each on its own link: rank 0 waiting to connect on one link while
  // rank 1 waits on another would hang both. So every link is connected here, one element
  // each way, in the same order on every rank (each rank is in at most one pair a link).
  for (const std::shared_ptr<Communicator>& c : {even_up, even_down, odd_up, odd_down}) {
    if (!c) continue;
    const Tensor out = Tensor::zeros({2}, DType::F32, device_);
    Tensor in = Tensor::empty({2}, DType::F32, device_);
    c->all_to_all_v(out, {1, 1}, in, {1, 1}, cuda::current_stream());
    c->synchronize(cuda::current_stream());
  }
}

OrderedTransport::~OrderedTransport() {
  try {
    for (Link* l : {&up_send_, &up_recv_, &down_send_, &down_recv_}) {
      if (!l->stream) continue;
      cuda::stream_synchronize(l->stream);
      cuda::destroy_stream(l->stream);
    }
    for (auto& [tag, a] : arrivals_) cuda::destroy_event(a.ready);
    cuda::destroy_event(compute_point_);
  } catch (const std::exception& e) {
    spdlog::error("pipeline transport: {}", e.what());
  }
}

OrderedTransport::Link& OrderedTransport::link(int peer, bool sending) {
  MT_CHECK(peer == rank_ + 1 || peer == rank_ - 1,
           "pipeline rank {}: a message {} rank {}, which is not a neighbour", rank_, sending ? "to" : "from", peer);
  Link& l = peer == rank_ + 1 ? (sending ? up_send_ : down_recv_) : (sending ? down_send_ : up_recv_);
  MT_CHECK(l.comm != nullptr, "pipeline rank {}: no link {} rank {}", rank_, sending ? "to" : "from", peer);
  return l;
}

void OrderedTransport::begin_step(const std::vector<Expected>& incoming) {
  MT_CHECK(arrivals_.empty() && in_flight_.empty(), "pipeline transport: a step began before the last one ended");
  // The buffers are allocated on the compute stream: the receiving streams start after it.
  std::vector<std::pair<const Expected*, Arrival*>> posted;
  for (const Expected& e : incoming) {
    Arrival& a = arrivals_[e.tag];
    MT_CHECK(!a.hidden.defined(), "pipeline transport: message tag {} expected twice", e.tag);
    a.hidden = Tensor::empty({e.rows, hidden_}, dtype_, device_);
    a.totals = Tensor::empty({totals_}, DType::F64, device_);
    a.ready = cuda::create_sync_event();
    posted.push_back({&e, &a});
  }
  cuda::record_event(compute_point_, cuda::current_stream());
  for (Link* l : {&up_recv_, &down_recv_}) {
    if (l->stream) cuda::stream_wait_event(l->stream, compute_point_);
  }
  for (auto& [e, a] : posted) {
    Link& l = link(e->from, false);
    l.comm->recv(a->hidden, peer_in(l), l.stream);
    l.comm->recv(a->totals, peer_in(l), l.stream);
    cuda::record_event(a->ready, l.stream);
  }
}

std::pair<Tensor, Tensor> OrderedTransport::receive(uint32_t tag) {
  auto it = arrivals_.find(tag);
  MT_CHECK(it != arrivals_.end(), "pipeline transport: message tag {} was not expected this step", tag);
  Arrival a = std::move(it->second);
  arrivals_.erase(it);
  cuda::stream_wait_event(cuda::current_stream(), a.ready);
  cuda::destroy_event(a.ready);
  return {a.hidden, a.totals};
}

void OrderedTransport::send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) {
  MT_CHECK(hidden.size(1) == hidden_ && totals.numel() == totals_ && !hidden.device().is_cpu(),
           "pipeline transport: message tag {} is {} and {}, expected [rows, {}] and [{}] on the GPU", tag,
           hidden.str(), totals.str(), hidden_, totals_);
  Link& l = link(to, true);
  cuda::record_event(compute_point_, cuda::current_stream());
  cuda::stream_wait_event(l.stream, compute_point_);
  l.comm->send(hidden, peer_in(l), l.stream);
  l.comm->send(totals, peer_in(l), l.stream);
  l.used = true;
  in_flight_.push_back(hidden);
  in_flight_.push_back(totals);
}

void OrderedTransport::end_step() {
  for (Link* l : {&up_send_, &down_send_}) {
    if (!l->used) continue;
    cuda::record_event(compute_point_, l->stream);
    cuda::stream_wait_event(cuda::current_stream(), compute_point_);  // the sent tensors may go now
    l->used = false;
  }
  in_flight_.clear();
  MT_CHECK(arrivals_.empty(), "pipeline transport: {} expected messages were never used this step", arrivals_.size());
}

}  // namespace moetrain
