// Helpers shared by the tests: random tensors and float64 finite-difference checks.
#pragma once

#include <cstring>
#include <functional>
#include <string>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain::testing {

// The message of the moetrain::Error that f() throws; "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moetrain::Error& e) {
    return e.what();
  }
  return "";
}

// N(0, scale^2) entries drawn from the stream keyed by `seed`.
inline Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, double scale = 1.0) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_normal(t, mix64(seed), scale);
  return t;
}

// Integers uniform in [lo, hi), as i32.
inline Tensor random_ints(const Shape& shape, int32_t lo, int32_t hi, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::I32);
  int32_t* p = t.data<int32_t>();
  Rng rng(mix64(seed));
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = lo + static_cast<int32_t>(rng.below(static_cast<uint64_t>(hi - lo)));
  return t;
}

// sum(a * b) over all elements, in double.
inline double dot(const Tensor& a, const Tensor& b) {
  auto x = a.to_double_vector(), y = b.to_double_vector();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Relative error ||a - b|| / max(||b||, tiny), over all elements.
inline double rel_error(const Tensor& a, const Tensor& b) {
  auto x = a.to_double_vector(), y = b.to_double_vector();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

// Central finite differences of the scalar `loss` w.r.t. every element of the f64 tensor
// `input` (perturbed in place and restored), compared with `analytic`. Returns the
// relative error ||analytic - numeric|| / ||numeric||.
inline double gradcheck(Tensor& input, const Tensor& analytic, const std::function<double()>& loss,
                        double h = 1e-6) {
  MT_CHECK(input.dtype() == DType::F64, "gradcheck needs an f64 input, got {}", input.str());
  Tensor numeric = Tensor::zeros(input.shape(), DType::F64);
  double* p = input.data<double>();
  double* n = numeric.data<double>();
  for (int64_t i = 0; i < input.numel(); ++i) {
    double saved = p[i];
    p[i] = saved + h;
    double up = loss();
    p[i] = saved - h;
    double down = loss();
    p[i] = saved;
    n[i] = (up - down) / (2 * h);
  }
  return rel_error(analytic, numeric);
}

// Same dtype, shape and bytes (host tensors).
inline bool bytes_equal(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// `needle` occurs in `text` (for error messages).
inline bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

}  // namespace moetrain::testing
