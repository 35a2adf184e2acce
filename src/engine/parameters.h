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
  Tensor value;                // what the model computes with (bf16 on GPU)
  Tensor grad;                 // same shape; f32 whenever value is bf16
  bool weight_decay = true;    // false for norms (1-D gains)
  double init_std = 0;         // 0: initialised to ones (norm gains)
  Tensor master;               // f32 master copy when value is bf16, else undefined

  // The tensor the optimizer updates: the f32 master, or value itself.
  Tensor& master_or_value() { return master.defined() ? master : value; }
};



using ParameterList = std::vector<Parameter>;

// The gradient (and master) dtype that goes with a parameter dtype: f32 for bf16.
DType grad_dtype_for(DType value_dtype);
// Gives every bf16 parameter an f32 master copy of its current value. The masters are
// views of one flat buffer in parameter order, so the optimizer's whole-list ops see few
// contiguous runs.
void attach_masters(ParameterList& params);
// Zero-filled tensors shaped like `like`, as consecutive views of one flat buffer of dtype
// on like's device (optimizer moments, masters).
std::vector<Tensor> flat_views(const std::vector<Tensor>& like, DType dtype);

// Total element count.
int64_t count_elements(const ParameterList& params);
// Sets every gradient to zero (one memset per contiguous run on the GPU).
void zero_grads(ParameterList& params);
// Draws each parameter from the stream keyed by (seed, name): N(0, init_std^2), or ones.
// The draw goes into the master when there is one, and value is its rounded copy.
void init_parameters(ParameterList& params, uint64_t seed);

}  // namespace moetrain
