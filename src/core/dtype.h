// Element types a Tensor can hold, and the bfloat16 storage type.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace moetrain {

// I16: raw 16-bit integers (the low halves of split f32 master weights, engine/parameters.h).
// F8E4M3: OCP FP8 e4m3 ("fn": no infinities, max 448), the FP8 recipe's operands (ops.h).
enum class DType : uint8_t { F32, F64, BF16, I32, I64, I16, F8E4M3 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);
// Parses "f32"/"float32", "f64"/"float64", "bf16"/"bfloat16", "i32"/"int32", "i64"/"int64",
// "i16"/"int16", "f8e4m3"/"float8_e4m3fn".
// Returns false when the name is not one of them.
bool parse_dtype(std::string_view name, DType* out);
inline bool is_floating(DType t) { return t == DType::F32 || t == DType::F64 || t == DType::BF16; }

// bfloat16: the upper half of an IEEE float32. Conversion rounds to nearest even and
// keeps NaN a NaN.
struct bf16 {
  uint16_t bits = 0;
  bf16() = default;
  explicit bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

// FP8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, there is
// no infinity. From float: rounded to nearest even, saturated to +-448 (what CUDA's
// __nv_cvt_float_to_fp8 does with __NV_SATFINITE), NaN to 0x7f.
uint8_t float_to_fp8_e4m3(float f);
float fp8_e4m3_to_float(uint8_t bits);
struct f8e4m3 {
  uint8_t bits = 0;
  f8e4m3() = default;
  explicit f8e4m3(float f) : bits(float_to_fp8_e4m3(f)) {}
  explicit operator float() const { return fp8_e4m3_to_float(bits); }
};
constexpr float kFp8E4m3Max = 448.0f;

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<int16_t>() { return DType::I16; }
template <> constexpr DType dtype_of<f8e4m3>() { return DType::F8E4M3; }

}  // namespace moetrain
