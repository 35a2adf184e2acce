// Launchers of the fused attention kernels (see attention.cpp for the checks and
// attention.cu for the kernels). Pointers are device pointers, token-major as ops.h says:
// q/dq [B*S, Hq*D], k/dk [B*S, Hkv*D], v/dv [B*S, Hkv*Dv], out/dout [B*S, Hq*Dv], lse/delta
// f32 [B, Hq, S], seg i32 [B*S] or null. (head_dim, v_head_dim) must be (32, 32), (64, 64),
// (128, 128) or (192, 128) (DeepSeek-V3's MLA); q, k, v, out, dout, dq, dk, dv 16-byte
// aligned (the host wrapper checks both).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

struct AttentionDims {
  int batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int v_head_dim = 0;  // Dv, the value heads' size (out's too); set, never 0
  float scale = 0;     // softmax scale, > 0
  // The part of each sequence taking part (ops.h's attention_part_*): query rows [q_begin,
  // q_begin + q_len) and key rows [k_begin, k_begin + k_len) of every sequence (lengths 0: the
  // whole sequence); the outputs' rows outside it are not written. causal: key j seen by query
  // i only when j <= i (a causal part has q_begin == k_begin and q_len == k_len). k_seg: the
  // keys' segment ids when they are not seg's rows (another rank's keys); null: seg.
  int q_begin = 0, q_len = 0, k_begin = 0, k_len = 0;
  bool causal = true;
  const int32_t* k_seg = nullptr;
  int queries() const { return q_len > 0 ? q_len : seq; }
  int keys() const { return k_len > 0 ? k_len : seq; }
  // The causal attention of whole sequences (what the Hopper kernels take).
  bool whole() const { return causal && q_begin == 0 && k_begin == 0 && queries() == seq && keys() == seq && !k_seg; }
};

// out = softmax(scale * q k^T, causal, segments) v; lse = log-sum-exp of each score row.
void launch_attention_forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                              const int32_t* seg, __nv_bfloat16* out, float* lse, const AttentionDims& d,
                              cudaStream_t s);

// How many blocks share the query heads of one (batch, kv head, key tile) in the dK/dV
// pass: a power of two dividing Hq/Hkv, raised until the pass has about 3 blocks per
// multiprocessor (B=1, S=2048, Hkv=4 has only 128 key-tile blocks otherwise); for the
// Hopper passes (one block per multiprocessor), until there is one block per multiprocessor. With
// splits > 1 the backward needs a workspace of splits * B*S * Hkv*(D + Dv) floats (the dK
// partials, then the dV partials).
int attention_dkdv_splits(const AttentionDims& d, int num_sms);

// Kernels in order on s: delta = rowsum(dout * out) and lse * log2(e) (f32 workspace of
// 2 * B*Hq*S: delta [B, Hq, S], then the scaled lse); dk/dv (one block per (batch, kv head,
// key tile, split)); with splits > 1 the sum of the f32 partials
// in dkdv_partial, in split order; dq (one block per (batch, query head, query tile)).
// No atomics: every output element is written once by one thread, in a fixed order.
// dq_acc (f32 [B*S, Hq*D], or null) asks for the one-pass backward where the Hopper kernels
// apply: the dK/dV blocks also add dQ into it with f32 atomics (not bitwise repeatable),
// and it is left there (dq is not written; the next op reads the f32 sums): returns true
// then. Elsewhere dq_acc is ignored, dq written, and it returns false.
bool launch_attention_backward(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const int32_t* seg, const __nv_bfloat16* out,
                               const float* lse, float* workspace, float* dkdv_partial, int split_count,
                               float* dq_acc, __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                               const AttentionDims& d, cudaStream_t s);

// The Hopper (sm_90a, TMA + wgmma) forward, dK/dV and dQ kernels (attention_hopper.cu):
// used by the launchers above when they apply (head_dim = v_head_dim = 128, seq a multiple of
// 128, the part's rows and beginnings multiples of 128, seg null or 16-byte aligned, an sm_90
// GPU, MOETRAIN_ATTENTION_MMA_SYNC unset or 0).
// Their dK/dV blocks cover attention_backward_hopper_key_tile() keys, which
// attention_dkdv_splits counts in. The launchers return false, launching nothing, when the
// driver refuses a tensor map. The forward also takes MLA's 192 / 128 heads
// (attention_hopper_forward_applies), and so does launch_attention_backward_hopper_mla.
bool attention_hopper_applies(const AttentionDims& d, const int32_t* seg);
bool attention_hopper_forward_applies(const AttentionDims& d, const int32_t* seg);
// MLA's backward (query/key heads of 192, values of 128) on Hopper, where
// attention_hopper_forward_applies and no dK/dV splits are asked: the dK/dV pass, then the dQ
// pass, from delta and lse2 as the other backward kernels take them.
// The Hopper launchers take the pointers at the part's first rows (seg: the queries'
// segment ids, kseg: the keys', both null or neither), as the kernels in attention.cu do.
bool launch_attention_backward_hopper_mla(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                          const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* seg,
                                          const int32_t* kseg, const float* delta, const float* lse2,
                                          __nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv,
                                          const AttentionDims& d, cudaStream_t s);
bool launch_attention_forward_hopper(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                                     const int32_t* seg, const int32_t* kseg, __nv_bfloat16* out, float* lse,
                                     const AttentionDims& d, cudaStream_t s);
int attention_backward_hopper_key_tile();
// With dq_acc, dQ (scaled) is left in it and dq is not written.
bool launch_attention_backward_hopper(const __nv_bfloat16* dout, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                      const __nv_bfloat16* v, const int32_t* seg, const int32_t* kseg,
                                      const float* delta, const float* lse2, float* dk_part, float* dv_part,
                                      int splits, float* dq_acc, __nv_bfloat16* dq, __nv_bfloat16* dk,
                                      __nv_bfloat16* dv, const AttentionDims& d, cudaStream_t s);

// Context parallelism's merge (ops.h's attention_merge): acc_out f32 [B*S, Hq*Dv], lse f32
// [B, Hq, S]; the part's out bf16 or f32.
void launch_attention_merge(float* acc_out, float* acc_lse, const __nv_bfloat16* part_out, const float* part_lse,
                            int batch, int q_heads, int seq, int v_head_dim, cudaStream_t s);
void launch_attention_merge(float* acc_out, float* acc_lse, const float* part_out, const float* part_lse, int batch,
                            int q_heads, int seq, int v_head_dim, cudaStream_t s);
// x[0..n) = value.
void launch_fill(float* x, int64_t n, float value, cudaStream_t s);

}  // namespace moetrain::ops::cuda
