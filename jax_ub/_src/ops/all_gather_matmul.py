"""all_gather_matmul: activation(all_gather(x) @ w + bias), the gather overlapped with the
matmul and the bias and activation applied in its epilogue."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ub._src.lowering.unfused import all_gather_matmul_reference
from jax_ub._src.lowering.varying import match_varying
from jax_ub._src.ops import driver
from jax_ub._src.ops.argument_checks import check_arguments
from jax_ub._src.ops.checkpoint_policy import saved_output
from jax_ub._src.ops.epilogue import epilogue_grads
from jax_ub._src.ops.fp8_ops import fp8_all_gather_matmul
from jax_ub._src.ops.group import Group
from jax_ub._src.ops.kept_input import KeptInput
from jax_ub._src.ops.path import Bodies
from jax_ub._src.ops.weight_grad import contract_rows, weight_grad_with
from jax_ub._src.settings.fp8 import Fp8Scales, result_dtype

_OP = "all_gather_matmul"


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    axis_name: str,
    *,
    bias: jax.Array | None = None,
    activation: str | None = None,
    impl: str = "auto",
    return_gathered: bool = False,
    fp8: Fp8Scales | None = None,
    seq_axis: int = 0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """All-gather the rows of ``x`` over ``axis_name`` and multiply by ``w``, overlapped;
    then add ``bias`` and apply ``activation`` in the GEMMs' epilogue.

    Two ways to call it:

    * Inside ``jax.shard_map`` whose manual axes include ``axis_name`` (under ``jit`` or
      not), like a ``lax`` collective, on local shards. Other mesh axes may stay automatic
      (``axis_names={axis_name}``): batch dims sharded over them stay sharded.
    * On global arrays, from plain ``jit`` or eagerly, under ``jax.set_mesh(mesh)``:
      ``x [seq, ..., k]`` sequence-sharded ``P(axis_name)`` (``P(None, axis_name)`` for
      ``[batch, seq, ..., k]`` with ``seq_axis=1``) and ``w [k, n]`` sharded
      ``P(None, axis_name)``; returns ``x @ w`` sharded ``P(None, ..., axis_name)``.
      Every other mesh axis is left to XLA. Where the layout is known (concrete arrays,
      ``Explicit`` axes) a wrong one is an error naming it; under ``Auto`` axes XLA moves
      the operands into this layout.

    Args:
      x: local row shard ``[m, ..., k]``; gathered along axis 0 (sequence-parallel input),
        or along ``seq_axis``.
      w: local weight ``[k, n]`` (typically the column shard of a larger weight).
      axis_name: the mesh axis to gather over, of size ``tp``.
      bias: ``[n]``, added to every row of the product (a column-parallel layer's bias
        shard: sharded like ``w``'s columns); cast to the output's dtype.
      activation: ``None`` or ``"gelu"`` (the tanh approximation, ``jax.nn.gelu``'s
        default), applied after the bias.
      impl: ``"ub"`` (userbuffer custom call), ``"xla"`` (lax reference), ``"auto"``
        (``"ub"`` where this platform and dtype are supported and, on GPUs, where the
        gather moves at least ``jax_ub.config.auto_min_bytes`` per rank, 8 MiB by default;
        else ``"xla"``: ``jax_ub.explain_impl`` says which and why), or ``"none"`` (the
        same GEMMs, nothing communicated: to time a bound; see ``jax_ub``'s module
        docstring).
      return_gathered: also return ``all_gather(x)``, e.g. to keep it for a backward pass
        (inside shard_map only; not with ``fp8``).
      fp8: run in fp8 with these scales (:class:`jax_ub.Fp8Scales`; ``Fp8Scales()`` for
        current scaling): x and w are quantized to ``float8_e4m3fn``, the gather moves fp8
        and the result is ``x.dtype``; gradients go through ``float8_e5m2`` (see
        ``jax_ub.fp8``). ``x`` or ``w`` may come already in ``float8_e4m3fn`` with its
        scale given; the result then has the other one's dtype (bfloat16 if both are fp8).
        ``impl="xla"`` runs the same quantized math on XLA's collectives. With a float32
        result the epilogue runs in XLA after the op (no cuBLASLt fp8 kernel).
      seq_axis: the dim of ``x`` split over ``axis_name`` (the sequence): 0 for
        ``[seq, batch, ..., k]``, 1 for batch-major ``[batch, seq, ..., k]``; not the last.
        The result keeps it in the same place. Other than 0 the calls take the shard as
        one block of rows (a free reshape) and the gathered blocks come back rank-major,
        which the op puts in sequence order: the rows of the result (and of the gathered
        ``x``) are moved once, the shard not at all.

    Returns:
      ``activation(all_gather(x, axis_name, axis=seq_axis, tiled=True) @ w + bias)``, of
      shape ``[tp * m, ..., n]`` for ``seq_axis=0``, and, with ``return_gathered``, the
      gathered ``x`` of shape ``[tp * m, ..., k]``.

    The gradient is overlapped too: ``dx = matmul_reduce_scatter(dp, w.T)`` and
    ``dw = all_gather(x).T @ dp``, ``x`` gathered again inside the ``dx`` call from the
    shard the forward kept (or, with ``jax_ub.configure(keep_gathered=True)``, the gathered
    ``x`` kept by the forward), where ``dp`` is the gradient of the product (``dy`` through
    GELU's backward, at GELU's input kept by the forward) and ``dbias`` its sum over rows.

    Example::

        mesh = jax.sharding.Mesh(jax.devices()[:4], ("tp",))
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp"),
            mesh=mesh, in_specs=(P("tp", None), P(None, "tp")), out_specs=P(None, "tp")))
        y = f(x, w)  # == x @ w, with the all-gather of x hidden behind the matmul
    """
    seq_axis = check_arguments(
        _OP, x, w, impl=impl, seq_axis=seq_axis, bias=bias, activation=activation, fp8=fp8
    )
    if fp8 is not None and return_gathered:
        raise ValueError(f"{_OP}: return_gathered is not available with fp8 ({x.shape=})")
    call = driver.Call(
        _OP,
        driver.GATHER,
        axis_name,
        impl,
        seq_axis,
        fp8=fp8 is not None,
        divides=(("columns of w", w.shape[1]),),
        shard_map_only=("return_gathered",) if return_gathered else (),
    )

    def body(call, x, w, extra):
        return gathered_product(call, x, w, extra.bias, extra.fp8, activation, return_gathered)

    extra = driver.Extra(bias=bias, fp8=fp8)
    specs = driver.Extra.specs(bias=P(axis_name))  # the bias's columns are w's
    return driver.run(call, body, driver.one_gemm, x, w, extra, specs)


def gathered_product(call: driver.Call, x, w, bias, fp8, activation=None, return_gathered=False):
    """The op on a rank's rows ``x [m, *batch, k]``: ``[tp * m, *batch, n]`` (and the
    gathered ``x`` with ``return_gathered``), on the call's path."""
    if bias is not None:  # the output's dtype, as the epilogue adds it
        bias = jnp.asarray(bias, x.dtype if fp8 is None else result_dtype(x, w))
    return _BODIES(call, x, w, bias, fp8, activation, return_gathered)


def _ub(call: driver.Call, x, w, bias, fp8, activation, return_gathered):
    gelu = activation == "gelu"
    return _all_gather_matmul(x, w, bias, call.group(), gelu, return_gathered)


def _unfused(call: driver.Call, x, w, bias, fp8, activation, return_gathered):
    return all_gather_matmul_reference(
        x,
        w,
        call.axis_name,
        return_gathered=return_gathered,
        bias=bias,
        activation=activation,
        collectives=call.path.collectives,
    )


def _fp8(call: driver.Call, x, w, bias, fp8, activation, return_gathered):
    return fp8_all_gather_matmul(x, w, fp8, bias, call.group(), activation == "gelu")


class _Residuals(NamedTuple):
    # The backward needs only x's and the bias's types (the mesh axes they vary over), not
    # their values: empty slices carry them without keeping the activation alive.
    x_like: jax.Array
    x_kept: KeptInput  # all_gather(x) or x's shard, for the weight gradient
    w: jax.Array
    pre_gelu: jax.Array | None  # GELU's input, with activation="gelu"
    bias_like: jax.Array | None


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _all_gather_matmul(x, w, bias, group: Group, gelu: bool, return_gathered: bool):
    out, gathered, _ = group.all_gather_matmul(
        x, w, return_gathered=return_gathered, bias=bias, gelu=gelu
    )
    return (out, gathered) if return_gathered else out


def _fwd(x, w, bias, group: Group, gelu: bool, return_gathered: bool):
    out, gathered, pre = group.all_gather_matmul(
        x,
        w,
        return_gathered=return_gathered or KeptInput.keeps_gathered(),
        bias=bias,
        gelu=gelu,
        keep_pre_gelu=True,
    )
    bias_like = None if bias is None else bias[:0]
    out = saved_output(out)  # kept under remat (checkpoint_policy.py), as is a kept gathered x
    res = _Residuals(x[:0], KeptInput.of(x, gathered), w, pre if gelu else None, bias_like)
    return ((out, gathered) if return_gathered else out), res


def _bwd(group: Group, gelu: bool, return_gathered: bool, res: _Residuals, cts):
    dy, dgathered = cts if return_gathered else (cts, None)
    dp, dbias = epilogue_grads(dy, res.pre_gelu, res.bias_like, gelu)
    # dx = reduce_scatter(dp @ w.T): the overlapped GEMM+RS, reading w transposed in place;
    # it gathers x again beside its GEMMs where the forward kept x's shard.
    dx, x_gathered = res.x_kept.input_grad_and_gathered(group, dp, res.w)
    dx, dw = weight_grad_with(dx, contract_rows(x_gathered, dp))
    dx = match_varying(dx, res.x_like)
    if dgathered is not None:
        scattered = group.scatter_rows(dgathered)
        dx = dx + match_varying(scattered, res.x_like)
    return dx, match_varying(dw, res.w), dbias


_all_gather_matmul.defvjp(_fwd, _bwd)

_BODIES = Bodies(ub=_ub, unfused=_unfused, fp8=_fp8)
