// Element types the overlapped ops accept, and their scalar conversions.
#pragma once

#include <cstdint>
#include <string>

namespace jax_ub {

// Values match xla::ffi::DataType so handlers can cast directly.
enum class DType : int32_t { kF32 = 11, kBF16 = 16, kF16 = 10 };

inline int64_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
  }
  return "unknown";
}

inline bool IsSupportedDType(int32_t raw) {
  return raw == static_cast<int32_t>(DType::kF32) || raw == static_cast<int32_t>(DType::kBF16) ||
         raw == static_cast<int32_t>(DType::kF16);
}

}  // namespace jax_ub
