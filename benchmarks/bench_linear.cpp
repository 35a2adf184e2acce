// cuBLASLt linear at the bench model's attention-projection shape (tokens 8192, hidden
// 2048 -> 4096 for q_proj), as a reference point for the hand-written kernels: what the
// vendor GEMM reaches on this GPU. Floor: 2*T*in*out FLOPs at 989 TFLOP/s (H100 dense bf16).
#include <benchmark/benchmark.h>

#include "core/cuda_runtime.h"
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

}  // namespace
}  // namespace moetrain
