#include "engine/parallel/replica_bridge.h"

#include "core/error.h"
#include "core/log.h"
#include "engine/ft/fault.h"

namespace moetrain {

void ReplicaBridge::rebuild(std::shared_ptr<Communicator> replicas) {
  // Live FT: the old groups may hold a dead one; NCCL would wait for it to finalize.
  if (tolerant_ && comm_) comm_->abort();
  comm_ = replicas && replicas->size() > 1 ? std::move(replicas) : nullptr;
  failure_.clear();
}

void ReplicaBridge::fail(std::string why) {
  failure_ = std::move(why);
  spdlog::warn("replica groups: {}; this step will be discarded", failure_);
  if (comm_) comm_->abort();
  comm_.reset();
}

template <typename F>
void ReplicaBridge::guarded(F&& op) {
  if (!comm_) return;
  if (!tolerant_) return op(*comm_);
  try {
    op(*comm_);
  } catch (const Error& e) {
    fail(e.what());
  }
}

void ReplicaBridge::all_reduce(Tensor& t, ReduceOp op) {
  if (comm_) fault_point("ft_allreduce", -1);  // for the chaos tests (count, skip)
  guarded([&](Communicator& c) { c.all_reduce(t, op); });
}

void ReplicaBridge::all_reduce_doubles(std::vector<double>& values, Device device, ReduceOp op) {
  guarded([&](Communicator& c) {
    moetrain::all_reduce_doubles(c, values, device, op);
    // NCCL reports a failure (a peer gone, a timeout) at the call after it: ask now, so
    // that values read after a failure are never taken for a result.
    if (tolerant_) c.synchronize();
  });
}

void sum_over_data(Communicator* group, ReplicaBridge* bridge, std::vector<double>& values, Device device) {
  if (group != nullptr) all_reduce_doubles(*group, values, device);
  if (bridge != nullptr) bridge->all_reduce_doubles(values, device);
}

}  // namespace moetrain
