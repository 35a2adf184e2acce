// Launcher of the AdamW kernel (adamw.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// In place on n f32 elements, each computed in double exactly as the CPU reference:
//   m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//   p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p)
// with bc1 = 1 - b1^step and bc2 = 1 - b2^step computed by the caller.
void launch_adamw(float* param, const float* grad, float* m, float* v, int64_t n, double lr, double b1, double b2,
                  double bc1, double bc2, double eps, double wd, cudaStream_t s);

}  // namespace moetrain::ops::cuda
