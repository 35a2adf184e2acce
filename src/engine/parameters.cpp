#include "engine/parameters.h"

#include "core/rng.h"

namespace moetrain {

int64_t count_elements(const ParameterList& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.value.numel();
  return n;
}

void zero_grads(ParameterList& params) {
  for (auto& p : params) p.grad.zero_();
}

void init_parameters(ParameterList& params, uint64_t seed) {
  for (auto& p : params) {
    if (p.init_std == 0) {
      p.value.fill_(1.0);
    } else {
      fill_normal(p.value, stream_key(seed, p.name), p.init_std);
    }
  }
}

}  // namespace moetrain
