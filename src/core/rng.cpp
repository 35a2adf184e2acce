#include "core/rng.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace moetrain {

uint64_t hash_string(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double uniform_at(uint64_t key, uint64_t counter) {
  uint64_t bits = mix64(key ^ mix64(counter));
  // 53 random bits, shifted by half a step so the result is strictly inside (0, 1).
  return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

double normal_at(uint64_t key, uint64_t counter) {
  double u1 = uniform_at(key, 2 * counter);
  double u2 = uniform_at(key, 2 * counter + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

void fill_normal(Tensor& t, uint64_t key, double std, int64_t first_element) {
  Tensor tmp = Tensor::empty(t.shape(), DType::F64);
  double* p = tmp.data<double>();
  const int64_t n = t.numel();
  // Each element is a pure function of its counter, so the threads change nothing but the
  // time (a 2.6 B-parameter model draws in seconds instead of minutes).
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) p[i] = std * normal_at(key, static_cast<uint64_t>(first_element + i));
  t.copy_from(tmp);
}

void fill_normal_box(Tensor& t, uint64_t key, double std, const Shape& whole, const Shape& start) {
  const Shape& box = t.shape();
  MT_CHECK(whole.size() == box.size() && start.size() == box.size(),
           "fill_normal_box: a box {} at {} of a tensor {} needs one start per dimension", shape_str(box),
           shape_str(start), shape_str(whole));
  for (size_t d = 0; d < box.size(); ++d) {
    MT_CHECK(start[d] >= 0 && start[d] + box[d] <= whole[d], "fill_normal_box: the box {} at {} leaves {}",
             shape_str(box), shape_str(start), shape_str(whole));
  }
  Tensor tmp = Tensor::empty(box, DType::F64);
  double* p = tmp.data<double>();
  const int64_t n = t.numel();
  const auto nd = static_cast<int64_t>(box.size());
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    int64_t rest = i, at = 0, stride = 1;  // i's place in the whole, from the innermost dimension out
    for (int64_t d = nd - 1; d >= 0; --d) {
      at += (rest % box[d] + start[d]) * stride;
      rest /= box[d];
      stride *= whole[d];
    }
    p[i] = std * normal_at(key, static_cast<uint64_t>(at));
  }
  t.copy_from(tmp);
}

}  // namespace moetrain
