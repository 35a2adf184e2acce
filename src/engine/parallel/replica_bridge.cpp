#include "engine/parallel/replica_bridge.h"


namespace moetrain {

void ReplicaBridge::rebuild(std::shared_ptr<Communicator> replicas) {
  comm_ = replicas && replicas->size() > 1 ? std::move(replicas) : nullptr;
}

void ReplicaBridge::all_reduce(Tensor& t, ReduceOp op) {
  if (comm_) comm_->all_reduce(t, op);
}

void ReplicaBridge::all_reduce_doubles(std::vector<double>& values, Device device, ReduceOp op) {
  if (comm_) moetrain::all_reduce_doubles(*comm_, values, device, op);
}

void sum_over_data(Communicator* group, ReplicaBridge* bridge, std::vector<double>& values, Device device) {
  if (group != nullptr) all_reduce_doubles(*group, values, device);
  if (bridge != nullptr) bridge->all_reduce_doubles(values, device);
}

}  // namespace moetrain
