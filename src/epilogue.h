// What an all_gather_matmul GEMM does to its float32 product before storing it, as
// cuBLASLt's epilogues do: add a bias, then GELU, keeping the pre-GELU value for the
// backward where asked. The host communicator emulates the same arithmetic.
#pragma once

#include <cmath>

namespace jax_ub {

struct Epilogue {
  bool bias = false;  // + bias[n] (of the output's type), broadcast over rows
  bool gelu = false;  // then GELU, tanh approximation (jax.nn.gelu's default, cuBLASLt's)
  bool aux = false;   // with gelu: also store the pre-GELU product, laid out as the output

  bool Any() const { return bias || gelu; }
  // A small integer naming the combination: part of a GEMM plan's key.
  int Code() const { return (bias ? 1 : 0) | (gelu ? 2 : 0) | (aux ? 4 : 0); }
};

// GELU's tanh approximation: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))).
inline float GeluTanh(float v) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
}

}  // namespace jax_ub
