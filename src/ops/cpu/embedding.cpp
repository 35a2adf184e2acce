// Token embedding lookup.
//
// forward:   y[t, :] = W[ids[t], :]                 ids i32 [T], W [V, H] -> y [T, H]
// backward:  dW[ids[t], :] += dy[t, :]              (accumulates; no gradient for ids)
// W may be a shard of the vocabulary's rows (VocabShard): other shards' ids give zero rows.
//
// The backward is deterministic: columns are split into fixed blocks, and each block is
// owned by one thread that adds the rows of dy in token order.
#include <algorithm>
#include <cstring>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// ids must be a 1-D i32 tensor with every entry in [0, vocab).
const int32_t* checked_ids(const Tensor& ids, int64_t vocab, const char* op) {
  MT_CHECK(ids.defined() && ids.ndim() == 1, "{}: ids must be a 1-D i32 tensor, got {}", op, ids.str());
  check_dtype(ids, DType::I32, "ids");
  const int32_t* p = ids.data<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    MT_CHECK(p[t] >= 0 && p[t] < vocab, "{}: token id {} at position {} is outside the vocabulary [0, {})", op,
             p[t], t, vocab);
  }
  return p;
}

}  // namespace

Tensor shift_tokens(const Tensor& ids, const Tensor& segment_ids, int64_t batch, int64_t k, int32_t fill) {
  const int64_t S = ids.numel() / batch;  // shapes checked in ops/dispatch.cpp
  const int32_t* in = ids.data<int32_t>();
  const int32_t* seg = segment_ids.defined() ? segment_ids.data<int32_t>() : nullptr;
  Tensor out = Tensor::empty(ids.shape(), DType::I32);
  int32_t* o = out.data<int32_t>();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    const bool inside = t % S + k < S && (seg == nullptr || seg[t + k] == seg[t]);
    o[t] = inside ? in[t + k] : fill;
  }
  return out;
}

Tensor embedding_forward(const Tensor& ids, const Tensor& weight, const VocabShard& shard) {
  const int64_t V = weight.size(0), H = weight.size(1), first = shard.begin;
  const int32_t* id = checked_ids(ids, shard.size, "embedding_forward");
  const int64_t T = ids.numel();
  Tensor y = Tensor::empty({T, H}, weight.dtype());
  dispatch_float(weight.dtype(), "embedding_forward", [&](auto tag) {
    using F = decltype(tag);
    const F* w = weight.data<F>();
    F* out = y.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = id[t] - first;
      if (row >= 0 && row < V) std::memcpy(out + t * H, w + row * H, sizeof(F) * H);
      else std::fill(out + t * H, out + (t + 1) * H, F(0));  // another shard's id
    }
  });
  return y;
}

void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight, const VocabShard& shard) {
  const int64_t V = dweight.size(0), H = dweight.size(1), first = shard.begin;
  const int32_t* id = checked_ids(ids, shard.size, "embedding_backward_weight");
  const int64_t T = ids.numel();
  check_shape(dy, {T, H}, "dy");
  check_same_dtype("embedding_backward_weight", dweight.dtype(), {&dy});
  dispatch_float(dweight.dtype(), "embedding_backward_weight", [&](auto tag) {
    using F = decltype(tag);
    const F* g = dy.data<F>();
    F* dw = dweight.data<F>();
    constexpr int64_t kBlock = 64;
    const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kBlock, c1 = std::min(H, c0 + kBlock);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t r = id[t] - first;
        if (r < 0 || r >= V) continue;  // another shard's id
        F* row = dw + r * H;
        const F* src = g + t * H;
        for (int64_t c = c0; c < c1; ++c) row[c] += src[c];
      }
    }
  });
}

}  // namespace moetrain::ops::cpu
