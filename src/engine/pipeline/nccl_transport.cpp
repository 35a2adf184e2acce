#include "engine/pipeline/nccl_transport.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "engine/telemetry/collective_timer.h"

namespace moetrain {

OrderedTransport::OrderedTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals)
    : pp_(pp), device_(device), hidden_(hidden), totals_(totals), dtype_(dtype) {
  MT_CHECK(!device.is_cpu(), "pipeline transport over {}: needs a GPU", pp.name());
  stream_ = cuda::create_stream();
  compute_point_ = cuda::create_sync_event();
}

OrderedTransport::~OrderedTransport() {
  try {
    if (!slots_.empty()) {
      // Destroyed in the middle of a step (an error is on its way up): receives the peer may
      // never send are still posted, and waiting for them would hold the error back until
      // the communicator's timeout. The step's buffers are left allocated (NCCL may still
      // write into them) and its stream and events are let go without a wait.
      spdlog::error("pipeline transport: a step stopped with {} of its {} messages issued; not waiting for them",
                    next_, slots_.size());
      new std::vector<Slot>(std::move(slots_));  // deliberately never freed
      cuda::destroy_stream(stream_);
      return;
    }
    cuda::stream_synchronize(stream_);
    cuda::destroy_stream(stream_);
    cuda::destroy_event(compute_point_);
    for (void* p : pinned_) cuda::pinned_free(p);
  } catch (const std::exception& e) {
    spdlog::error("pipeline transport: {}", e.what());
  }
}

// NCCL connects two ranks for point to point at their first exchange, and a rank's host waits
// there until the peer makes the same connection (NVIDIA/nccl#783); how many channels it
// connects depends on the message's size. So the neighbours are connected here, all ranks at
// once, at the largest size of the step, before any message of the step is issued.
void OrderedTransport::begin_step(const std::vector<std::vector<Message>>& orders, int64_t max_rows) {
  for (size_t r = 0; r < orders.size(); ++r) {
    for (const Message& m : orders[r]) {
      const int a = static_cast<int>(r), b = m.peer;
      pairs_grew_ = pairs_.insert({std::min(a, b), std::max(a, b)}).second || pairs_grew_;
    }
  }
  begin_step(orders.at(static_cast<size_t>(pp_.rank())), max_rows);
}

void OrderedTransport::connect(int64_t rows) {
  const int r = pp_.rank(), P = pp_.size();
  for (int q = 0; q + 1 < P; ++q) pairs_.insert({q, q + 1});  // the neighbours always
  for (const auto& [elements, dtype] : {std::pair<int64_t, DType>{totals_, DType::F64}, {rows * hidden_, dtype_}}) {
    std::vector<int64_t> counts(static_cast<size_t>(P), 0);
    int64_t n = 0;
    for (const auto& [a, b] : pairs_) {
      if (a != r && b != r) continue;
      counts[static_cast<size_t>(a == r ? b : a)] = elements;
      n += elements;
    }
    const Tensor out = Tensor::zeros({n}, dtype, device_);
    Tensor in = Tensor::empty({n}, dtype, device_);
    pp_.all_to_all_v(out, counts, in, counts, cuda::current_stream());
    pp_.synchronize(cuda::current_stream());
  }
}

void OrderedTransport::begin_step(const std::vector<Message>& order, int64_t max_rows) {
  MT_CHECK(slots_.empty(), "pipeline transport: a step began before the last one ended");
  std::map<std::pair<bool, uint32_t>, size_t> index;
  for (const Message& m : order) {
    MT_CHECK(m.rows <= max_rows, "pipeline transport: message tag {} has {} rows, more than the step's largest ({})",
             m.tag, m.rows, max_rows);
    MT_CHECK(m.peer >= 0 && m.peer < pp_.size() && m.peer != pp_.rank(),
             "pipeline transport: message tag {} names rank {} (pipeline of {}, this rank {})", m.tag, m.peer,
             pp_.size(), pp_.rank());
    MT_CHECK(index.emplace(std::make_pair(m.sending, m.tag), index.size()).second,
             "pipeline transport: message tag {} listed twice", m.tag);
  }
  if (max_rows > connected_rows_ || pairs_grew_) {
    connected_rows_ = std::max(max_rows, connected_rows_);
    connect(connected_rows_);
    pairs_grew_ = false;
  }
  // Slots are only added here, all at once, so references to them stay valid for the step.
  // The receive buffers are allocated on the compute stream: the transport's stream starts
  // after it.
  index_ = std::move(index);
  slots_.reserve(order.size());
  size_t receives = 0;
  for (const Message& m : order) {
    Slot s{m};
    if (!m.sending) {
      s.hidden = Tensor::empty({m.rows, hidden_}, dtype_, device_);
      s.totals = Tensor::empty({totals_}, DType::F64, device_);
      if (receives == pinned_.size()) pinned_.push_back(cuda::pinned_alloc(static_cast<size_t>(totals_) * 8));
      s.host_totals = Tensor::borrowed(pinned_[receives++], {totals_}, DType::F64, Device::cpu());
      s.on_host = cuda::create_sync_event();
    }
    s.ready = cuda::create_sync_event();
    slots_.push_back(std::move(s));
  }
  cuda::record_event(compute_point_, cuda::current_stream());
  cuda::stream_wait_event(stream_, compute_point_);
  next_ = 0;
  issue_ready();
}

void OrderedTransport::issue_ready() {
  for (; next_ < slots_.size(); ++next_) {
    Slot& s = slots_[next_];
    if (s.m.sending) {
      if (!s.handed) return;
      cuda::stream_wait_event(stream_, s.ready);
      CollectiveScope timed(Collective::kPipeline, stream_, /*on_compute=*/false);
      CollectiveTimer::count_bytes(Collective::kPipeline, static_cast<double>(s.hidden.nbytes() + s.totals.nbytes()));
      pp_.send(s.hidden, s.m.peer, stream_);
      pp_.send(s.totals, s.m.peer, stream_);
    } else {
      {  // on the stream, a receive also waits for its peer to send: the time includes the bubble
        CollectiveScope timed(Collective::kPipeline, stream_, /*on_compute=*/false);
        pp_.recv(s.hidden, s.m.peer, stream_);
        pp_.recv(s.totals, s.m.peer, stream_);
      }
      cuda::record_event(s.ready, stream_);
      {
        cuda::CurrentStreamScope on(stream_);
        cuda::copy_device_to_host_async(s.host_totals.raw(), s.totals.raw(), s.totals.nbytes());
      }
      cuda::record_event(s.on_host, stream_);
    }
    s.issued = true;
  }
}

OrderedTransport::Slot& OrderedTransport::slot(bool sending, uint32_t tag, const char* what) {
  auto it = index_.find({sending, tag});
  MT_CHECK(it != index_.end(), "pipeline transport: {} message tag {} is not in this step's order", what, tag);
  return slots_[it->second];
}

std::pair<Tensor, Tensor> OrderedTransport::receive(uint32_t tag) {
  Slot& s = slot(false, tag, "received");
  MT_CHECK(!s.used, "pipeline transport: message tag {} used twice", tag);
  MT_CHECK(s.issued, "pipeline transport: message tag {} is needed before this rank's send of tag {}, which comes "
           "before it in the order, was handed over (the order does not fit the schedule)", tag, slots_[next_].m.tag);
  s.used = true;
  CollectiveTimer::wait(Collective::kPipeline, cuda::current_stream(), s.ready);
  // The host needs the totals' counts now; reading them through the compute stream would
  // wait for all of its queued work too and leave the GPU idle while the host refills it.
  cuda::event_synchronize(s.on_host);
  return {s.hidden, s.host_totals};
}

void OrderedTransport::send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) {
  Slot& s = slot(true, tag, "sent");
  MT_CHECK(s.m.peer == to && !s.handed, "pipeline transport: message tag {} to rank {}: expected {} to rank {}", tag,
           to, s.handed ? "once" : "it", s.m.peer);
  MT_CHECK(hidden.dtype() == dtype_ && hidden.ndim() == 2 && hidden.size(0) == s.m.rows && hidden.size(1) == hidden_ &&
               totals.numel() == totals_ && hidden.device() == device_ && totals.device() == device_,
           "pipeline transport: message tag {} is {} and {}, expected [{}, {}] {} and [{}] on {}", tag, hidden.str(),
           totals.str(), s.m.rows, hidden_, dtype_name(dtype_), totals_, device_.str());
  s.hidden = hidden;
  s.totals = totals;
  s.handed = true;
  cuda::record_event(s.ready, cuda::current_stream());
  issue_ready();
}

void OrderedTransport::end_step() {
  issue_ready();
  MT_CHECK(next_ == slots_.size(), "pipeline transport: the step ended with message tag {} ({}) not {}",
           slots_[next_].m.tag, slots_[next_].m.sending ? "a send" : "a receive",
           slots_[next_].m.sending ? "handed over" : "issued");
  for (const Slot& s : slots_) {
    MT_CHECK(s.m.sending || s.used, "pipeline transport: received message tag {} was never used this step", s.m.tag);
  }
  // The compute stream waits for the sends: their tensors may go now.
  cuda::record_event(compute_point_, stream_);
  cuda::stream_wait_event(cuda::current_stream(), compute_point_);
  for (Slot& s : slots_) {
    cuda::destroy_event(s.ready);
    if (s.on_host) cuda::destroy_event(s.on_host);
  }
  slots_.clear();
  index_.clear();
  next_ = 0;
}

std::string OrderedTransport::pending() const {
  std::string out;
  if (next_ < slots_.size()) {
    const Slot& n = slots_[next_];
    out = fmt::format(" next: {} {} {} {} |", n.m.sending ? "send" : "receive", n.m.tag, n.m.sending ? "to" : "from",
                      n.m.peer);
  }
  for (const Slot& s : slots_) {
    if (s.m.sending || s.used || !s.issued) continue;
    out += fmt::format(" {}:{}", s.m.tag, cuda::event_done(s.ready) ? "in" : "--");
  }
  return out;
}

}  // namespace moetrain
