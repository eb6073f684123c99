"""Convert params between jax_ub's fused blocks and separate-projection checkpoints.

Pure functions on param trees, both ways: ``from_*`` give a jax_ub block's params, ``to_*``
take them. A tree is the block's own subtree, a nested mapping (``dict``, ``FrozenDict``,
``nnx.State``) of arrays, linen boxes (``nn.Partitioned``) or NNX variables (unboxed); the
result is plain nested dicts of ``jax.Array``:

* linen: ``variables["params"]["attn"]``; load with ``{"params": {"attn": converted}}``.
* NNX: ``nnx.state(model.attn, nnx.Param)`` (or its ``nnx.to_pure_dict``: the filter leaves
  out the fp8 histories, caches and rngs that a converter rejects); load with
  ``nnx.update(model.attn, converted)``. The arrays stay where ``jnp`` put them; to load
  them sharded, ``jax.device_put(converted, nnx.to_pure_dict(nnx.get_named_sharding(
  nnx.state(model.attn, nnx.Param), mesh)))`` first.

jax_ub's layouts (``x @ kernel``; global, unsharded shapes; ``H`` heads, ``G`` key/value
heads, ``hd`` head size, biases only with ``use_bias``):

* :class:`~jax_ub.flax.ParallelSelfAttention`: ``qkv/kernel [embed, G * (H / G + 2) * hd]``
  (columns ordered key/value head, [its ``H / G`` queries, key, value], ``hd``),
  ``qkv/bias`` likewise, ``out/kernel [H * hd, out]``, ``out/bias [out]``.
* :class:`~jax_ub.flax.ParallelMLP`: ``up_proj``, ``down_proj``: ``nn.Dense``'s params.
* :class:`~jax_ub.flax.ParallelGatedMLP`: ``gate_up [embed, 2, f]`` (gate at ``[:, 0]``,
  up at ``[:, 1]``), ``down_proj [f, out]``.

Llama-style (Hugging Face) checkpoints rotate the two halves of each head, as jax_ub's
``rope_theta`` does; Meta's original interleaved ones need the permutation of q and k that
Hugging Face's conversion script applies first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

Params = Mapping[str, Any]

LLAMA_ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
_FLAX_ATTENTION_NAMES = ("query", "key", "value", "out")
_MLP_NAMES = ("up_proj", "down_proj")


def from_flax_attention(params: Params) -> dict:
    """``flax.linen.MultiHeadDotProductAttention`` / ``flax.nnx.MultiHeadAttention`` params
    -> :class:`~jax_ub.flax.ParallelSelfAttention` params (``num_kv_heads = num_heads``).

    ``params``: ``query``, ``key``, ``value``, each ``kernel [embed, H, hd]`` and ``bias
    [H, hd]``; ``out``: ``kernel [H, hd, out]``, ``bias [out]`` (biases on all or none, as
    ``use_bias``). Build the jax_ub block with ``num_heads=H``, ``qkv_features=H * hd``,
    ``out_features=out`` and the same ``use_bias``; flax's attention is batch-major
    (``[batch, seq, embed]``), which jax_ub's takes with ``seq_axis=1``."""
    owner, names = "from_flax_attention", _FLAX_ATTENTION_NAMES
    dense, given = _read(owner, params, names, "kernel")
    (q, k, v, o), biases = [w for w, _ in dense], _all_or_none(owner, [b for _, b in dense])
    heads = q.shape[1] if q.ndim == 3 else 0
    expected = "query, key, value kernels [embed, H, hd], biases [H, hd]; out [H, hd, out], [out]"
    return _fuse(owner, expected, given, q, k, v, o, biases, heads, heads)


def to_flax_attention(params: Params, *, num_heads: int) -> dict:
    """Inverse of :func:`from_flax_attention`: the params of a jax_ub block with
    ``num_heads`` heads and no grouped-query attention (flax's has none) -> ``{"query",
    "key", "value", "out"}``, shapes as there."""
    q, k, v, o, biases = _split("to_flax_attention", params, num_heads, num_heads)
    return _write(_FLAX_ATTENTION_NAMES, [q, k, v, o], biases, "kernel")


def from_flax_mlp(params: Params, *, names: Sequence[str] = ("Dense_0", "Dense_1")) -> dict:
    """Two flax Dense layers ``names`` (``kernel [in, hidden]``, ``bias [hidden]``; then
    ``kernel [hidden, out]``, ``bias [out]``; biases on both or neither) ->
    :class:`~jax_ub.flax.ParallelMLP` params ``{"up_proj", "down_proj"}``, the same arrays.
    ``names``: by default linen's automatic ones (flax's lm1b ``MlpBlock``), numbered in
    the order the layers are built; ``("linear1", "linear2")`` for lm1b_nnx's."""
    return _rename_mlp("from_flax_mlp", params, _names("from_flax_mlp", names, 2), _MLP_NAMES)


def to_flax_mlp(params: Params, *, names: Sequence[str] = ("Dense_0", "Dense_1")) -> dict:
    """Inverse of :func:`from_flax_mlp`: ParallelMLP params -> Dense layers ``names``."""
    return _rename_mlp("to_flax_mlp", params, _MLP_NAMES, _names("to_flax_mlp", names, 2))


def from_llama_attention(
    params: Params,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    names: Sequence[str] = LLAMA_ATTENTION_NAMES,
    kernel_key: str | None = "kernel",
    transpose: bool = False,
) -> dict:
    """Llama-style separate q, k, v, o projections -> the params of a
    :class:`~jax_ub.flax.ParallelSelfAttention` built with the same ``num_heads``,
    ``num_kv_heads`` (default ``num_heads``) and the checkpoint's ``rope_theta``.

    ``params[name][kernel_key]`` for each of ``names`` (q, k, v, o), or ``params[name]``
    itself with ``kernel_key=None``, in the ``x @ kernel`` convention: q ``[embed, H * hd]``
    or ``[embed, H, hd]``; k, v ``[embed, G * hd]`` or ``[embed, G, hd]``; o ``[H * hd,
    out]`` or ``[H, hd, out]``. ``transpose=True`` takes PyTorch / Hugging Face
    ``nn.Linear`` weights ``[out, in]`` instead (2-D), e.g. with ``kernel_key="weight"``.
    Biases (``params[name]["bias"]``: ``[H * hd]`` or ``[H, hd]``, ``[G * hd]`` or ``[G,
    hd]``, ``[out]``) on all four or none, as jax_ub's ``use_bias``."""
    owner, heads = "from_llama_attention", num_heads
    groups = heads if num_kv_heads is None else num_kv_heads
    _check_heads(owner, heads, groups)
    names = _names(owner, names, 4)
    dense, given = _read(owner, params, names, kernel_key, transpose)
    (q, k, v, o), biases = [w for w, _ in dense], _all_or_none(owner, [b for _, b in dense])
    counts = (heads, groups, groups)
    q, k, v = (_unflatten(x, n, 1, 2) for x, n in zip((q, k, v), counts))
    o = _unflatten(o, heads, 0, 2)
    if biases is not None:
        biases = [_unflatten(b, n, 0, 1) for b, n in zip(biases, counts)] + biases[3:]
    expected = (
        f"q [embed, H * hd] or [embed, H, hd], k and v [embed, G * hd] or [embed, G, hd], o "
        f"[H * hd, out] or [H, hd, out]{', each transposed' if transpose else ''} (biases "
        f"[H * hd], [G * hd], [out] or none) for num_heads H={heads}, num_kv_heads G={groups}"
    )
    return _fuse(owner, expected, given, q, k, v, o, biases, heads, groups)


def to_llama_attention(
    params: Params,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    names: Sequence[str] = LLAMA_ATTENTION_NAMES,
    kernel_key: str | None = "kernel",
    transpose: bool = False,
    split_heads: bool = False,
) -> dict:
    """Inverse of :func:`from_llama_attention`: 2-D kernels ``[in, out]`` (``[out, in]``
    with ``transpose``) and 1-D biases, or with ``split_heads`` ``[embed, H, hd]``,
    ``[embed, G, hd]``, ``[H, hd, out]`` (biases ``[H, hd]``, ``[G, hd]``)."""
    owner = "to_llama_attention"
    if transpose and split_heads:
        raise ValueError(f"{owner}: transpose=True gives 2-D [out, in] weights: no split_heads")
    groups = num_heads if num_kv_heads is None else num_kv_heads
    names = _names(owner, names, 4)
    q, k, v, o, biases = _split(owner, params, num_heads, groups)
    if biases is not None and kernel_key is None:
        raise ValueError(f"{owner}: the block has biases, which kernel_key=None has no place for")
    if not split_heads:
        q, k, v, o = (x.reshape(x.shape[0], -1) for x in (q, k, v, o.reshape(-1, o.shape[-1])))
        biases = biases and [b.reshape(-1) for b in biases]
    return _write(names, [x.T if transpose else x for x in (q, k, v, o)], biases, kernel_key)


def from_llama_mlp(
    params: Params,
    *,
    names: Sequence[str] = LLAMA_MLP_NAMES,
    kernel_key: str | None = "kernel",
    transpose: bool = False,
) -> dict:
    """Llama-style gate, up and down projections (``names``; ``kernel_key``, ``transpose``
    as for :func:`from_llama_attention`): ``gate, up [embed, f]``, ``down [f, out]``, no
    biases -> :class:`~jax_ub.flax.ParallelGatedMLP` params ``gate_up [embed, 2, f]``
    (``stack([gate, up], axis=1)``), ``down_proj [f, out]``."""
    owner = "from_llama_mlp"
    names = _names(owner, names, 3)
    dense, given = _read(owner, params, names, kernel_key, transpose)
    if any(b is not None for _, b in dense):
        raise ValueError(f"{owner}: ParallelGatedMLP has no biases, but {list(names)} have")
    gate, up, down = (w for w, _ in dense)
    if gate.ndim != 2 or up.shape != gate.shape or down.ndim != 2 or down.shape[0] != gate.shape[1]:
        t = ", each transposed ([out, in]: transpose=True)" if transpose else ""
        raise _mismatch(owner, f"gate and up [embed, f], down [f, out]{t}", **given)
    return {"gate_up": jnp.stack([gate, up], axis=1), "down_proj": down}


def to_llama_mlp(
    params: Params,
    *,
    names: Sequence[str] = LLAMA_MLP_NAMES,
    kernel_key: str | None = "kernel",
    transpose: bool = False,
) -> dict:
    """Inverse of :func:`from_llama_mlp`: ``gate, up [embed, f]``, ``down [f, out]``
    (``[out, in]`` with ``transpose``)."""
    owner = "to_llama_mlp"
    names = _names(owner, names, 3)
    entries = _entries(owner, params, ("gate_up", "down_proj"))
    gate_up, down = entries["gate_up"], entries["down_proj"]
    if (
        gate_up.ndim != 3
        or gate_up.shape[1] != 2
        or (down.ndim, down.shape[0]) != (2, gate_up.shape[2])
    ):
        raise _mismatch(owner, "gate_up [embed, 2, f], down_proj [f, out]", **entries)
    ws = [gate_up[:, 0], gate_up[:, 1], down]
    return _write(names, [w.T if transpose else w for w in ws], None, kernel_key)


# --- helpers ------------------------------------------------------------------------------


def _array(x: Any) -> Any:
    """``x`` unboxed: a linen ``nn.Partitioned`` (or other box) or NNX variable's value."""
    if isinstance(x, meta.AxisMetadata):
        x = x.unbox()
    return jnp.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)


def _entries(owner: str, tree: Any, required: Sequence[str], optional: Sequence[str] = ()):
    """``tree``'s entries (leaves unboxed): all of ``required``, maybe ``optional``."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"{owner}: expected a mapping with {list(required)}, got {type(tree)}")
    missing = [k for k in required if k not in tree]
    extra = [k for k in tree if k not in required and k not in optional]
    problems = ([f"missing {missing}"] if missing else []) + (
        [f"unexpected {extra}"] if extra else []
    )
    if problems:
        want, keys = [*required, *(f"{k} (optional)" for k in optional)], sorted(map(str, tree))
        raise ValueError(
            f"{owner}: params with keys {keys}, expected {want}: {'; '.join(problems)}"
        )
    return {k: v if isinstance(v, Mapping) else _array(v) for k, v in tree.items()}


def _read(owner: str, params: Params, names: Sequence[str], key: str | None, transpose=False):
    """``([(kernel, bias or None)] of the projections names, {path: array as given})``:
    each ``params[name]`` a mapping with the kernel at ``key`` and maybe ``"bias"``, or
    with ``key=None`` the kernel itself; ``transpose``: 2-D kernels ``[out, in]``."""
    entries, dense, given = _entries(owner, params, names), [], {}
    for name in names:
        entry = entries[name]
        if key is None and isinstance(entry, Mapping):
            raise ValueError(f"{owner}: kernel_key=None takes arrays; {name} has {list(entry)}")
        entry = (
            {name: entry} if key is None else _entries(f"{owner}: {name}", entry, [key], ["bias"])
        )
        given |= {name if key is None else f"{name}/{k}": v for k, v in entry.items()}
        kernel = entry[name if key is None else key]
        if transpose and kernel.ndim != 2:
            raise _mismatch(owner, "2-D [out, in] weights with transpose=True", **given)
        dense.append((kernel.T if transpose else kernel, entry.get("bias")))
    return dense, given


def _names(owner: str, names: Sequence[str], count: int) -> tuple:
    if isinstance(names, str) or len(names) != count:
        raise ValueError(f"{owner}: names must be {count} names, got {names!r}")
    return tuple(names)


def _write(names: Sequence[str], kernels: list, biases: list | None, key: str | None) -> dict:
    if key is None:
        return dict(zip(names, kernels, strict=True))
    biases = biases or [None] * len(kernels)
    return {
        n: {key: w} | ({} if b is None else {"bias": b})
        for n, w, b in zip(names, kernels, biases, strict=True)
    }


def _all_or_none(owner: str, biases: list) -> list | None:
    if any(b is None for b in biases) and any(b is not None for b in biases):
        msg = "biases on some projections only; jax_ub's use_bias puts them on all"
        raise ValueError(f"{owner}: {msg} (add zero biases where missing)")
    return None if biases[0] is None else biases


def _mismatch(owner: str, expected: str, **given: Any) -> ValueError:
    shapes = ", ".join(f"{k} {tuple(jnp.shape(v))}" for k, v in given.items())
    return ValueError(f"{owner}: expected {expected}; got {shapes}")


def _check_heads(owner: str, heads: int, groups: int) -> None:
    if heads <= 0 or groups <= 0 or heads % groups:
        raise ValueError(f"{owner}: num_kv_heads={groups} must divide num_heads={heads}")


def _unflatten(x: Any, n: int, dim: int, flat: int) -> Any:
    """``x`` with ``flat`` dims, ``n * hd`` at ``dim``, as ``[.., n, hd, ..]``; else as is."""
    if x.ndim != flat or x.shape[dim] % n:
        return x
    return x.reshape(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :])


def _fuse(owner: str, expected: str, given: dict, q, k, v, o, biases, heads, groups) -> dict:
    """jax_ub attention params from ``q [embed, H, hd]``, ``k, v [embed, G, hd]``, ``o [H,
    hd, out]`` and ``biases`` (None or ``[H, hd]``, ``[G, hd]``, ``[G, hd]``, ``[out]``), or
    a ValueError: ``expected``, and the shapes ``given``."""
    embed, hd, out = (x.shape[i] if x.ndim else -1 for x, i in ((q, 0), (q, -1), (o, -1)))
    want = [(embed, heads, hd), (embed, groups, hd), (embed, groups, hd), (heads, hd, out)]
    want += [] if biases is None else [(heads, hd), (groups, hd), (groups, hd), (out,)]
    if heads <= 0 or [tuple(a.shape) for a in [q, k, v, o, *(biases or [])]] != want:
        raise _mismatch(owner, expected, **given)
    params = {"qkv": {"kernel": _fuse_heads(q, k, v)}, "out": {"kernel": o.reshape(-1, out)}}
    if biases is not None:
        params["qkv"]["bias"], params["out"]["bias"] = _fuse_heads(*biases[:3]), biases[3]
    return params


def _fuse_heads(q: Any, k: Any, v: Any) -> jax.Array:
    """``q [*lead, H, hd]``, ``k, v [*lead, G, hd]`` -> ``[*lead, G * (H / G + 2) * hd]``,
    columns ordered (key/value head, [its H / G queries, key, value], hd)."""
    *lead, heads, hd = q.shape
    groups = k.shape[-2]
    q = q.reshape(*lead, groups, heads // groups, hd)
    k, v = (a.reshape(*lead, groups, 1, hd) for a in (k, v))
    return jnp.concatenate([q, k, v], axis=-2).reshape(*lead, -1)


def _split(owner: str, params: Params, heads: int, groups: int) -> tuple:
    """``(q, k, v, o, biases)`` as :func:`_fuse` takes them, from jax_ub attention params."""
    _check_heads(owner, heads, groups)
    dense, given = _read(owner, params, ("qkv", "out"), "kernel")
    (qkv, _), (out, _) = dense
    biases = _all_or_none(owner, [b for _, b in dense])
    hd = out.shape[0] // heads if out.ndim == 2 else 0
    width, embed = groups * (heads // groups + 2) * hd, qkv.shape[0] if qkv.ndim else -1
    want = [(embed, width), (heads * hd, out.shape[-1] if out.ndim else -1)]
    want += [] if biases is None else [(width,), want[1][1:]]
    if hd <= 0 or [tuple(a.shape) for a in [qkv, out, *(biases or [])]] != want:
        fused = f"[embed, G * (H / G + 2) * hd] for num_heads H={heads}, num_kv_heads G={groups}"
        raise _mismatch(
            owner, f"qkv/kernel {fused}, out/kernel [H * hd, out], biases or none", **given
        )
    q, k, v = _split_heads(qkv, heads, groups, hd)
    if biases is not None:
        biases = [*_split_heads(biases[0], heads, groups, hd), biases[1]]
    return q, k, v, out.reshape(heads, hd, -1), biases


def _split_heads(fused: Any, heads: int, groups: int, hd: int) -> tuple:
    """Inverse of :func:`_fuse_heads`."""
    *lead, _ = fused.shape
    x = fused.reshape(*lead, groups, heads // groups + 2, hd)
    q = x[..., : heads // groups, :].reshape(*lead, heads, hd)
    return q, x[..., -2, :], x[..., -1, :]


def _rename_mlp(owner: str, params: Params, src: tuple, dst: tuple) -> dict:
    dense, given = _read(owner, params, src, "kernel")
    (w1, b1), (w2, b2) = dense
    biases = _all_or_none(owner, [b1, b2])
    ok = w1.ndim == w2.ndim == 2 and w1.shape[1] == w2.shape[0]
    if not ok or (biases is not None and (b1.shape, b2.shape) != (w1.shape[1:], w2.shape[1:])):
        raise _mismatch(
            owner, "kernels [in, hidden], [hidden, out] (biases [hidden], [out])", **given
        )
    return _write(dst, [w1, w2], biases, "kernel")
