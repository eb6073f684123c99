"""gated_mlp: the gated MLP of Llama, Mistral, Qwen (SwiGLU) and Gemma (GeGLU), tensor-parallel.

``down(act(x @ w_gate) * (x @ w_up))`` on sequence-parallel activations: ``x`` is
all-gathered once into one GEMM over this rank's gate and up columns side by side (one
:func:`all_gather_matmul`), the gated product stays feature-sharded on its rank, and the
down-projection's result is reduce-scattered back (one :func:`matmul_reduce_scatter`). The
backward is the ops' own: each swaps its collective for the other's, overlapped too, and
the gate and up weights' gradient is one GEMM against the gathered ``x`` (gathered again
inside the input gradient's reduce-scatter call, or kept by the forward with
``keep_gathered``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_ub._src.ops import driver, placement
from jax_ub._src.ops.all_gather_matmul import gathered_product
from jax_ub._src.ops.matmul_reduce_scatter import scattered_product
from jax_ub._src.settings import checks
from jax_ub._src.settings.fp8 import Fp8Scales, result_dtype

_OP = "gated_mlp"

# The activations of the gate: SwiGLU's (Llama, Mistral, Qwen) and GeGLU's (Gemma: GELU's
# tanh approximation, jax.nn.gelu's default).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": jax.nn.gelu,
}


def gated_mlp(
    x: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    axis_name: str,
    *,
    activation: str | Callable[[jax.Array], jax.Array] = "silu",
    impl: str = "auto",
    fp8: tuple[Fp8Scales, Fp8Scales] | None = None,
    seq_axis: int = 0,
) -> jax.Array:
    """``psum_scatter((act(x @ w_gate) * (x @ w_up)) @ w_down)`` with ``x`` all-gathered:
    a tensor-parallel gated MLP block whose collectives overlap its GEMMs.

    The gate and up kernels are one array ``w_gate_up [k, 2, f]``: ``w_gate_up[:, 0]`` is
    the gate projection, ``w_gate_up[:, 1]`` the up projection. Split over ``axis_name``
    on its last dim, every rank holds the gate and up columns of the same hidden units, so
    the split of the product into gate and up is local. From an unsharded checkpoint with
    ``gate_proj [k, F]`` and ``up_proj [k, F]`` (``x @ kernel`` convention; transpose
    PyTorch's ``[F, k]`` weights first): ``w_gate_up = jnp.stack([gate_proj, up_proj],
    axis=1)``, sharded ``P(None, None, axis_name)``; ``down_proj [F, n]`` is ``w_down``,
    sharded ``P(axis_name, None)``.

    Two ways to call it, as the ops: inside ``jax.shard_map`` over ``axis_name`` on local
    shards (``x [m, ..., k]``, ``w_gate_up [k, 2, F / tp]``, ``w_down [F / tp, n]``), or on
    global arrays under ``jax.set_mesh`` (``x`` sequence-sharded, the kernels as above).

    Args:
      x: ``[seq, ..., k]`` (or batch-major with ``seq_axis``), sequence-sharded.
      w_gate_up: ``[k, 2, f]``, the gate and up kernels stacked on dim 1.
      w_down: ``[f, n]``.
      axis_name: the tensor-parallel mesh axis, of size ``tp``.
      activation: the gate's activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, tanh
        approximation) or any elementwise callable.
      impl: ``"ub"``, ``"xla"`` or ``"auto"``, as for :func:`all_gather_matmul`.
      fp8: ``(gate_up, down)``, two :class:`jax_ub.Fp8Scales`: both projections in fp8,
        ``down.x`` scaling the gated product.
      seq_axis: the sequence dim of ``x`` and of the result, as for the ops.

    Returns:
      ``[seq, ..., n]``, sequence-sharded like ``x``.

    Example::

        f = jax.jit(jax.shard_map(
            lambda x, wgu, wd: jax_ub.gated_mlp(x, wgu, wd, "tp"), mesh=mesh,
            in_specs=(P("tp"), P(None, None, "tp"), P("tp", None)), out_specs=P("tp")))
        y = f(x, w_gate_up, w_down)  # == (silu(x @ wgu[:, 0]) * (x @ wgu[:, 1])) @ wd
    """
    checks.check_impl(_OP, impl)
    act = activation_function(activation)
    shapes = f"{x.shape=} {w_gate_up.shape=} {w_down.shape=}"
    if getattr(x, "ndim", 0) < 2:
        raise ValueError(f"{_OP}: x must be [seq, ..., k]; {shapes}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != 2 or w_gate_up.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{_OP}: w_gate_up must be [k, 2, f] (gate and up kernels stacked on dim 1) with "
            f"k = x.shape[-1] = {x.shape[-1]}; {shapes}"
        )
    if w_down.ndim != 2 or w_down.shape[0] != w_gate_up.shape[2]:
        raise ValueError(
            f"{_OP}: w_down must be [f, n] with f = w_gate_up.shape[2] = "
            f"{w_gate_up.shape[2]}; {shapes}"
        )
    seq_axis = placement.check_seq_axis(_OP, x, seq_axis)
    scales = checks.check_fp8_pair(_OP, fp8, "(gate_up, down)")
    call = driver.Call(
        _OP,
        driver.BLOCK,
        axis_name,
        impl,
        seq_axis,
        fp8=fp8 is not None,
        divides=(("f of w_gate_up", w_gate_up.shape[2]),),
    )

    def route(call, x, w_gate_up, extra):
        # Each projection's path, as its own op would decide: the gate and up GEMM on
        # [k, 2f], the down-projection on the gated product as the block computes it.
        w_down, (up, down) = extra.w_down, extra.fp8
        w = _side_by_side(w_gate_up)
        ag = call.choose(x, w, up, op="all_gather_matmul")
        dtype = x.dtype if up is None else result_dtype(x, w)
        gate_up = jax.ShapeDtypeStruct((call.size * x.shape[0], *x.shape[1:-1], w.shape[1]), dtype)
        hidden = jax.eval_shape(lambda g: _gated(act, g), gate_up)
        return ag, call.choose(hidden, w_down, down, op="matmul_reduce_scatter")

    def block(call, x, w_gate_up, extra):
        w_down, (up, down) = extra.w_down, extra.fp8
        ag = call.on("all_gather_matmul", driver.GATHER, call.paths[0])
        gate_up = gathered_product(ag, x, _side_by_side(w_gate_up), None, up)
        rs = call.on("matmul_reduce_scatter", driver.SCATTER, call.paths[1])
        return scattered_product(rs, _gated(act, gate_up), w_down, None, down)

    # w_down's rows are split as w_gate_up's f; the fp8 scales are replicated.
    extra = driver.Extra(fp8=scales, w_down=w_down)
    specs = driver.Extra.specs(w_down=P(axis_name, None))
    return driver.run(call, block, route, x, w_gate_up, extra, specs)


def _side_by_side(w_gate_up):
    """``[k, 2, f] -> [k, 2f]``, free: this rank's gate columns, then its up columns."""
    k, _, f = w_gate_up.shape
    return w_gate_up.reshape(k, 2 * f)


def _gated(act, gate_up):
    """``act(gate) * up`` of the gate and up products side by side, ``[..., 2f] -> [..., f]``."""
    f = gate_up.shape[-1] // 2
    return act(gate_up[..., :f]) * gate_up[..., f:]


def activation_function(activation) -> Callable[[jax.Array], jax.Array]:
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"{_OP}: activation must be one of {sorted(ACTIVATIONS)} or a callable, "
            f"got {activation!r}"
        )
    return ACTIVATIONS[activation]


def gated_mlp_reference(x, w_gate_up, w_down, activation="silu"):
    """The unsharded math: ``(act(x @ w_gate) * (x @ w_up)) @ w_down`` on whole arrays."""
    act = activation_function(activation)
    gate = jnp.einsum("...k,kf->...f", x, w_gate_up[:, 0])
    up = jnp.einsum("...k,kf->...f", x, w_gate_up[:, 1])
    return jnp.einsum("...f,fn->...n", act(gate) * up, w_down)
