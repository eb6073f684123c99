#include "host/gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace jax_ub {
namespace {

float BF16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as XLA does; NaN stays NaN.
uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t v) {
  _Float16 h;
  std::memcpy(&h, &v, 2);
  return static_cast<float>(h);
}

uint16_t FloatToF16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t v;
  std::memcpy(&v, &h, 2);
  return v;
}

// An 8-bit float with `mbits` mantissa bits and exponent bias `bias`. e5m2 is IEEE-like
// (all-ones exponent: Inf or NaN); e4m3fn has no Inf, and only S.1111.111 is NaN.
float Fp8ToFloat(uint8_t v, int mbits, int bias, bool ieee) {
  const int ebits = 7 - mbits;
  const int e = (v >> mbits) & ((1 << ebits) - 1);
  const int mant = v & ((1 << mbits) - 1);
  const float sign = (v & 0x80) ? -1.0f : 1.0f;
  const int emax = (1 << ebits) - 1;
  if (ieee && e == emax) return mant == 0 ? sign * INFINITY : NAN;
  if (!ieee && e == emax && mant == (1 << mbits) - 1) return NAN;
  if (e == 0) return sign * std::ldexp(static_cast<float>(mant), 1 - bias - mbits);
  return sign * std::ldexp(static_cast<float>(mant + (1 << mbits)), e - bias - mbits);
}

void ToFloat(DType t, const void* src, float* dst, int64_t count) {
  if (t == DType::kF32) {
    std::memcpy(dst, src, count * 4);
    return;
  }
  if (IsFp8(t)) {
    const uint8_t* s8 = static_cast<const uint8_t*>(src);
    const bool e5m2 = t == DType::kF8E5M2;
    for (int64_t i = 0; i < count; ++i)
      dst[i] = e5m2 ? Fp8ToFloat(s8[i], 2, 15, true) : Fp8ToFloat(s8[i], 3, 7, false);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  if (t == DType::kBF16) {
    for (int64_t i = 0; i < count; ++i) dst[i] = BF16ToFloat(s[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) dst[i] = F16ToFloat(s[i]);
  }
}

void FromFloat(DType t, const float* src, void* dst, int64_t count) {
  if (t == DType::kF32) {
    std::memcpy(dst, src, count * 4);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (t == DType::kBF16) {
    for (int64_t i = 0; i < count; ++i) d[i] = FloatToBF16(src[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) d[i] = FloatToF16(src[i]);
  }
}

// Sizes a thread's float32 scratch: a size the host cannot allocate is an error naming it,
// not an exception thrown through XLA's handler (which would end the process).
Status Resize(std::vector<float>& v, int64_t count, const char* what) {
  try {
    v.resize(static_cast<size_t>(count));
  } catch (const std::exception& e) {
    return Internal(std::string("the host could not allocate ") + what + " of " +
                    std::to_string(count) + " float32 values (" + e.what() + ")");
  }
  return Status::Ok();
}

}  // namespace

Status HostGemm(DType ta, DType tb, DType out, const void* a, const void* b, bool b_transposed,
                float scale, void* c, int64_t m, int64_t k, int64_t n, const Epilogue& ep,
                const void* bias, void* aux, const void* addend) {
  // Scratch is per thread: XLA runs each CPU device's handler on its own thread.
  thread_local std::vector<float> fb, fa, acc, fbias;
  JAX_UB_RETURN_IF_ERROR(Resize(fb, k * n, "a GEMM's copy of w, k x n,"));
  JAX_UB_RETURN_IF_ERROR(Resize(fa, std::max(k, n), "a row of x"));  // or of aux
  JAX_UB_RETURN_IF_ERROR(Resize(acc, n, "a row of the product"));
  if (ep.bias) {
    JAX_UB_RETURN_IF_ERROR(Resize(fbias, n, "the bias"));
    ToFloat(out, bias, fbias.data(), n);
  }
  const int64_t row_bytes = n * DTypeSize(out);
  const int64_t a_size = DTypeSize(ta), b_size = DTypeSize(tb);
  if (b_transposed) {  // row j of the stored [n, k] is column j of b
    for (int64_t j = 0; j < n; ++j) {
      ToFloat(tb, static_cast<const char*>(b) + j * k * b_size, fa.data(), k);
      for (int64_t p = 0; p < k; ++p) fb[p * n + j] = fa[p];
    }
  } else {
    ToFloat(tb, b, fb.data(), k * n);
  }
  for (int64_t i = 0; i < m; ++i) {
    ToFloat(ta, static_cast<const char*>(a) + i * k * a_size, fa.data(), k);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float av = fa[p];
      const float* brow = fb.data() + p * n;
      for (int64_t j = 0; j < n; ++j) acc[j] += av * brow[j];
    }
    if (scale != 1.0f)
      for (int64_t j = 0; j < n; ++j) acc[j] *= scale;
    if (addend != nullptr) {  // read before c's row is written: c may be the addend
      ToFloat(out, static_cast<const char*>(addend) + i * row_bytes, fa.data(), n);
      for (int64_t j = 0; j < n; ++j) acc[j] += fa[j];
    }
    if (ep.bias)
      for (int64_t j = 0; j < n; ++j) acc[j] += fbias[j];
    if (ep.gelu) {
      if (ep.aux) FromFloat(out, acc.data(), static_cast<char*>(aux) + i * row_bytes, n);
      for (int64_t j = 0; j < n; ++j) acc[j] = GeluTanh(acc[j]);
    }
    if (ep.dgelu) {
      ToFloat(out, static_cast<const char*>(aux) + i * row_bytes, fa.data(), n);
      for (int64_t j = 0; j < n; ++j) acc[j] *= GeluTanhGrad(fa[j]);
    }
    FromFloat(out, acc.data(), static_cast<char*>(c) + i * row_bytes, n);
  }
  return Status::Ok();
}

Status HostSum(DType t, const void* const* parts, int num_parts, void* c, int64_t count,
               const float* addend, bool c_f32) {
  thread_local std::vector<float> acc, tmp;
  JAX_UB_RETURN_IF_ERROR(Resize(acc, count, "a sum"));
  JAX_UB_RETURN_IF_ERROR(Resize(tmp, count, "a sum"));
  if (addend != nullptr) {
    std::copy(addend, addend + count, acc.begin());
  } else {
    std::fill(acc.begin(), acc.end(), 0.0f);
  }
  for (int j = 0; j < num_parts; ++j) {
    ToFloat(t, parts[j], tmp.data(), count);
    for (int64_t i = 0; i < count; ++i) acc[i] += tmp[i];
  }
  if (c_f32) {
    std::memcpy(c, acc.data(), count * sizeof(float));
  } else {
    FromFloat(t, acc.data(), c, count);
  }
  return Status::Ok();
}

}  // namespace jax_ub
