// The optimizer's memory-bound passes at the bench model's size of one expert layer (604 M
// parameters: 128 experts x 3 x 2048 x 768), against the device-to-device copy rate of the
// same GPU, the ceiling any streaming kernel can reach. Bytes counted read + written:
// AdamW 30 a parameter with f32 moments (master, grad, m, v read; master, m, v, bf16 weight
// written), 22 with bf16 moments, 2 fewer with split masters (the bf16 weight and a 16-bit
// low half read and written instead of the f32 master and the weight written); the gradient
// norm 4.
#include <benchmark/benchmark.h>

#include "core/cuda_runtime.h"
#include "gpu_timing.h"
#include "ops/ops.h"

namespace moetrain {
namespace {

constexpr int64_t kParams = 128LL * 3 * 2048 * 768;

// Times `body` with CUDA events; reports TB/s for `bytes` per call.
template <typename F>
void time_bytes(benchmark::State& state, double bytes, F&& body) {
  body();  // warm-up
  cuda::device_synchronize();
  set_rate(state, "TB/s", bytes, time_iterations(state, body));
}

void BM_DeviceCopy(benchmark::State& state) {
  if (!cuda::available()) return state.SkipWithError("needs a CUDA device");
  const Device gpu = Device::cuda(0);
  Tensor a = Tensor::zeros({kParams}, DType::F32, gpu), b = Tensor::zeros({kParams}, DType::F32, gpu);
  time_bytes(state, 8.0 * kParams, [&] { b.copy_from(a); });
}

void BM_AdamWExpertLayer(benchmark::State& state) {
  if (!cuda::available()) return state.SkipWithError("needs a CUDA device");
  const bool bf16 = state.range(0) == 1;
  const int max_sms = static_cast<int>(state.range(1));  // 0: every multiprocessor
  const bool split = state.range(2) == 1;                 // split masters (the default)
  const Device gpu = Device::cuda(0);
  const DType moments = bf16 ? DType::BF16 : DType::F32;
  ops::AdamWTensors t;
  if (split) {
    t.params.push_back(Tensor::full({kParams}, 0.01, DType::BF16, gpu));
    t.lows.push_back(Tensor::zeros({kParams}, DType::I16, gpu));
    t.values.push_back(Tensor());
  } else {
    t.params.push_back(Tensor::full({kParams}, 0.01, DType::F32, gpu));
    t.values.push_back(Tensor::zeros({kParams}, DType::BF16, gpu));
  }
  t.grads.push_back(Tensor::full({kParams}, 1e-3, DType::F32, gpu));
  t.m.push_back(Tensor::zeros({kParams}, moments, gpu));
  t.v.push_back(Tensor::zeros({kParams}, moments, gpu));
  t.decay.push_back(true);
  ops::AdamWStep s{1e-4, 0.9, 0.95, 1e-8, 0.1, 1, 0.5, max_sms};
  time_bytes(state, ((bf16 ? 22.0 : 30.0) - (split ? 2.0 : 0.0)) * kParams, [&] {
    ++s.step;
    ops::adamw_update_all(t, s);
  });
}

void BM_GradNormExpertLayer(benchmark::State& state) {
  if (!cuda::available()) return state.SkipWithError("needs a CUDA device");
  Tensor norms = Tensor::zeros({1}, DType::F64, Device::cuda(0));
  const std::vector<Tensor> grads{Tensor::full({kParams}, 1e-3, DType::F32, Device::cuda(0))};
  time_bytes(state, 4.0 * kParams, [&] { ops::sum_squares_all_into(grads, norms, 0); });
}

BENCHMARK(BM_DeviceCopy)->UseManualTime()->Unit(benchmark::kMillisecond);
// Args: bf16 moments (0/1), multiprocessors the update may occupy (0: all; the capped
// grid LayerwiseOptimizer runs under the next forward), split masters (0/1).
BENCHMARK(BM_AdamWExpertLayer)
    ->ArgsProduct({{0, 1}, {0, 16, 24, 32, 48, 66}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GradNormExpertLayer)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace moetrain
