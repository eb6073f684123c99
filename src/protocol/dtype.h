// Element types the overlapped ops accept, and their scalar conversions.
#pragma once

#include <cstdint>
#include <string>

namespace jax_ub {

// Values match xla::ffi::DataType so handlers can cast directly.
enum class DType : int32_t {
  kF32 = 11,
  kBF16 = 16,
  kF16 = 10,
  kF8E5M2 = 19,    // float8_e5m2: gradients
  kF8E4M3FN = 20,  // float8_e4m3fn: activations and weights
};

// fp8 products are scaled by x's and w's scales, passed as float32 [2 * kScaleStride]:
// x's at [0], w's at [kScaleStride], so each is 16-byte aligned as cuBLASLt reads it.
constexpr int kScaleStride = 4;

inline bool IsFp8(DType t) { return t == DType::kF8E5M2 || t == DType::kF8E4M3FN; }

inline int64_t DTypeSize(DType t) {
  if (t == DType::kF32) return 4;
  return IsFp8(t) ? 1 : 2;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF8E5M2:
      return "float8_e5m2";
    case DType::kF8E4M3FN:
      return "float8_e4m3fn";
  }
  return "unknown";
}

// Types of an output (and of the partial sums a reduce-scatter moves).
inline bool IsOutputDType(int32_t raw) {
  return raw == static_cast<int32_t>(DType::kF32) || raw == static_cast<int32_t>(DType::kBF16) ||
         raw == static_cast<int32_t>(DType::kF16);
}

// Types of x and w: an output type (then the output's own), or fp8 (scaled, with a 16- or
// 32-bit output; x and w may be different fp8 types).
inline bool IsInputDType(int32_t raw) {
  return IsOutputDType(raw) || raw == static_cast<int32_t>(DType::kF8E5M2) ||
         raw == static_cast<int32_t>(DType::kF8E4M3FN);
}

// The types of x, w and the output of a call, packed into one descriptor word.
inline uint32_t PackTypes(DType x, DType w, DType out) {
  return static_cast<uint32_t>(x) | static_cast<uint32_t>(w) << 8 |
         static_cast<uint32_t>(out) << 16;
}
inline DType UnpackType(uint32_t packed, int which) {  // 0: x, 1: w, 2: the output
  return static_cast<DType>((packed >> (8 * which)) & 0xff);
}
inline std::string TypesName(uint32_t packed) {
  const DType x = UnpackType(packed, 0), w = UnpackType(packed, 1), out = UnpackType(packed, 2);
  if (x == w && w == out) return DTypeName(x);
  if (x == w) return std::string(DTypeName(x)) + "->" + DTypeName(out);
  return std::string(DTypeName(x)) + " x " + DTypeName(w) + "->" + DTypeName(out);
}

}  // namespace jax_ub
