"""A global call's way around XLA's CPU abort on a 16-bit all-reduce
(``jax_compat.CPU_16BIT_ALL_REDUCE_ABORTS``), which :func:`placement.global_call` applies.

On CPU devices, where the shard_map's body computes in 16 bits (an operand is a 16-bit
float, or the caller's compute dtype is one) and the mesh has axes the shard_map leaves
automatic, XLA's CPU compiler would abort on the 16-bit all-reduce of a replicated input's
cotangent. There the inputs replicated over the axis cross in float32 and the shard_map is
unchecked, so that the sum is that of its transpose, of a float32 input, not of a cast to
varying inside the body after its cast to 16 bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_ub._src import jax_compat


@dataclasses.dataclass(frozen=True)
class Widening:
    """How one global call meets the abort (module docstring).

    Attributes:
      compute_dtype: the dtype the body computes in where its inputs do not say (a Flax
        layer's ``dtype``), or None. (Delayed fp8's amax histories, replicated inputs too,
        stay right unchecked: their cotangents come from one device, ``counted_once``.)
    """

    compute_dtype: Any = None

    def apply(
        self, f: Callable, args: tuple, in_specs: Any, axis_name: str, platform: str | None
    ) -> tuple[Callable, tuple] | None:
        """``(body, args)`` with the replicated 16-bit inputs crossing in float32 (the
        shard_map to be unchecked), or None where the abort cannot happen."""
        computes = jax.ShapeDtypeStruct((), self.compute_dtype or jnp.float32)
        leaves = [*jax.tree.leaves(args), computes]
        if not any(jax_compat.cpu_16bit(a, platform) for a in leaves):
            return None
        narrow = jax.tree.map(
            lambda spec, a: _replicated_16bit(spec, a, axis_name), in_specs, args, is_leaf=is_spec
        )
        wide = jax.tree.map(_widen, narrow, args, is_leaf=is_spec)

        def body(*wide):
            return f(*jax.tree.map(_narrow, narrow, wide, is_leaf=is_spec))

        return body, wide


# What the ops' own global calls take: their inputs' dtypes say what they compute in.
INPUTS_DTYPE = Widening()


def is_spec(s: Any) -> bool:
    """A leaf of an in_specs tree (a spec, or None), or of the dtypes tree made from one."""
    return s is None or isinstance(s, (P, np.dtype))


def _replicated_16bit(spec: P | None, a: Any, axis_name: str) -> Any:
    """``a``'s dtype where it is a 16-bit float replicated over ``axis_name`` (``spec``
    does not name it), else None."""
    dtype = getattr(a, "dtype", None)
    if spec is None or dtype not in (jnp.bfloat16, jnp.float16):
        return None
    named = {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,))}
    return None if axis_name in named else np.dtype(a.dtype)


def _widen(dtype: Any, a: Any) -> Any:
    return a if dtype is None else a.astype(np.float32)


def _narrow(dtype: Any, a: Any) -> Any:
    return a if dtype is None else a.astype(dtype)
