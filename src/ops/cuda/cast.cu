#include <algorithm>

#include "ops/adamw_math.h"
#include "ops/cuda/cast_launch.h"
#include "ops/cuda/kernels.cuh"

namespace moetrain::ops::cuda {
namespace {
// Four elements per thread (round to nearest even), grid-stride.
template <typename D, typename S>
__global__ void cast_kernel(D* __restrict__ dst, const S* __restrict__ src, int64_t n) {
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x * 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (i + j < n) dst[i + j] = from_float<D>(to_float(src[i + j]));
    }
  }
}

// Grid-stride, an element a thread a trip (these run at checkpoint loads and saves).
__global__ void master_join_kernel(float* __restrict__ master, const uint16_t* __restrict__ high,
                                   const int16_t* __restrict__ low, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    master[i] = master_join(high[i], low[i]);
  }
}
__global__ void master_split_kernel(const float* __restrict__ master, uint16_t* __restrict__ high,
                                    int16_t* __restrict__ low, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    master_split(master[i], high[i], low[i]);
  }
}

unsigned blocks_for(int64_t n, int threads, int per_thread) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads * per_thread - 1) / (threads * per_thread), 65536));
}

template <typename D, typename S>
void launch(D* dst, const S* src, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  cast_kernel<<<blocks_for(n, 256, 4), 256, 0, s>>>(dst, src, n);
}
}  // namespace

void launch_cast_f32_to_bf16(__nv_bfloat16* dst, const float* src, int64_t n, cudaStream_t s) { launch(dst, src, n, s); }
void launch_cast_bf16_to_f32(float* dst, const __nv_bfloat16* src, int64_t n, cudaStream_t s) { launch(dst, src, n, s); }

void launch_master_join(float* master, const uint16_t* high, const int16_t* low, int64_t n, cudaStream_t s) {
  if (n > 0) master_join_kernel<<<blocks_for(n, 256, 1), 256, 0, s>>>(master, high, low, n);
}
void launch_master_split(const float* master, uint16_t* high, int16_t* low, int64_t n, cudaStream_t s) {
  if (n > 0) master_split_kernel<<<blocks_for(n, 256, 1), 256, 0, s>>>(master, high, low, n);
}

}  // namespace moetrain::ops::cuda
