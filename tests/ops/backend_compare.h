// The CPU-vs-CUDA comparison harness (one table of op cases, llama.cpp's test-backend-ops
// style): fresh random inputs, representable in bf16 so both backends see the same values;
// the CPU reference in f32 (or f64); device outputs poisoned with NaN before the op runs
// (every new device allocation is 0xFF-filled), so an unwritten element fails.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "core/cuda_runtime.h"
#include "test_util.h"

namespace moetrain::testing {

// Skips, saying why, when no GPU answers (CI has none).
#define MT_REQUIRE_GPU()                                                                              \
  do {                                                                                                \
    if (!::moetrain::cuda::available()) {                                                             \
      GTEST_SKIP() << "SKIPPED: GPU test needs a CUDA device: " << ::moetrain::cuda::unavailable_reason(); \
    }                                                                                                 \
  } while (0)

// While alive, every new device allocation is filled with NaN bytes.
struct PoisonScope {
  PoisonScope() { cuda::set_poison_allocations(true); }
  ~PoisonScope() { cuda::set_poison_allocations(false); }
};

// An f32 host tensor of N(0, scale^2) values rounded to bf16.
inline Tensor random_bf16_values(const Shape& shape, uint64_t seed, double scale = 1.0) {
  return random_tensor(shape, DType::F32, seed, scale).to(DType::BF16).to(DType::F32);
}

// A device copy of a host tensor in `dtype`.
inline Tensor on_gpu(const Tensor& host, DType dtype) { return host.to(dtype).to(Device::cuda(0)); }

// ||gpu - ref|| / ||ref|| over all elements; +inf when the GPU output holds a NaN or Inf.
inline double backend_error(const Tensor& gpu, const Tensor& ref) {
  auto g = gpu.to_double_vector(), r = ref.to_double_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

// Asserts the shapes match and the relative error is under tol; prints a BACKEND line for
// the report: "BACKEND <op> <output> <rel_err>".
inline void expect_backend_close(const Tensor& gpu, const Tensor& ref, double tol, const std::string& op,
                                 const std::string& output) {
  ASSERT_EQ(gpu.shape(), ref.shape()) << op << " " << output;
  const double e = backend_error(gpu, ref);
  std::printf("BACKEND %s %s %.3e\n", op.c_str(), output.c_str(), e);
  EXPECT_LT(e, tol) << op << " " << output;
}

constexpr double kBf16Tol = 1e-2;  // outputs stored in bf16
constexpr double kF32Tol = 1e-5;   // outputs stored in f32

}  // namespace moetrain::testing
