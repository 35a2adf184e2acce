// cast_into on CUDA: f32 <-> bf16 on the device (the optimizer's master-to-weight copy);
// a same-dtype cast is a device copy. The joins and splits of split f32 masters.
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

void master_join_into(Tensor& master, const Tensor& high, const Tensor& low) {
  check_cuda_tensors("master_join_into", {&master, &high, &low});
  launch_master_join(master.data<float>(), static_cast<const uint16_t*>(high.raw()), low.data<int16_t>(),
                     master.numel(), stream());
  check_launch("master_join");
}

void master_split_into(const Tensor& master, Tensor& high, Tensor& low) {
  check_cuda_tensors("master_split_into", {&master, &high, &low});
  launch_master_split(master.data<float>(), static_cast<uint16_t*>(high.raw()), low.data<int16_t>(), master.numel(),
                      stream());
  check_launch("master_split");
}

}  // namespace moetrain::ops::cuda
