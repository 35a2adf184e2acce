#include "ops/cuda/tensor_map.h"

#include <cuda_runtime_api.h>

#include <cstdlib>

namespace moetrain::ops::cuda {
namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver, found at run time (no link against libcuda).
EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<EncodeTiledFn>(nullptr);
    }
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

bool env_set(const char* name) {
  const char* v = name != nullptr ? std::getenv(name) : nullptr;
  return v != nullptr && *v != '\0' && *v != '0';
}

}  // namespace

bool hopper_kernels_usable(const char* opt_out) {
  if (env_set(opt_out) || encode_tiled() == nullptr) return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

namespace {

bool encode_map(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                std::initializer_list<uint32_t> box, CUtensorMapDataType type, uint64_t elem_bytes,
                CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return false;
  cuuint64_t gdim[5], gstride[4];
  cuuint32_t bdim[5], estride[5] = {1, 1, 1, 1, 1};
  const int rank = static_cast<int>(dims.size());
  if (rank < 1 || rank > 5 || box.size() != dims.size()) return false;
  uint64_t stride = elem_bytes;
  for (int i = 0; i < rank; ++i) {
    gdim[i] = dims.begin()[i];
    bdim[i] = box.begin()[i];
    if (i > 0) gstride[i - 1] = stride;
    stride *= gdim[i];
  }
  return encode(map, type, rank,
                const_cast<void*>(base), gdim, gstride, bdim, estride, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool make_tensor_map(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                     std::initializer_list<uint32_t> box, bool f32) {
  return encode_map(map, base, dims, box, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    f32 ? 4 : 2);
}

bool make_tensor_map_bytes(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                           std::initializer_list<uint32_t> box) {
  return encode_map(map, base, dims, box, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1);
}

bool make_tensor_map_f32_plain(CUtensorMap* map, const void* base, std::initializer_list<uint64_t> dims,
                               std::initializer_list<uint32_t> box) {
  return encode_map(map, base, dims, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, CU_TENSOR_MAP_SWIZZLE_NONE);
}

}  // namespace moetrain::ops::cuda
