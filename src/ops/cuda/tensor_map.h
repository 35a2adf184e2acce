// Host side of the Hopper (sm_90a) kernels: TMA tensor maps and the check that the GPU can
// run them. The kernels themselves use hopper.cuh.
#pragma once

#include <cuda.h>  // CUtensorMap (types only: the encoder is fetched from the driver at run time)

#include <cstdint>
#include <initializer_list>

namespace moetrain::ops::cuda {

// True when the current GPU is sm_90 (Hopper: the sm_90a kernels run there and only there)
// and the driver offers cuTensorMapEncodeTiled, and the environment variable `opt_out` (a
// per-op switch back to the portable kernels, e.g. MOETRAIN_SWIGLU_MMA_SYNC) is unset or 0.
bool hopper_kernels_usable(const char* opt_out);

// Map of a contiguous tensor of bf16 (or f32), dims innermost first, boxes 128-byte
// swizzled (box[0] must then be 128 bytes: 64 bf16 or 32 f32), zero fill outside the tensor.
// False when the driver refuses it (alignment, sizes).
bool make_tensor_map(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                     std::initializer_list<uint32_t> box, bool f32 = false);
// The same for a tensor of bytes (e4m3 codes): box[0] must be 128 (one swizzled row).
bool make_tensor_map_bytes(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                           std::initializer_list<uint32_t> box);

// A contiguous f32 tensor with plain (unswizzled) boxes, e.g. a run of block scales; box[0]
// a multiple of 4 (16 bytes), at most 256.
bool make_tensor_map_f32_plain(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                               std::initializer_list<uint32_t> box);

}  // namespace moetrain::ops::cuda
