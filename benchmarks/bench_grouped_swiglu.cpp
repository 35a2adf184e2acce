// Grouped expert SwiGLU at the bench model's MoE shape: E = 128 experts, hidden H = 2048,
// expert FFN I = 768, 65536 token-expert rows (8192 tokens, top-8) split unevenly.
// Each op is 6*N*H*I FLOPs (forward: gate|up 4NHI + down 2NHI; backward_input: da 2NHI +
// dx 4NHI; backward_weight: dWd 2NHI + dWg|dWu 4NHI). Floor: those FLOPs at 989 TFLOP/s
// (H100 SXM dense bf16); backward_weight also reads and writes the f32 dW (2.4 GB each
// way), 1.5 ms at 3.35 TB/s, more than its 0.63 ms of tensor-core time.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/cuda_runtime.h"
#include "gpu_timing.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

constexpr int64_t kE = 128, kH = 2048, kI = 768, kN = 65536;

// Router-like imbalance: expert loads drawn from a log-normal (sigma 0.5, so the busiest
// experts get ~2-3x the mean and the idlest ~1/3), two experts with no rows at all.
std::vector<int64_t> uneven_counts() {
  std::mt19937 rng(7);
  std::lognormal_distribution<double> load(0.0, 0.5);
  std::vector<double> w(kE);
  double sum = 0;
  for (int64_t e = 0; e < kE; ++e) sum += (w[e] = (e == 17 || e == 90) ? 0.0 : load(rng));
  std::vector<int64_t> c(kE);
  int64_t used = 0;
  for (int64_t e = 0; e < kE; ++e) used += (c[e] = static_cast<int64_t>(w[e] / sum * kN));
  c[0] += kN - used;
  return c;
}

// Random bf16 values (tensor-core power and clocks depend on the data, so no zeros).
Tensor random_bf16(const Shape& shape, double scale, uint32_t seed) {
  Tensor t = Tensor::empty(shape, DType::F32);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(scale) * u(rng);
  return t.to(DType::BF16).to(Device::cuda(0));
}

struct Problem {
  Tensor counts, x, wg, wu, wd, dy, dwg, dwu, dwd;
  Problem() {
    counts = Tensor::from_vector(uneven_counts(), {kE}).to(Device::cuda(0));
    x = random_bf16({kN, kH}, 1.0, 1);
    wg = random_bf16({kE, kI, kH}, 1.0 / std::sqrt(double(kH)), 2);
    wu = random_bf16({kE, kI, kH}, 1.0 / std::sqrt(double(kH)), 3);
    wd = random_bf16({kE, kH, kI}, 1.0 / std::sqrt(double(kI)), 4);
    dy = random_bf16({kN, kH}, 1.0, 5);
    dwg = Tensor::zeros({kE, kI, kH}, DType::F32, Device::cuda(0));
    dwu = Tensor::zeros({kE, kI, kH}, DType::F32, Device::cuda(0));
    dwd = Tensor::zeros({kE, kH, kI}, DType::F32, Device::cuda(0));
  }
};

Problem& problem() {
  static Problem p;  // ~3 GB of device memory, built once for all the benchmarks
  return p;
}

// Times `body` with CUDA events and reports TFLOP/s for 6*N*H*I FLOPs per call.
template <typename F>
void time_op(benchmark::State& state, F&& body) {
  if (!cuda::available()) {
    state.SkipWithError("needs a CUDA device");
    return;
  }
  body();  // warm-up (and kernel attribute setup)
  cuda::device_synchronize();
  set_rate(state, "TFLOP/s", 6.0 * kN * kH * kI, time_iterations(state, body));
}

void BM_GroupedSwigluForward(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  time_op(state, [&] { ops::SwigluOut o = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd); });
}

void BM_GroupedSwigluBackwardInput(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  time_op(state, [&] {
    ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input(p.dy, p.counts, f.gate, f.up, p.wg, p.wu, p.wd);
  });
}

void BM_GroupedSwigluBackwardWeight(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  const ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input(p.dy, p.counts, f.gate, f.up, p.wg, p.wu, p.wd);
  time_op(state, [&] {
    // as the model calls it: adding into dW, with the forward's activations
    ops::grouped_swiglu_backward_weight(p.dy, p.x, p.counts, f.gate, f.up, g.dgate, g.dup, p.dwg, p.dwu, p.dwd, true,
                                        {}, f.act);
  });
}

// As the step calls it with one micro-batch: dW written (no read of the old values) and the
// sum of squares for the gradient norm taken from the tiles.
void BM_GroupedSwigluBackwardWeightOverwrite(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  const ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input(p.dy, p.counts, f.gate, f.up, p.wg, p.wu, p.wd);
  Tensor squares = Tensor::zeros({1}, DType::F64, Device::cuda(0));
  time_op(state, [&] {
    ops::grouped_swiglu_backward_weight(p.dy, p.x, p.counts, f.gate, f.up, g.dgate, g.dup, p.dwg, p.dwu, p.dwd, false,
                                        {&squares, 0}, f.act);
  });
}

// FP8 (issue 30): the same forward from e4m3 operands (x per 1 x 128 tile, the weights per
// 128 x 128 block, quantized once outside the loop as a step's kept weights are); inside: the
// gate/up GEMM, act's quantization and the down GEMM. Floor at Hopper's dense FP8 rate (1979
// TFLOP/s on an H100 SXM): 0.31 ms. "WithX" also quantizes x, as a layer does.
void BM_GroupedSwigluForwardFp8(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::Fp8Tensor x = ops::quantize_fp8(p.x, ops::Fp8Blocks::kRows);
  const ops::Fp8Tensor wg = ops::quantize_fp8_experts(p.wg), wu = ops::quantize_fp8_experts(p.wu);
  const ops::Fp8Tensor wd = ops::quantize_fp8_experts(p.wd);
  time_op(state, [&] { ops::SwigluOut o = ops::grouped_swiglu_forward_fp8(x, p.counts, wg, wu, wd, kE); });
}

void BM_GroupedSwigluForwardFp8WithX(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::Fp8Tensor wg = ops::quantize_fp8_experts(p.wg), wu = ops::quantize_fp8_experts(p.wu);
  const ops::Fp8Tensor wd = ops::quantize_fp8_experts(p.wd);
  time_op(state, [&] {
    ops::SwigluOut o =
        ops::grouped_swiglu_forward_fp8(ops::quantize_fp8(p.x, ops::Fp8Blocks::kRows), p.counts, wg, wu, wd, kE);
  });
}

// The input gradient in FP8 from e4m3 operands (each expert's W^T blocks made once outside
// the loop, as a step's kept weights are): da with the dSwiGLU epilogue, dgate's and dup's
// quantization and dx. "WithDy" also quantizes dy, as a layer does.
void BM_GroupedSwigluBackwardInputFp8(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  auto wt = [](const Tensor& w) { return ops::transpose_fp8_experts(ops::quantize_fp8_experts(w), kE); };
  const ops::Fp8Tensor wgt = wt(p.wg), wut = wt(p.wu), wdt = wt(p.wd);
  const ops::Fp8Tensor dy = ops::quantize_fp8(p.dy, ops::Fp8Blocks::kRows);
  time_op(state, [&] {
    ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input_fp8(dy, p.counts, f.gate, f.up, wgt, wut, wdt, kE);
  });
}

void BM_GroupedSwigluBackwardInputFp8WithDy(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  auto wt = [](const Tensor& w) { return ops::transpose_fp8_experts(ops::quantize_fp8_experts(w), kE); };
  const ops::Fp8Tensor wgt = wt(p.wg), wut = wt(p.wu), wdt = wt(p.wd);
  time_op(state, [&] {
    ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input_fp8(ops::quantize_fp8(p.dy, ops::Fp8Blocks::kRows),
                                                                     p.counts, f.gate, f.up, wgt, wut, wdt, kE);
  });
}

// FP8 (issue 30): the experts' weight gradient from e4m3 operands quantized along the tokens
// per expert (quantize_fp8_expert_columns, done outside the loop: "WithQuant" times it too,
// five operands), dW written (as the step's first micro-batch): dW_down = dy^T act, dW_gate =
// dgate^T x, dW_up = dup^T x, three launches of the FP8 wgmma kernel. Floor: the f32 dW
// written, 2.4 GB, 0.72 ms at 3.35 TB/s; the MMAs 0.31 ms at the dense FP8 rate.
void BM_GroupedSwigluBackwardWeightFp8(benchmark::State& state) {
  if (!cuda::available()) return time_op(state, [] {});
  Problem& p = problem();
  const ops::SwigluOut f = ops::grouped_swiglu_forward(p.x, p.counts, p.wg, p.wu, p.wd);
  const ops::SwigluInputGrads g = ops::grouped_swiglu_backward_input(p.dy, p.counts, f.gate, f.up, p.wg, p.wu, p.wd);
  const bool with_quant = state.range(0) != 0;
  auto q = [&](const Tensor& t) { return ops::quantize_fp8_expert_columns(t, p.counts); };
  ops::Fp8Tensor dy = q(p.dy), act = q(f.act), dgate = q(g.dgate), dup = q(g.dup), x = q(p.x);
  time_op(state, [&] {
    if (with_quant) {
      dy = q(p.dy);
      act = q(f.act);
      dgate = q(g.dgate);
      dup = q(g.dup);
      x = q(p.x);
    }
    ops::grouped_wgrad_fp8(dy, act, p.counts, p.dwd, false);
    ops::grouped_wgrad_fp8(dgate, x, p.counts, p.dwg, false);
    ops::grouped_wgrad_fp8(dup, x, p.counts, p.dwu, false);
  });
}

BENCHMARK(BM_GroupedSwigluForward)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluForwardFp8)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluForwardFp8WithX)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardInput)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardInputFp8)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardInputFp8WithDy)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardWeight)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardWeightOverwrite)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK(BM_GroupedSwigluBackwardWeightFp8)->Arg(0)->Arg(1)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);

}  // namespace
}  // namespace moetrain
