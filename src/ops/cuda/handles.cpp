#include "ops/cuda/common.h"

namespace moetrain::ops::cuda {

void check_cublas(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw_error(file, line, fmt::format("cuBLAS error {} in {}", static_cast<int>(s), what));
}

namespace {
// Released when its thread ends (the main thread's before the CUDA runtime unloads): a
// thread that did GEMMs and ended would otherwise keep its 32 MB, and compute-sanitizer's
// leak check reported the main thread's at exit. Errors are ignored: at exit there is no one
// left to tell.
struct LtState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t bytes = 32u << 20;
  ~LtState() {
    if (workspace) (void)cudaFree(workspace);
    if (handle) (void)cublasLtDestroy(handle);
  }
};
thread_local LtState t_lt;
}  // namespace

cublasLtHandle_t cublaslt_handle() {
  if (!t_lt.handle) {
    MT_CUBLAS_CHECK(cublasLtCreate(&t_lt.handle));
    MT_CUDA_CHECK(cudaMalloc(&t_lt.workspace, t_lt.bytes));  // lives as long as the thread's handle
  }
  return t_lt.handle;
}

void* cublaslt_workspace(size_t* bytes) {
  cublaslt_handle();
  *bytes = t_lt.bytes;
  return t_lt.workspace;
}

LtPlan::~LtPlan() {  // host objects only; statuses ignored in a destructor
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (op) cublasLtMatmulDescDestroy(op);
}

cublasStatus_t lt_pick_algorithm(LtPlan& plan, const uint32_t* aligns_abd, int* found) {
  *found = 0;
  cublasLtMatmulPreference_t pref = nullptr;
  MT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws64 = t_lt.bytes;
  cublasStatus_t st =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws64, sizeof(ws64));
  if (aligns_abd != nullptr) {
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i) {
      const uint32_t al = aligns_abd[i < 2 ? i : 2];  // C is D
      st = cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &al, sizeof(al));
    }
  }
  cublasLtMatmulHeuristicResult_t result{};
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), plan.op, plan.a, plan.b, plan.d, plan.d, pref, 1, &result,
                                        found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && *found > 0) plan.algo = result.algo;
  return st;
}

}  // namespace moetrain::ops::cuda
