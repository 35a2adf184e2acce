// Routes each op to the backend where its tensors live: the first tensor argument decides.
#include "ops/arg_checks.h"
#include "ops/cpu/cpu_ops.h"
#if MOETRAIN_WITH_CUDA
#include "ops/cuda/cuda_ops.h"
#endif

#include <atomic>

namespace moetrain::ops {
namespace {
std::atomic<bool> g_deterministic{true};

bool on_cuda(const Tensor& t, const char* op) {
  if (!t.defined() || t.device().is_cpu()) return false;
  MT_CHECK(MOETRAIN_WITH_CUDA, "{}: tensor on {} but this moetrain was built without CUDA", op, t.device().str());
  return true;
}
}  // namespace

void set_deterministic(bool on) { g_deterministic.store(on, std::memory_order_relaxed); }
bool deterministic() { return g_deterministic.load(std::memory_order_relaxed); }

#if MOETRAIN_WITH_CUDA
#define MT_ROUTE(first, name, ...) \
  (on_cuda(first, #name) ? cuda::name(__VA_ARGS__) : cpu::name(__VA_ARGS__))
#else
#define MT_ROUTE(first, name, ...) (on_cuda(first, #name), cpu::name(__VA_ARGS__))
#endif

namespace {

// A shard with its whole vocabulary's size filled in (size 0: weight is the whole vocabulary).
VocabShard embedding_shard(const VocabShard& shard, const Tensor& weight, const char* op) {
  MT_CHECK(weight.defined() && weight.ndim() == 2, "{}: weight must be [V, H], got {}", op, weight.str());
  if (shard.size == 0 && shard.begin == 0) return {0, weight.size(0)};
  MT_CHECK(shard.begin >= 0 && shard.begin + weight.size(0) <= shard.size,
           "{}: a shard of {} rows from id {} does not fit a vocabulary of {}", op, weight.size(0), shard.begin,
           shard.size);
  return shard;
}

}  // namespace

Tensor embedding_forward(const Tensor& ids, const Tensor& weight, const VocabShard& shard) {
  return MT_ROUTE(ids, embedding_forward, ids, weight, embedding_shard(shard, weight, "embedding_forward"));
}

// The embedding and norm gradients are small next to the matrices': overwrite is a zero
// fill and then the backends' accumulating kernels.
void embedding_backward_weight(const Tensor& ids, const Tensor& dy, Tensor& dweight, bool accumulate,
                               const VocabShard& shard) {
  const VocabShard whole = embedding_shard(shard, dweight, "embedding_backward_weight");
  if (!accumulate) dweight.zero_();
  MT_ROUTE(ids, embedding_backward_weight, ids, dy, dweight, whole);
}

Tensor shift_tokens(const Tensor& ids, const Tensor& segment_ids, int64_t batch, int64_t k, int32_t fill) {
  check_dtype(ids, DType::I32, "shift_tokens ids");
  MT_CHECK(ids.ndim() == 1 && batch > 0 && ids.numel() % batch == 0 && k >= 0,
           "shift_tokens: ids {} must be [batch * seq] with batch = {} and k = {} >= 0", ids.str(), batch, k);
  if (segment_ids.defined()) {
    check_dtype(segment_ids, DType::I32, "shift_tokens segment_ids");
    check_shape(segment_ids, ids.shape(), "shift_tokens segment_ids");
  }
  return MT_ROUTE(ids, shift_tokens, ids, segment_ids, batch, k, fill);
}

Fp8Tensor quantize_fp8(const Tensor& x, Fp8Blocks blocks) {
  check_fp8_input("quantize_fp8", x);
  return MT_ROUTE(x, quantize_fp8, x, blocks);
}

Fp8Tensor quantize_fp8_transposed(const Tensor& x, Fp8Blocks blocks) {
  check_fp8_input("quantize_fp8_transposed", x);
  return MT_ROUTE(x, quantize_fp8_transposed, x, blocks);
}

Fp8BothWays quantize_fp8_both_ways(const Tensor& x) {
  check_fp8_input("quantize_fp8_both_ways", x);
  return MT_ROUTE(x, quantize_fp8_both_ways, x);
}

Fp8WeightBlocks quantize_fp8_weight(const Tensor& w) {
  const char* op = "quantize_fp8_weight";
  MT_CHECK(w.defined() && (w.ndim() == 2 || w.ndim() == 3), "{}: w must be [n, k] or experts' [E, n, k], got {}", op,
           w.defined() ? w.str() : std::string("undefined"));
  if (w.ndim() == 3) {
    MT_CHECK(w.size(1) % kFp8Block == 0 && w.size(2) % kFp8Block == 0,
             "{}: each expert's weight is [{}, {}]; both must be multiples of 128 (whole blocks either way)", op,
             w.size(1), w.size(2));
  }
  check_fp8_input(op, w.ndim() == 3 ? w.view({w.size(0) * w.size(1), w.size(2)}) : w);
  return MT_ROUTE(w, quantize_fp8_weight, w);
}

Fp8Tensor quantize_fp8_experts(const Tensor& w) {
  MT_CHECK(w.defined() && w.ndim() == 3, "quantize_fp8_experts: w must be [E, n, k], got {}",
           w.defined() ? w.str() : std::string("undefined"));
  const int64_t E = w.size(0), n = w.size(1), k = w.size(2);
  MT_CHECK(n % kFp8Block == 0, "quantize_fp8_experts: w {} has n = {} rows an expert, not a multiple of 128", w.str(),
           n);
  return quantize_fp8(w.view({E * n, k}), Fp8Blocks::kBlocks);
}

int64_t fp8_expert_tiles(int64_t rows, int64_t experts) { return fp8_blocks_of(rows) + experts; }

Fp8Tensor quantize_fp8_expert_columns(const Tensor& x, const Tensor& counts) {
  const char* op = "quantize_fp8_expert_columns";
  check_fp8_input(op, x);
  MT_CHECK(counts.defined() && counts.ndim() == 1 && counts.dtype() == DType::I64 && counts.device() == x.device(),
           "{}: counts must be i64 [E] on x's device ({}), got {}", op, x.device().str(),
           counts.defined() ? counts.str() : std::string("undefined"));
  return MT_ROUTE(x, quantize_fp8_expert_columns, x, counts);
}

void grouped_wgrad_fp8(const std::vector<Fp8WgradOperands>& sources, Tensor& dw, bool accumulate) {
  const char* op = "grouped_wgrad_fp8";
  MT_CHECK(!sources.empty(), "{}: no sources", op);
  const int64_t Ca = sources[0].a_t.q.defined() ? sources[0].a_t.q.size(0) : 0;
  const int64_t Cb = sources[0].b_t.q.defined() ? sources[0].b_t.q.size(0) : 0;
  const int64_t E = sources[0].counts.defined() ? sources[0].counts.size(0) : 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const Fp8WgradOperands& src = sources[i];
    check_fp8_rows(op, src.a_t, "a_t");
    check_fp8_rows(op, src.b_t, "b_t");
    const int64_t P = src.a_t.q.size(1);
    MT_CHECK(src.counts.defined() && src.counts.ndim() == 1 && src.counts.dtype() == DType::I64 &&
                 src.counts.size(0) == E && src.counts.device() == dw.device(),
             "{}: source {}'s counts must be i64 [E = {}] on dw's device ({}), got {}", op, i, E, dw.device().str(),
             src.counts.defined() ? src.counts.str() : std::string("undefined"));
    MT_CHECK(src.a_t.q.size(0) == Ca && src.b_t.q.size(0) == Cb && src.b_t.q.size(1) == P && P % kFp8Block == 0 &&
                 P / kFp8Block >= E,
             "{}: source {}: a_t {} and b_t {} must be [{}, P] and [{}, P] with P a multiple of 128 of at least "
             "128 E = {} columns (quantize_fp8_expert_columns)", op, i, src.a_t.q.str(), src.b_t.q.str(), Ca, Cb,
             128 * E);
    MT_CHECK(src.a_t.q.device() == dw.device() && src.b_t.q.device() == dw.device(),
             "{}: source {}'s operands and dw must be on one device, got {}, {} and {}", op, i,
             src.a_t.q.device().str(), src.b_t.q.device().str(), dw.device().str());
  }
  check_shape(dw, {E, Ca, Cb}, "grouped_wgrad_fp8 dw [E, Ca, Cb]");
  check_dtype(dw, DType::F32, "grouped_wgrad_fp8 dw");
  MT_ROUTE(dw, grouped_wgrad_fp8, sources, dw, accumulate);
}

void grouped_swiglu_backward_weight_fp8(const std::vector<SwigluWgradRows>& rows, Tensor& dw_gate, Tensor& dw_up,
                                        Tensor& dw_down, bool accumulate, SumSquaresInto squares) {
  // Micro-batches whose operands are quantized at a time: one pass of the GPU kernel.
  constexpr size_t kChunk = kFp8WgradSourcesPerPass;
  for (size_t first = 0; first < rows.size(); first += kChunk) {
    std::vector<Fp8WgradOperands> down, gate, up;
    for (size_t i = first; i < std::min(rows.size(), first + kChunk); ++i) {
      const SwigluWgradRows& r = rows[i];
      MT_CHECK(r.act.defined(), "grouped_swiglu_backward_weight_fp8: act (the forward's) must be given");
      auto along_tokens = [&](const Tensor& t) { return quantize_fp8_expert_columns(t, r.counts); };
      const Fp8Tensor x = along_tokens(r.x);
      down.push_back({along_tokens(r.dy), along_tokens(r.act), r.counts});
      gate.push_back({along_tokens(r.dgate), x, r.counts});
      up.push_back({along_tokens(r.dup), x, r.counts});
    }
    const bool add = accumulate || first > 0;
    grouped_wgrad_fp8(down, dw_down, add);
    grouped_wgrad_fp8(gate, dw_gate, add);
    grouped_wgrad_fp8(up, dw_up, add);
  }
  if (!accumulate && squares.out != nullptr) sum_squares_all_into({dw_gate, dw_up, dw_down}, *squares.out, squares.index);
}

Tensor dequantize_fp8(const Fp8Tensor& t, DType dtype) {
  check_fp8_tensor("dequantize_fp8", t, "t");
  MT_CHECK(is_floating(dtype), "dequantize_fp8: dtype must be bf16, f32 or f64, got {}", dtype_name(dtype));
  return MT_ROUTE(t.q, dequantize_fp8, t, dtype);
}

Tensor pack_fp8_rows(const Fp8Tensor& x) {
  check_fp8_rows("pack_fp8_rows", x, "x");
  return MT_ROUTE(x.q, pack_fp8_rows, x);
}

UnpackedFp8Rows unpack_fp8_rows(const Tensor& packed, int64_t cols, DType dtype) {
  MT_CHECK(packed.defined() && packed.ndim() == 2 && packed.dtype() == DType::F8E4M3 && cols >= 0 &&
               packed.size(1) == packed_fp8_row_bytes(cols),
           "unpack_fp8_rows: packed must be f8e4m3 [R, {}] (the codes and scales of {} columns), got {}",
           packed_fp8_row_bytes(std::max<int64_t>(cols, 0)), cols, packed.defined() ? packed.str() : "undefined");
  MT_CHECK(is_floating(dtype), "unpack_fp8_rows: dtype must be bf16, f32 or f64, got {}", dtype_name(dtype));
  return MT_ROUTE(packed, unpack_fp8_rows, packed, cols, dtype);
}

Tensor linear_fp8(const Fp8Tensor& a, const Fp8Tensor& b, DType out) {
  check_linear_fp8_args("linear_fp8", a, b, out);
  Tensor y = Tensor::empty({a.q.size(0), b.q.size(0)}, out, a.q.device());
  MT_ROUTE(a.q, linear_fp8_into, a, b, y, false);
  return y;
}

void linear_fp8_into(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& y, bool accumulate) {
  const auto [M, N, K] = check_linear_fp8_args("linear_fp8_into", a, b, y.defined() ? y.dtype() : DType::F32);
  (void)K;
  check_shape(y, {M, N}, "linear_fp8_into y");
  MT_CHECK(y.device() == a.q.device(), "linear_fp8_into: y {} is not on a's device", y.str());
  MT_ROUTE(a.q, linear_fp8_into, a, b, y, accumulate);
}

Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& residual) {
  return MT_ROUTE(x, linear_forward, x, w, residual);
}

Tensor linear_forward_f32_out(const Tensor& x, const Tensor& w) {
#if MOETRAIN_WITH_CUDA
  if (on_cuda(x, "linear_forward_f32_out")) return cuda::linear_forward_f32_out(x, w);
#else
  on_cuda(x, "linear_forward_f32_out");
#endif
  return cpu::linear_forward(x, w, Tensor());  // the CPU's models are f32 or f64 already
}

Tensor linear_backward_input(const Tensor& dy, const Tensor& w) {
  return MT_ROUTE(dy, linear_backward_input, dy, w);
}

void linear_backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  MT_ROUTE(dy, linear_backward_input_add, dy, w, dx);
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  MT_ROUTE(dy, linear_backward_weight, dy, x, dw, accumulate);
}

RmsNormOut rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  return MT_ROUTE(x, rmsnorm_forward, x, w, eps);
}

RmsNormOut rmsnorm_forward_fp8(const Tensor& x, const Tensor& w, double eps) {
  MT_CHECK(w.defined() && w.numel() % kFp8Block == 0,
           "rmsnorm_forward_fp8: the row width (w's length) must be a multiple of {} (whole 1 x 128 tiles), got {}",
           kFp8Block, w.defined() ? w.str() : "undefined");
  MT_CHECK(x.defined() && x.ndim() == 2 && x.size(1) == w.numel(),
           "rmsnorm_forward_fp8: x must be rows [R, {}] (its codes are [R, {}]), got {}", w.numel(), w.numel(),
           x.defined() ? x.str() : "undefined");
  return MT_ROUTE(x, rmsnorm_forward_fp8, x, w, eps);
}

Tensor rmsnorm_backward_input(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                              const Tensor& residual) {
  if (residual.defined()) {
    MT_CHECK(x.defined() && residual.shape() == x.shape() && residual.dtype() == x.dtype() &&
                 residual.device() == x.device(),
             "rmsnorm_backward_input: residual must be like x ({}), got {}", x.defined() ? x.str() : "undefined",
             residual.str());
  }
  return MT_ROUTE(dy, rmsnorm_backward_input, dy, x, w, rstd, residual);
}

void rmsnorm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& rstd, Tensor& dw, bool accumulate) {
  if (!accumulate) dw.zero_();
  MT_ROUTE(dy, rmsnorm_backward_weight, dy, x, rstd, dw);
}

Tensor rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& r) {
  return MT_ROUTE(x, rope_forward, x, positions, r);
}

Tensor rope_backward(const Tensor& dy, const Tensor& positions, const RopeSpec& r) {
  return MT_ROUTE(dy, rope_backward, dy, positions, r);
}

MlaKv mla_kv_forward(const Tensor& kv, const Tensor& k_rot, int64_t heads, int64_t nope, int64_t v_dim) {
  return MT_ROUTE(kv, mla_kv_forward, kv, k_rot, heads, nope, v_dim);
}

MlaKvGrads mla_kv_backward(const Tensor& dk, const Tensor& dv, int64_t heads, int64_t nope, int64_t v_dim) {
  return MT_ROUTE(dk, mla_kv_backward, dk, dv, heads, nope, v_dim);
}

RmsNormOut rmsnorm_rope_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& positions,
                                int64_t head_dim, double theta) {
  return MT_ROUTE(x, rmsnorm_rope_forward, x, w, eps, positions, head_dim, theta);
}

RmsNormRopeGrads rmsnorm_rope_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                                       const Tensor& positions, int64_t head_dim, double theta) {
  return MT_ROUTE(dy, rmsnorm_rope_backward, dy, x, w, rstd, positions, head_dim, theta);
}

AttentionOut attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const AttentionShape& shape) {
  return MT_ROUTE(q, attention_forward, q, k, v, segment_ids, shape);
}

AttentionGrads attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& segment_ids, const Tensor& out, const Tensor& lse, const AttentionShape& shape) {
  return MT_ROUTE(dout, attention_backward, dout, q, k, v, segment_ids, out, lse, shape);
}

AttentionOut attention_part_forward(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionPart& part,
                                    const AttentionShape& shape) {
  return MT_ROUTE(q, attention_part_forward, q, k, v, part, shape);
}

void attention_merge(AttentionOut& acc, const AttentionOut& part) { MT_ROUTE(acc.out, attention_merge, acc, part); }

AttentionGrads attention_part_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionPart& part, const Tensor& out, const Tensor& lse,
                                       const AttentionShape& shape) {
  return MT_ROUTE(dout, attention_part_backward, dout, q, k, v, part, out, lse, shape);
}

RouterOut router_forward(const Tensor& logits, int64_t k, bool norm_topk_prob, const Tensor& selection_bias) {
  return MT_ROUTE(logits, router_forward, logits, k, norm_topk_prob, selection_bias);
}

Tensor router_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd, bool norm_topk_prob) {
  return MT_ROUTE(dtopk_weight, router_backward, dtopk_weight, dprobs, fwd, norm_topk_prob);
}

RouterOut router_sigmoid_forward(const Tensor& logits, const Tensor& bias, int64_t k, int64_t n_group,
                                 int64_t topk_group, bool norm_topk_prob, double scaling) {
  return MT_ROUTE(logits, router_sigmoid_forward, logits, bias, k, n_group, topk_group, norm_topk_prob, scaling);
}

Tensor router_sigmoid_backward(const Tensor& dtopk_weight, const Tensor& dprobs, const RouterOut& fwd,
                               bool norm_topk_prob, double scaling) {
  return MT_ROUTE(dtopk_weight, router_sigmoid_backward, dtopk_weight, dprobs, fwd, norm_topk_prob, scaling);
}

Permutation permutation_by_expert(const Tensor& topk_idx, int64_t num_experts) {
  return MT_ROUTE(topk_idx, permutation_by_expert, topk_idx, num_experts);
}

Tensor expert_ids_in_range(const Tensor& topk_idx, int64_t first, int64_t count) {
  MT_CHECK(first >= 0 && count >= 1 && first + count <= INT32_MAX,
           "expert_ids_in_range: the range [{}, {} + {}) must be non-empty and of i32 expert ids", first, first, count);
  return MT_ROUTE(topk_idx, expert_ids_in_range, topk_idx, first, count);
}

namespace {

// Checks, for both backends, that `p` is a complete permutation (of which the first
// permuted_rows() rows are kept) and that `t` is [T, H] (kTokens), [T*K, H] (kPairs) or
// [R, H] with R the kept rows (kPermuted).
enum class RowsOf { kTokens, kPermuted, kPairs };
void check_permuted(const Permutation& p, const Tensor& t, RowsOf of, const char* op, const char* name) {
  const int64_t NK = p.num_tokens * p.top_k;
  MT_CHECK(p.source_token.defined() && p.slot_row.defined() && p.source_token.numel() == NK &&
               p.slot_row.numel() == NK && p.permuted_rows() <= NK,
           "{}: permutation is incomplete: source_token {} and slot_row {} must hold T*K = {} rows, of which {} "
           "kept",
           op, p.source_token.str(), p.slot_row.str(), NK, p.permuted_rows());
  const int64_t rows = of == RowsOf::kTokens ? p.num_tokens : of == RowsOf::kPairs ? NK : p.permuted_rows();
  MT_CHECK(t.defined() && t.ndim() == 2 && t.size(0) == rows, "{}: {} must be [{}, H], got {}", op, name, rows,
           t.str());
}

}  // namespace

Tensor permute_forward(const Tensor& x, const Permutation& p) {
  check_permuted(p, x, RowsOf::kTokens, "permute_forward", "x");
  return MT_ROUTE(x, permute_forward, x, p);
}

namespace {

// Tokens quantized per 1 x 128 tile (rows mode) and a permutation of them, on one device.
void check_permuted_fp8_tokens(const char* op, const Fp8Tensor& x, const Permutation& p) {
  check_fp8_rows(op, x, "x");
  check_permuted(p, x.q, RowsOf::kTokens, op, "x.q");
  MT_CHECK(p.source_token.device() == x.q.device(), "{}: x and the permutation must be on one device", op);
}

}  // namespace

Fp8Tensor permute_forward_fp8(const Fp8Tensor& x, const Permutation& p) {
  check_permuted_fp8_tokens("permute_forward_fp8", x, p);
  return MT_ROUTE(x.q, permute_forward_fp8, x, p);
}

UnpackedFp8Rows permute_forward_fp8_values(const Fp8Tensor& x, const Permutation& p, DType dtype) {
  check_permuted_fp8_tokens("permute_forward_fp8_values", x, p);
  MT_CHECK(is_floating(dtype), "permute_forward_fp8_values: dtype must be bf16, f32 or f64, got {}", dtype_name(dtype));
  return MT_ROUTE(x.q, permute_forward_fp8_values, x, p, dtype);
}

Tensor permute_backward(const Tensor& dxp, const Permutation& p) {
  check_permuted(p, dxp, RowsOf::kPermuted, "permute_backward", "dxp");
  return MT_ROUTE(dxp, permute_backward, dxp, p);
}

Tensor take_rows(const Tensor& x, const Tensor& index) {
  MT_CHECK(x.defined() && x.ndim() >= 1, "take_rows: x must have rows, got {}", x.defined() ? x.str() : "undefined");
  MT_CHECK(index.defined() && index.ndim() == 1 && index.dtype() == DType::I32,
           "take_rows: index must be i32 [N], got {}", index.defined() ? index.str() : "undefined");
  MT_CHECK(index.device() == x.device(), "take_rows: index is on {}, x on {}", index.device().str(), x.device().str());
  return MT_ROUTE(x, take_rows, x, index);
}

Tensor unpermute_forward(const Tensor& yp, const Permutation& p) {
  check_permuted(p, yp, RowsOf::kPermuted, "unpermute_forward", "yp");
  return MT_ROUTE(yp, unpermute_forward, yp, p);
}

Tensor unpermute_backward(const Tensor& dy, const Permutation& p) {
  check_permuted(p, dy, RowsOf::kPairs, "unpermute_backward", "dy");
  return MT_ROUTE(dy, unpermute_backward, dy, p);
}

// `order` must be a permutation of [0, T*K) on the expert outputs' device: a permutation
// checked on the host when it lives there; on the GPU it is the routing's slot_row, and the
// kernels only skip rows outside the range. Without an order expert_out holds T*K rows; with
// one, at most T*K (a partial permutation's rows; the slots beyond are absent).
void check_combine_order(const Tensor& order, const Tensor& weight, const Tensor& expert_out, const char* op) {
  const int64_t n = weight.defined() && weight.ndim() == 2 ? weight.size(0) * weight.size(1) : -1;
  MT_CHECK(expert_out.defined() && expert_out.ndim() == 2 &&
               (order.defined() ? expert_out.size(0) <= n : expert_out.size(0) == n),
           "{}: expert_out must be [{}T*K = {}, H] for weight {}, got {}", op, order.defined() ? "at most " : "", n,
           weight.str(), expert_out.str());
  if (!order.defined()) return;
  MT_CHECK(order.dtype() == DType::I32 && order.ndim() == 1 && order.numel() == n,
           "{}: order must be i32 [T*K = {}] (a permutation of the expert-output rows), got {}", op, n, order.str());
  MT_CHECK(order.device() == expert_out.device(), "{}: order {} must be on {} with expert_out", op, order.str(),
           expert_out.device().str());
  if (order.device().is_cpu()) {
    std::vector<bool> seen(static_cast<size_t>(n), false);
    const int32_t* o = order.data<int32_t>();
    for (int64_t i = 0; i < n; ++i) {
      MT_CHECK(o[i] >= 0 && o[i] < n && !seen[static_cast<size_t>(o[i])],
               "{}: order[{}] = {} is outside [0, {}) or repeats: order must be a permutation", op, i, o[i], n);
      seen[static_cast<size_t>(o[i])] = true;
    }
  }
}

Tensor combine_forward(const Tensor& expert_out, const Tensor& weight, const Tensor& residual, const Tensor& order) {
  check_combine_order(order, weight, expert_out, "combine_forward");
  return MT_ROUTE(expert_out, combine_forward, expert_out, weight, residual, order);
}

CombineGrads combine_backward(const Tensor& dy, const Tensor& expert_out, const Tensor& weight, const Tensor& order,
                              bool quantize_rows) {
  check_combine_order(order, weight, expert_out, "combine_backward");
#if MOETRAIN_WITH_CUDA
  CombineGrads g = on_cuda(dy, "combine_backward") ? cuda::combine_backward(dy, expert_out, weight, order, quantize_rows)
                                                   : cpu::combine_backward(dy, expert_out, weight, order);
#else
  CombineGrads g = MT_ROUTE(dy, combine_backward, dy, expert_out, weight, order);
#endif
  if (quantize_rows && !g.dexpert_out_q.q.defined()) g.dexpert_out_q = quantize_fp8(g.dexpert_out, Fp8Blocks::kRows);
  return g;
}

SwigluOut grouped_swiglu_forward(const Tensor& x, const Tensor& counts, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down) {
  return MT_ROUTE(x, grouped_swiglu_forward, x, counts, w_gate, w_up, w_down);
}

SwigluOut grouped_swiglu_forward_fp8(const Fp8Tensor& x, const Tensor& counts, const Fp8Tensor& w_gate,
                                     const Fp8Tensor& w_up, const Fp8Tensor& w_down, int64_t experts) {
  const char* op = "grouped_swiglu_forward_fp8";
  check_fp8_rows(op, x, "x");
  check_fp8_tensor(op, w_gate, "w_gate");
  check_fp8_tensor(op, w_up, "w_up");
  check_fp8_tensor(op, w_down, "w_down");
  MT_CHECK(w_gate.blocks == Fp8Blocks::kBlocks && w_up.blocks == Fp8Blocks::kBlocks &&
               w_down.blocks == Fp8Blocks::kBlocks,
           "{}: the weights must be quantized in blocks (128 x 128) mode (quantize_fp8_experts)", op);
  MT_CHECK(experts >= 1 && w_gate.q.size(0) % experts == 0, "{}: w_gate {} is not {} experts' [I, H] blocks", op,
           w_gate.q.str(), experts);
  const int64_t N = x.q.size(0), H = x.q.size(1), I = w_gate.q.size(0) / experts;
  MT_CHECK(H % kFp8Block == 0 && I % kFp8Block == 0,
           "{}: the hidden size H = {} and the experts' width I = {} must be multiples of 128 (each expert's "
           "weights in whole 128 x 128 blocks)",
           op, H, I);
  check_shape(w_gate.q, {experts * I, H}, "grouped_swiglu_forward_fp8 w_gate [E I, H]");
  check_shape(w_up.q, {experts * I, H}, "grouped_swiglu_forward_fp8 w_up [E I, H]");
  check_shape(w_down.q, {experts * H, I}, "grouped_swiglu_forward_fp8 w_down [E H, I]");
  check_shape(counts, {experts}, "grouped_swiglu_forward_fp8 counts [E]");
  check_dtype(counts, DType::I64, "grouped_swiglu_forward_fp8 counts");
  (void)N;
  return MT_ROUTE(x.q, grouped_swiglu_forward_fp8, x, counts, w_gate, w_up, w_down, experts);
}

Fp8Tensor transpose_fp8_experts(const Fp8Tensor& w, int64_t experts) {
  const char* op = "transpose_fp8_experts";
  check_fp8_tensor(op, w, "w");
  MT_CHECK(w.blocks == Fp8Blocks::kBlocks, "{}: w must be quantized in blocks (128 x 128) mode", op);
  MT_CHECK(experts >= 1 && w.q.size(0) % experts == 0, "{}: w {} is not {} experts' [n, k] blocks", op, w.q.str(),
           experts);
  const int64_t n = w.q.size(0) / experts, k = w.q.size(1);
  MT_CHECK(n % kFp8Block == 0 && k % kFp8Block == 0,
           "{}: each expert's weight is [{}, {}]; both must be multiples of 128 (whole blocks either way)", op, n, k);
  return MT_ROUTE(w.q, transpose_fp8_experts, w, experts);
}

SwigluInputGrads grouped_swiglu_backward_input_fp8(const Fp8Tensor& dy, const Tensor& counts, const Tensor& gate,
                                                   const Tensor& up, const Fp8Tensor& w_gate_t,
                                                   const Fp8Tensor& w_up_t, const Fp8Tensor& w_down_t,
                                                   int64_t experts) {
  const char* op = "grouped_swiglu_backward_input_fp8";
  check_fp8_rows(op, dy, "dy");
  check_fp8_tensor(op, w_gate_t, "w_gate_t");
  check_fp8_tensor(op, w_up_t, "w_up_t");
  check_fp8_tensor(op, w_down_t, "w_down_t");
  MT_CHECK(w_gate_t.blocks == Fp8Blocks::kBlocks && w_up_t.blocks == Fp8Blocks::kBlocks &&
               w_down_t.blocks == Fp8Blocks::kBlocks,
           "{}: the weights must be each expert's W^T in blocks (128 x 128) mode (transpose_fp8_experts)", op);
  const int64_t N = dy.q.size(0), H = dy.q.size(1);
  MT_CHECK(experts >= 1 && w_down_t.q.size(0) % experts == 0, "{}: w_down_t {} is not {} experts' [I, H] blocks", op,
           w_down_t.q.str(), experts);
  const int64_t I = w_down_t.q.size(0) / experts;
  MT_CHECK(H % kFp8Block == 0 && I % kFp8Block == 0,
           "{}: the hidden size H = {} and the experts' width I = {} must be multiples of 128", op, H, I);
  check_shape(w_down_t.q, {experts * I, H}, "grouped_swiglu_backward_input_fp8 w_down_t [E I, H]");
  check_shape(w_gate_t.q, {experts * H, I}, "grouped_swiglu_backward_input_fp8 w_gate_t [E H, I]");
  check_shape(w_up_t.q, {experts * H, I}, "grouped_swiglu_backward_input_fp8 w_up_t [E H, I]");
  check_shape(gate, {N, I}, "grouped_swiglu_backward_input_fp8 gate");
  check_shape(up, {N, I}, "grouped_swiglu_backward_input_fp8 up");
  MT_CHECK(gate.dtype() == up.dtype(), "{}: gate is {}, up {}: one dtype", op, gate.str(), up.str());
  check_shape(counts, {experts}, "grouped_swiglu_backward_input_fp8 counts [E]");
  check_dtype(counts, DType::I64, "grouped_swiglu_backward_input_fp8 counts");
  return MT_ROUTE(dy.q, grouped_swiglu_backward_input_fp8, dy, counts, gate, up, w_gate_t, w_up_t, w_down_t, experts);
}

SwigluInputGrads grouped_swiglu_backward_input(const Tensor& dy, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down) {
  return MT_ROUTE(dy, grouped_swiglu_backward_input, dy, counts, gate, up, w_gate, w_up, w_down);
}

void grouped_swiglu_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& counts, const Tensor& gate, const Tensor& up, const Tensor& dgate, const Tensor& dup, Tensor& dw_gate, Tensor& dw_up, Tensor& dw_down, bool accumulate, SumSquaresInto squares, const Tensor& act) {
  if (squares.out) {
    const Tensor& o = *squares.out;
    MT_CHECK(!accumulate, "grouped_swiglu_backward_weight: the sum of squares is only known to a call that writes "
             "the gradients (accumulate false)");
    MT_CHECK(o.defined() && o.dtype() == DType::F64 && o.ndim() == 1 && squares.index >= 0 &&
                 squares.index < o.numel() && o.device() == dw_gate.device(),
             "grouped_swiglu_backward_weight: squares must be a 1-D f64 tensor on {} with an element {}, got {}",
             dw_gate.device().str(), squares.index, o.defined() ? o.str() : std::string("undefined"));
  }
  if (act.defined()) {
    MT_CHECK(dgate.defined() && act.shape() == dgate.shape() && act.dtype() == dgate.dtype() &&
                 act.device() == dgate.device(),
             "grouped_swiglu_backward_weight: act must be like dgate ({}), got {}",
             dgate.defined() ? dgate.str() : "undefined", act.str());
  }
  MT_ROUTE(dy, grouped_swiglu_backward_weight, dy, x, counts, gate, up, dgate, dup, dw_gate, dw_up, dw_down,
           accumulate, squares, act);
}

void grouped_swiglu_backward_weight_group(const std::vector<SwigluWgradRows>& rows, Tensor& dw_gate, Tensor& dw_up,
                                          Tensor& dw_down, bool accumulate, SumSquaresInto squares) {
  MT_CHECK(!rows.empty(), "grouped_swiglu_backward_weight_group: no micro-batch given");
  MT_CHECK(!squares.out || !accumulate,
           "grouped_swiglu_backward_weight_group: the sum of squares is only known to a call that writes the gradients "
           "(accumulate false)");
#if MOETRAIN_WITH_CUDA
  if (on_cuda(rows[0].x, "grouped_swiglu_backward_weight_group") &&
      cuda::grouped_swiglu_backward_weight_group(rows, dw_gate, dw_up, dw_down, accumulate, squares)) {
    return;
  }
#endif
  for (size_t k = 0; k < rows.size(); ++k) {
    const SwigluWgradRows& r = rows[k];
    grouped_swiglu_backward_weight(r.dy, r.x, r.counts, r.gate, r.up, r.dgate, r.dup, dw_gate, dw_up, dw_down,
                                   accumulate || k > 0, rows.size() == 1 ? squares : SumSquaresInto{}, r.act);
  }
  if (squares.out && rows.size() > 1) sum_squares_all_into({dw_gate, dw_up, dw_down}, *squares.out, squares.index);
}

CrossEntropyOut cross_entropy_forward(const Tensor& logits, const Tensor& targets) {
  return MT_ROUTE(logits, cross_entropy_forward, logits, targets);
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, double scale) {
  return MT_ROUTE(logits, cross_entropy_backward, logits, targets, lse, scale);
}

VocabShardStats vocab_shard_stats(const Tensor& logits, const Tensor& targets, const VocabShard& shard) {
  return MT_ROUTE(logits, vocab_shard_stats, logits, targets, shard);
}

CrossEntropyOut vocab_parallel_loss(const Tensor& shard_lse, const Tensor& shard_target_logit, const Tensor& targets) {
  return MT_ROUTE(shard_lse, vocab_parallel_loss, shard_lse, shard_target_logit, targets);
}

Tensor vocab_shard_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const VocabShard& shard,
                            double scale) {
  return MT_ROUTE(logits, vocab_shard_backward, logits, targets, lse, shard, scale);
}

// The GPU's one pass where its kernel takes the rows; elsewhere (the CPU has no pass to save)
// the forward, the backward, the gradient over the logits: the same values.
CrossEntropyOut cross_entropy_forward_backward_(Tensor& logits, const Tensor& targets, double scale) {
#if MOETRAIN_WITH_CUDA
  CrossEntropyOut o;
  if (on_cuda(logits, "cross_entropy_forward_backward_") && cuda::cross_entropy_one_pass(logits, targets, scale, o)) {
    return o;
  }
#endif
  CrossEntropyOut f = cross_entropy_forward(logits, targets);
  logits.copy_from(cross_entropy_backward(logits, targets, f.lse, scale));
  return f;
}

void load_balance_accumulate(const Tensor& probs, const Tensor& topk_idx, Tensor& selections, Tensor& prob_sum) {
  MT_ROUTE(probs, load_balance_accumulate, probs, topk_idx, selections, prob_sum);
}

Tensor load_balance_backward(const Tensor& selections, int64_t rows, int64_t total_rows, double coef) {
  return MT_ROUTE(selections, load_balance_backward, selections, rows, total_rows, coef);
}

Tensor router_entropy_sum(const Tensor& probs) { return MT_ROUTE(probs, router_entropy_sum, probs); }

Tensor seq_balance_loss_sum(const Tensor& probs, const Tensor& topk_idx, int64_t batch, const SeqBalanceWhole& whole) {
  return MT_ROUTE(probs, seq_balance_loss_sum, probs, topk_idx, batch, whole);
}

Tensor seq_balance_counts(const Tensor& topk_idx, int64_t batch, int64_t experts) {
  return MT_ROUTE(topk_idx, seq_balance_counts, topk_idx, batch, experts);
}

Tensor seq_balance_backward(const Tensor& probs, const Tensor& topk_idx, int64_t batch, double scale,
                            const SeqBalanceWhole& whole) {
  return MT_ROUTE(probs, seq_balance_backward, probs, topk_idx, batch, scale, whole);
}

ZLossOut router_z_loss_forward(const Tensor& logits) {
  return MT_ROUTE(logits, router_z_loss_forward, logits);
}

Tensor router_z_loss_backward(const Tensor& probs, const Tensor& lse, double scale) {
  return MT_ROUTE(probs, router_z_loss_backward, probs, lse, scale);
}

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWStep& s) {
  MT_ROUTE(param, adamw_update, param, grad, m, v, s);
}

double sum_squares(const Tensor& x) {
  return MT_ROUTE(x, sum_squares, x);
}

namespace {
// A whole-list op runs where its first tensor lives; every tensor must live there too.
const Tensor& first_of(const std::vector<Tensor>& xs, const char* op) {
  static const Tensor kNone;
  for (const Tensor& x : xs) {
    MT_CHECK(x.defined(), "{}: undefined tensor in the list", op);
    MT_CHECK(x.device() == xs.front().device(), "{}: tensors on {} and {} in one list", op, xs.front().device().str(),
             x.device().str());
  }
  return xs.empty() ? kNone : xs.front();
}
}  // namespace

void adamw_update_all(AdamWTensors& t, const AdamWStep& s) {
  const size_t n = t.params.size();
  if (t.lows.empty()) t.lows.resize(n);  // no split masters
  MT_CHECK(t.grads.size() == n && t.m.size() == n && t.v.size() == n && t.values.size() == n && t.decay.size() == n &&
               t.lows.size() == n,
           "adamw_update_all: list lengths differ (params {}, grads {}, m {}, v {}, values {}, lows {}, decay {})", n,
           t.grads.size(), t.m.size(), t.v.size(), t.values.size(), t.lows.size(), t.decay.size());
  const Tensor& first = first_of(t.params, "adamw_update_all");
  for (size_t i = 0; i < n; ++i) {
    if (t.values[i].defined()) {
      check_shape(t.values[i], t.params[i].shape(), "adamw_update_all value (the weight refreshed from its master)");
    }
    if (t.lows[i].defined()) {
      MT_CHECK(!t.values[i].defined() && t.params[i].dtype() == DType::BF16 && t.lows[i].dtype() == DType::I16 &&
                   t.lows[i].device() == t.params[i].device(),
               "adamw_update_all: a split master is a bf16 param and an i16 low half on its device with no value, "
               "got param {}, low {}{}", t.params[i].str(), t.lows[i].str(),
               t.values[i].defined() ? " and a value" : "");
      check_shape(t.lows[i], t.params[i].shape(), "adamw_update_all low (the low half of a split master)");
    }
  }
  MT_ROUTE(first, adamw_update_all, t, s);
}

double sum_squares_all(const std::vector<Tensor>& xs) {
  return MT_ROUTE(first_of(xs, "sum_squares_all"), sum_squares_all, xs);
}

void sum_squares_all_into(const std::vector<Tensor>& xs, Tensor& out, int64_t index) {
  MT_CHECK(out.defined() && out.dtype() == DType::F64 && index >= 0 && index < out.numel(),
           "sum_squares_all_into: out must be f64 with an element {}, got {}", index,
           out.defined() ? out.str() : std::string("undefined"));
  for (const Tensor& x : xs) {
    MT_CHECK(x.defined() && x.device() == out.device(), "sum_squares_all_into: {} is not on {} with out",
             x.defined() ? x.str() : std::string("undefined"), out.device().str());
  }
  MT_ROUTE(out, sum_squares_all_into, xs, out, index);
}

void zero_all(const std::vector<Tensor>& xs) {
  MT_ROUTE(first_of(xs, "zero_all"), zero_all, xs);
}

void scale_(Tensor& x, double alpha) {
  MT_ROUTE(x, scale_, x, alpha);
}

void add_(Tensor& y, const Tensor& x) {
  MT_ROUTE(y, add_, y, x);
}

bool all_finite(const Tensor& x) {
  return MT_ROUTE(x, all_finite, x);
}

void cast_into(Tensor& dst, const Tensor& src) {
  MT_ROUTE(dst, cast_into, dst, src);
}

namespace {
void check_master_halves(const Tensor& master, const Tensor& high, const Tensor& low, const char* op) {
  MT_CHECK(master.defined() && high.defined() && low.defined(), "{}: undefined tensor", op);
  MT_CHECK(master.dtype() == DType::F32 && high.dtype() == DType::BF16 && low.dtype() == DType::I16,
           "{}: expected an f32 master, a bf16 high half and an i16 low half, got {}, {}, {}", op, master.str(),
           high.str(), low.str());
  MT_CHECK(master.shape() == high.shape() && master.shape() == low.shape(), "{}: shapes differ: {}, {}, {}", op,
           master.str(), high.str(), low.str());
  MT_CHECK(master.device() == high.device() && master.device() == low.device(), "{}: devices differ: {}, {}, {}", op,
           master.str(), high.str(), low.str());
}
}  // namespace

void master_join_into(Tensor& master, const Tensor& high, const Tensor& low) {
  check_master_halves(master, high, low, "master_join_into");
  MT_ROUTE(master, master_join_into, master, high, low);
}

void master_split_into(const Tensor& master, Tensor& high, Tensor& low) {
  check_master_halves(master, high, low, "master_split_into");
  MT_ROUTE(master, master_split_into, master, high, low);
}

void signal_peers_and_wait(const std::vector<void*>& peer_words, int rank, uint32_t value, double timeout_s) {
  MT_CHECK(rank >= 0 && rank < static_cast<int>(peer_words.size()), "signal_peers_and_wait: rank {} of {} ranks",
           rank, peer_words.size());
#if MOETRAIN_WITH_CUDA
  cuda::signal_peers_and_wait(peer_words, rank, value, timeout_s);
#else
  MT_THROW("signal_peers_and_wait: this moetrain was built without CUDA");
#endif
}

void signal_word(void* word, uint32_t value) {
  MT_CHECK(word != nullptr, "signal_word: no word");
#if MOETRAIN_WITH_CUDA
  cuda::signal_word(word, value);
#else
  (void)value;
  MT_THROW("signal_word: this moetrain was built without CUDA");
#endif
}

void wait_word(const void* word, uint32_t value, double timeout_s) {
  MT_CHECK(word != nullptr, "wait_word: no word");
#if MOETRAIN_WITH_CUDA
  cuda::wait_word(word, value, timeout_s);
#else
  (void)value, (void)timeout_s;
  MT_THROW("wait_word: this moetrain was built without CUDA");
#endif
}

}  // namespace moetrain::ops
