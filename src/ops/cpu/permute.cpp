// Token permutation by expert: the T*K (token, slot) pairs sorted stably by expert id.
//
// permutation_by_expert: a counting sort of topk_idx [T, K]. counts[e] = #pairs routed to
//   e; offsets = exclusive prefix sum; pairs visited in (t, k) order take the next row of
//   their expert, so slot_row[t*K+k] = r and source_token[r] = t.
// permute:   xp[r] = x[source_token[r]]            backward: dx[t] = sum_k dxp[slot_row[t*K+k]]
//   (the backward gathers the K rows of each token in k order: deterministic, no atomics)
// unpermute: y[t*K+k] = yp[slot_row[t*K+k]]        backward: dyp[slot_row[i]] = dy[i]
//   (slot_row is a bijection, so this scatter writes each row exactly once)
// A partial permutation (Permutation::rows) keeps rows [0, R): pairs with slot_row >= R
// are absent, skipped in the sums and scatters, zero in unpermute_forward.
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops/cpu/common.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// dst[i] = src[index[i]] for rows of H elements (any element type).
void gather_rows(const Tensor& src, const int32_t* index, int64_t n, Tensor& dst) {
  const int64_t row_bytes = src.size(1) * static_cast<int64_t>(dtype_size(src.dtype()));
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * row_bytes, s + index[i] * row_bytes, row_bytes);
}

}  // namespace

Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts) {
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2, "permutation_by_expert: topk_idx must be [T, K], got {}",
           topk_idx.str());
  check_dtype(topk_idx, DType::I32, "permutation_by_expert topk_idx");
  MT_CHECK(num_experts >= 1, "permutation_by_expert: num_experts = {} must be positive", num_experts);
  Permutation p;
  p.num_tokens = topk_idx.size(0);
  p.top_k = topk_idx.size(1);
  const int64_t NK = p.num_tokens * p.top_k;
  MT_CHECK(NK <= INT32_MAX, "permutation_by_expert: T*K = {} rows exceed the i32 row index range", NK);
  const int32_t* idx = topk_idx.data<int32_t>();
  p.expert_counts = Tensor::zeros({num_experts}, DType::I64);
  int64_t* counts = p.expert_counts.data<int64_t>();
  for (int64_t i = 0; i < NK; ++i) {
    MT_CHECK(idx[i] >= 0 && idx[i] < num_experts,
             "permutation_by_expert: topk_idx[{}, {}] = {} is not an expert id in [0, {})", i / p.top_k,
             i % p.top_k, idx[i], num_experts);
    ++counts[idx[i]];
  }
  std::vector<int64_t> next(static_cast<size_t>(num_experts));
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    next[e] = off;
    off += counts[e];
  }
  p.source_token = Tensor::empty({NK}, DType::I32);
  p.slot_row = Tensor::empty({NK}, DType::I32);
  int32_t* src = p.source_token.data<int32_t>();
  int32_t* slot = p.slot_row.data<int32_t>();
  for (int64_t i = 0; i < NK; ++i) {
    const int64_t r = next[idx[i]]++;
    slot[i] = static_cast<int32_t>(r);
    src[r] = static_cast<int32_t>(i / p.top_k);
  }
  return p;
}

Tensor expert_ids_in_range(const Tensor& topk_idx, int64_t first, int64_t count) {
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2, "expert_ids_in_range: topk_idx must be [T, K], got {}",
           topk_idx.str());
  check_dtype(topk_idx, DType::I32, "expert_ids_in_range topk_idx");
  Tensor out = Tensor::empty(topk_idx.shape(), DType::I32);
  const int32_t* in = topk_idx.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t i = 0; i < topk_idx.numel(); ++i) {
    const int64_t e = in[i];
    o[i] = static_cast<int32_t>(e >= first && e < first + count ? e - first : count);
  }
  return out;
}

Tensor permute_forward(const Tensor& x, const Permutation& p) {
  const int64_t H = x.size(1);  // shapes checked in ops/dispatch.cpp
  Tensor xp = Tensor::empty({p.permuted_rows(), H}, x.dtype());
  gather_rows(x, p.source_token.data<int32_t>(), p.permuted_rows(), xp);
  return xp;
}

Fp8Tensor permute_forward_fp8(const Fp8Tensor& x, const Permutation& p) {
  const int64_t T = p.num_tokens, R = p.permuted_rows(), L = x.scale.size(0);
  Fp8Tensor out{cpu::permute_forward(x.q, p), Tensor::empty({L, R}, DType::F32), Fp8Blocks::kRows};
  const float* s = x.scale.data<float>();
  const int32_t* src = p.source_token.data<int32_t>();
  float* o = out.scale.data<float>();
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t r = 0; r < R; ++r) o[l * R + r] = s[l * T + src[r]];
  }
  return out;
}

UnpackedFp8Rows permute_forward_fp8_values(const Fp8Tensor& x, const Permutation& p, DType dtype) {
  Fp8Tensor q = cpu::permute_forward_fp8(x, p);
  Tensor values = cpu::dequantize_fp8(q, dtype);
  return {std::move(q), std::move(values)};
}

Tensor permute_backward(const Tensor& dxp, const Permutation& p) {
  const int64_t H = dxp.size(1);  // shapes checked in ops/dispatch.cpp
  const int64_t T = p.num_tokens, K = p.top_k, R = p.permuted_rows();
  Tensor dx = Tensor::empty({T, H}, dxp.dtype());
  dispatch_float(dxp.dtype(), "permute_backward", [&](auto tag) {
    using F = decltype(tag);
    const F* g = dxp.data<F>();
    const int32_t* slot = p.slot_row.data<int32_t>();
    F* out = dx.data<F>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      F* o = out + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = F(0);
      for (int64_t k = 0; k < K; ++k) {
        if (slot[t * K + k] >= R) continue;  // absent
        const F* row = g + static_cast<int64_t>(slot[t * K + k]) * H;
        for (int64_t h = 0; h < H; ++h) o[h] += row[h];
      }
    }
  });
  return dx;
}

Tensor take_rows(const Tensor& x, const Tensor& index) {
  Shape shape = x.shape();
  const int64_t R = shape[0], N = index.size(0);
  shape[0] = N;
  Tensor y = Tensor::zeros(shape, x.dtype(), x.device());
  if (R == 0) return y;
  const size_t row = static_cast<size_t>(x.nbytes() / R);
  const auto* src = static_cast<const unsigned char*>(x.raw());
  auto* dst = static_cast<unsigned char*>(y.raw());
  const int32_t* idx = index.data<int32_t>();
  for (int64_t i = 0; i < N; ++i) {
    if (idx[i] >= 0 && idx[i] < R) std::memcpy(dst + static_cast<size_t>(i) * row, src + static_cast<size_t>(idx[i]) * row, row);
  }
  return y;
}

Tensor unpermute_forward(const Tensor& yp, const Permutation& p) {
  const int64_t H = yp.size(1);  // shapes checked in ops/dispatch.cpp
  const int64_t NK = p.num_tokens * p.top_k, R = p.permuted_rows();
  if (R == NK) {
    Tensor y = Tensor::empty({NK, H}, yp.dtype());
    gather_rows(yp, p.slot_row.data<int32_t>(), NK, y);
    return y;
  }
  Tensor y = Tensor::zeros({NK, H}, yp.dtype());
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(yp.dtype()));
  const int32_t* slot = p.slot_row.data<int32_t>();
  const char* s = static_cast<const char*>(yp.raw());
  char* d = static_cast<char*>(y.raw());
  for (int64_t i = 0; i < NK; ++i) {
    if (slot[i] < R) std::memcpy(d + i * row_bytes, s + slot[i] * row_bytes, row_bytes);
  }
  return y;
}

Tensor unpermute_backward(const Tensor& dy, const Permutation& p) {
  const int64_t H = dy.size(1);  // shapes checked in ops/dispatch.cpp
  const int64_t NK = p.num_tokens * p.top_k, R = p.permuted_rows();
  // The gather by the inverse of slot_row: row r of expert order is pair
  // (source_token[r], k) with slot_row of that pair equal to r. Scatter through slot_row
  // is the same map and touches each kept row once.
  Tensor dyp = Tensor::empty({R, H}, dy.dtype());
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(dy.dtype()));
  const int32_t* slot = p.slot_row.data<int32_t>();
  const char* s = static_cast<const char*>(dy.raw());
  char* d = static_cast<char*>(dyp.raw());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < NK; ++i) {
    if (slot[i] < R) std::memcpy(d + slot[i] * row_bytes, s + i * row_bytes, row_bytes);
  }
  return dyp;
}

}  // namespace moetrain::ops::cpu
