"""``jax_ub.flax.DenseGeneral`` (NNX) and ``jax_ub.flax.linen.DenseGeneral``: one
trainer-shaped projection that runs column-parallel, row-parallel or as a plain matmul as
its kernel's logical names and the rules place it, and a trainer's DenseGeneral
conventions: rules listing several mesh axes, ``out_sharding=`` at call, n-d initializers
called with ``in_axis`` / ``out_axis``, ``weight_dtype``, ``kernel_axes=()``, and the
options with no counterpart (``quant``, ``matmul_precision``) refused by name.

Each against plain ``jnp.einsum`` of the same params on fresh random data, f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel_err
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf

B, L, E, H, HD, F = 2, 8, 16, 4, 4, 32
AXES = ("data", "fsdp", "fsdp_transpose", "tensor", "tensor_sequence")
RULES = (
    ("embed", "fsdp"),
    ("heads", ("tensor", "tensor_sequence")),
    ("kv", None),
    ("mlp", ("fsdp_transpose", "tensor", "tensor_sequence")),
    ("vocab", None),
)
TOL = 2e-5


def trainer_mesh(data: int, fsdp: int, tensor: int) -> Mesh:
    devices = np.array(jax.devices()[: data * fsdp * tensor])
    return Mesh(devices.reshape(data, fsdp, 1, tensor, 1), AXES)


def nd_init(key, shape, dtype, in_axis, out_axis):
    """A trainer's n-d initializer: fan-in over the contracted dims it is told of."""
    init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis, out_axis)
    return init(key, shape, dtype)


def einsum(x, kernel, bias, n_in):
    contract = "".join("ijk"[:n_in])
    out = jnp.einsum(f"bl{contract},{contract}...->bl...", x, kernel)
    return out if bias is None else out + bias


# (kernel_axes, in_features, out_features, axis): q, o, an up projection, a head.
CASES = {
    "q": (("embed", "heads", "kv"), E, (H, HD), -1, "column"),
    "o": (("heads", "kv", "embed"), (H, HD), E, (-2, -1), "row"),
    "up": (("embed", "mlp"), E, F, -1, "column"),
    "head": (("embed", "vocab"), E, 24, -1, "replicated"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nnx_kind_from_the_names_and_rules(rand, case):
    """data 2 x tensor 2 (rules listing size-1 axes too): the kind from the kernel's
    names, the tensor-parallel axis the one listed axis of size > 1, the values x @ w."""
    names, fin, fout, axis, kind = CASES[case]
    mesh = trainer_mesh(2, 1, 2)
    n_in = 1 if isinstance(fin, int) else len(fin)
    x = rand(B, L, *((fin,) if isinstance(fin, int) else fin))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        layer = ubf.DenseGeneral(
            fin, fout, axis=axis, kernel_axes=names, kernel_init=nd_init, seq_axis=1,
            impl="ub", rngs=nnx.Rngs(0),
        )  # fmt: skip
        assert layer.kind == kind
        y = nnx.jit(lambda m, x: m(x))(layer, x)
        text = jax.jit(lambda s, x: nnx.merge(*s)(x)).lower(nnx.split(layer), x).as_text()
    assert ("jax_ub_" in text) == (kind != "replicated")
    want = einsum(x, layer.kernel[...], layer.bias[...], n_in)
    assert rel_err(y, want) < TOL
    if kind != "replicated":
        assert layer.axis_name == "tensor"


def test_linen_kind_from_the_names_and_rules(rand):
    """The same in linen, the names from a kernel_init wrapped with_logical_partitioning
    (an n-d one, called with in_axis and out_axis), decided at each call."""
    mesh = trainer_mesh(2, 1, 2)

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = functools.partial(ubf.linen.DenseGeneral, seq_axis=1, impl="ub")
            init = functools.partial(nn.with_logical_partitioning, nd_init)
            q = dense((H, HD), kernel_init=init(("embed", "heads", "kv")), name="q")
            o = dense(E, axis=(-2, -1), kernel_init=init(("heads", "kv", "embed")), name="o")
            kinds = (q.kind(), o.kind())
            return o(jnp.tanh(q(x))), kinds

    x = rand(B, L, E)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        variables = Attn().init(jax.random.key(0), x)
        (y, kinds) = Attn().apply(variables, x)
        hlo = jax.jit(lambda v, x: Attn().apply(v, x)[0]).lower(variables, x).as_text()
    assert kinds == ("column", "row") and "jax_ub_all_gather_matmul" in hlo
    p = nn.unbox(variables["params"])
    assert nn.get_partition_spec(variables)["params"]["q"]["kernel"] == P("embed", "heads", "kv")
    want = einsum(
        jnp.tanh(einsum(x, p["q"]["kernel"], p["q"]["bias"], 1)),
        p["o"]["kernel"],
        p["o"]["bias"],
        2,
    )
    assert rel_err(y, want) < TOL


def test_nd_initializer_gets_the_kernel_shape_and_its_axes():
    """An initializer taking in_axis and out_axis gets the kernel's own n-d shape, the
    contracted dims as in_axis and the features as out_axis, with the trainer's key:
    the trainer's kernel, value for value (nnx, linen, and the column/row layers)."""
    key = jax.random.key(3)
    want = nd_init(nnx.Rngs(key).params(), (H, HD, E), jnp.float32, (0, 1), (2,))
    got = ubf.DenseGeneral(
        (H, HD), E, axis=(-2, -1), kernel_init=nd_init, rngs=nnx.Rngs(key)
    ).kernel[...]
    np.testing.assert_array_equal(got, want)
    row = ubf.RowParallelLinear((H, HD), E, axis=(-2, -1), kernel_init=nd_init, rngs=nnx.Rngs(key))
    np.testing.assert_array_equal(row.kernel[...], want)
    calls = []

    def spy(key, shape, dtype, in_axis, out_axis):
        calls.append((shape, in_axis, out_axis))
        return nd_init(key, shape, dtype, in_axis, out_axis)

    layer = ubf.linen.DenseGeneral(E, axis=(-2, -1), kernel_init=spy)
    layer.init(jax.random.key(0), jnp.ones((B, L, H, HD)))
    assert ((H, HD, E), (0, 1), (2,)) in calls, calls
    # A plain initializer is still called on the flattened [in, out] shape, as flax does.
    flat = ubf.DenseGeneral((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(key))
    ref = nnx.LinearGeneral((H, HD), E, axis=(-2, -1), rngs=nnx.Rngs(key))
    np.testing.assert_array_equal(flat.kernel[...], ref.kernel[...])


def test_fsdp_and_tensor_both_above_one_need_axis_name(rand):
    mesh = trainer_mesh(1, 2, 2)
    kw = dict(kernel_axes=("embed", "mlp"), seq_axis=1, rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        with pytest.raises(
            ValueError, match=r"split over the mesh axes \('fsdp', 'tensor'\).*pass axis_name"
        ):
            ubf.DenseGeneral(E, F, **kw)
        up = ubf.DenseGeneral(E, F, axis_name="tensor", **kw)
        down = ubf.DenseGeneral(
            F, E, axis_name="tensor", kernel_axes=("mlp", "embed"), seq_axis=1, rngs=nnx.Rngs(1)
        )
        assert (up.kind, down.kind) == ("column", "row")
        x = rand(B, L, E)
        y = nnx.jit(lambda u, d, x: d(u(x)))(up, down, x)
    want = einsum(einsum(x, up.kernel[...], up.bias[...], 1), down.kernel[...], down.bias[...], 1)
    assert rel_err(y, want) < TOL


def test_axis_of_size_one_runs_a_plain_matmul(rand):
    """fsdp 4, tensor 1: no tensor parallelism, XLA's matmul as the trainer's own layer."""
    mesh = trainer_mesh(1, 4, 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        layer = ubf.DenseGeneral(
            E, F, kernel_axes=("embed", "mlp"), axis_name="tensor", seq_axis=1, rngs=nnx.Rngs(0)
        )
        assert layer.kind == "replicated"
        x = rand(B, L, E)
        y = nnx.jit(lambda m, x: m(x))(layer, x)
    assert rel_err(y, einsum(x, layer.kernel[...], layer.bias[...], 1)) < TOL


def test_out_sharding_is_checked_against_the_output_layout(rand):
    mesh = trainer_mesh(2, 1, 2)
    x = rand(B, L, E)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(RULES):
        up = ubf.DenseGeneral(E, F, kernel_axes=("embed", "mlp"), seq_axis=1, rngs=nnx.Rngs(0))
        down = ubf.DenseGeneral(F, E, kernel_axes=("mlp", "embed"), seq_axis=1, rngs=nnx.Rngs(1))
        h_spec = NamedSharding(mesh, P("data", None, "tensor"))
        step = nnx.jit(
            lambda u, d, x, h, o: d(u(x, out_sharding=h), out_sharding=o), static_argnums=(3, 4)
        )
        y = step(up, down, x, h_spec, P("data", None, None))  # row: gathered by XLA
        assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 3)
        y2 = step(up, down, x, h_spec, P("data", "tensor", None))  # row: sequence-parallel
        h = einsum(x, up.kernel[...], up.bias[...], 1)
        for got in (y, y2):
            assert rel_err(got, einsum(h, down.kernel[...], down.bias[...], 1)) < TOL
        with pytest.raises(
            ValueError,
            match=r"out_sharding .* places the tensor-parallel axis 'tensor' on dims \[1\]"
            r".*column-parallel layer's output is split over 'tensor' on dim 2",
        ):
            nnx.jit(lambda u, x: u(x, out_sharding=P(None, "tensor", None)))(up, x)
        with pytest.raises(
            ValueError,
            match=r"row-parallel layer's output is split over 'tensor' on dim 1, or replicated",
        ):
            nnx.jit(lambda d, h: d(h, out_sharding=P(None, None, "tensor")))(down, h)
        with pytest.raises(
            ValueError, match=r"out_sharding must be a jax.sharding.NamedSharding or PartitionSpec"
        ):
            up(x, out_sharding=("data", None, "tensor"))


def test_options_with_no_counterpart_are_named():
    kw = dict(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"quant='int8'.*do not run a trainer's quantization"):
        ubf.DenseGeneral(E, F, quant="int8", **kw)
    with pytest.raises(ValueError, match=r"matmul_precision='bfloat16' has no counterpart"):
        ubf.DenseGeneral(E, F, matmul_precision="bfloat16", **kw)
    with pytest.raises(ValueError, match=r"weight_dtype=.* and param_dtype=.* name the same"):
        ubf.DenseGeneral(E, F, weight_dtype=jnp.bfloat16, param_dtype=jnp.float32, **kw)
    layer = ubf.DenseGeneral(E, F, weight_dtype=jnp.bfloat16, matmul_precision="highest", **kw)
    assert layer.kernel[...].dtype == jnp.bfloat16
    assert ubf.DenseGeneral(E, F, kernel_axes=(), **kw).kind == "replicated"  # () means none
    linen = ubf.linen.DenseGeneral(F, quant=object())
    with pytest.raises(ValueError, match=r"quant=<object.*do not run a trainer.s quantization"):
        linen.init(jax.random.key(0), jnp.ones((B, L, E)))


def test_project_refuses_a_plain_matmul():
    layer = ubf.DenseGeneral(E, F, rngs=nnx.Rngs(0))  # no names: a plain matmul
    assert layer.kind == "replicated"
    with pytest.raises(ValueError, match="runs as a plain matmul: call it alone"):
        ubf.nnx.project(jnp.ones((B, L, E)), layer)
