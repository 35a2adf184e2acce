// CUDA FP8 ops (ops.h): quantization (kernels in fp8.cu) and the block-scaled GEMM through
// cuBLASLt (12.9+ on Hopper): FP8 operands in the "TN" form (both K-major), the activation
// side's scales VEC128_32F ([K/128][rows], the rows contiguous) and the weight side's
// VEC128_32F or BLK128x128_32F ([rows/128][round_up(K/128, 4)]): the layouts the quantizers
// write, so nothing is copied between them. cuBLASLt applies each 128-of-K partial sum's
// scales in f32 (no fast accumulation: DeepSeek's promotion).
#include <cstring>
#include <memory>
#include <unordered_map>

#include "ops/arg_checks.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/fp8_launch.h"
#include "ops/cuda/swiglu_launch.h"

namespace moetrain::ops::cuda {

static_assert(kFp8WgradMaxSources == ops::kFp8WgradSourcesPerPass, "one number of FP8 weight-gradient sources a pass");

namespace {

void check_input(const char* op, const Tensor& x) {
  check_cuda_tensors(op, {&x});
  MT_CHECK(x.dtype() == DType::BF16 || x.dtype() == DType::F32, "{}: x must be bf16 or f32 on CUDA, got {}", op,
           x.str());
}

struct Fp8PlanKey {
  int64_t m, n, k;
  int32_t out, a_blocks;
  bool operator==(const Fp8PlanKey& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};
struct Fp8PlanKeyHash {
  size_t operator()(const Fp8PlanKey& k) const {
    return std::hash<int64_t>()(k.m * 1000003 + k.n * 1009 + k.k) ^ (static_cast<size_t>(k.out) << 1) ^
           (static_cast<size_t>(k.a_blocks) << 2);
  }
};
thread_local std::unordered_map<Fp8PlanKey, std::unique_ptr<LtPlan>, Fp8PlanKeyHash> t_fp8_plans;

// Where the kernels write values of `dtype` (bf16 or f32, which they write; f64 through f32),
// and those values in `dtype`.
Tensor values_buffer(int64_t R, int64_t C, DType dtype, Device device) {
  return Tensor::empty({R, C}, dtype == DType::BF16 ? DType::BF16 : DType::F32, device);
}
Tensor in_dtype(Tensor values, DType dtype) { return values.dtype() == dtype ? values : values.to(dtype); }

}  // namespace

Fp8Tensor empty_fp8(int64_t R, int64_t C, Fp8Blocks blocks, Device device) {
  Fp8Tensor out{Tensor::empty({R, C}, DType::F8E4M3, device),
                Tensor::empty(fp8_scale_shape(R, C, blocks), DType::F32, device), blocks};
  if (blocks == Fp8Blocks::kBlocks) out.scale.fill_(1.0);
  return out;
}

Fp8Tensor quantize_fp8(const Tensor& x, Fp8Blocks blocks) {
  const char* op = "quantize_fp8";
  check_input(op, x);
  const int64_t R = x.size(0), C = x.size(1);
  Fp8Tensor out = empty_fp8(R, C, blocks, x.device());
  const int eb = static_cast<int>(dtype_size(x.dtype()));
  uint8_t* q = static_cast<uint8_t*>(out.q.raw());
  if (blocks == Fp8Blocks::kRows) {
    launch_quantize_fp8_rows(x.raw(), eb, R, C, q, out.scale.data<float>(), stream());
  } else {
    launch_quantize_fp8_blocks(x.raw(), eb, R, C, q, out.scale.data<float>(), out.scale.size(1), stream());
  }
  check_launch(op);
  return out;
}

Fp8Tensor quantize_fp8_transposed(const Tensor& x, Fp8Blocks blocks) {
  const char* op = "quantize_fp8_transposed";
  check_input(op, x);
  const int64_t R = x.size(0), C = x.size(1);
  Fp8Tensor out = empty_fp8(C, R, blocks, x.device());
  const int eb = static_cast<int>(dtype_size(x.dtype()));
  if (blocks == Fp8Blocks::kRows) {
    launch_quantize_fp8_transposed(x.raw(), eb, R, C, static_cast<uint8_t*>(out.q.raw()), out.scale.data<float>(),
                                   stream());
  } else {
    launch_quantize_fp8_transposed_blocks(x.raw(), eb, R, C, static_cast<uint8_t*>(out.q.raw()),
                                          out.scale.data<float>(), out.scale.size(1), stream());
  }
  check_launch(op);
  return out;
}

Fp8Tensor transpose_fp8_experts(const Fp8Tensor& w, int64_t experts) {
  check_cuda_tensors("transpose_fp8_experts", {&w.q, &w.scale});
  const int64_t n = w.q.size(0) / experts, k = w.q.size(1);
  Fp8Tensor out = empty_fp8(experts * k, n, Fp8Blocks::kBlocks, w.q.device());
  launch_transpose_fp8_experts(static_cast<const uint8_t*>(w.q.raw()), w.scale.data<float>(), experts, n, k,
                               w.scale.size(1), out.scale.size(1), static_cast<uint8_t*>(out.q.raw()),
                               out.scale.data<float>(), stream());
  check_launch("transpose_fp8_experts");
  return out;
}

Fp8BothWays quantize_fp8_both_ways(const Tensor& x) {
  const char* op = "quantize_fp8_both_ways";
  check_input(op, x);
  const int64_t R = x.size(0), C = x.size(1);
  if (!fp8_blocks_vec_fits(x.raw(), C) || R % 16 != 0) {  // two passes, as the ops one after the other
    return {cuda::quantize_fp8(x, Fp8Blocks::kRows), cuda::quantize_fp8_transposed(x, Fp8Blocks::kRows)};
  }
  Fp8BothWays out{empty_fp8(R, C, Fp8Blocks::kRows, x.device()), empty_fp8(C, R, Fp8Blocks::kRows, x.device())};
  launch_quantize_fp8_both_ways(x.raw(), static_cast<int>(dtype_size(x.dtype())), R, C,
                                static_cast<uint8_t*>(out.rows.q.raw()), out.rows.scale.data<float>(),
                                static_cast<uint8_t*>(out.tokens.q.raw()), out.tokens.scale.data<float>(), stream());
  check_launch(op);
  return out;
}

Fp8WeightBlocks quantize_fp8_weight(const Tensor& w) {
  const char* op = "quantize_fp8_weight";
  const bool experts = w.ndim() == 3;
  const int64_t E = experts ? w.size(0) : 1, n = experts ? w.size(1) : w.size(0), k = w.size(-1);
  const Tensor x = experts ? w.view({E * n, k}) : w;
  check_input(op, x);
  MT_CHECK(!experts || (n % kFp8Block == 0 && k % kFp8Block == 0),
           "{}: each expert's weight is [{}, {}]; both must be multiples of 128", op, n, k);
  if (!fp8_blocks_vec_fits(x.raw(), k) || n % 16 != 0) {  // two passes, as the ops one after the other
    Fp8Tensor blocks = cuda::quantize_fp8(x, Fp8Blocks::kBlocks);
    Fp8Tensor transposed =
        experts ? cuda::transpose_fp8_experts(blocks, E) : cuda::quantize_fp8_transposed(x, Fp8Blocks::kBlocks);
    return {std::move(blocks), std::move(transposed)};
  }
  Fp8WeightBlocks out{empty_fp8(E * n, k, Fp8Blocks::kBlocks, w.device()),
                      empty_fp8(E * k, n, Fp8Blocks::kBlocks, w.device())};
  launch_quantize_fp8_weight(x.raw(), static_cast<int>(dtype_size(x.dtype())), E * n, k, n,
                             static_cast<uint8_t*>(out.w.q.raw()), out.w.scale.data<float>(), out.w.scale.size(1),
                             static_cast<uint8_t*>(out.w_t.q.raw()), out.w_t.scale.data<float>(),
                             out.w_t.scale.size(1), stream());
  check_launch(op);
  return out;
}

namespace {
// first_row [E + 1], first_tile [E + 1] and, with `tiles` > 0, tile_row [tiles] and
// tile_rows [tiles] (i32) of counts over `rows` rows, one after the other (launch_expert_tiles).
Tensor expert_tiles(const Tensor& counts, int64_t rows, int64_t tiles = 0) {
  const int64_t E = counts.size(0);
  Tensor t = Tensor::empty({2 * (E + 1) + 2 * tiles}, DType::I32, counts.device());
  int32_t* p = t.data<int32_t>();
  launch_expert_tiles(counts.data<int64_t>(), static_cast<int>(E), rows, static_cast<int>(tiles), p, p + E + 1,
                      tiles > 0 ? p + 2 * (E + 1) : nullptr, tiles > 0 ? p + 2 * (E + 1) + tiles : nullptr, stream());
  return t;
}
}  // namespace

Fp8Tensor quantize_fp8_expert_columns(const Tensor& x, const Tensor& counts) {
  const char* op = "quantize_fp8_expert_columns";
  check_input(op, x);
  check_cuda_tensors(op, {&counts});
  const int64_t N = x.size(0), C = x.size(1), E = counts.size(0), T = ops::fp8_expert_tiles(N, E);
  Fp8Tensor out{Tensor::empty({C, T * kFp8Block}, DType::F8E4M3, x.device()),
                Tensor::empty({T, C}, DType::F32, x.device()), Fp8Blocks::kRows};
  const Tensor tiles = expert_tiles(counts, N, T);
  const int32_t* tile_row = tiles.data<int32_t>() + 2 * (E + 1);
  launch_quantize_fp8_expert_columns(x.raw(), static_cast<int>(dtype_size(x.dtype())), C, T, tile_row, tile_row + T,
                                     static_cast<uint8_t*>(out.q.raw()), out.scale.data<float>(), stream());
  check_launch(op);
  return out;
}

void grouped_wgrad_fp8(const std::vector<Fp8WgradOperands>& sources, Tensor& dw, bool accumulate) {
  const char* op = "grouped_wgrad_fp8";
  check_cuda_tensors(op, {&dw});
  const int64_t E = dw.size(0), M = dw.size(1), Nc = dw.size(2);
  Tensor counters = Tensor::empty({2}, DType::I32, dw.device());
  for (size_t first = 0; first < sources.size(); first += kFp8WgradMaxSources) {
    std::vector<Tensor> tiles;  // kept until the launch is queued
    std::vector<Fp8WgradSource> src;
    for (size_t i = first; i < std::min(sources.size(), first + kFp8WgradMaxSources); ++i) {
      const Fp8WgradOperands& s = sources[i];
      check_cuda_tensors(op, {&s.a_t.q, &s.a_t.scale, &s.b_t.q, &s.b_t.scale, &s.counts});
      const int64_t P = s.a_t.q.size(1);
      // The tiles as quantize_fp8_expert_columns laid them out (its counts sum to at most P rows).
      tiles.push_back(expert_tiles(s.counts, P));
      src.push_back({static_cast<const uint8_t*>(s.a_t.q.raw()), s.a_t.scale.data<float>(),
                     static_cast<const uint8_t*>(s.b_t.q.raw()), s.b_t.scale.data<float>(), P,
                     tiles.back().data<int32_t>() + E + 1});
    }
    MT_CHECK(launch_grouped_wgrad_fp8(src.data(), static_cast<int>(src.size()), M, Nc, static_cast<int>(E),
                                      dw.data<float>(), accumulate || first > 0, counters.data<int32_t>(), stream()),
             "{}: the FP8 weight-gradient GEMM needs a Hopper GPU (sm_90) and operands its tensor maps take "
             "(dw {}, the first source's a_t {})", op, dw.str(), sources[first].a_t.q.str());
    check_launch(op);
  }
}

Tensor dequantize_fp8(const Fp8Tensor& t, DType dtype) {
  check_cuda_tensors("dequantize_fp8", {&t.q, &t.scale});
  const int64_t R = t.q.size(0), C = t.q.size(1);
  Tensor y = values_buffer(R, C, dtype, t.q.device());
  launch_dequantize_fp8(static_cast<const uint8_t*>(t.q.raw()), t.scale.data<float>(), t.blocks == Fp8Blocks::kBlocks,
                        R, C, t.scale.size(1), y.raw(), dtype == DType::BF16, stream());
  check_launch("dequantize_fp8");
  return in_dtype(std::move(y), dtype);
}

Tensor pack_fp8_rows(const Fp8Tensor& x) {
  check_cuda_tensors("pack_fp8_rows", {&x.q, &x.scale});
  const int64_t R = x.q.size(0), C = x.q.size(1);
  Tensor out = Tensor::empty({R, packed_fp8_row_bytes(C)}, DType::F8E4M3, x.q.device());
  launch_pack_fp8_rows(static_cast<const uint8_t*>(x.q.raw()), x.scale.data<float>(), R, C,
                       static_cast<uint8_t*>(out.raw()), stream());
  check_launch("pack_rows_kernel (pack_fp8_rows)");
  return out;
}

UnpackedFp8Rows permute_forward_fp8_values(const Fp8Tensor& x, const Permutation& p, DType dtype) {
  check_cuda_tensors("permute_forward_fp8_values", {&x.q, &x.scale, &p.source_token});
  const int64_t T = p.num_tokens, C = x.q.size(1), R = p.permuted_rows();
  UnpackedFp8Rows out{empty_fp8(R, C, Fp8Blocks::kRows, x.q.device()), values_buffer(R, C, dtype, x.q.device())};
  launch_permute_fp8_values(static_cast<const uint8_t*>(x.q.raw()), x.scale.data<float>(), T, C,
                            p.source_token.data<int32_t>(), R, static_cast<uint8_t*>(out.q.q.raw()),
                            out.q.scale.data<float>(), out.values.raw(), dtype == DType::BF16, stream());
  check_launch("permute_values_kernel (permute_forward_fp8_values)");
  out.values = in_dtype(std::move(out.values), dtype);
  return out;
}

UnpackedFp8Rows unpack_fp8_rows(const Tensor& packed, int64_t cols, DType dtype) {
  check_cuda_tensors("unpack_fp8_rows", {&packed});
  const int64_t R = packed.size(0), C = cols;
  UnpackedFp8Rows out{empty_fp8(R, C, Fp8Blocks::kRows, packed.device()), values_buffer(R, C, dtype, packed.device())};
  launch_unpack_fp8_rows(static_cast<const uint8_t*>(packed.raw()), R, C, static_cast<uint8_t*>(out.q.q.raw()),
                         out.q.scale.data<float>(), out.values.raw(), dtype == DType::BF16, stream());
  check_launch("unpack_rows_kernel (unpack_fp8_rows)");
  out.values = in_dtype(std::move(out.values), dtype);
  return out;
}

// y [M, N] row-major = column-major y^T [N, M] = b [N, K] (cuBLAS A, op T) times a^T (cuBLAS
// B [K, M], op N): b's scales are cuBLAS A's, a's are B's.
void linear_fp8_into(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& y, bool accumulate) {
  const char* opname = "linear_fp8";
  check_cuda_tensors(opname, {&a.q, &a.scale, &b.q, &b.scale, &y});
  const DType out = y.dtype();
  const auto [M, N, K] = check_linear_fp8_args(opname, a, b, out);
  MT_CHECK(K % 16 == 0 && M % 4 == 0 && N % 4 == 0,
           "{}: cuBLASLt's block-scaled FP8 GEMM needs K a multiple of 16 and M, N multiples of 4; got M={} N={} K={}",
           opname, M, N, K);
  if (M == 0 || N == 0) return;
  const Fp8PlanKey key{M, N, K, static_cast<int32_t>(out), b.blocks == Fp8Blocks::kBlocks ? 1 : 0};
  cublasLtHandle_t handle = cublaslt_handle();
  size_t ws_bytes = 0;
  void* ws = cublaslt_workspace(&ws_bytes);
  auto it = t_fp8_plans.find(key);
  if (it == t_fp8_plans.end()) {
    auto plan = std::make_unique<LtPlan>();
    MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opa = CUBLAS_OP_T, opb = CUBLAS_OP_N;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    const cublasLtMatmulMatrixScale_t mode_a = key.a_blocks ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                            : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const cublasLtMatmulMatrixScale_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
    // (Fast accumulation stays off, its default: the block modes promote every 128 of K.)
    const void* scale_a = b.scale.raw();  // set again before every call
    const void* scale_b = a.scale.raw();
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, K, N, K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, K, M, K));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, out == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F, N, M, N));
    int found = 0;
    const cublasStatus_t st = lt_pick_algorithm(*plan, nullptr, &found);
    MT_CHECK(st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED,
             "{}: cuBLASLt's heuristic for the block-scaled FP8 GEMM M={} N={} K={} -> {} failed: {}", opname, M, N, K,
             dtype_name(out), cublasLtGetStatusName(st));
    if (st != CUBLAS_STATUS_SUCCESS) found = 0;
    MT_CHECK(found > 0,
             "{}: cuBLASLt has no block-scaled FP8 algorithm for M={} N={} K={} (b in {} mode) on this GPU (it needs "
             "Hopper and cuBLAS 12.9 or later)",
             opname, M, N, K, key.a_blocks ? "128 x 128" : "1 x 128");
    it = t_fp8_plans.emplace(key, std::move(plan)).first;
  }
  const LtPlan& p = *it->second;
  const void* scale_a = b.scale.raw();
  const void* scale_b = a.scale.raw();
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a, sizeof(scale_a)));
  MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b, sizeof(scale_b)));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  MT_CUBLAS_CHECK(cublasLtMatmul(handle, p.op, &alpha, b.q.raw(), p.a, a.q.raw(), p.b, &beta, y.raw(), p.d, y.raw(),
                                 p.d, &p.algo, ws, ws_bytes, stream()));
}

}  // namespace moetrain::ops::cuda
