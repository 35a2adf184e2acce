// Token-permutation kernels: a deterministic, stable counting sort by expert with no host
// synchronisation, and the row gathers/scatters that move tokens between (t, k) order and
// expert order.
//
// permutation (pairs i = t*K + k split into chunks of kChunk, one block each):
//   1. count:   per-chunk histogram of expert ids (shared-memory integer atomics: a count,
//               so the order of the adds does not matter) -> tally[e][chunk]
//   2. scan:    one block per expert: exclusive prefix of tally[e][.] over the chunks, in
//               chunk order; the totals are counts[e]
//   3. scatter: each block scans counts into expert offsets, adds its chunk's prefix, then
//               walks its pairs in order, 256 at a time: within a warp, a pair's rank among
//               the earlier lanes with the same expert comes from __match_any_sync; the
//               per-warp tallies are scanned in warp order. So pair i gets
//               row = offset[e] + #(pairs before i with expert e): the CPU's stable order.
#include <type_traits>

#include "ops/cuda/kernels.cuh"
#include "ops/cuda/moe_device.cuh"
#include "ops/cuda/permute_launch.h"

namespace moetrain::ops::cuda {
namespace {

using namespace moe;

constexpr int kChunk = 4096;  // pairs per block
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

int64_t num_chunks(int64_t NK) { return (NK + kChunk - 1) / kChunk; }

__global__ void __launch_bounds__(kThreads)
    permutation_count_kernel(const int32_t* __restrict__ idx, int64_t NK, int E, int nchunks, int* __restrict__ tally) {
  extern __shared__ int hist[];  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, NK);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int e = idx[i];
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) tally[static_cast<int64_t>(e) * nchunks + blockIdx.x] = hist[e];
}

__global__ void __launch_bounds__(kThreads)
    permutation_scan_kernel(int* __restrict__ tally, int nchunks, int* __restrict__ totals,
                            int64_t* __restrict__ counts) {
  __shared__ int scratch[33];
  const int e = blockIdx.x;
  const int total = block_exclusive_scan(tally + static_cast<int64_t>(e) * nchunks, nchunks, scratch);
  if (threadIdx.x == 0) {
    totals[e] = total;
    counts[e] = total;
  }
}

__global__ void __launch_bounds__(kThreads)
    permutation_scatter_kernel(const int32_t* __restrict__ idx, int64_t NK, int K, int E, int nchunks,
                               const int* __restrict__ tally, const int* __restrict__ totals,
                               int32_t* __restrict__ slot_row, int32_t* __restrict__ source_token) {
  extern __shared__ int smem[];
  int* base = smem;              // [E]: next row of each expert for this block
  int* wcount = smem + E;        // [kWarps][E]: per-warp tallies of a round, then their offsets
  int* scratch = smem + (kWarps + 1) * E;  // [33]
  for (int e = threadIdx.x; e < E; e += blockDim.x) base[e] = totals[e];
  __syncthreads();
  block_exclusive_scan(base, E, scratch);  // expert offsets (ends with a barrier)
  for (int e = threadIdx.x; e < E; e += blockDim.x) base[e] += tally[static_cast<int64_t>(e) * nchunks + blockIdx.x];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned lower_lanes = (1u << lane) - 1u;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, NK);
  for (int64_t round = begin; round < end; round += kThreads) {
    for (int j = threadIdx.x; j < kWarps * E; j += blockDim.x) wcount[j] = 0;
    __syncthreads();  // also orders the base[] updates above / of the last round
    const int64_t i = round + threadIdx.x;
    int e = i < end ? idx[i] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & lower_lanes);
    if (e >= 0 && rank == 0) wcount[warp * E + e] = __popc(peers);
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
      int s = base[x];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int c = wcount[w * E + x];
        wcount[w * E + x] = s;
        s += c;
      }
      base[x] = s;
    }
    __syncthreads();
    if (e >= 0) {
      const int row = wcount[warp * E + e] + rank;
      slot_row[i] = row;
      source_token[row] = static_cast<int32_t>(i / K);
    }
    __syncthreads();  // wcount is cleared by the next round
  }
}

// ---- row copies ------------------------------------------------------------------------
constexpr int kCopyWarps = 4;

template <typename V>
__global__ void __launch_bounds__(kCopyWarps * 32)
    copy_rows_kernel(const V* __restrict__ src, V* __restrict__ dst, const int32_t* __restrict__ index, int64_t rows,
                     int64_t index_rows, int64_t row_vecs, bool scatter) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kCopyWarps + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int64_t j = index[r];
  if (j < 0 || j >= index_rows) return;
  const V* s = src + (scatter ? r : j) * row_vecs;
  V* d = dst + (scatter ? j : r) * row_vecs;
  // Streaming stores (evict-first in L2), so that the copies (K times the source's bytes in a
  // gather) push less of the source, each row read K times, out of L2. The bench's gather:
  // 164 -> 152 us a layer (~100 would be the copies' own bytes; the source was mostly not
  // what it waited for).
  constexpr int kUnroll = 4;
  int64_t c = lane;
  for (; c + 32 * (kUnroll - 1) < row_vecs; c += 32 * kUnroll) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[c + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) __stcs(d + c + 32 * u, v[u]);
  }
  for (; c < row_vecs; c += 32) __stcs(d + c, s[c]);
}

template <typename T, bool kVec8>
__global__ void __launch_bounds__(kCopyWarps * 32)
    permute_backward_kernel(const T* __restrict__ dxp, const int32_t* __restrict__ slot_row, int64_t T_, int K,
                            int64_t NK, int64_t H, T* __restrict__ dx) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kCopyWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  const int32_t* slots = slot_row + t * K;  // rows outside [0, NK) (NK: the kept rows) skipped
  T* out = dx + t * H;
  if constexpr (kVec8) {
    for (int64_t h = static_cast<int64_t>(lane) * 8; h < H; h += 32 * 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        const int64_t r = slots[k];
        if (r < 0 || r >= NK) continue;
        float v[8];
        load8(dxp + r * H + h, v);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] += v[q];
      }
      store8(out + h, acc);
    }
  } else {
    for (int64_t h = lane; h < H; h += 32) {
      float acc = 0.f;
      for (int k = 0; k < K; ++k) {
        const int64_t r = slots[k];
        if (r >= 0 && r < NK) acc += to_float(dxp[r * H + h]);
      }
      out[h] = from_float<T>(acc);
    }
  }
}

__global__ void expert_ids_in_range_kernel(const int32_t* __restrict__ idx, int64_t n, int32_t first, int32_t count,
                                           int32_t* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int32_t e = idx[i];
  out[i] = e >= first && e - first < count ? e - first : count;
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

int64_t permutation_workspace_words(int64_t NK, int E) { return static_cast<int64_t>(E) * (num_chunks(NK) + 1); }

void launch_permutation(const int32_t* topk_idx, int64_t NK, int K, int E, int64_t* counts, int32_t* slot_row,
                        int32_t* source_token, int32_t* workspace, cudaStream_t stream) {
  const int nchunks = static_cast<int>(num_chunks(NK));
  int* tally = workspace;                                  // [E][nchunks]
  int* totals = workspace + static_cast<int64_t>(E) * nchunks;  // [E]
  if (nchunks > 0) {
    permutation_count_kernel<<<nchunks, kThreads, E * sizeof(int), stream>>>(topk_idx, NK, E, nchunks, tally);
  }
  permutation_scan_kernel<<<E, kThreads, 0, stream>>>(tally, nchunks, totals, counts);
  if (nchunks > 0) {
    const size_t smem = ((kWarps + 1) * static_cast<size_t>(E) + 33) * sizeof(int);
    permutation_scatter_kernel<<<nchunks, kThreads, smem, stream>>>(topk_idx, NK, K, E, nchunks, tally, totals,
                                                                    slot_row, source_token);
  }
}

void launch_copy_rows(const void* src, void* dst, const int32_t* index, int64_t rows, int64_t index_rows,
                      int64_t row_bytes, bool scatter, cudaStream_t stream) {
  if (rows == 0 || row_bytes == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kCopyWarps - 1) / kCopyWarps);
  auto go = [&](auto vec) {
    using V = decltype(vec);
    copy_rows_kernel<V><<<blocks, kCopyWarps * 32, 0, stream>>>(static_cast<const V*>(src), static_cast<V*>(dst),
                                                                 index, rows, index_rows,
                                                                 row_bytes / static_cast<int64_t>(sizeof(V)), scatter);
  };
  auto fits = [&](size_t a) { return row_bytes % static_cast<int64_t>(a) == 0 && aligned(src, a) && aligned(dst, a); };
  if (fits(16)) go(uint4{});
  else if (fits(8)) go(uint2{});
  else if (fits(4)) go(uint32_t{});
  else if (fits(2)) go(uint16_t{});
  else go(uint8_t{});
}

namespace {
__global__ void gather_columns_kernel(const float* __restrict__ x, int64_t L, int64_t T,
                                      const int32_t* __restrict__ index, int64_t R, float* __restrict__ out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= R) return;
  const int64_t j = index[r];
  if (j < 0 || j >= T) return;  // as copy_rows_kernel: a row whose index is outside stays as it is
  for (int64_t l = 0; l < L; ++l) out[l * R + r] = x[l * T + j];
}
}  // namespace

void launch_gather_columns(const float* x, int64_t L, int64_t T, const int32_t* index, int64_t R, float* out,
                           cudaStream_t stream) {
  if (R == 0 || L == 0) return;
  gather_columns_kernel<<<static_cast<unsigned>((R + 255) / 256), 256, 0, stream>>>(x, L, T, index, R, out);
}

void launch_permute_backward(const void* dxp, const int32_t* slot_row, int64_t T, int K, int64_t R, int64_t H,
                             void* dx, bool is_bf16, cudaStream_t stream) {
  if (T == 0 || H == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kCopyWarps - 1) / kCopyWarps);
  const bool vec = H % 8 == 0 && aligned(dxp, 16) && aligned(dx, 16);
  auto go = [&](auto tag) {
    using E = decltype(tag);
    const E* in = static_cast<const E*>(dxp);
    E* out = static_cast<E*>(dx);
    if (vec) permute_backward_kernel<E, true><<<blocks, kCopyWarps * 32, 0, stream>>>(in, slot_row, T, K, R, H, out);
    else permute_backward_kernel<E, false><<<blocks, kCopyWarps * 32, 0, stream>>>(in, slot_row, T, K, R, H, out);
  };
  if (is_bf16) go(__nv_bfloat16{});
  else go(float{});
}

void launch_expert_ids_in_range(const int32_t* idx, int64_t n, int32_t first, int32_t count, int32_t* out,
                                cudaStream_t stream) {
  if (n == 0) return;
  expert_ids_in_range_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(idx, n, first, count, out);
}

}  // namespace moetrain::ops::cuda
