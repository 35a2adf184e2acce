// Host-side plumbing of the CUDA ops' wrappers (.cpp files, compiled by the host
// compiler): the current stream, launch and library status checks, cuBLASLt handles,
// argument checks.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/cuda_runtime.h"
#include "core/tensor.h"

namespace moetrain::ops::cuda {

inline cudaStream_t stream() { return static_cast<cudaStream_t>(moetrain::cuda::current_stream()); }

// Throws naming the kernel when its launch failed (bad configuration, no kernel image).
inline void check_launch(const char* kernel) {
  cudaError_t e = cudaGetLastError();
  MT_CHECK(e == cudaSuccess, "CUDA kernel {} failed to launch: {} ({})", kernel, cudaGetErrorName(e),
           cudaGetErrorString(e));
}

void check_cublas(cublasStatus_t s, const char* what, const char* file, int line);
#define MT_CUBLAS_CHECK(call) ::moetrain::ops::cuda::check_cublas((call), #call, __FILE__, __LINE__)

// One cuBLASLt handle and a 32 MiB workspace per host thread, made on first use.
cublasLtHandle_t cublaslt_handle();
void* cublaslt_workspace(size_t* bytes);

// A cuBLASLt matmul's descriptors and the algorithm picked for them (host objects, destroyed
// with it); C has D's layout. The GEMM wrappers (linear.cpp, fp8.cpp) cache one per shape.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan();
};
// The heuristic's first algorithm for the plan's descriptors within the thread's workspace
// (and the operands' alignments in bytes, A, B and C/D, when given) into plan.algo; the
// heuristic's status and, in *found, how many it offered.
cublasStatus_t lt_pick_algorithm(LtPlan& plan, const uint32_t* aligns_abd, int* found);

// Each defined tensor must live on a CUDA device.
inline void check_cuda_tensors(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->defined()) MT_CHECK(!t->device().is_cpu(), "{}: tensor {} is on the CPU, expected CUDA", op, t->str());
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace moetrain::ops::cuda
