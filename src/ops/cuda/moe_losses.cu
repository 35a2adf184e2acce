// MoE auxiliary-loss kernels: Hugging Face load balancing (tallies and gradient) and the
// ST-MoE router z-loss. All deterministic:
//
// load_balance_accumulate
//   counts: each 256-thread block histograms 4096 (r, k) entries in shared memory and adds
//           its bins to global i32 counts with integer atomics (integer sums do not depend
//           on their order); an index outside [0, E) bumps a "bad" counter;
//   prob sums: pass 1 over a grid (E/32 column tiles, row chunks), block 32 x 8, thread
//           (e, j) adds rows r0+j, r0+j+8, ... of its chunk in double, in order; the 8 row
//           lanes are added in fixed order through shared memory -> partial[chunk][e];
//           pass 2, one thread per expert, adds the chunks in order (double) and does the
//           += into prob_sum and selections (NaN selections if some index was bad).
//   The row chunks depend only on (R, E).
// load_balance_backward: a fill, each value computed in double as the CPU reference does.
// router_z_loss_forward: one warp per row (max, then sum of exp, in f32 with full-precision
//   expf/logf), lse and lse^2 per row, then the fixed-order sum of launch_sum_fixed_order.
// router_z_loss_backward: element-wise.
// seq_balance (DeepSeek-V3's sequence-wise balance loss): one block per sequence, below.
#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/kernels.cuh"
#include "ops/cuda/moe_losses_launch.h"
#include "ops/cuda/vec_io.cuh"

namespace moetrain::ops::cuda {
namespace {

constexpr int kColTile = 32, kRowLanes = 8;
constexpr int kHistThreads = 256, kHistEntries = 4096;
constexpr int kHistMaxExperts = 8192;  // shared histogram up to this many experts

struct Split {
  int64_t chunks, rows_per_chunk;
};
Split row_split(int64_t R, int64_t E) {
  const int64_t col_tiles = (E + kColTile - 1) / kColTile;
  int64_t chunks = (1024 + col_tiles - 1) / col_tiles;
  const int64_t max_chunks = (R + 63) / 64;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks < 1) chunks = 1;
  int64_t rows_per = (R + chunks - 1) / chunks;
  if (rows_per < 1) rows_per = 1;
  return {(R + rows_per - 1) / rows_per > 0 ? (R + rows_per - 1) / rows_per : 1, rows_per};
}

size_t align_up(size_t n) { return (n + 255) & ~size_t{255}; }

// Scratch layout: [counts i32 E][bad i32 1] | partial f64 [chunks * E]
size_t counts_bytes(int64_t E) { return align_up(static_cast<size_t>(E + 1) * 4); }

__global__ void __launch_bounds__(kHistThreads) count_selections(const int32_t* __restrict__ idx, int64_t n,
                                                                 int64_t E, int32_t* __restrict__ counts,
                                                                 int32_t* __restrict__ bad, bool shared_hist) {
  extern __shared__ int32_t hist[];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kHistEntries;
  const int64_t end = begin + kHistEntries < n ? begin + kHistEntries : n;
  if (shared_hist) {
    for (int64_t e = threadIdx.x; e < E; e += kHistThreads) hist[e] = 0;
    __syncthreads();
  }
  int32_t nbad = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kHistThreads) {
    const int32_t e = idx[i];
    if (e < 0 || e >= E) {
      ++nbad;
    } else if (shared_hist) {
      atomicAdd(&hist[e], 1);
    } else {
      atomicAdd(&counts[e], 1);
    }
  }
  if (nbad) atomicAdd(bad, nbad);
  if (shared_hist) {
    __syncthreads();
    for (int64_t e = threadIdx.x; e < E; e += kHistThreads) {
      if (hist[e]) atomicAdd(&counts[e], hist[e]);
    }
  }
}

__global__ void __launch_bounds__(kColTile* kRowLanes) prob_sum_pass1(const float* __restrict__ probs,
                                                                     double* __restrict__ partial, int64_t R,
                                                                     int64_t E, int64_t rows_per) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per;
  const int64_t r1 = r0 + rows_per < R ? r0 + rows_per : R;
  double acc = 0.0;
  if (e < E) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kRowLanes) acc += static_cast<double>(probs[r * E + e]);
  }
  __shared__ double lanes[kRowLanes][kColTile + 1];
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double t = 0.0;
#pragma unroll
    for (int k = 0; k < kRowLanes; ++k) t += lanes[k][threadIdx.x];
    partial[blockIdx.y * E + e] = t;
  }
}

__global__ void load_balance_finish(const double* __restrict__ partial, const int32_t* __restrict__ counts,
                                    const int32_t* __restrict__ bad, float* __restrict__ selections,
                                    float* __restrict__ prob_sum, int64_t E, int64_t chunks) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  double t = 0.0;
  for (int64_t b = 0; b < chunks; ++b) t += partial[b * E + e];
  prob_sum[e] = static_cast<float>(static_cast<double>(prob_sum[e]) + t);
  selections[e] = *bad ? NAN : static_cast<float>(static_cast<double>(selections[e]) + counts[e]);
}

// dprobs[r, e] = (coef * E * sel[e]) / R^2, in double in the CPU reference's order.
__global__ void load_balance_grad(const float* __restrict__ selections, float* __restrict__ dprobs, int64_t n,
                                  int64_t E, double coef_e, double r2) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dprobs[i] = static_cast<float>(coef_e * static_cast<double>(selections[i % E]) / r2);
}

__global__ void zero_ints(int32_t* __restrict__ p, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = 0;
}

constexpr int kZRowsPerBlock = 8;

template <typename T>
__global__ void __launch_bounds__(32 * kZRowsPerBlock) z_loss_forward_kernel(const T* __restrict__ logits,
                                                                              float* __restrict__ lse,
                                                                              float* __restrict__ sq, int64_t R,
                                                                              int64_t E) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kZRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const T* l = logits + r * E;
  float m = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) m = fmaxf(m, to_float(l[e]));
  m = warp_max(m);
  float s = 0.f;
  if (m != -INFINITY) {
    for (int64_t e = lane; e < E; e += 32) s += expf(to_float(l[e]) - m);
  }
  s = warp_sum(s);
  if (lane == 0) {
    const float z = m + logf(s);
    lse[r] = z;
    sq[r] = z * z;
  }
}

__global__ void z_loss_backward_kernel(const float* __restrict__ probs, const float* __restrict__ lse,
                                       __nv_bfloat16* __restrict__ d, int64_t n, int64_t E, float scale2) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    d[i] = __float2bfloat16(scale2 * lse[i / E] * probs[i]);
}

// One warp per row: h[r] = -sum_e p log p (p = 0 adds nothing).
__global__ void __launch_bounds__(32 * kZRowsPerBlock) router_entropy_kernel(const float* __restrict__ probs,
                                                                             float* __restrict__ h, int64_t R,
                                                                             int64_t E) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kZRowsPerBlock + (threadIdx.x >> 5);
  if (r >= R) return;  // whole warps leave together
  const int lane = threadIdx.x & 31;
  const float* p = probs + r * E;
  float s = 0.f;
  for (int64_t e = lane; e < E; e += 32) {
    const float v = p[e];
    if (v > 0.f) s -= v * logf(v);
  }
  s = warp_sum(s);
  if (lane == 0) h[r] = s;
}

int grid_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 132 * 16) b = 132 * 16;
  return static_cast<int>(b);
}

template <typename T>
void z_forward_impl(const T* logits, float* lse, float* sq, float* loss_sum, int64_t R, int64_t E, cudaStream_t s) {
  if (R > 0) {
    const auto grid = static_cast<unsigned>((R + kZRowsPerBlock - 1) / kZRowsPerBlock);
    z_loss_forward_kernel<T><<<grid, 32 * kZRowsPerBlock, 0, s>>>(logits, lse, sq, R, E);
  }
  launch_sum_fixed_order(sq, R, loss_sum, s);
}

// DeepSeek-V3's sequence-wise balance loss: one block per sequence. Its experts' counts in
// shared memory (integer atomics: exact), f = E / (K S) * counts; then a warp per row: Z and
// <f, p> (warp sums, fixed order). Forward: each warp adds its rows' <f, p> / Z in row order,
// the warps in order -> per_seq[b] / S. Backward: dprobs = scale / S * (f - <f, p> / Z) / Z.
// Over a part of each sequence (context parallelism): `whole` (f64 [B, E]) gives the whole
// sequences' counts and s_whole their length, which take the place of this part's.
constexpr int kSeqWarps = 8;

// The selections of each expert in each sequence (one block a sequence), as f64 [B, E].
__global__ void __launch_bounds__(kSeqWarps * 32) seq_counts_kernel(const int32_t* __restrict__ idx, int S, int E,
                                                                     int K, double* __restrict__ out) {
  extern __shared__ int tally[];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * S;
  for (int e = threadIdx.x; e < E; e += blockDim.x) tally[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(S) * K; i += blockDim.x) {
    const int e = idx[row0 * K + i];
    if (e >= 0 && e < E) atomicAdd(&tally[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) out[static_cast<int64_t>(blockIdx.x) * E + e] = tally[e];
}

template <bool kBackward>
__global__ void __launch_bounds__(kSeqWarps * 32) seq_balance_kernel(const float* __restrict__ probs,
                                                                      const int32_t* __restrict__ idx, int S, int E,
                                                                      int K, float scale, const double* __restrict__ whole,
                                                                      int s_whole, float* __restrict__ per_seq,
                                                                      float* __restrict__ dprobs) {
  extern __shared__ float f[];  // [E], then kSeqWarps partial sums
  int* counts = reinterpret_cast<int*>(f);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * S;
  const int s_norm = whole != nullptr ? s_whole : S;  // the length f and P are over
  const float per = static_cast<float>(E) / static_cast<float>(K * s_norm);
  if (whole != nullptr) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      f[e] = per * static_cast<float>(whole[static_cast<int64_t>(blockIdx.x) * E + e]);
    }
  } else {
    for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(S) * K; i += blockDim.x) {
      const int e = idx[row0 * K + i];
      if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) f[e] = per * static_cast<float>(counts[e]);
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc = 0.f;
  for (int t = warp; t < S; t += kSeqWarps) {
    const float* p = probs + (row0 + t) * E;
    float z = 0.f, dot = 0.f;
    for (int e = lane; e < E; e += 32) {
      z += p[e];
      dot += f[e] * p[e];
    }
    z = warp_sum(z);
    dot = warp_sum(dot);
    if constexpr (kBackward) {
      float* d = dprobs + (row0 + t) * E;
      const float c = scale / static_cast<float>(s_norm) / z, fp = dot / z;
      for (int e = lane; e < E; e += 32) d[e] = c * (f[e] - fp);
    } else {
      acc += dot / z;
    }
  }
  if constexpr (!kBackward) {
    float* partial = f + E;
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int w = 0; w < kSeqWarps; ++w) total += partial[w];
      per_seq[blockIdx.x] = total / static_cast<float>(s_norm);
    }
  }
}

}  // namespace

void launch_router_entropy_sum(const float* probs, float* h, float* out, int64_t R, int64_t E, cudaStream_t s) {
  if (R > 0) {
    const auto grid = static_cast<unsigned>((R + kZRowsPerBlock - 1) / kZRowsPerBlock);
    router_entropy_kernel<<<grid, 32 * kZRowsPerBlock, 0, s>>>(probs, h, R, E);
  }
  launch_sum_fixed_order(h, R, out, s);
}

size_t load_balance_scratch_bytes(int64_t R, int64_t E) {
  return counts_bytes(E) + static_cast<size_t>(row_split(R, E).chunks * E) * sizeof(double);
}

void launch_load_balance_accumulate(const float* probs, const int32_t* topk_idx, float* selections,
                                    float* prob_sum, int64_t R, int64_t E, int64_t K, void* scratch,
                                    cudaStream_t s) {
  if (E == 0) return;
  auto* counts = static_cast<int32_t*>(scratch);
  int32_t* bad = counts + E;
  auto* partial = reinterpret_cast<double*>(static_cast<char*>(scratch) + counts_bytes(E));
  zero_ints<<<grid_for(E + 1, 256), 256, 0, s>>>(counts, E + 1);
  const int64_t n = R * K;
  if (n > 0) {
    const bool shared_hist = E <= kHistMaxExperts;
    const size_t smem = shared_hist ? static_cast<size_t>(E) * sizeof(int32_t) : 0;
    const auto grid = static_cast<unsigned>((n + kHistEntries - 1) / kHistEntries);
    count_selections<<<grid, kHistThreads, smem, s>>>(topk_idx, n, E, counts, bad, shared_hist);
  }
  const Split sp = row_split(R, E);
  if (R > 0) {
    const dim3 grid(static_cast<unsigned>((E + kColTile - 1) / kColTile), static_cast<unsigned>(sp.chunks));
    prob_sum_pass1<<<grid, dim3(kColTile, kRowLanes), 0, s>>>(probs, partial, R, E, sp.rows_per_chunk);
  }
  load_balance_finish<<<static_cast<unsigned>((E + 255) / 256), 256, 0, s>>>(partial, counts, bad, selections,
                                                                             prob_sum, E, R > 0 ? sp.chunks : 0);
}

void launch_load_balance_backward(const float* selections, float* dprobs, int64_t rows, int64_t E,
                                  int64_t total_rows, double coef, cudaStream_t s) {
  const int64_t n = rows * E;
  if (n == 0) return;
  const double R = static_cast<double>(total_rows);
  load_balance_grad<<<grid_for(n, 256), 256, 0, s>>>(selections, dprobs, n, E, coef * static_cast<double>(E),
                                                      R * R);
}

void launch_router_z_loss_forward(const float* logits, float* lse, float* sq, float* loss_sum, int64_t R,
                                  int64_t E, cudaStream_t s) {
  z_forward_impl(logits, lse, sq, loss_sum, R, E, s);
}
void launch_router_z_loss_forward(const __nv_bfloat16* logits, float* lse, float* sq, float* loss_sum, int64_t R,
                                  int64_t E, cudaStream_t s) {
  z_forward_impl(logits, lse, sq, loss_sum, R, E, s);
}

void launch_router_z_loss_backward(const float* probs, const float* lse, __nv_bfloat16* dlogits, int64_t R,
                                   int64_t E, float scale, cudaStream_t s) {
  const int64_t n = R * E;
  if (n == 0) return;
  z_loss_backward_kernel<<<grid_for(n, 256), 256, 0, s>>>(probs, lse, dlogits, n, E, 2.f * scale);
}

void launch_seq_balance_loss_sum(const float* probs, const int32_t* topk_idx, const double* whole, int64_t s_whole,
                                  float* per_seq, float* loss_sum, int64_t B, int64_t S, int64_t E, int64_t K,
                                  cudaStream_t s) {
  if (B > 0 && S > 0) {
    const size_t smem = (static_cast<size_t>(E) + kSeqWarps) * sizeof(float);
    seq_balance_kernel<false><<<static_cast<unsigned>(B), kSeqWarps * 32, smem, s>>>(
        probs, topk_idx, static_cast<int>(S), static_cast<int>(E), static_cast<int>(K), 0.f, whole,
        static_cast<int>(s_whole), per_seq, nullptr);
  }
  launch_sum_fixed_order(per_seq, B, loss_sum, s);
}

void launch_seq_balance_backward(const float* probs, const int32_t* topk_idx, const double* whole, int64_t s_whole,
                                 float* dprobs, int64_t B, int64_t S, int64_t E, int64_t K, float scale,
                                 cudaStream_t s) {
  if (B == 0 || S == 0) return;
  const size_t smem = (static_cast<size_t>(E) + kSeqWarps) * sizeof(float);
  seq_balance_kernel<true><<<static_cast<unsigned>(B), kSeqWarps * 32, smem, s>>>(
      probs, topk_idx, static_cast<int>(S), static_cast<int>(E), static_cast<int>(K), scale, whole,
      static_cast<int>(s_whole), nullptr, dprobs);
}

void launch_seq_balance_counts(const int32_t* topk_idx, double* counts, int64_t B, int64_t S, int64_t E, int64_t K,
                               cudaStream_t s) {
  if (B == 0) return;
  seq_counts_kernel<<<static_cast<unsigned>(B), kSeqWarps * 32, static_cast<size_t>(E) * sizeof(int), s>>>(
      topk_idx, static_cast<int>(S), static_cast<int>(E), static_cast<int>(K), counts);
}

}  // namespace moetrain::ops::cuda
