"""The settings every jax_ub Flax layer shares, as one validated record, and the model-wide
defaults the layers take them from when they are not given.

A layer's settings are, in order of precedence: the keyword arguments (attributes, for
linen) given to it that are not None; else its ``config=`` record; else the defaults of
the innermost :func:`defaults` context; else the defaults of :class:`ParallelConfig`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from jax_ub._src.ops import placement
from jax_ub._src.settings import checks, trace_key
from jax_ub.flax import _fp8


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a jax_ub Flax layer runs: the settings its projections share, checked once.

    Frozen and hashable: the layers key their compiled functions on it. Every layer takes
    these as keyword arguments (linen: attributes) and also whole, as ``config=``; a model
    sets them for all its layers with :func:`defaults`.

    Attributes:
      mesh: the :class:`jax.sharding.Mesh` to create the params on and run on when no
        mesh is set (None: the mesh set by ``jax.set_mesh``, or the enclosing shard_map's).
      axis_name: the tensor-parallel mesh axis (None: from the layer's ``kernel_axes`` and
        the logical axis rules, else ``"tp"``).
      impl: ``"ub"`` (userbuffers), ``"xla"`` (lax collectives), ``"auto"``, or ``"none"``
        (the same GEMMs, the communication removed: wrong numbers, to time a model's
        no-communication bound).
      sequence_parallel: the activations' layout between layers. True: split over the
        axis on the sequence dim (a ValueError where ``tp`` does not divide the sequence);
        False: replicated over the axis (tensor parallelism without sequence
        parallelism: plain matmuls, an all-reduce after each row-parallel one); None
        (default): sequence-parallel where ``tp`` divides the sequence, else replicated.
        Inside a shard_map over the axis, the inputs are local sequence shards unless
        this is False.
      seq_axis: the sequence dim of the activations: 0 for ``[seq, *batch, features]``,
        1 for batch-major ``[batch, seq, features]``.
      fp8: False (default), True or ``"current"`` (current scaling), ``"delayed"``
        (delayed scaling from amax histories).
      amax_history_length: steps of amaxes each delayed scale looks back over.
      dtype: the dtype of the computation (None: the inputs' and params' common one).
      param_dtype: the dtype the params are created in.

    A bad value raises a ValueError (TypeError for ``fp8``) naming it::

        >>> jax_ub.flax.ParallelConfig(impl="nccl")
        Traceback (most recent call last):
        ...
        ValueError: ParallelConfig: impl must be one of ('auto', 'ub', 'xla', 'none'), got ...
    """

    mesh: Mesh | None = None
    axis_name: str | None = None
    impl: str = "auto"
    sequence_parallel: bool | None = None
    seq_axis: int = 0
    fp8: bool | str = False
    amax_history_length: int = _fp8.DEFAULT_HISTORY_LENGTH
    dtype: Any = None
    param_dtype: Any = jnp.float32
    # The name errors are reported under: the layer being built.
    owner: dataclasses.InitVar[str] = "ParallelConfig"

    def __post_init__(self, owner: str) -> None:
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError(
                f"{owner}: mesh must be a concrete jax.sharding.Mesh or None (then the mesh "
                f"set by jax.set_mesh is used), got {type(self.mesh).__name__}"
            )
        if self.axis_name is not None and not isinstance(self.axis_name, str):
            raise ValueError(
                f"{owner}: axis_name must be a mesh axis name (str) or None, got {self.axis_name!r}"
            )
        checks.check_impl(owner, self.impl)
        if not (self.sequence_parallel is None or isinstance(self.sequence_parallel, bool)):
            raise ValueError(
                f"{owner}: sequence_parallel must be True, False or None (sequence-parallel "
                f"where the axis divides the sequence), got {self.sequence_parallel!r}"
            )
        placement.check_seq_axis_type(owner, self.seq_axis)
        _fp8.check(owner, self.fp8, self.amax_history_length)
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value is None and name == "dtype":
                continue
            try:
                jnp.dtype(value)
            except TypeError:
                raise ValueError(f"{owner}: {name} must be a dtype, got {value!r}") from None

    @property
    def fp8_recipe(self) -> str | None:
        """``fp8`` as the recipe's name: ``"current"``, ``"delayed"`` or None."""
        return _fp8.recipe(self.fp8)


FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))

# The fields set by the enclosing defaults() contexts, innermost last.
_DEFAULTS: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "jax_ub_flax_defaults", default=()
)


@contextlib.contextmanager
def defaults(**settings: Any) -> Iterator[ParallelConfig]:
    """Settings for every jax_ub Flax layer of a model that does not set them itself.

    Takes any of :class:`ParallelConfig`'s fields, e.g. ``impl`` and the activations'
    layout (``sequence_parallel``, ``seq_axis``); nested contexts add to the enclosing
    ones. A layer's own keyword arguments (linen attributes) and ``config=`` take
    precedence. It is read where flax reads ``logical_axis_rules``: NNX layers take it
    when they are built, linen ones when they are called, so wrap ``init`` and ``apply``
    (and a ``jit`` of them, which reads it when it traces: the defaults are part of the
    key of ``jit``'s cache, so a function traced under other defaults is traced again).
    Yields the resulting :class:`ParallelConfig` defaults.

    Example: a model whose layers all run batch-major with userbuffers, none of them
    passing ``impl`` or ``seq_axis``::

        >>> class Block(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.attn = jax_ub.flax.ParallelSelfAttention(16, 4, rngs=rngs)
        ...         self.mlp = jax_ub.flax.ParallelMLP(16, 64, rngs=rngs)
        ...     def __call__(self, x):
        ...         x = x + self.attn(x, is_causal=True)
        ...         return x + self.mlp(x)
        >>> with jax_ub.flax.defaults(impl="ub", seq_axis=1, mesh=mesh):
        ...     block = Block(nnx.Rngs(0))
        >>> block.mlp.up_proj.impl, block.attn.qkv.seq_axis
        ('ub', 1)
        >>> nnx.jit(lambda m, x: m(x))(block, jnp.ones((2, 32, 16))).shape  # [batch, seq, 16]
        (2, 32, 16)

    The linen layers read it when the model is initialised and applied::

        >>> mlp = jax_ub.flax.linen.ParallelMLP(64)
        >>> with jax_ub.flax.defaults(impl="xla", mesh=mesh):
        ...     variables = mlp.init(jax.random.key(0), x)
        ...     y = jax.jit(mlp.apply)(variables, x)
        >>> y.shape
        (32, 2, 16)
    """
    merged = dict(_DEFAULTS.get()) | settings
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"jax_ub.flax.defaults: unknown settings {unknown}; the settings are {FIELDS}"
        )
    config = ParallelConfig(**merged, owner="jax_ub.flax.defaults")
    token = _DEFAULTS.set(tuple(merged.items()))
    try:
        # Linen layers read the defaults when traced: a function jit traced under other
        # defaults is traced again, not silently run with the settings of its first trace.
        with trace_key.scoped(("jax_ub.flax.defaults", config)):
            yield config
    finally:
        _DEFAULTS.reset(token)


def current() -> ParallelConfig:
    """The defaults of the enclosing :func:`defaults` contexts (checked when set)."""
    return ParallelConfig(**dict(_DEFAULTS.get()))


def resolve(owner: str, config: ParallelConfig | None = None, **given: Any) -> ParallelConfig:
    """A layer's settings: those ``given`` that are not None, over ``config`` (else the
    model defaults, :func:`current`); checked, errors naming ``owner``."""
    if config is not None and not isinstance(config, ParallelConfig):
        raise ValueError(
            f"{owner}: config must be a jax_ub.flax.ParallelConfig or None, got "
            f"{type(config).__name__}"
        )
    unknown = sorted(set(given) - set(FIELDS))
    assert not unknown, unknown
    base = current() if config is None else config
    fields = {name: getattr(base, name) for name in FIELDS}
    fields |= {k: v for k, v in given.items() if v is not None}
    return ParallelConfig(**fields, owner=owner)
