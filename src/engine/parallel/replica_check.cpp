#include "engine/parallel/replica_check.h"

#include <cstdint>
#include <cstring>
#include <set>

#include "engine/checkpoint/safetensors.h"

namespace moetrain {

std::vector<NamedTensor> replicated_state(Model& model, bool whole_weights, ReplicaSet set) {
  std::vector<NamedTensor> out;
  const bool pieces = set == ReplicaSet::kTensorPieces;
  if (!pieces) {
    for (const NamedBuffer& b : model.buffers()) out.push_back({b.name, b.value});
  }
  if (!whole_weights) return out;
  std::set<size_t> expert_params;
  const ParameterList& params = model.parameters();
  for (const ParamBucket& b : model.buckets()) {
    if (!b.experts) continue;
    for (const ParamBucket::Member& m : b.members) {
      expert_params.insert(m.param);
      if (set == ReplicaSet::kTensorCopies && b.tp_replicated) out.push_back({params[m.param].name, params[m.param].value});
    }
  }
  if (set == ReplicaSet::kTensorCopies) return out;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!expert_params.count(i) && params[i].tp_split() == pieces) out.push_back({params[i].name, params[i].value});
  }
  return out;
}

namespace {

// XXH3-64 of the tensor's bytes (one tensor on the host at a time: the peak is the largest).
uint64_t hash_of(const Tensor& t) {
  const Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
  return xxh3_bytes(host.raw(), host.nbytes());
}

}  // namespace

std::vector<std::string> replicas_that_differ(const std::vector<NamedTensor>& tensors, Communicator& group,
                                              Device device) {
  // Per tensor: its hash's two 32-bit halves (exact in f64) and their negations; the max over
  // the group of both is the max and minus the min, equal on every rank only if all agree.
  const auto n = static_cast<int64_t>(tensors.size());
  std::vector<double> v(static_cast<size_t>(4 * n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = hash_of(tensors[i].value);
    const double hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffull);
    v[4 * i] = hi;
    v[4 * i + 1] = lo;
    v[4 * i + 2] = -hi;
    v[4 * i + 3] = -lo;
  }
  Tensor t = Tensor::from_vector(v, {4 * n}).to(device);
  group.all_reduce(t, ReduceOp::Max);
  const std::vector<double> r = t.to_double_vector();
  std::vector<std::string> differ;
  for (int64_t i = 0; i < n; ++i) {
    if (r[4 * i] != -r[4 * i + 2] || r[4 * i + 1] != -r[4 * i + 3]) differ.push_back(tensors[i].name);
  }
  return differ;
}

}  // namespace moetrain
