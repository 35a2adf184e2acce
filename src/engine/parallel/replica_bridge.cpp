#include "engine/parallel/replica_bridge.h"

#include "engine/parallel/fsdp.h"

namespace moetrain {

void ReplicaBridge::rebuild(std::shared_ptr<Communicator> replicas) {
  comm_ = replicas && replicas->size() > 1 ? std::move(replicas) : nullptr;
}

void ReplicaBridge::all_reduce(Tensor& t, ReduceOp op) {
  if (comm_) comm_->all_reduce(t, op);
}

void ReplicaBridge::all_reduce_doubles(std::vector<double>& values, Device device, ReduceOp op) {
  if (!comm_ || values.empty()) return;
  Tensor t = Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
  if (comm_->backend() != "gloo" && !device.is_cpu()) t = t.to(device);
  comm_->all_reduce(t, op);
  values = t.to_double_vector();
}

void sum_over_data(Communicator* group, ReplicaBridge* bridge, std::vector<double>& values, Device device) {
  if (group != nullptr) all_reduce_doubles(*group, values, device);
  if (bridge != nullptr) bridge->all_reduce_doubles(values, device);
}

}  // namespace moetrain
