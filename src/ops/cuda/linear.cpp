// Linear layer on CUDA through cuBLASLt: bf16 (or f32) operands, f32 accumulation.
//
// Row-major tensors seen by column-major cuBLASLt are transposed, so each op is written
// as the column-major product of the transposes:
//   forward:         y  = x W^T   ->  y^T [out, T]  = W^T(op T on W's [in, out]) x^T
//   backward_input:  dx = dy W    ->  dx^T [in, T]  = W^T [in, out] dy^T [out, T]
//   backward_weight: dW += dy^T x ->  dW^T [in, out] += x^T [in, T] (dy^T)^T [T, out]
// The weight gradient is f32 and accumulates (beta = 1, C = D = dW); the forward's
// residual and backward_input_add use the same epilogue (C = residual or dx, beta = 1), so
// neither costs a separate element-wise pass.
//
// Descriptors and the heuristic's algorithm are cached per host thread (the cuBLASLt
// handle is per thread too), keyed by shape, dtypes, transposes and pointer alignment.
#include <algorithm>
#include <cstring>
#include <memory>
#include <unordered_map>

#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {
namespace {

struct PlanKey {
  int64_t m, n, k, lda, ldb, ldd;
  int32_t ta, tb, ab_type, cd_type;
  uint32_t align_a, align_b, align_d;  // align_d covers C too (the smaller of the two)
  uint32_t pad = 0;  // no uninitialised padding: the key is compared and hashed as bytes
  bool operator==(const PlanKey& o) const { return std::memcmp(this, &o, sizeof(PlanKey)) == 0; }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the key's bytes
    for (size_t i = 0; i < sizeof(PlanKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

thread_local std::unordered_map<PlanKey, std::unique_ptr<LtPlan>, PlanKeyHash> t_plans;

uint32_t alignment_of(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && (u % a) != 0) a >>= 1;
  return a;
}

cudaDataType_t cuda_type(DType t) { return t == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// Column-major D[m, n] (ldd) = op(A) op(B) + beta C, op(A) [m, k], op(B) [k, n]; C has
// D's layout and is D itself when null.
void lt_matmul(const char* opname, bool ta, bool tb, int64_t m, int64_t n, int64_t k, DType ab, const void* A,
               int64_t lda, const void* B, int64_t ldb, float beta, DType cd, void* D, int64_t ldd,
               const void* C = nullptr) {
  if (C == nullptr) C = D;
  const PlanKey key{m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldd,
                    ta,
                    tb,
                    static_cast<int32_t>(ab),
                    static_cast<int32_t>(cd),
                    alignment_of(A),
                    alignment_of(B),
                    std::min(alignment_of(C), alignment_of(D))};
  cublasLtHandle_t handle = cublaslt_handle();
  size_t ws_bytes = 0;
  void* ws = cublaslt_workspace(&ws_bytes);
  auto it = t_plans.find(key);
  if (it == t_plans.end()) {
    auto plan = std::make_unique<LtPlan>();
    const cudaDataType_t abt = cuda_type(ab), cdt = cuda_type(cd);
    MT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    MT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, abt, ta ? k : m, ta ? m : k, lda));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, abt, tb ? n : k, tb ? k : n, ldb));
    MT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->d, cdt, m, n, ldd));
    const uint32_t aligns[3] = {key.align_a, key.align_b, key.align_d};
    int found = 0;
    MT_CUBLAS_CHECK(lt_pick_algorithm(*plan, aligns, &found));
    MT_CHECK(found > 0,
             "{}: cuBLASLt has no algorithm for m={} n={} k={} (lda={} ldb={} ldd={}, {} x {} -> {})", opname, m, n,
             k, lda, ldb, ldd, dtype_name(ab), dtype_name(ab), dtype_name(cd));
    it = t_plans.emplace(key, std::move(plan)).first;
  }
  const LtPlan& p = *it->second;
  const float alpha = 1.0f;
  MT_CUBLAS_CHECK(cublasLtMatmul(handle, p.op, &alpha, A, p.a, B, p.b, &beta, C, p.d, D, p.d, &p.algo, ws, ws_bytes,
                                 stream()));
}

void check_operand(const Tensor& t, const char* op, const char* name) {
  MT_CHECK(t.defined() && t.ndim() == 2, "{}: tensor {} must be 2-D, got {}", op, name, t.str());
  MT_CHECK(t.dtype() == DType::BF16 || t.dtype() == DType::F32, "{}: tensor {} must be bf16 or f32, got {}", op,
           name, t.str());
}

}  // namespace

Tensor linear_forward(const Tensor& x, const Tensor& w, const Tensor& residual) {
  const char* op = "linear_forward";
  check_operand(x, op, "x");
  check_operand(w, op, "w");
  check_cuda_tensors(op, {&x, &w, &residual});
  const int64_t T = x.size(0), in = x.size(1), out = w.size(0);
  check_shape(w, {out, in}, "linear_forward w");
  MT_CHECK(w.dtype() == x.dtype(), "{}: w {} and x {} must share a dtype", op, w.str(), x.str());
  if (residual.defined()) {
    check_shape(residual, {T, out}, "linear_forward residual");
    check_dtype(residual, x.dtype(), "linear_forward residual");
  }
  Tensor y = Tensor::empty({T, out}, x.dtype(), x.device());
  if (T == 0 || out == 0) return y;
  if (in == 0) {
    if (residual.defined()) y.copy_from(residual);
    else y.zero_();
    return y;
  }
  // y^T [out, T] = op_T(W^T as [in, out]) * x^T [in, T] (+ residual^T)
  lt_matmul(op, true, false, out, T, in, x.dtype(), w.raw(), in, x.raw(), in, residual.defined() ? 1.0f : 0.0f,
            x.dtype(), y.raw(), out, residual.defined() ? residual.raw() : nullptr);
  return y;
}

Tensor linear_forward_f32_out(const Tensor& x, const Tensor& w) {
  const char* op = "linear_forward_f32_out";
  check_operand(x, op, "x");
  check_operand(w, op, "w");
  check_cuda_tensors(op, {&x, &w});
  const int64_t T = x.size(0), in = x.size(1), out = w.size(0);
  check_shape(w, {out, in}, "linear_forward_f32_out w");
  MT_CHECK(w.dtype() == x.dtype(), "{}: w {} and x {} must share a dtype", op, w.str(), x.str());
  Tensor y = Tensor::empty({T, out}, DType::F32, x.device());
  if (T == 0 || out == 0) return y;
  if (in == 0) {
    y.zero_();
    return y;
  }
  lt_matmul(op, true, false, out, T, in, x.dtype(), w.raw(), in, x.raw(), in, 0.0f, DType::F32, y.raw(), out);
  return y;
}

namespace {
// dx (+)= dy W; beta 0 writes, 1 accumulates.
void backward_input_into(const Tensor& dy, const Tensor& w, Tensor& dx, float beta, const char* op) {
  check_operand(dy, op, "dy");
  check_operand(w, op, "w");
  check_cuda_tensors(op, {&dy, &w, &dx});
  const int64_t T = dy.size(0), out = w.size(0), in = w.size(1);
  check_shape(dy, {T, out}, "linear_backward_input dy");
  check_shape(dx, {T, in}, "linear_backward_input dx");
  MT_CHECK(w.dtype() == dy.dtype() && dx.dtype() == dy.dtype(), "{}: w {}, dy {} and dx {} must share a dtype", op,
           w.str(), dy.str(), dx.str());
  if (T == 0 || in == 0) return;
  if (out == 0) {
    if (beta == 0.0f) dx.zero_();
    return;
  }
  // dx^T [in, T] = W^T [in, out] * dy^T [out, T] (+ dx^T)
  lt_matmul(op, false, false, in, T, out, dy.dtype(), w.raw(), in, dy.raw(), out, beta, dy.dtype(), dx.raw(), in);
}
}  // namespace

Tensor linear_backward_input(const Tensor& dy, const Tensor& w) {
  check_operand(dy, "linear_backward_input", "dy");
  check_operand(w, "linear_backward_input", "w");
  Tensor dx = Tensor::empty({dy.size(0), w.size(1)}, dy.dtype(), dy.device());
  backward_input_into(dy, w, dx, 0.0f, "linear_backward_input");
  return dx;
}

void linear_backward_input_add(const Tensor& dy, const Tensor& w, Tensor& dx) {
  MT_CHECK(dx.defined(), "linear_backward_input_add: dx is undefined");
  backward_input_into(dy, w, dx, 1.0f, "linear_backward_input_add");
}

void linear_backward_weight(const Tensor& dy, const Tensor& x, Tensor& dw, bool accumulate) {
  const char* op = "linear_backward_weight";
  check_operand(dy, op, "dy");
  check_operand(x, op, "x");
  check_cuda_tensors(op, {&dy, &x, &dw});
  const int64_t T = x.size(0), in = x.size(1), out = dy.size(1);
  check_shape(dy, {T, out}, "linear_backward_weight dy");
  check_shape(dw, {out, in}, "linear_backward_weight dw");
  MT_CHECK(dy.dtype() == x.dtype(), "{}: dy {} and x {} must share a dtype", op, dy.str(), x.str());
  check_dtype(dw, DType::F32, "linear_backward_weight dw (f32 weight gradient)");
  if (in == 0 || out == 0) return;
  if (T == 0) {  // nothing to add; an overwrite leaves zeros
    if (!accumulate) dw.zero_();
    return;
  }
  // dW^T [in, out] (+)= x^T [in, T] * op_T(dy^T as [out, T])
  lt_matmul(op, false, true, in, out, T, x.dtype(), x.raw(), in, dy.raw(), out, accumulate ? 1.0f : 0.0f, DType::F32,
            dw.raw(), in);
}

}  // namespace moetrain::ops::cuda
