// Launchers of the element-wise kernels and small reductions (elementwise.cu), and the
// fixed-order float sum that the loss kernels of this folder share. Raw pointers, sizes
// and a stream; no checks (the wrappers in elementwise.cpp and the loss files do them).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moetrain::ops::cuda {

// Doubles of device scratch that launch_sum_squares_* needs for n elements: the result in
// scratch[0], then one partial per block of the first pass.
int64_t sum_squares_scratch_doubles(int64_t n);
// scratch[0] = sum_i x_i^2, each square and every sum in double. The split into blocks and
// the order of every addition depend only on n and on whether x is 16-byte aligned, so
// repeated calls give bitwise the same result.
void launch_sum_squares(const float* x, int64_t n, double* scratch, cudaStream_t s);
void launch_sum_squares(const __nv_bfloat16* x, int64_t n, double* scratch, cudaStream_t s);

// The same over many f32 segments at once (a gradient list): each segment is cut into
// chunks of a fixed size, each chunk summed by one block, then the chunk partials in
// order. Scratch: the result in scratch[0], then one double per chunk.
struct SquaresSegment {
  const float* x;
  int64_t n;
};
int64_t sum_squares_segments_scratch_doubles(const SquaresSegment* segments, int count);
// The sum goes to scratch[0], or to *result when given (a device double elsewhere).
void launch_sum_squares_segments(const SquaresSegment* segments, int count, double* scratch, cudaStream_t s,
                                 double* result = nullptr);

// *out = sum of v[0, n) (n < 2^31) in a fixed order: one block, thread i adds v[i],
// v[i + 256], ..., then a fixed tree. Partial sums kernels left in slots become one number.
void launch_sum_doubles(const double* v, int64_t n, double* out, cudaStream_t s);

// x *= alpha (alpha rounded to f32; bf16 elements computed in f32 and rounded back).
void launch_scale(float* x, int64_t n, float alpha, cudaStream_t s);
void launch_scale(__nv_bfloat16* x, int64_t n, float alpha, cudaStream_t s);

// y += x (bf16 in f32, rounded back).
void launch_add(float* y, const float* x, int64_t n, cudaStream_t s);
void launch_add(__nv_bfloat16* y, const __nv_bfloat16* x, int64_t n, cudaStream_t s);
void launch_add(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t s);  // f32 sums of bf16 terms

// Sets *flag = 1 when some element is NaN or +-inf; leaves it alone otherwise.
void launch_find_nonfinite(const float* x, int64_t n, int32_t* flag, cudaStream_t s);
void launch_find_nonfinite(const __nv_bfloat16* x, int64_t n, int32_t* flag, cudaStream_t s);

// out[0] = sum of v[0, n), accumulated in double in a fixed order (one block: thread i adds
// v[i], v[i + 1024], ... in order, then a fixed tree), rounded to f32. n may be 0 (out = 0).
void launch_sum_fixed_order(const float* v, int64_t n, float* out, cudaStream_t s);

}  // namespace moetrain::ops::cuda
