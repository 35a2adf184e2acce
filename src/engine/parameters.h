// Parameter: one model tensor under its canonical Hugging Face name, with its gradient.
//
// The canonical name is the one identity a weight has across pipeline stages, expert
// ranks, FSDP shards and checkpoints. Experts of a layer are stored stacked ([E, ...]) so
// grouped GEMMs can read them at once; each expert's Parameter is a dim-0 view of that
// stack, so names stay per expert as in HF.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

struct Parameter {
  std::string name;
  Tensor value;
  Tensor grad;                 // same shape and dtype as value
  bool weight_decay = true;    // false for norms (1-D gains)
  double init_std = 0;         // 0: initialised to ones (norm gains)
};

using ParameterList = std::vector<Parameter>;

// Total element count.
int64_t count_elements(const ParameterList& params);
// Sets every gradient to zero.
void zero_grads(ParameterList& params);
// Draws each parameter from the stream keyed by (seed, name): N(0, init_std^2), or ones.
void init_parameters(ParameterList& params, uint64_t seed);

}  // namespace moetrain
