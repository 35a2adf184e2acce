// FP8 (e4m3) block quantization and the block-scaled GEMM on the CPU: the references the
// CUDA kernels match (ops.h).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ops/arg_checks.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {
namespace {

// Elements of x as floats (bf16, f32 or f64; x on the host).
std::vector<float> as_floats(const Tensor& x) {
  const std::vector<double> d = x.to_double_vector();
  return std::vector<float>(d.begin(), d.end());
}

// One tile's scale: amax / 448, or 1 for an all-zero tile.
float tile_scale(float amax) { return amax > 0.0f ? amax / kFp8E4m3Max : 1.0f; }

}  // namespace

Fp8Tensor quantize_fp8(const Tensor& x, Fp8Blocks blocks) {
  const int64_t R = x.size(0), C = x.size(1), L = fp8_blocks_of(C);
  const std::vector<float> v = as_floats(x);
  Fp8Tensor out{Tensor::empty({R, C}, DType::F8E4M3), Tensor::full(fp8_scale_shape(R, C, blocks), 1.0, DType::F32),
                blocks};
  uint8_t* q = static_cast<uint8_t*>(out.q.raw());
  float* s = out.scale.data<float>();
  const int64_t tile_rows = blocks == Fp8Blocks::kRows ? 1 : kFp8Block;
  const int64_t scale_cols = out.scale.size(1);
  for (int64_t r0 = 0; r0 < R; r0 += tile_rows) {
    const int64_t r1 = std::min(R, r0 + tile_rows);
    for (int64_t kb = 0; kb < L; ++kb) {
      const int64_t c0 = kb * kFp8Block, c1 = std::min(C, c0 + kFp8Block);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(v[r * C + c]));
      }
      const float scale = tile_scale(amax);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * C + c] = float_to_fp8_e4m3(v[r * C + c] / scale);
      }
      s[fp8_scale_index(blocks, r0, c0, R, scale_cols)] = scale;
    }
  }
  return out;
}

Fp8Tensor quantize_fp8_transposed(const Tensor& x, Fp8Blocks blocks) {
  const int64_t R = x.size(0), C = x.size(1);
  const std::vector<float> v = as_floats(x);
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) t[c * R + r] = v[r * C + c];
  }
  return cpu::quantize_fp8(Tensor::from_vector(t, {C, R}), blocks);
}

Fp8Tensor transpose_fp8_experts(const Fp8Tensor& w, int64_t experts) {
  const int64_t n = w.q.size(0) / experts, k = w.q.size(1);
  Fp8Tensor out{Tensor::empty({experts * k, n}, DType::F8E4M3),
                Tensor::full(fp8_scale_shape(experts * k, n, Fp8Blocks::kBlocks), 1.0, DType::F32), Fp8Blocks::kBlocks};
  const uint8_t* q = static_cast<const uint8_t*>(w.q.raw());
  uint8_t* qt = static_cast<uint8_t*>(out.q.raw());
  const float* s = w.scale.data<float>();
  float* st = out.scale.data<float>();
  const int64_t ls = w.scale.size(1), lt = out.scale.size(1), nb = n / kFp8Block, kb = k / kFp8Block;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t c = 0; c < k; ++c) qt[(e * k + c) * n + r] = q[(e * n + r) * k + c];
    }
    for (int64_t rb = 0; rb < nb; ++rb) {
      for (int64_t cb = 0; cb < kb; ++cb) st[(e * kb + cb) * lt + rb] = s[(e * nb + rb) * ls + cb];
    }
  }
  return out;
}

Tensor dequantize_fp8(const Fp8Tensor& t, DType dtype) {
  const int64_t R = t.q.size(0), C = t.q.size(1);
  const uint8_t* q = static_cast<const uint8_t*>(t.q.raw());
  const float* s = t.scale.data<float>();
  const int64_t scale_cols = t.scale.size(1);
  std::vector<float> out(static_cast<size_t>(R * C));
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      out[r * C + c] = fp8_e4m3_to_float(q[r * C + c]) * s[fp8_scale_index(t.blocks, r, c, R, scale_cols)];
    }
  }
  return Tensor::from_vector(out, {R, C}).to(dtype);
}

// Row r: its C codes, then its L scales' bytes; scale[l * R + r] in rows mode.
Tensor pack_fp8_rows(const Fp8Tensor& x) {
  const int64_t R = x.q.size(0), C = x.q.size(1), L = x.scale.size(0), W = packed_fp8_row_bytes(C);
  Tensor out = Tensor::empty({R, W}, DType::F8E4M3);
  const uint8_t* q = static_cast<const uint8_t*>(x.q.raw());
  const float* s = x.scale.data<float>();
  uint8_t* o = static_cast<uint8_t*>(out.raw());
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(o + r * W, q + r * C, static_cast<size_t>(C));
    for (int64_t l = 0; l < L; ++l) std::memcpy(o + r * W + C + 4 * l, s + l * R + r, 4);
  }
  return out;
}

UnpackedFp8Rows unpack_fp8_rows(const Tensor& packed, int64_t cols, DType dtype) {
  const int64_t R = packed.size(0), C = cols, L = fp8_blocks_of(C), W = packed.size(1);
  Fp8Tensor t{Tensor::empty({R, C}, DType::F8E4M3), Tensor::empty({L, R}, DType::F32), Fp8Blocks::kRows};
  const uint8_t* p = static_cast<const uint8_t*>(packed.raw());
  uint8_t* q = static_cast<uint8_t*>(t.q.raw());
  float* s = t.scale.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(q + r * C, p + r * W, static_cast<size_t>(C));
    for (int64_t l = 0; l < L; ++l) std::memcpy(s + l * R + r, p + r * W + C + 4 * l, 4);
  }
  Tensor values = cpu::dequantize_fp8(t, dtype);
  return {std::move(t), std::move(values)};
}

namespace {

// The experts' first tiles [E + 1] of quantize_fp8_expert_columns' layout (expert e: tiles
// [first[e], first[e + 1])) and their first rows [E + 1], from counts (`what` names them in
// the errors).
struct ExpertTiles {
  std::vector<int64_t> first_tile, first_row;
};
ExpertTiles expert_tiles(const Tensor& counts, const std::string& what) {
  const int64_t E = counts.size(0);
  const int64_t* c = counts.data<int64_t>();
  ExpertTiles t{std::vector<int64_t>(static_cast<size_t>(E + 1), 0), std::vector<int64_t>(static_cast<size_t>(E + 1), 0)};
  for (int64_t e = 0; e < E; ++e) {
    MT_CHECK(c[e] >= 0, "{}[{}] = {} is negative", what, e, c[e]);
    t.first_row[e + 1] = t.first_row[e] + c[e];
    t.first_tile[e + 1] = t.first_tile[e] + fp8_blocks_of(c[e]);
  }
  return t;
}

}  // namespace

Fp8BothWays quantize_fp8_both_ways(const Tensor& x) {
  return {cpu::quantize_fp8(x, Fp8Blocks::kRows), cpu::quantize_fp8_transposed(x, Fp8Blocks::kRows)};
}

Fp8WeightBlocks quantize_fp8_weight(const Tensor& w) {
  if (w.ndim() == 2) return {cpu::quantize_fp8(w, Fp8Blocks::kBlocks), cpu::quantize_fp8_transposed(w, Fp8Blocks::kBlocks)};
  Fp8Tensor blocks = cpu::quantize_fp8(w.view({w.size(0) * w.size(1), w.size(2)}), Fp8Blocks::kBlocks);
  Fp8Tensor transposed = cpu::transpose_fp8_experts(blocks, w.size(0));
  return {std::move(blocks), std::move(transposed)};
}

// Each tile: the amax of every column over the tile's rows (those of its expert), then the
// codes, written transposed into the tile's 128 columns.
Fp8Tensor quantize_fp8_expert_columns(const Tensor& x, const Tensor& counts) {
  const int64_t N = x.size(0), C = x.size(1), E = counts.size(0), T = fp8_expert_tiles(N, E), P = T * kFp8Block;
  const ExpertTiles et = expert_tiles(counts, "quantize_fp8_expert_columns: counts");
  MT_CHECK(et.first_row[E] == N, "quantize_fp8_expert_columns: counts sum to {} but there are {} rows",
           et.first_row[E], N);
  const std::vector<float> v = as_floats(x);
  Fp8Tensor out{Tensor::zeros({C, P}, DType::F8E4M3), Tensor::full({T, C}, 1.0, DType::F32), Fp8Blocks::kRows};
  uint8_t* q = static_cast<uint8_t*>(out.q.raw());
  float* s = out.scale.data<float>();
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t t = et.first_tile[e]; t < et.first_tile[e + 1]; ++t) {
      const int64_t r0 = et.first_row[e] + (t - et.first_tile[e]) * kFp8Block;
      const int64_t r1 = std::min(et.first_row[e + 1], r0 + kFp8Block);
      for (int64_t c = 0; c < C; ++c) {
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) amax = std::max(amax, std::fabs(v[r * C + c]));
        const float scale = tile_scale(amax);
        for (int64_t r = r0; r < r1; ++r) q[c * P + t * kFp8Block + (r - r0)] = float_to_fp8_e4m3(v[r * C + c] / scale);
        s[t * C + c] = scale;
      }
    }
  }
  return out;
}

// Per source and expert one BLAS product over its tiles' columns of the dequantized operands.
void grouped_wgrad_fp8(const std::vector<Fp8WgradOperands>& sources, Tensor& dw, bool accumulate) {
  float* d = dw.data<float>();
  const int64_t E = dw.size(0), Ca = dw.size(1), Cb = dw.size(2);
  for (size_t i = 0; i < sources.size(); ++i) {
    const Fp8WgradOperands& src = sources[i];
    const bool add = accumulate || i > 0;
    const int64_t P = src.a_t.q.size(1);
    const std::vector<int64_t> first =
        expert_tiles(src.counts, fmt::format("grouped_wgrad_fp8: source {}: counts", i)).first_tile;
    MT_CHECK(first[E] * kFp8Block <= P,
             "grouped_wgrad_fp8: source {}: counts need {} tiles of 128 columns, the operands have {}", i, first[E],
             P / kFp8Block);
    const Tensor a = cpu::dequantize_fp8(src.a_t, DType::F32), b = cpu::dequantize_fp8(src.b_t, DType::F32);
    for (int64_t e = 0; e < E; ++e) {
      float* de = d + e * Ca * Cb;
      const int64_t K = (first[e + 1] - first[e]) * kFp8Block;
      if (K == 0) {
        if (!add) std::fill(de, de + Ca * Cb, 0.0f);
        continue;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(Ca), static_cast<int>(Cb),
                  static_cast<int>(K), 1.0f, a.data<float>() + first[e] * kFp8Block, static_cast<int>(P),
                  b.data<float>() + first[e] * kFp8Block, static_cast<int>(P), add ? 1.0f : 0.0f, de,
                  static_cast<int>(Cb));
    }
  }
}

// The f32 product of the dequantized operands (BLAS): the reference the GPU's GEMM is held to.
// On the CPU f32 sums need no promotion every 128 of K; Hopper's FP8 tensor cores, whose
// accumulators keep ~14 bits, do (cuBLASLt promotes them).
void linear_fp8_into(const Fp8Tensor& a, const Fp8Tensor& b, Tensor& out, bool accumulate) {
  check_linear_fp8_args("linear_fp8", a, b, out.dtype());
  const Tensor y = linear_forward(cpu::dequantize_fp8(a, DType::F32), cpu::dequantize_fp8(b, DType::F32), Tensor());
  const Tensor result = out.dtype() == DType::F32 ? y : y.to(out.dtype());
  if (accumulate) add_(out, result);
  else out.copy_from(result);
}

}  // namespace moetrain::ops::cpu
