// Element-wise kernels and small deterministic reductions (see elementwise_launch.h).
//
// sum_squares: pass 1 has nblocks = clamp(n / 8192, 1, 1024) blocks of 256 threads; thread
// (b, i) adds, in order, the squares of vectors b*256 + i, + nblocks*256, ... (8 elements a
// vector, 16-byte loads when x is aligned; the n % 8 tail goes to the first threads), in
// double, then the block sums its threads in a fixed tree. Pass 2 (one block) adds the
// block partials the same way. Every order depends on n alone: bitwise reproducible.
// scale_/add_: one thread per 8 elements (vector path when aligned), grid-stride.
// all_finite: any thread that sees a non-finite element stores 1 to a flag (all writers
// store the same value, so the race is benign).
#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSumBlocks = 1024;

int sum_blocks(int64_t n) {
  int64_t b = (n + 8 * 1024 - 1) / (8 * 1024);
  if (b < 1) b = 1;
  if (b > kMaxSumBlocks) b = kMaxSumBlocks;
  return static_cast<int>(b);
}

// A grid for grid-stride element-wise loops over `work` items.
int grid_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > 132 * 32) b = 132 * 32;
  return static_cast<int>(b);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) sum_squares_pass1(const T* __restrict__ x, int64_t n, bool vec,
                                                              double* __restrict__ partial) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  double acc = 0.0;
  int64_t done = 0;  // elements covered by the vector loop
  if (vec) {
    const int64_t nvec = n / 8;
#pragma unroll 4
    for (int64_t v = tid; v < nvec; v += stride) {
      float f[8];
      load8(x + v * 8, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc += static_cast<double>(f[k]) * static_cast<double>(f[k]);
    }
    done = nvec * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const double f = static_cast<double>(to_float(x[i]));
    acc += f * f;
  }
  acc = block_sum_double(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) sum_doubles_pass2(const double* __restrict__ partial, int n,
                                                              double* __restrict__ out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += kThreads) acc += partial[i];
  acc = block_sum_double(acc);
  if (threadIdx.x == 0) *out = acc;
}

template <typename T>
void sum_squares_impl(const T* x, int64_t n, double* scratch, cudaStream_t s) {
  const int blocks = sum_blocks(n);
  sum_squares_pass1<T><<<blocks, kThreads, 0, s>>>(x, n, aligned16(x), scratch + 1);
  sum_doubles_pass2<<<1, kThreads, 0, s>>>(scratch + 1, blocks, scratch);
}

constexpr int64_t kSquaresChunk = 16384;  // elements a block sums into one partial
constexpr int kMaxSquaresSegments = 200;  // 16 B each: within the 4 KB parameter space

struct SquaresBatch {
  SquaresSegment seg[kMaxSquaresSegments];
  int32_t count;
  int64_t chunks;                 // over this batch
  int64_t first_partial;          // where this batch's chunk partials go
};

__host__ __device__ inline int64_t chunks_of(int64_t n) { return (n + kSquaresChunk - 1) / kSquaresChunk; }

// Block per chunk (grid-stride over the batch's chunks, segments in order): thread i adds
// the squares of elements i, i + 256, ... of the chunk (four at a time when aligned), then
// the block's fixed tree; the partial goes to its chunk's slot.
__global__ void __launch_bounds__(kThreads) sum_squares_segments_pass1(const __grid_constant__ SquaresBatch b,
                                                                       double* __restrict__ partial) {
  int s = 0;
  int64_t seg_first = 0;  // first chunk of segment s
  for (int64_t c = blockIdx.x; c < b.chunks; c += gridDim.x) {
    while (c >= seg_first + chunks_of(b.seg[s].n)) seg_first += chunks_of(b.seg[s++].n);
    const float* x = b.seg[s].x;
    const int64_t begin = (c - seg_first) * kSquaresChunk;
    const int64_t end = min(b.seg[s].n, begin + kSquaresChunk);
    double acc = 0.0;
    if (aligned16(x)) {
      int64_t i = begin + threadIdx.x * 4;
      for (; i + 4 <= end; i += kThreads * 4) {
        const float4 f = *reinterpret_cast<const float4*>(x + i);
        acc += static_cast<double>(f.x) * f.x + static_cast<double>(f.y) * f.y + static_cast<double>(f.z) * f.z +
               static_cast<double>(f.w) * f.w;
      }
      for (; i < end; ++i) acc += static_cast<double>(x[i]) * x[i];  // < 4 left, one thread
    } else {
      for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) acc += static_cast<double>(x[i]) * x[i];
    }
    acc = block_sum_double(acc);
    if (threadIdx.x == 0) partial[b.first_partial + c] = acc;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(T* __restrict__ x, int64_t n, float alpha, bool vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t done = 0;
  if (vec) {
    const int64_t nvec = n / 8;
    for (int64_t v = tid; v < nvec; v += stride) {
      float f[8];
      load8(x + v * 8, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] *= alpha;
      store8(x + v * 8, f);
    }
    done = nvec * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) x[i] = from_float<T>(to_float(x[i]) * alpha);
}

template <typename T, typename X>
__global__ void __launch_bounds__(kThreads) add_kernel(T* __restrict__ y, const X* __restrict__ x, int64_t n,
                                                       bool vec) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t done = 0;
  if (vec) {
    const int64_t nvec = n / 8;
    for (int64_t v = tid; v < nvec; v += stride) {
      float a[8], b[8];
      load8(y + v * 8, a);
      load8(x + v * 8, b);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += b[k];
      store8(y + v * 8, a);
    }
    done = nvec * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) y[i] = from_float<T>(to_float(y[i]) + to_float(x[i]));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) nonfinite_kernel(const T* __restrict__ x, int64_t n, bool vec,
                                                             int32_t* __restrict__ flag) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  bool bad = false;
  int64_t done = 0;
  if (vec) {
    const int64_t nvec = n / 8;
    for (int64_t v = tid; v < nvec; v += stride) {
      float f[8];
      load8(x + v * 8, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) bad |= !isfinite(f[k]);
    }
    done = nvec * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) bad |= !isfinite(to_float(x[i]));
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

constexpr int kSumThreads = 1024;

__global__ void __launch_bounds__(kSumThreads) sum_fixed_order_kernel(const float* __restrict__ v, int64_t n,
                                                                      float* __restrict__ out) {
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kSumThreads) acc += static_cast<double>(v[i]);
  acc = block_sum_double(acc);
  if (threadIdx.x == 0) *out = static_cast<float>(acc);
}

}  // namespace

int64_t sum_squares_scratch_doubles(int64_t n) { return 1 + sum_blocks(n); }

void launch_sum_squares(const float* x, int64_t n, double* scratch, cudaStream_t s) {
  sum_squares_impl(x, n, scratch, s);
}
void launch_sum_squares(const __nv_bfloat16* x, int64_t n, double* scratch, cudaStream_t s) {
  sum_squares_impl(x, n, scratch, s);
}

int64_t sum_squares_segments_scratch_doubles(const SquaresSegment* segments, int count) {
  int64_t chunks = 0;
  for (int k = 0; k < count; ++k) chunks += chunks_of(segments[k].n);
  return 1 + chunks;
}

void launch_sum_squares_segments(const SquaresSegment* segments, int count, double* scratch, cudaStream_t s,
                                 double* result) {
  int64_t done = 0;
  for (int first = 0; first < count; first += kMaxSquaresSegments) {
    SquaresBatch b{};
    b.count = count - first < kMaxSquaresSegments ? count - first : kMaxSquaresSegments;
    b.first_partial = done;
    for (int k = 0; k < b.count; ++k) {
      b.seg[k] = segments[first + k];
      b.chunks += chunks_of(b.seg[k].n);
    }
    if (b.chunks > 0) {
      const int grid = static_cast<int>(b.chunks < 132 * 8 ? b.chunks : 132 * 8);
      sum_squares_segments_pass1<<<grid, kThreads, 0, s>>>(b, scratch + 1);
    }
    done += b.chunks;
  }
  sum_doubles_pass2<<<1, kThreads, 0, s>>>(scratch + 1, static_cast<int>(done), result ? result : scratch);
}

void launch_sum_doubles(const double* v, int64_t n, double* out, cudaStream_t s) {
  sum_doubles_pass2<<<1, kThreads, 0, s>>>(v, static_cast<int>(n), out);
}

void launch_scale(float* x, int64_t n, float alpha, cudaStream_t s) {
  if (n == 0) return;
  scale_kernel<float><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(x, n, alpha, aligned16(x));
}
void launch_scale(__nv_bfloat16* x, int64_t n, float alpha, cudaStream_t s) {
  if (n == 0) return;
  scale_kernel<__nv_bfloat16><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(x, n, alpha, aligned16(x));
}

void launch_add(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<float, float><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(y, x, n, aligned16(y) && aligned16(x));
}
void launch_add(float* y, const __nv_bfloat16* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<float, __nv_bfloat16><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(y, x, n, aligned16(y) && aligned16(x));
}
void launch_add(__nv_bfloat16* y, const __nv_bfloat16* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<__nv_bfloat16, __nv_bfloat16><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(y, x, n, aligned16(y) && aligned16(x));
}

void launch_find_nonfinite(const float* x, int64_t n, int32_t* flag, cudaStream_t s) {
  if (n == 0) return;
  nonfinite_kernel<float><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(x, n, aligned16(x), flag);
}
void launch_find_nonfinite(const __nv_bfloat16* x, int64_t n, int32_t* flag, cudaStream_t s) {
  if (n == 0) return;
  nonfinite_kernel<__nv_bfloat16><<<grid_for((n + 7) / 8), kThreads, 0, s>>>(x, n, aligned16(x), flag);
}

void launch_sum_fixed_order(const float* v, int64_t n, float* out, cudaStream_t s) {
  sum_fixed_order_kernel<<<1, kSumThreads, 0, s>>>(v, n, out);
}

}  // namespace moetrain::ops::cuda
