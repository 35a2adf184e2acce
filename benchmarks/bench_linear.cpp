// cuBLASLt linear at the bench model's attention-projection shape (tokens 8192, hidden
// 2048 -> 4096 for q_proj), as a reference point for the hand-written kernels: what the
// vendor GEMM reaches on this GPU. Floor: 2*T*in*out FLOPs at 989 TFLOP/s (H100 dense bf16).
// BM_LinearForwardFp8: the same shapes with FP8 operands in DeepSeek-V3's block scales
// (activations 1 x 128, weights 128 x 128; issue 30), the GEMM alone (operands quantized
// before the timing), dense FP8 peak 1979 TFLOP/s; BM_QuantizeFp8: the activation
// quantizer's pass (TB/s read and written; H100 HBM3 ~3.35): /0 rows, /1 transposed, /2 both
// in one pass (quantize_fp8_both_ways, against /0 + /1); BM_QuantizeFp8Weight: an
// expert weight of the bench model ([128, 768, 2048]) in blocks both ways, as a training
// step quantizes each weight once: /0 as two passes (quantize_fp8_experts, then
// transpose_fp8_experts of its codes), /1 as one (quantize_fp8_weight); the second argument
// the weight's bytes an element (2: bf16, 4: f32). TB/s counts the one pass's bytes (the
// weight read once, both codes written), so /0's figure is what it does of that work.
#include <benchmark/benchmark.h>

#include "core/cuda_runtime.h"
#include "core/rng.h"
#include "gpu_timing.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

void BM_LinearForwardBf16(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  const int64_t T = state.range(0), in = state.range(1), out = state.range(2);
  const Device gpu = Device::cuda(0);
  Tensor x = Tensor::zeros({T, in}, DType::BF16, gpu);
  Tensor w = Tensor::zeros({out, in}, DType::BF16, gpu);
  const double ms_total = time_iterations(state, [&] { Tensor y = ops::linear_forward(x, w); });
  set_rate(state, "TFLOP/s", 2.0 * T * in * out, ms_total);
}
BENCHMARK(BM_LinearForwardBf16)->Args({8192, 2048, 4096})->Args({8192, 2048, 32768})->UseManualTime();

void BM_LinearForwardFp8(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  const int64_t T = state.range(0), in = state.range(1), out = state.range(2);
  const Device gpu = Device::cuda(0);
  Tensor x = Tensor::empty({T, in}, DType::F32), w = Tensor::empty({out, in}, DType::F32);
  fill_normal(x, 1, 1.0);
  fill_normal(w, 2, 0.02);
  const ops::Fp8Tensor a = ops::quantize_fp8(x.to(DType::BF16).to(gpu), ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor b = ops::quantize_fp8(w.to(DType::BF16).to(gpu), ops::Fp8Blocks::kBlocks);
  const double ms_total = time_iterations(state, [&] { Tensor y = ops::linear_fp8(a, b, DType::BF16); });
  set_rate(state, "TFLOP/s", 2.0 * T * in * out, ms_total);
}
BENCHMARK(BM_LinearForwardFp8)->Args({8192, 2048, 4096})->Args({8192, 2048, 32768})->Args({8192, 4096, 2048})->UseManualTime();

void BM_QuantizeFp8(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  const int64_t T = state.range(0), in = state.range(1);
  Tensor x = Tensor::empty({T, in}, DType::F32);
  fill_normal(x, 3, 1.0);
  const Tensor xg = x.to(DType::BF16).to(Device::cuda(0));
  const int64_t mode = state.range(2);  // 0: rows, 1: transposed, 2: both ways in one pass
  const double ms_total = time_iterations(state, [&] {
    if (mode == 2) {
      ops::Fp8BothWays both = ops::quantize_fp8_both_ways(xg);
    } else {
      ops::Fp8Tensor q = mode == 1 ? ops::quantize_fp8_transposed(xg) : ops::quantize_fp8(xg, ops::Fp8Blocks::kRows);
    }
  });
  // 2 bytes read, 1 written (both ways: 2)
  set_rate(state, "TB/s", static_cast<double>(T * in) * (mode == 2 ? 4.0 : 3.0), ms_total);
}
BENCHMARK(BM_QuantizeFp8)->Args({8192, 2048, 0})->Args({8192, 2048, 1})->Args({8192, 2048, 2})->UseManualTime();

void BM_QuantizeFp8Weight(benchmark::State& state) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  const int64_t E = 128, n = 768, k = 2048;
  const bool one_pass = state.range(0) != 0;
  const DType dtype = state.range(1) == 2 ? DType::BF16 : DType::F32;
  Tensor w = Tensor::empty({E, n, k}, DType::F32);
  fill_normal(w, 4, 0.02);
  const Tensor wg = w.to(dtype).to(Device::cuda(0));
  const double ms_total = time_iterations(state, [&] {
    if (one_pass) {
      ops::Fp8WeightBlocks both = ops::quantize_fp8_weight(wg);
    } else {
      ops::Fp8Tensor blocks = ops::quantize_fp8_experts(wg);
      ops::Fp8Tensor transposed = ops::transpose_fp8_experts(blocks, E);
    }
  });
  set_rate(state, "TB/s", static_cast<double>(E * n * k) * (static_cast<double>(dtype_size(dtype)) + 2.0), ms_total);
}
BENCHMARK(BM_QuantizeFp8Weight)->Args({0, 2})->Args({1, 2})->Args({0, 4})->Args({1, 4})->UseManualTime();

}  // namespace
}  // namespace moetrain
