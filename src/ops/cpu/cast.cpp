// cast_into on the CPU: an element-wise dtype conversion (Tensor::copy_from does it); the
// joins and splits of split f32 masters (ops/adamw_math.h).
#include "ops/adamw_math.h"
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {

void cast_into(Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.shape() == src.shape(), "cast_into: destination {} and source {} differ in shape", dst.str(), src.str());
  dst.copy_from(src);
}

void master_join_into(Tensor& master, const Tensor& high, const Tensor& low) {
  const bf16* hp = high.data<bf16>();
  const int16_t* lp = low.data<int16_t>();
  float* mp = master.data<float>();
  const int64_t n = master.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) mp[i] = ops::master_join(hp[i].bits, lp[i]);
}

void master_split_into(const Tensor& master, Tensor& high, Tensor& low) {
  const float* mp = master.data<float>();
  bf16* hp = high.data<bf16>();
  int16_t* lp = low.data<int16_t>();
  const int64_t n = master.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) ops::master_split(mp[i], hp[i].bits, lp[i]);
}

}  // namespace moetrain::ops::cpu
