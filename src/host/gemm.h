// Reference-quality matrix product on the host, used by the CPU communicator for each
// chunk as it arrives. Row-major, float accumulation, one rounding to the output type.
#pragma once

#include <cstdint>

#include "protocol/dtype.h"
#include "protocol/epilogue.h"
#include "protocol/status.h"

namespace jax_ub {

// c[m, n] (type `out`) = scale * (a[m, k] @ b[k, n]) (+ addend[m, n], type `out`, where
// given: cuBLASLt's C with beta = 1) (a of type `ta`, b of type `tb`), all row-major; with
// `b_transposed`, b is stored as its transpose [n, k]. `ep` is applied to the float32 sum
// before the one rounding: + bias[n] (type `out`), then GELU, the
// pre-GELU value rounded into aux[m, n] (type `out`) where `ep.aux`; or with `ep.dgelu`, the
// product times GELU's derivative at aux[m, n] (read). Fails, writing nothing, where the
// host cannot allocate its float32 scratch (k * n values).
Status HostGemm(DType ta, DType tb, DType out, const void* a, const void* b, bool b_transposed,
                float scale, void* c, int64_t m, int64_t k, int64_t n, const Epilogue& ep = {},
                const void* bias = nullptr, void* aux = nullptr, const void* addend = nullptr);

// c[m, n] (type t) = sum over j of parts[j][m, n] (type t), accumulated in float in the
// order given, rounded once. With `addend` (float32) the sum starts from it; with `c_f32`, c
// is float32 (a partial sum, added to later) and nothing is rounded. Fails, writing nothing,
// where the host cannot allocate its float32 scratch (2 * count values).
Status HostSum(DType t, const void* const* parts, int num_parts, void* c, int64_t count,
               const float* addend = nullptr, bool c_f32 = false);

}  // namespace jax_ub
