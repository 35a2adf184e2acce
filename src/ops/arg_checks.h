// Argument checks an op's two backends share: shapes, integer arguments and index dtypes,
// each error naming the op and the tensor. Each backend adds its own: dtypes it computes in,
// sizes its kernels take.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/ops.h"

namespace moetrain::ops {

struct RopeDims {
  int64_t T, W, head_dim, stride, half;
};
inline RopeDims check_rope_args(const char* op, const Tensor& x, const Tensor& positions, const RopeSpec& r) {
  const int64_t hd = r.head_dim, stride = r.head_stride(), half = hd / 2;
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: input must be [T, heads*head_dim], got {}", op, x.str());
  MT_CHECK(hd > 0 && hd % 2 == 0, "{}: head_dim must be positive and even, got {}", op, hd);
  MT_CHECK(stride >= hd, "{}: a head's width (stride) {} is less than its rotary head_dim {}", op, stride, hd);
  MT_CHECK(x.size(1) % stride == 0,
           "{}: width {} of {} is not a multiple of the head width {} (the stride, else head_dim)", op, x.size(1),
           x.str(), stride);
  MT_CHECK(r.inv_freq.empty() ? r.theta > 0 : static_cast<int64_t>(r.inv_freq.size()) == half,
           "{}: theta must be positive (got {}) or inv_freq hold head_dim/2 = {} frequencies (got {})", op, r.theta,
           half, r.inv_freq.size());
  const int64_t T = x.size(0);
  check_shape(positions, {T}, "positions");
  check_dtype(positions, DType::I32, "positions");
  return {T, x.size(1), hd, stride, half};
}

// mla_kv_forward's kv and k_rot; returns the rotary width.
inline int64_t check_mla_kv_forward_args(const char* op, const Tensor& kv, const Tensor& k_rot, int64_t heads,
                                         int64_t nope, int64_t v_dim) {
  MT_CHECK(heads > 0 && nope >= 0 && v_dim > 0, "{}: bad MLA shape heads={} nope={} v_dim={}", op, heads, nope,
           v_dim);
  MT_CHECK(kv.defined() && kv.ndim() == 2 && kv.size(1) == heads * (nope + v_dim),
           "{}: kv must be [T, heads*(nope+v_dim)] = [T, {}], got {}", op, heads * (nope + v_dim), kv.str());
  MT_CHECK(k_rot.defined() && k_rot.ndim() == 2 && k_rot.size(0) == kv.size(0),
           "{}: k_rot must be [T={}, rope], got {}", op, kv.size(0), k_rot.str());
  return k_rot.size(1);
}

// mla_kv_backward's dk and dv; returns the rotary width.
inline int64_t check_mla_kv_backward_args(const char* op, const Tensor& dk, const Tensor& dv, int64_t heads,
                                          int64_t nope, int64_t v_dim) {
  MT_CHECK(heads > 0 && nope >= 0 && v_dim > 0, "{}: bad MLA shape heads={} nope={} v_dim={}", op, heads, nope,
           v_dim);
  MT_CHECK(dk.defined() && dk.ndim() == 2 && dk.size(1) % heads == 0 && dk.size(1) / heads > nope,
           "{}: dk must be [T, heads*(nope+rope)] with {} heads of more than {} dims, got {}", op, heads, nope,
           dk.str());
  check_shape(dv, {dk.size(0), heads * v_dim}, "dv");
  return dk.size(1) / heads - nope;
}

// seq_balance_*'s probs [B*S, E] and topk_idx [B*S, K]; returns S.
inline int64_t check_seq_balance_args(const char* op, const Tensor& probs, const Tensor& topk_idx, int64_t batch) {
  MT_CHECK(probs.defined() && probs.ndim() == 2, "{}: probs must be [B*S, E], got {}", op, probs.str());
  const int64_t R = probs.size(0);
  MT_CHECK(batch > 0 && R % batch == 0, "{}: {} rows of probs are not {} sequences of one length", op, R, batch);
  MT_CHECK(topk_idx.defined() && topk_idx.ndim() == 2 && topk_idx.size(0) == R,
           "{}: topk_idx must be [B*S = {}, K], got {}", op, R, topk_idx.str());
  check_dtype(topk_idx, DType::I32, "seq_balance topk_idx");
  MT_CHECK(topk_idx.size(1) > 0, "{}: topk_idx {} selects no expert", op, topk_idx.str());
  return R / batch;
}

}  // namespace moetrain::ops
