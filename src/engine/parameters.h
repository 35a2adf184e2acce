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
  // bf16 values: the f32 master, kept split (ops/adamw_math.h): value is its high half,
  // rounded to nearest (ties away from zero), and master_low (i16) the rest, so that the two
  // are the master exactly, in 4 bytes an element instead of 6 for a separate f32 copy
  // beside the weight. Undefined for f32 values (the value is its own master).
  Tensor master_low;
  // Tensor parallelism: value is the box of a tensor of whole_shape that starts at `start`
  // (this tp rank's heads, MLP columns or vocabulary rows); empty: value is the whole tensor
  // (held whole on every tp rank, or tp = 1). Checkpoints store the box under the whole
  // tensor's name and shape; initialisation draws the whole tensor's numbers there.
  Shape whole_shape, start;

  bool has_master() const { return master_low.defined(); }
  bool tp_split() const { return !whole_shape.empty(); }
  const Shape& global_shape() const { return tp_split() ? whole_shape : value.shape(); }
};

// `p` as piece `rank` of `ranks` equal pieces along dimension `dim` of the whole tensor (value
// is the piece already): sets whole_shape and start; ranks == 1 leaves p whole.
Parameter tp_piece(Parameter p, int dim, int64_t rank, int64_t ranks);

using ParameterList = std::vector<Parameter>;

// The parameters of one part of a model (the embedding and head, one decoder layer's
// attention and router, one layer's experts) lie back to back in one flat value buffer and
// one flat gradient buffer. Sharded data parallelism reduces, updates and gathers a bucket
// as one tensor; `experts` buckets shard over fewer ranks (see engine/parallel/fsdp.h).
struct ParamBucket {
  std::string name;   // "model.layers.3.experts", for errors and logs
  bool experts = false;
  // Tensor parallelism: weights every tp rank holds whole (norms, the router) while each
  // computes on its own slice of the tokens: their gradients are summed over the tp group.
  bool tp_replicated = false;
  int64_t layer = -1;    // decoder layer it belongs to; -1: the embedding, final norm and head
  Tensor values, grads;  // 1-D; numel padded to a multiple of the pad given to build()
  int64_t used = 0;      // up to the end of the last parameter (the rest is padding)
  struct Member {
    size_t param;    // index into the model's ParameterList
    int64_t offset;  // where that parameter's elements start in values/grads
  };
  std::vector<Member> members;  // ascending offset; filled by index_buckets
};

// A piece of a parameter that one rank of a sharded optimizer owns: elements [begin, end)
// of the row-major flattened params[param].
struct ShardSegment {
  size_t param;
  int64_t begin, end;
};

// Collects the weights of one bucket, then allocates them at once.
class BucketBuilder {
 public:
  BucketBuilder(std::string name, bool experts, bool tp_replicated = false)
      : name_(std::move(name)), experts_(experts), tp_replicated_(tp_replicated) {}
  // Reserves a weight of `shape`: build() makes *value and *grad views of the flat buffers.
  void add(Tensor* value, Tensor* grad, Shape shape);
  bool empty() const { return slots_.empty(); }
  // Values uninitialised, gradients zero, both padded to a multiple of `pad` elements.
  ParamBucket build(DType dtype, Device device, int64_t pad = 1);

 private:
  std::string name_;
  bool experts_, tp_replicated_;
  std::vector<std::pair<Tensor*, Tensor*>> slots_;
  std::vector<Shape> shapes_;
};

// Fills each bucket's members from where the parameters' values live. Throws naming the
// parameter when one lies in no bucket or in two.
void index_buckets(std::vector<ParamBucket>& buckets, const ParameterList& params);

// The gradient (and master) dtype that goes with a parameter dtype: f32 for bf16.
DType grad_dtype_for(DType value_dtype);
// Gives every bf16 parameter an f32 master equal to its current value (a zero low half).
// The low halves are views of one flat buffer in parameter order, so the optimizer's
// whole-list ops see few contiguous runs.
void attach_masters(ParameterList& params);
// The parameter's master as a new f32 tensor of its shape (joined from its halves), or its
// value converted to f32 when it has none.
Tensor master_f32(const Parameter& p);
// Sets the parameter from f32 (or any float) elements, p's shape: its master's halves when
// it has one, else its value (converted).
void set_master(Parameter& p, const Tensor& master);
// Zero-filled tensors shaped like `like`, as consecutive views of one flat buffer of dtype
// on like's device (optimizer moments, masters).
std::vector<Tensor> flat_views(const std::vector<Tensor>& like, DType dtype);

// Total element count.
int64_t count_elements(const ParameterList& params);
// Sets every gradient to zero (one memset per contiguous run on the GPU).
void zero_grads(ParameterList& params);
// Draws each parameter from the stream keyed by (seed, name): N(0, init_std^2), or ones.
// The draw goes into the master when there is one (value is its rounded high half).
void init_parameters(ParameterList& params, uint64_t seed);

}  // namespace moetrain
