// Weighted combine kernels: one warp per token, 8-wide vector accesses when H % 8 == 0
// (scalar otherwise), f32 accumulation in k order; dweight's row dot product is reduced
// with a fixed warp butterfly, so results are deterministic. With an order (the routing's
// slot_row), the expert outputs and their gradients stay in expert order: each token's K
// rows are read and written where the grouped GEMMs left them (4 KB each), which saves the
// two unpermute copies of 2 x 268 MB a layer at the bench shape.
#include "ops/cuda/combine_launch.h"
#include "ops/cuda/fp8_device.cuh"
#include "ops/cuda/kernels.cuh"
#include "ops/cuda/moe_device.cuh"

namespace moetrain::ops::cuda {
namespace {

using namespace moe;

constexpr int kWarps = 4;

template <typename T, bool kVec8>
__global__ void __launch_bounds__(kWarps * 32)
    combine_forward_kernel(const T* __restrict__ eo, const float* __restrict__ weight, const T* __restrict__ residual,
                           const int32_t* __restrict__ order, int64_t T_, int K, int64_t R, int64_t H,
                           T* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  const float* w = weight + t * K;
  // Expert-output row of slot k of this token (-1: outside the R rows, absent, skipped).
  auto row_of = [&](int k) -> int64_t {
    const int64_t r = order ? order[t * K + k] : t * K + k;
    return r >= 0 && r < R ? r : -1;
  };
  T* out = y + t * H;
  if constexpr (kVec8) {
    for (int64_t h = static_cast<int64_t>(lane) * 8; h < H; h += 32 * 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (residual) load8(residual + t * H + h, acc);
      for (int k = 0; k < K; ++k) {
        const int64_t r = row_of(k);
        if (r < 0) continue;
        const float wk = w[k];
        float v[8];
        load8(eo + r * H + h, v);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] += wk * v[q];
      }
      store8(out + h, acc);
    }
  } else {
    for (int64_t h = lane; h < H; h += 32) {
      float acc = residual ? to_float(residual[t * H + h]) : 0.f;
      for (int k = 0; k < K; ++k) {
        const int64_t r = row_of(k);
        if (r >= 0) acc += w[k] * to_float(eo[r * H + h]);
      }
      out[h] = from_float<T>(acc);
    }
  }
}

// kCodes (bf16, kVec8, H % 128 == 0): also each written row's e4m3 codes per 1 x 128 tile (a
// half-warp's 16 lanes hold one tile, 8 columns each): the bits quantize_fp8 makes of deo.
// Every slot's row is dy scaled by its weight, so a tile's amax is found once a token: with
// RN products and RN to bf16 both monotone in |x|, max |bf16(w x)| over the tile is
// bf16(|w| max |x|). The warp's tiles' amax of dy wait in shared memory (H / 128 floats a
// warp); a slot's scales then take a product each instead of a half-warp's four dependent
// shuffles per tile, which sat between each slot's loads and the next's (with the shuffles
// the codes cost 6.6 ms a bench step, against ~3 for their bytes; docs/fp8.md, session 34).
template <typename T, bool kVec8, bool kCodes = false>
__global__ void __launch_bounds__(kWarps * 32)
    combine_backward_kernel(const T* __restrict__ dy, const T* __restrict__ eo, const float* __restrict__ weight,
                            const int32_t* __restrict__ order, int64_t T_, int K, int64_t R, int64_t H,
                            T* __restrict__ deo, float* __restrict__ dweight, Fp8Codes codes) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= T_) return;
  const T* d = dy + t * H;
  float* tile_amax = nullptr;  // kCodes: dy's amax of each tile of the row
  if constexpr (kCodes) {
    extern __shared__ float tile_amax_smem[];
    tile_amax = tile_amax_smem + (threadIdx.x >> 5) * (H / 128);
    for (int64_t c = static_cast<int64_t>(lane) * 8; c < H; c += 256) {  // a half-warp's lanes all in or all out
      float v[8];
      load8(d + c, v);
      const float m = fp8::half_warp_amax(v);
      if ((lane & 15) == 0) tile_amax[c / 128] = m;
    }
    __syncwarp();
  }
  for (int k = 0; k < K; ++k) {
    const int64_t r = t * K + k;
    const int64_t at = order ? order[r] : r;  // the expert-output row (and its gradient's)
    if (at < 0 || at >= R) {  // absent
      if (lane == 0) dweight[r] = 0.f;
      continue;
    }
    const float wk = weight[r];
    const T* e = eo + at * H;
    T* de = deo + at * H;
    float acc = 0.f;
    if constexpr (kVec8) {
      // Four groups' loads issued before any is used: one group at a time kept too few
      // bytes in flight (a warp per token, H = 2048 is eight groups a lane).
      constexpr int kU = 4;
      for (int64_t h0 = static_cast<int64_t>(lane) * 8; h0 < H; h0 += 32 * 8 * kU) {
        float dv[kU][8], ev[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (h0 + u * 256 < H) {
            load8(d + h0 + u * 256, dv[u]);
            load8(e + h0 + u * 256, ev[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (h0 + u * 256 >= H) continue;
          float o[8];
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            o[q] = wk * dv[u][q];
            acc += dv[u][q] * ev[u][q];
          }
          store8(de + h0 + u * 256, o);
          if constexpr (kCodes) {  // the half-warp's columns are all inside H or all past it
            const int64_t c = h0 + u * 256;
#pragma unroll
            for (int q = 0; q < 8; ++q) o[q] = __bfloat162float(__float2bfloat16_rn(o[q]));  // as stored
            const float amax = __bfloat162float(__float2bfloat16_rn(fabsf(wk) * tile_amax[c / 128]));
            fp8::store_half_warp_codes(o, fp8::tile_scale(amax), codes.q + at * H + c, codes.scale + (c / 128) * R + at);
          }
        }
      }
    } else {
      for (int64_t h = lane; h < H; h += 32) {
        const float dv = to_float(d[h]);
        de[h] = from_float<T>(wk * dv);
        acc += dv * to_float(e[h]);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) dweight[r] = acc;
  }
}

bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void launch_combine_forward(const void* expert_out, const float* weight, const void* residual, const int32_t* order,
                            int64_t T, int K, int64_t R, int64_t H, void* y, bool is_bf16, cudaStream_t stream) {
  if (T == 0 || H == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kWarps - 1) / kWarps);
  const bool vec = H % 8 == 0 && is_aligned16(expert_out) && is_aligned16(y) && (!residual || is_aligned16(residual));
  auto go = [&](auto tag) {
    using E = decltype(tag);
    auto eo = static_cast<const E*>(expert_out);
    auto res = static_cast<const E*>(residual);
    auto out = static_cast<E*>(y);
    if (vec) combine_forward_kernel<E, true><<<blocks, kWarps * 32, 0, stream>>>(eo, weight, res, order, T, K, R, H, out);
    else combine_forward_kernel<E, false><<<blocks, kWarps * 32, 0, stream>>>(eo, weight, res, order, T, K, R, H, out);
  };
  if (is_bf16) go(__nv_bfloat16{});
  else go(float{});
}

bool launch_combine_backward(const void* dy, const void* expert_out, const float* weight, const int32_t* order,
                             int64_t T, int K, int64_t R, int64_t H, void* dexpert_out, float* dweight,
                             bool is_bf16, Fp8Codes codes, cudaStream_t stream) {
  const bool vec = H % 8 == 0 && is_aligned16(dy) && is_aligned16(expert_out) && is_aligned16(dexpert_out);
  const bool with_codes = codes.q != nullptr && is_bf16 && vec && H % 128 == 0;
  if (T == 0 || K == 0) return with_codes;
  const unsigned blocks = static_cast<unsigned>((T + kWarps - 1) / kWarps);
  auto go = [&](auto tag) {
    using E = decltype(tag);
    auto d = static_cast<const E*>(dy);
    auto eo = static_cast<const E*>(expert_out);
    auto de = static_cast<E*>(dexpert_out);
    if (vec) {
      combine_backward_kernel<E, true>
          <<<blocks, kWarps * 32, 0, stream>>>(d, eo, weight, order, T, K, R, H, de, dweight, codes);
    } else {
      combine_backward_kernel<E, false>
          <<<blocks, kWarps * 32, 0, stream>>>(d, eo, weight, order, T, K, R, H, de, dweight, codes);
    }
  };
  if (with_codes) {
    const size_t smem = static_cast<size_t>(kWarps) * (H / 128) * sizeof(float);  // each warp's tiles' amax of dy
    combine_backward_kernel<__nv_bfloat16, true, true><<<blocks, kWarps * 32, smem, stream>>>(
        static_cast<const __nv_bfloat16*>(dy), static_cast<const __nv_bfloat16*>(expert_out), weight, order, T, K, R,
        H, static_cast<__nv_bfloat16*>(dexpert_out), dweight, codes);
  } else if (is_bf16) {
    go(__nv_bfloat16{});
  } else {
    go(float{});
  }
  return with_codes;
}

}  // namespace moetrain::ops::cuda
