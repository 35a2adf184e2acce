// CUDA element-wise helpers and small reductions: sum_squares, scale_, add_, all_finite.
// Floating tensors are f32 or bf16 (f64 has no CUDA path). sum_squares and all_finite
// return host values, so they wait for the stream: the only ops here that do (ops.h's
// "no host waits" has to give way where the API returns a number).
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"
#include "ops/cuda/elementwise_launch.h"
#include "ops/cuda/tensor_runs.h"

namespace moetrain::ops::cuda {
namespace {

void check_float(const Tensor& x, const char* op, const char* name) {
  MT_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::BF16, "{}: {} must be f32 or bf16 on CUDA, got {}", op,
           name, x.str());
}

__nv_bfloat16* bf16_ptr(const Tensor& t) { return static_cast<__nv_bfloat16*>(t.raw()); }

}  // namespace

double sum_squares(const Tensor& x) {
  MT_CHECK(x.defined(), "sum_squares: x is undefined");
  check_cuda_tensors("sum_squares", {&x});
  check_float(x, "sum_squares", "x");
  const int64_t n = x.numel();
  Tensor scratch = Tensor::empty({sum_squares_scratch_doubles(n)}, DType::F64, x.device());
  double* s = scratch.data<double>();
  if (x.dtype() == DType::F32) {
    launch_sum_squares(x.data<float>(), n, s, stream());
  } else {
    launch_sum_squares(bf16_ptr(x), n, s, stream());
  }
  check_launch("sum_squares");
  return scratch.item(0);  // the device-to-host copy waits for the kernels
}

namespace {
// Launches the list's sum of squares into *result (null: the scratch's first double, which
// is returned to keep the scratch alive until the caller reads it).
Tensor launch_squares_of_list(const std::vector<Tensor>& xs, double* result, const char* op) {
  for (const Tensor& x : xs) {
    check_cuda_tensors(op, {&x});
    MT_CHECK(x.dtype() == DType::F32, "{}: CUDA lists must be f32 (gradients), got {}", op, x.str());
  }
  std::vector<SquaresSegment> segs;
  for (const TensorRun& r : contiguous_runs({&xs}, [](size_t, size_t) { return true; })) {
    segs.push_back({xs[r.first].data<float>(), r.numel});
  }
  const int count = static_cast<int>(segs.size());
  Tensor scratch =
      Tensor::empty({sum_squares_segments_scratch_doubles(segs.data(), count)}, DType::F64, xs.front().device());
  launch_sum_squares_segments(segs.data(), count, scratch.data<double>(), stream(), result);
  check_launch(op);
  return scratch;
}
}  // namespace

double sum_squares_all(const std::vector<Tensor>& xs) {
  if (xs.empty()) return 0.0;
  return launch_squares_of_list(xs, nullptr, "sum_squares_all").item(0);  // the one wait of the list
}

void sum_squares_all_into(const std::vector<Tensor>& xs, Tensor& out, int64_t index) {
  check_cuda_tensors("sum_squares_all_into", {&out});
  double* dst = out.data<double>() + index;
  if (xs.empty()) {
    moetrain::cuda::memset_device(dst, 0, sizeof(double));
    return;
  }
  launch_squares_of_list(xs, dst, "sum_squares_all_into");  // the scratch is freed in stream order
}

void zero_all(const std::vector<Tensor>& xs) {
  for (const Tensor& x : xs) check_cuda_tensors("zero_all", {&x});
  for (const TensorRun& r : contiguous_runs({&xs}, [](size_t, size_t) { return true; })) {
    const Tensor& x = xs[r.first];
    moetrain::cuda::memset_device(x.raw(), 0, static_cast<size_t>(r.numel) * dtype_size(x.dtype()));
  }
}

void scale_(Tensor& x, double alpha) {
  MT_CHECK(x.defined(), "scale_: x is undefined");
  check_cuda_tensors("scale_", {&x});
  check_float(x, "scale_", "x");
  if (x.dtype() == DType::F32) {
    launch_scale(x.data<float>(), x.numel(), static_cast<float>(alpha), stream());
  } else {
    launch_scale(bf16_ptr(x), x.numel(), static_cast<float>(alpha), stream());
  }
  check_launch("scale_");
}

void add_(Tensor& y, const Tensor& x) {
  MT_CHECK(y.defined() && x.defined(), "add_: y {} and x {} must be defined", y.str(), x.str());
  check_cuda_tensors("add_", {&y, &x});
  check_shape(x, y.shape(), "add_ x (must match y)");
  check_float(y, "add_", "y");
  MT_CHECK(x.dtype() == y.dtype() || (y.dtype() == DType::F32 && x.dtype() == DType::BF16),
           "add_: x {} must have y's dtype {} (or be bf16 added into f32)", x.str(), dtype_name(y.dtype()));
  if (y.dtype() == DType::F32 && x.dtype() == DType::BF16) {
    launch_add(y.data<float>(), bf16_ptr(x), y.numel(), stream());
  } else if (y.dtype() == DType::F32) {
    launch_add(y.data<float>(), x.data<float>(), y.numel(), stream());
  } else {
    launch_add(bf16_ptr(y), bf16_ptr(x), y.numel(), stream());
  }
  check_launch("add_");
}

bool all_finite(const Tensor& x) {
  MT_CHECK(x.defined(), "all_finite: x is undefined");
  check_cuda_tensors("all_finite", {&x});
  check_float(x, "all_finite", "x");
  Tensor flag = Tensor::zeros({1}, DType::I32, x.device());
  if (x.dtype() == DType::F32) {
    launch_find_nonfinite(x.data<float>(), x.numel(), flag.data<int32_t>(), stream());
  } else {
    launch_find_nonfinite(bf16_ptr(x), x.numel(), flag.data<int32_t>(), stream());
  }
  check_launch("all_finite");
  return flag.item(0) == 0;  // waits for the kernel
}

}  // namespace moetrain::ops::cuda
