"""The shape of a column- or row-parallel projection, as flax's ``DenseGeneral`` (linen)
and ``LinearGeneral`` (NNX) shape theirs, and where its params are split.

A projection contracts the input's trailing dims ``in_shape`` with a kernel
``[*in_shape, *features]`` into ``[..., *features]``, plus a bias ``[*features]``. One
kernel dim is split over the tensor-parallel axis: a feature dim for a column-parallel
projection (e.g. the heads of ``[embed, heads, head_dim]``), a contracted one for a
row-parallel projection (the heads of ``[heads, head_dim, embed]``). Flattened, the
contracted dims and the features are the ``[k, n]`` matmul of the plain linear layers,
and each rank's shard flattens to its block of that matmul (its columns, its rows) in the
same order, whichever dim is split: the ops run on the flattened shards.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec as P

from jax_ub.flax import _fp8


def canonical_shape(owner: str, what: str, value: Any) -> tuple[int, ...]:
    """``value`` (an int or a sequence of them, each positive) as a tuple."""
    dims = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        dims = tuple(dims)
    except TypeError:
        dims = None
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise ValueError(
            f"{owner}: {what} must be a positive int or a non-empty sequence of them, got {value!r}"
        )
    return dims


def canonical_axes(owner: str, axis: Any, n_in: int | None = None) -> tuple[int, ...]:
    """The input dims a projection contracts, ``axis`` (an int or a sequence of them, as
    flax's ``axis``), as negative indices: they must be the input's last ``len(axis)``
    dims, in order (the trailing dims the ops flatten)."""
    axes = (axis,) if isinstance(axis, int) and not isinstance(axis, bool) else axis
    try:
        axes = tuple(axes)
    except TypeError:
        axes = ()
    valid = bool(axes) and all(isinstance(a, int) and not isinstance(a, bool) for a in axes)
    if valid and n_in is not None and len(axes) != n_in:
        raise ValueError(
            f"{owner}: in_features {n_in} dims and axis={axis!r} must have the same length"
        )
    if not valid or any(a >= 0 for a in axes):
        if valid and all(a >= 0 for a in axes):
            raise ValueError(
                f"{owner}: axis={axis!r} counts from the front; the contracted dims are the "
                f"input's last ones, so give them from the end: axis="
                f"{tuple(range(-len(axes), 0)) if len(axes) > 1 else -1}"
            )
        raise ValueError(f"{owner}: axis must be an int or a sequence of ints, got {axis!r}")
    if axes != tuple(range(-len(axes), 0)):
        raise ValueError(
            f"{owner}: axis={axis!r} must be the input's last {len(axes)} dims in order, "
            f"{tuple(range(-len(axes), 0))}: jax_ub contracts the trailing dims (move the "
            "others there with jnp.moveaxis)"
        )
    return axes


class Projection(NamedTuple):
    """A projection's shape: ``kind`` (``"column"``, ``"row"``; ``"replicated"``: a plain
    matmul, :class:`jax_ub.flax.DenseGeneral`'s where no kernel dim is tensor-parallel),
    the contracted ``in_shape``, the output ``features``, which kernel dim is ``split`` over the
    tensor-parallel axis, and whether it has a bias. Hashable: the layers' compiled
    functions are keyed on it."""

    kind: str
    in_shape: tuple[int, ...]
    features: tuple[int, ...]
    split: int
    use_bias: bool

    @classmethod
    def linear(cls, kind: str, use_bias: bool) -> Projection:
        """A plain ``[k, n]`` linear layer's (its sizes not needed for names and specs)."""
        return cls(kind, (0,), (0,), 1 if kind == "column" else 0, use_bias)

    @property
    def n_in(self) -> int:
        return len(self.in_shape)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return self.in_shape + self.features

    @property
    def split_size(self) -> int:
        return self.kernel_shape[self.split]

    @property
    def split_what(self) -> str:
        """The split dim as the layer's arguments name it, e.g. ``out_features[0]``."""
        name, dims, i = "out_features", self.features, self.split - self.n_in
        if self.kind == "row":
            name, dims, i = "in_features", self.in_shape, self.split
        return name if len(dims) == 1 else f"{name}[{i}]"

    def names(
        self, owner: str, axis_name: str, other_axes: Any, logical: tuple | None = None
    ) -> dict[str, tuple]:
        """The sharding names the params carry as metadata (``nnx.get_partition_spec``,
        ``nn.get_partition_spec``). With ``logical`` names of the kernel's dims (the user's
        rules map them to mesh axes), those, and the features' for the bias. Else mesh
        axes: ``axis_name`` on the split dim and ``other_axes`` (e.g. an FSDP axis, or
        None) on the first dim of the other side (the model dim: the first contracted one
        of a column projection, the first feature of a row one); the bias split as the
        features are (column) or replicated, as it is added after the sum (row).

        Only initial placement and the user's view: the ops take the params in whatever
        layout they arrive, and XLA gathers what is not split over ``axis_name``."""
        if logical is not None:
            kernel = tuple(logical)
            bias = kernel[self.n_in :]
        elif self.kind == "replicated":
            kernel = (other_axes,) + (None,) * (len(self.kernel_shape) - 1)
            bias = (None,) * len(self.features)
        else:
            if other_axes is not None and (
                other_axes == axis_name
                or (isinstance(other_axes, tuple) and axis_name in other_axes)
            ):
                raise ValueError(
                    f"{owner}: param_axes={other_axes!r} names the tensor-parallel axis "
                    f"{axis_name!r}; it names the axes that split the kernel's other dim"
                )
            names: list[Any] = [None] * len(self.kernel_shape)
            names[0 if self.kind == "column" else self.n_in] = other_axes
            names[self.split] = axis_name
            kernel = tuple(names)
            bias = kernel[self.n_in :] if self.kind == "column" else (None,) * len(self.features)
        return {"kernel": kernel, "bias": bias} if self.use_bias else {"kernel": kernel}

    def param_specs(self, axis_name: str, fp8: str | None = None) -> dict[str, Any]:
        """The specs the ops take the params in, over ``axis_name`` alone (with
        ``fp8="delayed"``, the amax histories too, replicated): :meth:`names`' mesh axes."""
        names = self.names("", axis_name, None)
        return {k: P(*v) for k, v in names.items()} | _fp8.history_specs(fp8)


def takes_axes(init: Any) -> bool:
    """Whether ``init`` is an n-d initializer, called ``init(key, shape, dtype, in_axis,
    out_axis)`` on the kernel's own shape, as trainers' ``variance_scaling``-style
    initializers of n-d kernels are: its parameters include ``in_axis`` and ``out_axis``,
    or it requires five positional arguments (through flax's partitioning wrappers, which
    keep the wrapped function's signature)."""
    try:
        params = list(inspect.signature(init).parameters.values())
    except (TypeError, ValueError):
        return False
    if {"in_axis", "out_axis"} <= {p.name for p in params}:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is p.empty]
    return len(required) >= 5


def init_kernel(init: Any, key: Any, shape: Sequence[int], n_in: int, dtype: Any) -> Any:
    """A kernel ``[*in (n_in dims), *features]`` from ``init``: an n-d initializer
    (:func:`takes_axes`) on ``shape`` with ``in_axis`` the contracted dims and ``out_axis``
    the features; any other on the shape flattened to ``[in, out]`` as flax's
    ``DenseGeneral`` calls it (:func:`flat_shape`), so that a fan-in is the contracted
    dims'. The value as ``init`` returns it (a box, flat, where it boxes)."""
    if takes_axes(init):
        in_axis = tuple(range(n_in))
        out_axis = tuple(range(n_in, len(shape)))
        return init(key, tuple(shape), dtype, in_axis, out_axis)
    return init(key, flat_shape(shape, n_in), dtype)


# Where flax versions keep the names ``nnx.with_partitioning`` gives (VariableMetadata).
NNX_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def nnx_box_key(value: Any) -> str | None:
    """The metadata key under which an NNX box (``nnx.with_partitioning``'s
    VariableMetadata) holds its names; None for anything else, or a box without names."""
    metadata = getattr(value, "metadata", None)
    if not (isinstance(metadata, dict) and dataclasses.is_dataclass(value)):
        return None
    return next((k for k in NNX_NAME_KEYS if metadata.get(k) is not None), None)


def _per_init(f: Any) -> Any:
    """``f(init)`` cached per initializer (an unhashable one: computed each time)."""
    cached = functools.lru_cache(maxsize=64)(f)

    @functools.wraps(f)
    def call(init: Any) -> Any:
        try:
            hash(init)
        except TypeError:
            return f(init)
        return cached(init)

    return call


@_per_init
def box_names(init: Any) -> tuple[tuple | None, bool]:
    """The names a partitioning wrapper boxes ``init``'s values with, and whether they are
    mesh axes: linen's ``nn.with_partitioning`` (mesh axes) and
    ``nn.with_logical_partitioning`` (logical), NNX's ``nnx.with_partitioning`` (read as
    ``kernel_axes`` are); ``(None, False)`` for an initializer that boxes nothing."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from flax import linen as nn  # noqa: PLC0415

    if not callable(init):
        return None, False
    nnx_names: list = []

    def shape_of_box() -> Any:
        box = init_kernel(init, jax.random.key(0), (2, 2), 1, jnp.float32)
        key = nnx_box_key(box)
        if key is not None:  # NNX's box is no pytree: its names out, its value returned
            nnx_names.append(box.metadata[key])
            return box.raw_value
        return box

    box = jax.eval_shape(shape_of_box)
    if isinstance(box, nn.LogicallyPartitioned):
        return tuple(box.names), False
    if isinstance(box, nn.Partitioned):
        return tuple(box.names), True
    return (tuple(nnx_names[0]), False) if nnx_names else (None, False)


@_per_init  # one wrapper an init: box_names' cache keys on it
def row_kernel_init(init: Any) -> Any:
    """A block's ``kernel_init`` as its row-parallel projection takes it. A block's names
    read ``(model dim, split dim)``, as its ``kernel_axes`` do: its column projection's
    kernel is ``[model, split]``, its row projection's ``[split, model]``, so the two names
    a partitioning wrapper (linen's or NNX's) boxes a value with are reversed for it
    (without them, a block-level ``nn.with_partitioning(init, (None, "tp"))`` would split
    ``down_proj``'s output features). Anything else passes through."""

    @functools.wraps(init)  # its signature too: takes_axes reads it
    def reversed_names(*args: Any, **kwargs: Any) -> Any:
        return _reverse_box_names(init(*args, **kwargs))

    return reversed_names


def _reverse_box_names(value: Any) -> Any:
    names = getattr(value, "names", None)  # linen: meta.Partitioned, LogicallyPartitioned
    if isinstance(names, tuple) and len(names) == 2 and hasattr(value, "replace"):
        return value.replace(names=names[::-1])
    key = nnx_box_key(value)  # NNX: VariableMetadata
    if key is not None and len(value.metadata[key]) == 2:
        names = tuple(value.metadata[key])[::-1]
        return dataclasses.replace(value, metadata={**value.metadata, key: names})
    return value


def flat_shape(shape: Sequence[int], n_lead: int) -> tuple[int, ...]:
    """``shape`` as flax's ``DenseGeneral`` / ``LinearGeneral`` hand it to their
    initializers: ``[prod(leading n_lead dims), prod(the rest)]``, or with no leading
    dims one dim, so that a fan-in is that of the contracted dims."""
    rest = math.prod(shape[n_lead:])
    return (math.prod(shape[:n_lead]), rest) if n_lead else (rest,)


def param_names(
    owner: str, kind: str, axis_name: str, use_bias: bool, other_axes: Any
) -> dict[str, tuple]:
    """The sharding names a plain ``[k, n]`` ``kind`` layer's params carry as metadata
    (:meth:`Projection.names`)."""
    return Projection.linear(kind, use_bias).names(owner, axis_name, other_axes)


def param_specs(kind: str, axis_name: str, use_bias: bool, fp8: str | None = None) -> dict:
    """How the ops need a plain ``kind`` layer's params split over ``axis_name`` (with
    ``fp8="delayed"``, its amax histories too, replicated)."""
    return Projection.linear(kind, use_bias).param_specs(axis_name, fp8)


def check_group(projections: Sequence[Projection], configs: Sequence[Any]) -> None:
    """Projections that run from one input as one (:func:`jax_ub.flax.nnx.project`): column
    ones, of the same input features and settings; fp8 with current scaling only."""
    if any(p.kind == "replicated" for p in projections):
        raise ValueError(
            "project: a DenseGeneral that no tensor-parallel axis splits runs as a plain "
            "matmul: call it alone"
        )
    if len(projections) == 1:
        return
    if any(p.kind != "column" for p in projections):
        raise ValueError(
            "project: layers run from one gather are column-parallel; a row-parallel layer "
            "runs alone"
        )
    if len({(p.in_shape, config) for p, config in zip(projections, configs)}) > 1:
        fields = [f.name for f in dataclasses.fields(configs[0])]
        differ = [f for f in fields if len({getattr(c, f) for c in configs}) > 1]
        raise ValueError(
            "project: the layers of one gather take the same input features and settings; "
            f"got in_features {[p.in_shape for p in projections]}"
            + "".join(f", {f} {[getattr(c, f) for c in configs]}" for f in differ)
        )
    if configs[0].fp8_recipe == "delayed":
        raise ValueError(
            "project: fp8='delayed' keeps amax histories per layer, and layers run from one "
            "gather share one GEMM: call them one by one, or use fp8='current'"
        )
