// AdamW on f32 master weights and moments: one thread per element (grid-stride, four
// elements a thread through 16-byte accesses when every pointer is aligned), arithmetic in
// double like the CPU reference, so the two agree to f32 rounding. No reduction: the
// result does not depend on the launch shape.
#include "ops/cuda/adamw_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

constexpr int kThreads = 256;

struct AdamWArgs {
  double lr, b1, b2, bc1, bc2, eps, wd;
};

__device__ __forceinline__ void adamw_one(float& p, float g, float& m, float& v, const AdamWArgs& a) {
  const double gi = static_cast<double>(g);
  const double mi = a.b1 * static_cast<double>(m) + (1.0 - a.b1) * gi;
  const double vi = a.b2 * static_cast<double>(v) + (1.0 - a.b2) * gi * gi;
  m = static_cast<float>(mi);
  v = static_cast<float>(vi);
  const double pi = static_cast<double>(p);
  p = static_cast<float>(pi - a.lr * ((mi / a.bc1) / (sqrt(vi / a.bc2) + a.eps) + a.wd * pi));
}

__global__ void __launch_bounds__(kThreads) adamw_kernel(float* __restrict__ param, const float* __restrict__ grad,
                                                         float* __restrict__ m, float* __restrict__ v, int64_t n,
                                                         AdamWArgs a, bool vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t done = 0;
  if (vec) {
    const int64_t nvec = n / 4;
    for (int64_t i = tid; i < nvec; i += stride) {
      float4 p = reinterpret_cast<const float4*>(param)[i];
      const float4 g = reinterpret_cast<const float4*>(grad)[i];
      float4 mm = reinterpret_cast<const float4*>(m)[i];
      float4 vv = reinterpret_cast<const float4*>(v)[i];
      adamw_one(p.x, g.x, mm.x, vv.x, a);
      adamw_one(p.y, g.y, mm.y, vv.y, a);
      adamw_one(p.z, g.z, mm.z, vv.z, a);
      adamw_one(p.w, g.w, mm.w, vv.w, a);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(m)[i] = mm;
      reinterpret_cast<float4*>(v)[i] = vv;
    }
    done = nvec * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) adamw_one(param[i], grad[i], m[i], v[i], a);
}

}  // namespace

void launch_adamw(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double b1, double b2,
                  double bc1, double bc2, double eps, double wd, cudaStream_t s) {
  if (n == 0) return;
  int64_t blocks = (n / 4 + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 132 * 16) blocks = 132 * 16;
  const bool vec = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v);
  adamw_kernel<<<static_cast<int>(blocks), kThreads, 0, s>>>(param, grad, m, v, n,
                                                              AdamWArgs{lr, b1, b2, bc1, bc2, eps, wd}, vec);
}

}  // namespace moetrain::ops::cuda
