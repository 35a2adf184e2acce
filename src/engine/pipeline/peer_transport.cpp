#include "engine/pipeline/peer_transport.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "engine/telemetry/collective_timer.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// All ranks of the group here, their work so far done (a host wait for a one-element sum).
void barrier(Communicator& group, Device device) {
  std::vector<double> one{1.0};
  all_reduce_doubles(group, one, device);
}

}  // namespace

PeerTransport::PeerTransport(Communicator& pp, Device device, int64_t hidden, DType dtype, int64_t totals)
    : pp_(pp),
      device_(device),
      hidden_(hidden),
      totals_(totals),
      dtype_(dtype),
      timeout_s_(std::chrono::duration<double>(pp.options().timeout).count()) {
  MT_CHECK(!device.is_cpu(), "pipeline transport over {}: needs a GPU", pp.name());
  const size_t P = static_cast<size_t>(pp.size());
  for (size_t q = 0; q < P; ++q) {
    lanes_.push_back(cuda::create_stream());
    lane_done_.push_back(cuda::create_sync_event());
  }
  host_lane_ = cuda::create_stream();
  ready_ = cuda::create_sync_event();
}

PeerTransport::~PeerTransport() {
  try {
    if (!msgs_.empty()) {
      // Stopped in the middle of a step (an error is on its way up): a peer may still copy
      // into this arena, so it is left allocated and mapped.
      spdlog::error("pipeline transport: a step stopped with {} messages pending; not waiting for them",
                    msgs_.size());
      return;
    }
    for (cuda::Stream l : lanes_) cuda::stream_synchronize(l);
    cuda::stream_synchronize(host_lane_);
    release();
    for (cuda::Stream l : lanes_) cuda::destroy_stream(l);
    for (cuda::Event e : lane_done_) cuda::destroy_event(e);
    cuda::destroy_stream(host_lane_);
    cuda::destroy_event(ready_);
    for (void* p : pinned_) cuda::pinned_free(p);
  } catch (const std::exception& e) {
    spdlog::error("pipeline transport: {}", e.what());
  }
}

void PeerTransport::release() {
  close_peer_buffers(peers_);
  if (mine_) cuda::shareable_free(mine_);
  mine_ = nullptr;
  slots_ = slot_bytes_ = words_bytes_ = 0;
}

void PeerTransport::reserve(size_t slots, size_t slot_bytes) {
  // Nobody may still copy into or read from the old arenas: this rank's work is done, then
  // every rank's.
  cuda::device_synchronize();
  barrier(pp_, device_);
  release();
  slots_ = slots;
  slot_bytes_ = slot_bytes;
  words_bytes_ = round_up(4 * (slots + static_cast<size_t>(pp_.size())), 256);
  mine_ = cuda::shareable_alloc(words_bytes_ + slots_ * slot_bytes_);
  cuda::memset_device(mine_, 0, words_bytes_);  // no signal yet
  peers_ = open_peer_buffers(pp_, mine_);
  step_ = 0;
  barrier(pp_, device_);  // every rank has mapped every arena before anyone writes
}

char* PeerTransport::slot_at(int rank, size_t slot) const {
  return static_cast<char*>(peers_.at[static_cast<size_t>(rank)]) + words_bytes_ + slot * slot_bytes_;
}

void PeerTransport::begin_step(const std::vector<std::vector<Message>>& orders, int64_t max_rows) {
  MT_CHECK(msgs_.empty(), "pipeline transport: a step began before the last one ended");
  MT_CHECK(static_cast<int>(orders.size()) == pp_.size(), "pipeline transport: orders of {} ranks, the group has {}",
           orders.size(), pp_.size());
  // A message's slot is its place among its receiver's receives.
  std::vector<std::map<uint32_t, size_t>> slot_of(orders.size());
  size_t most = 0;
  for (size_t r = 0; r < orders.size(); ++r) {
    for (const Message& m : orders[r]) {
      if (!m.sending) slot_of[r].emplace(m.tag, slot_of[r].size());
    }
    most = std::max(most, slot_of[r].size());
  }
  // Slots start 256-byte aligned (the hidden state is read by kernels that load 16 bytes at a time).
  const size_t need = round_up(totals_bytes() + static_cast<size_t>(max_rows * hidden_) * dtype_size(dtype_), 256);
  if (most > slots_ || need > slot_bytes_) reserve(std::max(most, slots_), std::max(need, slot_bytes_));
  ++step_;
  const int me = pp_.rank();
  sent_to_.assign(static_cast<size_t>(pp_.size()), false);
  size_t receives = 0;
  for (const Message& m : orders[static_cast<size_t>(me)]) {
    MT_CHECK(m.rows <= max_rows && m.peer >= 0 && m.peer < pp_.size() && m.peer != me,
             "pipeline transport: message tag {} ({} rows, rank {}) does not fit the step (largest {} rows, {} ranks, "
             "this rank {})", m.tag, m.rows, m.peer, max_rows, pp_.size(), me);
    Msg g{m};
    const auto& at = slot_of[static_cast<size_t>(m.sending ? m.peer : me)];
    auto it = at.find(m.tag);
    MT_CHECK(it != at.end(), "pipeline transport: rank {} does not expect message tag {} from rank {}",
             m.sending ? m.peer : me, m.tag, m.sending ? me : m.peer);
    g.slot = it->second;
    if (!m.sending) {
      if (receives == pinned_.size()) pinned_.push_back(cuda::pinned_alloc(static_cast<size_t>(totals_) * 8));
      g.host = Tensor::borrowed(pinned_[receives++], {totals_}, DType::F64, Device::cpu());
      g.on_host = cuda::create_sync_event();
    }
    MT_CHECK(msgs_.emplace(std::make_pair(m.sending, m.tag), std::move(g)).second,
             "pipeline transport: message tag {} listed twice", m.tag);
  }
}

std::pair<Tensor, Tensor> PeerTransport::receive(uint32_t tag) {
  auto it = msgs_.find({false, tag});
  MT_CHECK(it != msgs_.end(), "pipeline transport: received message tag {} is not in this step's order", tag);
  Msg& g = it->second;
  MT_CHECK(!g.done, "pipeline transport: message tag {} used twice", tag);
  g.done = true;
  const int me = pp_.rank();
  {  // the compute stream waits here, for this message only
    CollectiveScope timed(Collective::kPipeline);
    ops::wait_word(words(me) + g.slot, step_, timeout_s_);
  }
  {  // the host needs the totals' counts: it waits for the message, not for the compute stream
    cuda::CurrentStreamScope on(host_lane_);
    ops::wait_word(words(me) + g.slot, step_, timeout_s_);
    cuda::copy_device_to_host_async(g.host.raw(), slot_at(me, g.slot), g.host.nbytes());
    cuda::record_event(g.on_host, host_lane_);
  }
  cuda::event_synchronize(g.on_host);
  const Tensor hidden =
      Tensor::borrowed(slot_at(me, g.slot) + totals_bytes(), {g.m.rows, hidden_}, dtype_, device_);
  return {hidden, g.host};
}

void PeerTransport::send(int to, uint32_t tag, const Tensor& hidden, const Tensor& totals) {
  auto it = msgs_.find({true, tag});
  MT_CHECK(it != msgs_.end(), "pipeline transport: sent message tag {} is not in this step's order", tag);
  Msg& g = it->second;
  MT_CHECK(g.m.peer == to && !g.done, "pipeline transport: message tag {} to rank {}: expected {} to rank {}", tag, to,
           g.done ? "once" : "it", g.m.peer);
  MT_CHECK(hidden.dtype() == dtype_ && hidden.ndim() == 2 && hidden.size(0) == g.m.rows && hidden.size(1) == hidden_ &&
               totals.numel() == totals_ && totals.dtype() == DType::F64 && hidden.device() == device_ &&
               totals.device() == device_,
           "pipeline transport: message tag {} is {} and {}, expected [{}, {}] {} and [{}] f64 on {}", tag, hidden.str(),
           totals.str(), g.m.rows, hidden_, dtype_name(dtype_), totals_, device_.str());
  g.done = true;
  g.hidden = hidden;  // kept until the step's end: the copy reads it
  g.totals = totals;
  const size_t q = static_cast<size_t>(to);
  cuda::record_event(ready_, cuda::current_stream());
  cuda::stream_wait_event(lanes_[q], ready_);
  cuda::CurrentStreamScope on(lanes_[q]);
  CollectiveTimer::count_bytes(Collective::kPipeline, static_cast<double>(g.hidden.nbytes() + g.totals.nbytes()));
  if (!sent_to_[q]) {  // the receiver is done with its slots' last step
    sent_to_[q] = true;
    ops::wait_word(words(pp_.rank()) + freed_word() + q, step_ - 1, timeout_s_);
  }
  char* slot = slot_at(to, g.slot);  // the totals, then the hidden state
  cuda::copy_device_to_device(slot, g.totals.raw(), g.totals.nbytes());
  cuda::copy_device_to_device(slot + totals_bytes(), g.hidden.raw(), g.hidden.nbytes());
  ops::signal_word(words(to) + g.slot, step_);
}

void PeerTransport::end_step() {
  std::string missing;
  for (const auto& [key, g] : msgs_) {
    if (!g.done) missing += fmt::format("{}{} {}", missing.empty() ? "" : ", ", key.first ? "send" : "receive", key.second);
  }
  MT_CHECK(missing.empty(), "pipeline transport: the step ended with messages neither sent nor used: {}", missing);
  const int me = pp_.rank();
  // The compute stream has read every received slot by here: tell every peer, also one that
  // sent nothing this step (it holds none of this rank's slots), or its first send of a later
  // step would wait for a signal of this step that never comes (a validation step has no head
  // helper's messages, say).
  for (int q = 0; q < pp_.size(); ++q) {
    if (q != me) ops::signal_word(words(q) + freed_word() + me, step_);
  }
  // The compute stream waits for the copies: the sent tensors may go.
  for (size_t q = 0; q < lanes_.size(); ++q) {
    cuda::record_event(lane_done_[q], lanes_[q]);
    cuda::stream_wait_event(cuda::current_stream(), lane_done_[q]);
  }
  for (auto& [key, g] : msgs_) {
    if (g.on_host) cuda::destroy_event(g.on_host);
  }
  msgs_.clear();
}

std::string PeerTransport::pending() const {
  std::string out;
  for (const auto& [key, g] : msgs_) {
    if (!key.first && !g.done) out += fmt::format(" {}:{}", key.second, cuda::event_done(g.on_host) ? "in" : "--");
  }
  return out;
}

}  // namespace moetrain
