// Helpers shared by the CPU and CUDA FFI handlers: status conversion and the shape
// checks every handler repeats.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "bindings/registry.h"
#include "protocol/dtype.h"
#include "protocol/schedule.h"
#include "protocol/status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ub {

namespace ffi = xla::ffi;

inline ffi::Error ToFfiError(const Status& st) {
  if (st.ok()) return ffi::Error::Success();
  ffi::ErrorCode code = ffi::ErrorCode::kInternal;
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
      code = ffi::ErrorCode::kInvalidArgument;
      break;
    case StatusCode::kDeadlineExceeded:
      code = ffi::ErrorCode::kDeadlineExceeded;
      break;
    case StatusCode::kFailedPrecondition:
      code = ffi::ErrorCode::kFailedPrecondition;
      break;
    default:
      break;
  }
  return ffi::Error(code, "jax_ub: " + st.message());
}

// Operands arrive flattened to 2-D by the Python layer; check what it promised. w is
// [k, n], or [n, k] with `w_transposed`. x and w share a type: the output's, or fp8 (the
// output then 16- or 32-bit, and the GEMM's operands need w as [n, k]). `scales` holds
// float32 [2 * kScaleStride], x_scale at 0 and w_scale at kScaleStride: the product is
// scaled by both (fp8; ignored otherwise).
inline Status CheckMatmulOperands(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                  bool w_transposed, ffi::AnyBuffer scales, ffi::AnyBuffer out,
                                  DType* in, DType* w_type, DType* out_type) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || od.size() != 2)
    return InvalidArgument(std::string(op) + ": operands must be 2-D after flattening");
  const int64_t wk = w_transposed ? wd[1] : wd[0];
  if (xd[1] != wk)
    return InvalidArgument(std::string(op) + ": contracting dims differ: x has k=" +
                           std::to_string(xd[1]) + ", w has k=" + std::to_string(wk));
  const int32_t raw_in = static_cast<int32_t>(x.element_type());
  const int32_t raw_out = static_cast<int32_t>(out.element_type());
  const int32_t raw_w = static_cast<int32_t>(w.element_type());
  const bool fp8 = IsInputDType(raw_in) && IsFp8(static_cast<DType>(raw_in)) &&
                   IsInputDType(raw_w) && IsFp8(static_cast<DType>(raw_w));
  if (!IsOutputDType(raw_out) || (!fp8 && (raw_in != raw_out || raw_w != raw_out)))
    return InvalidArgument(std::string(op) +
                           ": x and w must both be of the output's dtype (float32, bfloat16, "
                           "float16), or both fp8 (float8_e4m3fn, float8_e5m2) with a 16- or "
                           "32-bit output");
  if (scales.element_type() != ffi::DataType::F32 || scales.element_count() != 2 * kScaleStride)
    return InvalidArgument(std::string(op) + ": scales must be float32 [" +
                           std::to_string(2 * kScaleStride) + "]");
  *in = static_cast<DType>(raw_in);
  *w_type = static_cast<DType>(raw_w);
  *out_type = static_cast<DType>(raw_out);
  return Status::Ok();
}

// What a handler hands its communicator: the live communicator and the decoded call.
template <typename Comm>
struct MatmulCall {
  std::shared_ptr<Comm> comm;
  CallShape shape;
  Operands ops;
};

// The operands of a call, checked; shape.m is set by the caller.
template <typename Comm>
Status DecodeCall(const char* op, ffi::AnyBuffer x, ffi::AnyBuffer w, bool w_transposed,
                  ffi::AnyBuffer scales, ffi::AnyBuffer out, int64_t comm_id,
                  MatmulCall<Comm>* call) {
  DType in, w_type, out_type;
  JAX_UB_RETURN_IF_ERROR(
      CheckMatmulOperands(op, x, w, w_transposed, scales, out, &in, &w_type, &out_type));
  call->comm = Registry<Comm>::Get(comm_id);
  if (!call->comm)
    return FailedPrecondition(
        "jax_ub: this program's communicator was finalized (jax_ub.finalize()); call the "
        "jitted function again to compile it anew (an executable compiled ahead of time "
        "with .lower().compile() must be compiled again)");
  CallShape& shape = call->shape;
  shape.k = x.dimensions()[1];
  shape.n = w.dimensions()[w_transposed ? 0 : 1];
  shape.in = in;
  shape.w_type = w_type;
  shape.out = out_type;
  Operands& ops = call->ops;
  ops.x = x.untyped_data();
  ops.w = w.untyped_data();
  ops.w_transposed = w_transposed;
  ops.scales = static_cast<const float*>(scales.untyped_data());
  ops.out = out.untyped_data();
  return Status::Ok();
}

// The epilogue of an all_gather_matmul call: a bias [n] of the output's type (none when
// empty), GELU where `gelu`, and the pre-GELU value kept in `aux` (as out; none when empty);
// or with `dgelu` (and nothing else), the product times GELU's derivative at `gelu_input`.
inline Status DecodeEpilogue(ffi::AnyBuffer bias, ffi::AnyBuffer gelu_input, ffi::AnyBuffer out,
                             ffi::AnyBuffer aux, bool gelu, bool dgelu, CallShape* shape,
                             Operands* ops) {
  const int64_t n = out.dimensions()[1];
  if (bias.element_count() > 0) {
    if (bias.dimensions().size() != 1 || bias.dimensions()[0] != n ||
        bias.element_type() != out.element_type())
      return InvalidArgument("all_gather_matmul: bias must be [n] = [" + std::to_string(n) +
                             "] of the output's dtype");
    shape->epilogue.bias = true;
    ops->bias = bias.untyped_data();
  }
  shape->epilogue.gelu = gelu;
  if (aux.element_count() > 0) {
    if (!gelu || aux.element_count() != out.element_count() ||
        aux.element_type() != out.element_type())
      return InvalidArgument(
          "all_gather_matmul: the pre-GELU output must be laid out as the output, with gelu");
    shape->epilogue.aux = true;
    ops->aux = aux.untyped_data();
  }
  if (dgelu) {
    if (gelu || shape->epilogue.bias || gelu_input.element_count() != out.element_count() ||
        gelu_input.element_type() != out.element_type())
      return InvalidArgument(
          "all_gather_matmul: dgelu takes GELU's input laid out as the output, and no other "
          "epilogue");
    shape->epilogue.dgelu = true;
    ops->aux = gelu_input.untyped_data();  // read only: the DGELU epilogue's input
  }
  return Status::Ok();
}

// Decode and check an all_gather_matmul call: x [m, k], w [k, n] (or [n, k] transposed),
// out [size*m, n], and its epilogue (DecodeEpilogue).
template <typename Comm>
Status PrepareAllGather(ffi::AnyBuffer x, ffi::AnyBuffer w, bool w_transposed,
                        ffi::AnyBuffer scales, ffi::AnyBuffer bias, ffi::AnyBuffer gelu_input,
                        ffi::AnyBuffer out, ffi::AnyBuffer gathered, ffi::AnyBuffer aux,
                        int64_t comm_id, bool gelu, bool dgelu, MatmulCall<Comm>* call) {
  JAX_UB_RETURN_IF_ERROR(
      DecodeCall("all_gather_matmul", x, w, w_transposed, scales, out, comm_id, call));
  call->shape.m = x.dimensions()[0];
  if (out.dimensions()[0] != call->shape.m * call->comm->topology().group_size())
    return InvalidArgument("all_gather_matmul: output rows do not match the group");
  if (gathered.element_count() > 0) {
    call->shape.gathered = true;
    call->ops.gathered = gathered.untyped_data();
  }
  return DecodeEpilogue(bias, gelu_input, out, aux, gelu, dgelu, &call->shape, &call->ops);
}

// Decode and check a matmul_reduce_scatter call: x [size*m, k], w [k, n] (or [n, k]
// transposed), out [m, n]; and, unless empty, gather_src [m, n] of out's type, whose
// all-gather the call writes to gathered [size*m, n].
template <typename Comm>
Status PrepareReduceScatter(ffi::AnyBuffer x, ffi::AnyBuffer w, bool w_transposed,
                            ffi::AnyBuffer scales, ffi::AnyBuffer gather_src, ffi::AnyBuffer out,
                            ffi::AnyBuffer gathered, int64_t comm_id, MatmulCall<Comm>* call) {
  JAX_UB_RETURN_IF_ERROR(
      DecodeCall("matmul_reduce_scatter", x, w, w_transposed, scales, out, comm_id, call));
  const int64_t size = call->comm->topology().group_size();
  call->shape.m = out.dimensions()[0];
  if (x.dimensions()[0] != call->shape.m * size)
    return InvalidArgument("matmul_reduce_scatter: input rows do not match the group");
  if (gather_src.element_count() > 0) {
    if (gather_src.element_count() != out.element_count() ||
        gather_src.element_type() != out.element_type() ||
        gathered.element_count() != size * out.element_count() ||
        gathered.element_type() != out.element_type())
      return InvalidArgument(
          "matmul_reduce_scatter: the input to all-gather beside it must be laid out as the "
          "output, and its result as the group's outputs stacked");
    call->shape.gathered = true;
    call->ops.gather_src = gather_src.untyped_data();
    call->ops.gathered = gathered.untyped_data();
  }
  return Status::Ok();
}

// Each op's operands, results and attributes after the platform's context (CPU: the
// device ordinal; CUDA: the stream, then the ordinal), one list for both platforms. The
// lowering (jax_ub/_src/lowering/custom_call.py) passes them in this order. Binding's methods take
// an rvalue, hence the move.
template <typename Binding>
auto BindAllGatherMatmul(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // w
      .template Arg<ffi::AnyBuffer>()  // scales
      .template Arg<ffi::AnyBuffer>()  // bias
      .template Arg<ffi::AnyBuffer>()  // gelu_input
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // gathered
      .template Ret<ffi::AnyBuffer>()  // aux (the pre-GELU product)
      .template Attr<int64_t>("comm_id")
      .template Attr<bool>("transpose_w")
      .template Attr<bool>("gelu")
      .template Attr<bool>("dgelu");
}

template <typename Binding>
auto BindMatmulReduceScatter(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<ffi::AnyBuffer>()  // w
      .template Arg<ffi::AnyBuffer>()  // scales
      .template Arg<ffi::AnyBuffer>()  // gather_src
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // gathered
      .template Attr<int64_t>("comm_id")
      .template Attr<bool>("transpose_w");
}

}  // namespace jax_ub
