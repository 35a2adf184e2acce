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

}  // namespace moetrain::ops::cuda
