// Argument checks an op's two backends share: shapes, integer arguments and index dtypes,
// each error naming the op and the tensor. Each backend adds its own: dtypes it computes in,
// sizes its kernels take.
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"
#include "ops/ops.h"

namespace moetrain::ops {

constexpr int64_t kFp8Block = 128;
inline int64_t fp8_blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }
// Bytes a row of C columns takes in pack_fp8_rows' form (ops.h): its codes, then its scales.
inline int64_t packed_fp8_row_bytes(int64_t C) { return C + 4 * fp8_blocks_of(C); }
// The shape of the scales of an [R, C] tensor quantized in `blocks` mode (ops.h).
inline Shape fp8_scale_shape(int64_t R, int64_t C, Fp8Blocks blocks) {
  if (blocks == Fp8Blocks::kRows) return {fp8_blocks_of(C), R};
  return {fp8_blocks_of(R), (fp8_blocks_of(C) + 3) / 4 * 4};
}
// Where element (r, c)'s scale lies in an [R, C] tensor's scales (fp8_scale_shape's layout;
// scale_cols: the scale tensor's row length).
inline int64_t fp8_scale_index(Fp8Blocks blocks, int64_t r, int64_t c, int64_t R, int64_t scale_cols) {
  const int64_t kb = c / kFp8Block;
  return blocks == Fp8Blocks::kRows ? kb * R + r : (r / kFp8Block) * scale_cols + kb;
}
// A quantizer's input: x [R, C] of a floating dtype.
inline void check_fp8_input(const char* op, const Tensor& x) {
  MT_CHECK(x.defined() && x.ndim() == 2, "{}: x must be [R, C], got {}", op, x.str());
  MT_CHECK(is_floating(x.dtype()), "{}: x must be bf16, f32 or f64, got {}", op, x.str());
}
// An Fp8Tensor's q and scale agree with each other and its mode.
inline void check_fp8_tensor(const char* op, const Fp8Tensor& t, const char* name) {
  MT_CHECK(t.q.defined() && t.q.ndim() == 2 && t.q.dtype() == DType::F8E4M3, "{}: {}.q must be f8e4m3 [R, C], got {}",
           op, name, t.q.str());
  MT_CHECK(t.scale.defined() && t.scale.dtype() == DType::F32 &&
               t.scale.shape() == fp8_scale_shape(t.q.size(0), t.q.size(1), t.blocks),
           "{}: {}.scale is {}, expected f32 {} for {} in {} mode", op, name, t.scale.str(),
           shape_str(fp8_scale_shape(t.q.size(0), t.q.size(1), t.blocks)), t.q.str(),
           t.blocks == Fp8Blocks::kRows ? "rows (1 x 128)" : "blocks (128 x 128)");
  MT_CHECK(t.q.device() == t.scale.device(), "{}: {}'s q and scale lie on different devices", op, name);
}
// check_fp8_tensor, and quantized per 1 x 128 tile (rows mode: activations and their gradients).
inline void check_fp8_rows(const char* op, const Fp8Tensor& t, const char* name) {
  check_fp8_tensor(op, t, name);
  MT_CHECK(t.blocks == Fp8Blocks::kRows, "{}: {} must be quantized per 1 x 128 tile (rows mode), got {}", op, name,
           t.q.str());
}
// linear_fp8's operands: a in rows mode, b in either, the same K; returns {M, N, K}.
inline std::array<int64_t, 3> check_linear_fp8_args(const char* op, const Fp8Tensor& a, const Fp8Tensor& b, DType out) {
  check_fp8_rows(op, a, "a");
  check_fp8_tensor(op, b, "b");
  MT_CHECK(a.q.size(1) == b.q.size(1), "{}: a {} and b {} differ in K", op, a.q.str(), b.q.str());
  MT_CHECK(a.q.device() == b.q.device(), "{}: a and b lie on different devices", op);
  MT_CHECK(out == DType::BF16 || out == DType::F32, "{}: the output must be bf16 or f32, got {}", op, dtype_name(out));
  return {a.q.size(0), b.q.size(0), a.q.size(1)};
}

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

// attention_part_*'s part: its rows within [0, shape.seq), a causal part's two ranges one,
// segments for both sides or neither (each i32 [B*S]).
inline void check_attention_part(const char* op, const AttentionPart& p, const AttentionShape& a) {
  MT_CHECK(0 <= p.q_begin && p.q_begin <= p.q_end && p.q_end <= a.seq && 0 <= p.k_begin && p.k_begin <= p.k_end &&
               p.k_end <= a.seq,
           "{}: the part's rows q [{}, {}) and k [{}, {}) must lie in [0, {}) (shape.seq)", op, p.q_begin, p.q_end,
           p.k_begin, p.k_end, a.seq);
  MT_CHECK(!p.causal || (p.q_begin == p.k_begin && p.q_end == p.k_end),
           "{}: a causal part takes the same rows of queries and keys, got q [{}, {}) and k [{}, {})", op, p.q_begin,
           p.q_end, p.k_begin, p.k_end);
  MT_CHECK(p.q_segments.defined() == p.k_segments.defined(), "{}: segments given for the queries or the keys only",
           op);
  for (const Tensor* t : {&p.q_segments, &p.k_segments}) {
    if (!t->defined()) continue;
    const char* name = t == &p.q_segments ? "q_segments" : "k_segments";
    check_shape(*t, {a.batch * a.seq}, name);
    check_dtype(*t, DType::I32, name);
  }
}

}  // namespace moetrain::ops
