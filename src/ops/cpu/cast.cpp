// cast_into on the CPU: an element-wise dtype conversion (Tensor::copy_from does it).
#include "ops/cpu/cpu_ops.h"

namespace moetrain::ops::cpu {

void cast_into(Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.shape() == src.shape(), "cast_into: destination {} and source {} differ in shape", dst.str(), src.str());
  dst.copy_from(src);
}

}  // namespace moetrain::ops::cpu
