// cast_into on CUDA: f32 <-> bf16 on the device (the optimizer's master-to-weight copy);
// a same-dtype cast is a device copy.
#include "ops/cuda/cast_launch.h"
#include "ops/cuda/common.h"
#include "ops/cuda/cuda_ops.h"

namespace moetrain::ops::cuda {

void cast_into(Tensor& dst, const Tensor& src) {
  check_cuda_tensors("cast_into", {&dst, &src});
  MT_CHECK(dst.shape() == src.shape(), "cast_into: destination {} and source {} differ in shape", dst.str(), src.str());
  if (dst.dtype() == src.dtype()) {
    dst.copy_from(src);
  } else if (dst.dtype() == DType::BF16 && src.dtype() == DType::F32) {
    launch_cast_f32_to_bf16(static_cast<__nv_bfloat16*>(dst.raw()), src.data<float>(), src.numel(), stream());
    check_launch("cast_f32_to_bf16");
  } else if (dst.dtype() == DType::F32 && src.dtype() == DType::BF16) {
    launch_cast_bf16_to_f32(dst.data<float>(), static_cast<const __nv_bfloat16*>(src.raw()), src.numel(), stream());
    check_launch("cast_bf16_to_f32");
  } else {
    MT_THROW("cast_into: no CUDA cast from {} to {}", dtype_name(src.dtype()), dtype_name(dst.dtype()));
  }
}

}  // namespace moetrain::ops::cuda
