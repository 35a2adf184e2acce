#include "engine/parallel/ring.h"

#include <spdlog/spdlog.h>

namespace moetrain {

Ring::~Ring() {
  if (stream_ == nullptr) return;
  try {
    cuda::stream_synchronize(stream_);
    cuda::destroy_stream(stream_);
  } catch (const std::exception& e) {
    spdlog::error("ring over {}: releasing its stream: {}", group_.name(), e.what());
  }
}

Ring::Hop::Hop(Hop&& o) noexcept
    : request_(std::move(o.request_)), arrived_(o.arrived_), keep_(std::move(o.keep_)), kind_(o.kind_) {
  o.arrived_ = nullptr;
}

Ring::Hop& Ring::Hop::operator=(Hop&& o) noexcept {
  if (this != &o) {
    finish();
    request_ = std::move(o.request_);
    arrived_ = o.arrived_;
    keep_ = std::move(o.keep_);
    kind_ = o.kind_;
    o.arrived_ = nullptr;
  }
  return *this;
}

Ring::Hop::~Hop() { finish(); }

void Ring::Hop::wait() {
  if (request_) request_->wait();
  request_.reset();
  if (arrived_ != nullptr) {
    CollectiveTimer::wait(kind_, cuda::current_stream(), arrived_);
    cuda::destroy_event(arrived_);
    arrived_ = nullptr;
  }
  keep_.clear();
}

void Ring::Hop::finish() noexcept {
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("a ring transfer failed: {}", e.what());
  }
}

Ring::Hop Ring::pass_on(std::vector<Tensor> sends, std::vector<Tensor> recvs, uint32_t first_tag) const {
  const int n = group_.size(), r = group_.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  double bytes = 0;
  for (const Tensor& t : sends) bytes += static_cast<double>(t.nbytes());
  CollectiveTimer::count_bytes(kind_, bytes);
  Hop h;
  h.kind_ = kind_;
  if (!sends.front().device().is_cpu()) {
    if (stream_ == nullptr) stream_ = cuda::create_stream();
    cuda::Event ready = cuda::create_sync_event();
    cuda::record_event(ready, cuda::current_stream());
    cuda::stream_wait_event(stream_, ready);  // the tensors are made and the buffers allocated
    cuda::destroy_event(ready);               // released once the wait has passed it
    {
      CollectiveScope scope(kind_, stream_, /*on_compute=*/false);
      h.request_ = group_.send_recv(sends, next, recvs, prev, first_tag, stream_);
    }
    h.arrived_ = cuda::create_sync_event();
    cuda::record_event(h.arrived_, stream_);
  } else {
    h.request_ = group_.send_recv(sends, next, recvs, prev, first_tag);
  }
  h.keep_ = std::move(sends);
  h.keep_.insert(h.keep_.end(), recvs.begin(), recvs.end());
  return h;
}

}  // namespace moetrain
