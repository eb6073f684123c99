// What an all_gather_matmul GEMM does to its float32 product before storing it, as
// cuBLASLt's epilogues do: add a bias, then GELU, keeping the pre-GELU value for the
// backward where asked; or, in a backward, multiply by GELU's derivative at GELU's input
// (DGELU). The host communicator emulates the same arithmetic.
#pragma once

#include <cmath>

namespace jax_ub {

struct Epilogue {
  bool bias = false;  // + bias[n] (of the output's type), broadcast over rows
  bool gelu = false;  // then GELU, tanh approximation (jax.nn.gelu's default, cuBLASLt's)
  bool aux = false;   // with gelu: also store the pre-GELU product, laid out as the output
  // Alone: the product times gelu'(aux), aux being GELU's input (read, laid out as the
  // output): the gradient of GELU's input from the gradient of its output.
  bool dgelu = false;

  bool Any() const { return bias || gelu || dgelu; }
  bool UsesAux() const { return aux || dgelu; }
  // A small integer naming the combination: part of a GEMM plan's key.
  int Code() const { return (bias ? 1 : 0) | (gelu ? 2 : 0) | (aux ? 4 : 0) | (dgelu ? 8 : 0); }
};

// GELU's tanh approximation: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))).
inline float GeluTanh(float v) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
}

// Its derivative: 0.5 (1 + t) + 0.5 v (1 - t^2) sqrt(2 / pi) (1 + 3 * 0.044715 v^2), with t
// the tanh above.
inline float GeluTanhGrad(float v) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const float t = std::tanh(kSqrt2OverPi * (v + 0.044715f * v * v * v));
  return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 0.134145f * v * v);
}

}  // namespace jax_ub
