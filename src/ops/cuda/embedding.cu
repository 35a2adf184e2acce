// Token embedding kernels.
//
// forward: one block (128 threads) per token copies its weight row, 16 bytes a thread
// when the row size and both pointers allow, else element by element. The copy is exact.
//
// backward (dW[ids[t]] += dy[t], deterministic, no float atomics):
//   1. keys[t] = ids[t] (or V for an id outside [0, V)), vals[t] = t;
//   2. CUB's stable radix sort by key over the bits that V needs: the tokens of each id end
//      up together, in token order;
//   3. a grid of (sorted position i, column chunk of 512 = 128 threads x 4 columns): the
//      block at the first position of each run of equal ids (all others exit at once)
//      walks its run in token order, 128 positions at a time staged in shared memory,
//      eight dy rows loaded ahead of their in-order additions, and adds the run into dW in
//      f32. dW starts from its old value and gets the rows added one by one in token
//      order: exactly the CPU reference's order, so the two agree bitwise on equal inputs.
// A run as long as a frequent token's is walked by one block per column chunk: hundreds of
// rows at eight in flight; that is the price of the fixed order, small beside the GEMMs.
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/embedding_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

constexpr int kFwdThreads = 128;
constexpr int kBwdThreads = 128;
constexpr int kAhead = 8;  // dy rows loaded ahead of their (in-order) additions

template <typename W>
__global__ void __launch_bounds__(kFwdThreads) embedding_forward_kernel(const int32_t* __restrict__ ids,
                                                                        const W* __restrict__ w, W* __restrict__ y,
                                                                        int64_t V, int64_t row_units, W nan_bits,
                                                                        int64_t first, int64_t whole) {
  const int64_t t = blockIdx.x;
  const int64_t id = ids[t];
  W* out = y + t * row_units;
  if (id < 0 || id >= whole) {
    for (int64_t i = threadIdx.x; i < row_units; i += kFwdThreads) out[i] = nan_bits;
    return;
  }
  if (id < first || id >= first + V) {  // another shard's row
    for (int64_t i = threadIdx.x; i < row_units; i += kFwdThreads) out[i] = W{};
    return;
  }
  const W* src = w + (id - first) * row_units;
  for (int64_t i = threadIdx.x; i < row_units; i += kFwdThreads) out[i] = src[i];
}

__global__ void make_sort_keys(const int32_t* __restrict__ ids, uint32_t* __restrict__ keys,
                               int32_t* __restrict__ vals, int64_t T, int64_t V, int64_t first) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const int64_t id = ids[t] - first;
  keys[t] = (id >= 0 && id < V) ? static_cast<uint32_t>(id) : static_cast<uint32_t>(V);
  vals[t] = static_cast<int32_t>(t);
}

// VEC consecutive values of a row as floats.
template <int VEC>
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&f)[VEC]) {
  if constexpr (VEC == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  } else {
    f[0] = __bfloat162float(*p);
  }
}
template <int VEC>
__device__ __forceinline__ void load_vec(const float* p, float (&f)[VEC]) {
  if constexpr (VEC == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  } else {
    f[0] = *p;
  }
}
template <int VEC>
__device__ __forceinline__ void store_vec(float* p, const float (&f)[VEC]) {
  if constexpr (VEC == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  } else {
    *p = f[0];
  }
}

template <typename G, int VEC>
__global__ void __launch_bounds__(kBwdThreads) embedding_backward_runs(const uint32_t* __restrict__ keys,
                                                                       const int32_t* __restrict__ toks,
                                                                       const G* __restrict__ dy,
                                                                       float* __restrict__ dw, int64_t T,
                                                                       int64_t V, int64_t H) {
  const int64_t i = blockIdx.x;
  const uint32_t key = keys[i];
  // Only the first position of a run of equal (valid) ids works; the test is block-uniform.
  if (key >= static_cast<uint64_t>(V) || (i > 0 && keys[i - 1] == key)) return;
  const int64_t col = (static_cast<int64_t>(blockIdx.y) * kBwdThreads + threadIdx.x) * VEC;
  const bool active = col < H;  // with VEC = 4, H is a multiple of 4
  __shared__ int32_t s_tok[kBwdThreads];
  float acc[VEC];
  float* out = dw + static_cast<int64_t>(key) * H + col;
  if (active) {
    load_vec<VEC>(out, acc);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  }
  for (int64_t base = i;; base += kBwdThreads) {
    const int64_t j = base + threadIdx.x;
    const bool match = j < T && keys[j] == key;
    s_tok[threadIdx.x] = match ? toks[j] : 0;
    // Sorted keys: the matches of this chunk are a prefix of it.
    const int cnt = __syncthreads_count(match);
    if (active) {
      int k = 0;
      for (; k + kAhead <= cnt; k += kAhead) {
        float r[kAhead][VEC];
#pragma unroll
        for (int u = 0; u < kAhead; ++u) load_vec<VEC>(dy + static_cast<int64_t>(s_tok[k + u]) * H + col, r[u]);
#pragma unroll
        for (int u = 0; u < kAhead; ++u) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[v] += r[u][v];
        }
      }
      for (; k < cnt; ++k) {
        float r[VEC];
        load_vec<VEC>(dy + static_cast<int64_t>(s_tok[k]) * H + col, r);
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] += r[v];
      }
    }
    if (cnt < kBwdThreads) break;
    __syncthreads();  // everyone has read s_tok before the next chunk overwrites it
  }
  if (active) store_vec<VEC>(out, acc);
}

int key_bits(int64_t V) {  // bits that hold every key in [0, V]
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) <= V) ++bits;
  return bits;
}

size_t align_up(size_t n) { return (n + 255) & ~size_t{255}; }

size_t cub_temp_bytes(int64_t T, int64_t V) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(T), 0, key_bits(V));
  return bytes;
}

template <typename G>
cudaError_t embedding_backward_impl(const int32_t* ids, const G* dy, float* dw, int64_t T, int64_t V, int64_t H,
                                    int64_t first, void* workspace, size_t workspace_bytes, cudaStream_t s) {
  if (T == 0 || H == 0) return cudaSuccess;
  char* p = static_cast<char*>(workspace);
  const size_t arr = align_up(static_cast<size_t>(T) * 4);
  auto* keys_in = reinterpret_cast<uint32_t*>(p);
  auto* vals_in = reinterpret_cast<int32_t*>(p + arr);
  auto* keys_out = reinterpret_cast<uint32_t*>(p + 2 * arr);
  auto* vals_out = reinterpret_cast<int32_t*>(p + 3 * arr);
  void* temp = p + 4 * arr;
  size_t temp_bytes = cub_temp_bytes(T, V);
  if (4 * arr + temp_bytes > workspace_bytes) return cudaErrorInvalidValue;
  make_sort_keys<<<static_cast<unsigned>((T + 255) / 256), 256, 0, s>>>(ids, keys_in, vals_in, T, V, first);
  cudaError_t e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in, vals_out,
                                                  static_cast<int>(T), 0, key_bits(V), s);
  if (e != cudaSuccess) return e;
  const bool vec = H % 4 == 0 && aligned16(dw) && (reinterpret_cast<uintptr_t>(dy) % (4 * sizeof(G))) == 0;
  if (vec) {
    const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((H / 4 + kBwdThreads - 1) / kBwdThreads));
    embedding_backward_runs<G, 4><<<grid, kBwdThreads, 0, s>>>(keys_out, vals_out, dy, dw, T, V, H);
  } else {
    const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((H + kBwdThreads - 1) / kBwdThreads));
    embedding_backward_runs<G, 1><<<grid, kBwdThreads, 0, s>>>(keys_out, vals_out, dy, dw, T, V, H);
  }
  return cudaGetLastError();
}

}  // namespace

void launch_embedding_forward(const int32_t* ids, const void* w, void* y, int64_t T, int64_t V, int64_t H,
                              int elem_bytes, int64_t first, int64_t whole, cudaStream_t s) {
  if (T == 0 || H == 0) return;
  const int64_t row_bytes = H * elem_bytes;
  const auto grid = static_cast<unsigned>(T);
  if (row_bytes % 16 == 0 && aligned16(w) && aligned16(y)) {
    // 16-byte units; NaN in every lane (0x7FC0 for bf16 halves, 0x7FC00000 for f32).
    const uint4 nan = elem_bytes == 2 ? make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u)
                                      : make_uint4(0x7FC00000u, 0x7FC00000u, 0x7FC00000u, 0x7FC00000u);
    embedding_forward_kernel<uint4><<<grid, kFwdThreads, 0, s>>>(ids, static_cast<const uint4*>(w),
                                                                 static_cast<uint4*>(y), V, row_bytes / 16, nan,
                                                                 first, whole);
  } else if (elem_bytes == 2) {
    embedding_forward_kernel<uint16_t><<<grid, kFwdThreads, 0, s>>>(ids, static_cast<const uint16_t*>(w),
                                                                     static_cast<uint16_t*>(y), V, H, 0x7FC0u, first,
                                                                     whole);
  } else {
    embedding_forward_kernel<uint32_t><<<grid, kFwdThreads, 0, s>>>(ids, static_cast<const uint32_t*>(w),
                                                                     static_cast<uint32_t*>(y), V, H, 0x7FC00000u,
                                                                     first, whole);
  }
}

namespace {
__global__ void shift_tokens_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ seg,
                                    int32_t* __restrict__ out, int64_t n, int64_t seq, int64_t k, int32_t fill) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const bool inside = t % seq + k < seq && (seg == nullptr || seg[t + k] == seg[t]);
  out[t] = inside ? ids[t + k] : fill;
}
}  // namespace

void launch_shift_tokens(const int32_t* ids, const int32_t* seg, int32_t* out, int64_t n, int64_t seq, int64_t k,
                         int32_t fill, cudaStream_t s) {
  if (n == 0) return;
  shift_tokens_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(ids, seg, out, n, seq, k, fill);
}

size_t embedding_backward_workspace_bytes(int64_t T, int64_t V) {
  if (T == 0) return 0;
  return 4 * align_up(static_cast<size_t>(T) * 4) + cub_temp_bytes(T, V);
}

cudaError_t launch_embedding_backward(const int32_t* ids, const __nv_bfloat16* dy, float* dw, int64_t T, int64_t V,
                                      int64_t H, int64_t first, void* workspace, size_t workspace_bytes,
                                      cudaStream_t s) {
  return embedding_backward_impl(ids, dy, dw, T, V, H, first, workspace, workspace_bytes, s);
}
cudaError_t launch_embedding_backward(const int32_t* ids, const float* dy, float* dw, int64_t T, int64_t V,
                                      int64_t H, int64_t first, void* workspace, size_t workspace_bytes,
                                      cudaStream_t s) {
  return embedding_backward_impl(ids, dy, dw, T, V, H, first, workspace, workspace_bytes, s);
}

}  // namespace moetrain::ops::cuda
