#include <algorithm>

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

template <typename D, typename S>
void launch(D* dst, const S* src, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads * 4 - 1) / (threads * 4), 65536);
  cast_kernel<<<static_cast<unsigned>(blocks), threads, 0, s>>>(dst, src, n);
}
}  // namespace

void launch_cast_f32_to_bf16(__nv_bfloat16* dst, const float* src, int64_t n, cudaStream_t s) { launch(dst, src, n, s); }
void launch_cast_bf16_to_f32(float* dst, const __nv_bfloat16* src, int64_t n, cudaStream_t s) { launch(dst, src, n, s); }

}  // namespace moetrain::ops::cuda
