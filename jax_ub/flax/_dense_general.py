"""What :class:`jax_ub.flax.DenseGeneral` (NNX) and :class:`jax_ub.flax.linen.DenseGeneral`
share: a trainer's DenseGeneral conventions jax_ub's column and row layers have no
counterpart for (``weight_dtype``, ``quant``, ``matmul_precision``, an empty
``kernel_axes``), the plain matmul of a projection no tensor-parallel axis splits, and the
check of a call's ``out_sharding=`` against the layer's output layout.

The output layout, ``[*lead, *features]`` (``lead`` the input's dims before the contracted
ones, the sequence at ``seq_axis`` among them), over the tensor-parallel axis ``tp``:

* column: the split feature dim over ``tp`` (the sequence whole);
* row: the sequence over ``tp`` where the call runs sequence-parallel, else replicated;
* replicated: whatever XLA chooses (a plain matmul).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ub._src.ops import placement
from jax_ub._src.settings.config import config as ub_config
from jax_ub.flax._core import promote

# matmul_precision values asking for full float32, which jax_ub's GEMMs meet (they multiply
# in the operands' dtype and accumulate in float32; no TF32 unless allow_tf32).
_FULL_F32 = ("float32", "highest")


def check_options(owner: str, quant: Any, matmul_precision: Any) -> None:
    """A trainer's options with no counterpart in jax_ub's layers are refused, naming them:
    ``quant`` (its quantization) other than None; ``matmul_precision`` other than the
    ones the GEMMs meet (``"default"``; ``"float32"`` / ``"highest"`` while
    ``allow_tf32`` is off)."""
    if quant is not None:
        raise ValueError(
            f"{owner}: quant={quant!r}: jax_ub's layers do not run a trainer's quantization; "
            "use jax_ub's fp8 (fp8=True or 'delayed') or keep your own DenseGeneral for the "
            "quantized layers"
        )
    precision = getattr(matmul_precision, "name", matmul_precision)
    if isinstance(precision, str):
        precision = precision.lower()
    if precision in _FULL_F32:
        if ub_config.allow_tf32:
            raise ValueError(
                f"{owner}: matmul_precision={matmul_precision!r} asks for full float32 "
                "GEMMs, while jax_ub.configure(allow_tf32=True) lets them use TF32"
            )
        return
    if precision not in (None, "default"):
        raise ValueError(
            f"{owner}: matmul_precision={matmul_precision!r} has no counterpart in jax_ub's "
            "GEMMs, which multiply in the operands' dtype and accumulate in float32: pass "
            "'default' (or 'float32' / 'highest': float32 operands in full float32)"
        )


def check_no_fp8(owner: str, fp8: Any) -> None:
    """fp8 runs in jax_ub's tensor-parallel ops: a projection that runs as a plain matmul
    refuses it, naming it."""
    if fp8:
        raise ValueError(
            f"{owner}: fp8={fp8!r} runs in jax_ub's tensor-parallel ops; this projection is a "
            "plain matmul (no feature or contracted dim of its kernel is split over a "
            "tensor-parallel axis): leave fp8 off for it"
        )


def param_dtype(owner: str, weight_dtype: Any, param_dtype: Any) -> Any:
    """The params' dtype from a trainer's ``weight_dtype`` or jax_ub's ``param_dtype``
    (not both)."""
    if weight_dtype is not None and param_dtype is not None:
        raise ValueError(
            f"{owner}: weight_dtype={weight_dtype!r} and param_dtype={param_dtype!r} name "
            "the same setting: pass one"
        )
    return weight_dtype if weight_dtype is not None else param_dtype


def alias(owner: str, name: str, value: Any, trainer_value: Any) -> Any:
    """``name`` given as itself or as a trainer's ``{name}_shape``: one of them."""
    if value is not None and trainer_value is not None:
        raise ValueError(
            f"{owner}: {name}={value!r} and {name}_shape={trainer_value!r} name the same "
            "setting: pass one"
        )
    value = value if value is not None else trainer_value
    if value is None:
        raise TypeError(f"{owner}.__init__() missing the argument {name!r} (or {name}_shape)")
    return value


def kernel_axes(names: Any) -> Any:
    """A trainer's ``kernel_axes``, ``()`` meaning none (its default), as jax_ub's."""
    return None if names is not None and len(tuple(names)) == 0 else names


def replicated_matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    n_in: int,
    dtype: Any,
    precision: Any = None,
) -> jax.Array:
    """``x [..., *in (n_in dims)]`` contracted with ``kernel [*in, *features]``, plus
    ``bias [*features]``, in ``dtype`` (None: their common one), as flax's DenseGeneral
    computes it; sharded however XLA chooses."""
    x, kernel, bias = promote(dtype, x, kernel, bias)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    precision = None if precision in ("default", None) else precision
    out = jax.lax.dot_general(x, kernel, (contract, ((), ())), precision=precision)
    return out if bias is None else out + bias


def output_tp_dim(shape: Any, out_ndim: int, sp: bool, seq_axis: int) -> int | None:
    """The output dim a projection of ``shape`` (a ``_projection.Projection``) splits over
    the tensor-parallel axis (module docstring): a column one's split feature dim, a row
    one's sequence where the call runs sequence-parallel (``sp``); else None."""
    if shape.kind == "column":
        return out_ndim - len(shape.features) + (shape.split - shape.n_in)
    if shape.kind == "row" and sp:
        return seq_axis
    return None


def constrain_output(
    owner: str, out: jax.Array, out_sharding: Any, kind: str, tp_dim: int | None, axis_name: str
) -> jax.Array:
    """``out`` under a call's ``out_sharding`` (a ``NamedSharding`` or ``PartitionSpec``
    of mesh axes; None: as it is), checked against the layer's layout over
    ``axis_name``: a column layer's output must be split over it on ``tp_dim`` (its split
    feature dim) and nowhere else; a row layer's may be split over it on the sequence
    (``tp_dim``, where the call runs sequence-parallel) or not at all (XLA gathers it);
    a replicated one's is XLA's to lay out. The other mesh axes are XLA's: the output is
    constrained to ``out_sharding``, as flax's ``DenseGeneral`` does with it."""
    if out_sharding is None:
        return out
    spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    if not isinstance(spec, P):
        raise ValueError(
            f"{owner}: out_sharding must be a jax.sharding.NamedSharding or PartitionSpec "
            f"(of mesh axes), got {out_sharding!r}"
        )
    if len(spec) > out.ndim:
        raise ValueError(
            f"{owner}: out_sharding {spec} names {len(spec)} dims; the output has "
            f"{out.ndim}, shape {out.shape}"
        )
    if axis_name in placement.manual_axes():
        raise ValueError(
            f"{owner}: out_sharding={spec} is for global arrays; inside a shard_map over "
            f"{axis_name!r} the layer returns its local shard"
        )
    on_tp = [d for d, entry in enumerate(spec) if axis_name in _axes_of(entry)]
    allowed = {"column": [[tp_dim]], "row": [[], [tp_dim]] if tp_dim is not None else [[]]}
    if kind in allowed and on_tp not in allowed[kind]:
        layout = (
            f"split over {axis_name!r} on dim {tp_dim}"
            if tp_dim is not None
            else f"replicated over {axis_name!r}"
        )
        raise ValueError(
            f"{owner}: out_sharding {spec} places the tensor-parallel axis {axis_name!r} on "
            f"dims {on_tp} of the output (shape {out.shape}); this {kind}-parallel layer's "
            f"output is {layout}"
            + (", or replicated over it" if kind == "row" and tp_dim is not None else "")
        )
    return jax.lax.with_sharding_constraint(out, out_sharding)


def _axes_of(entry: Any) -> tuple:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)
