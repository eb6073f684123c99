"""The Flax layers' settings record (jax_ub.flax.ParallelConfig), the model-wide defaults
(jax_ub.flax.defaults), the activation layout setting (sequence_parallel) and attention
masks of other dtypes than bool. CPU devices."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import regathering_calls
from conftest import make_mesh, rel_err, use_tuning
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
from jax_ub.flax import _settings

D, F, HEADS, SEQ, BATCH = 16, 32, 4, 8, 2


def hlo(f, *args) -> str:
    return f.lower(*args).as_text()


@pytest.mark.parametrize(
    "field, value",
    [
        ("impl", "nccl"),
        ("sequence_parallel", "yes"),
        ("seq_axis", "0"),
        ("fp8", "e4m3"),
        ("amax_history_length", 0),
        ("dtype", "float99"),
        ("param_dtype", "float99"),
        ("mesh", "tp"),
        ("axis_name", 3),
    ],
)
def test_bad_settings_are_named(field, value):
    with pytest.raises((ValueError, TypeError), match=f"{field}.*{value!r}|{field}.*str"):
        ubf.ParallelConfig(**{field: value})
    # The layers report it under their own name; the defaults under theirs.
    with pytest.raises((ValueError, TypeError), match=f"^ColumnParallelLinear: {field}"):
        ubf.ColumnParallelLinear(D, F, rngs=nnx.Rngs(0), **{field: value})
    with pytest.raises((ValueError, TypeError), match=f"^jax_ub.flax.defaults: {field}"):
        with ubf.defaults(**{field: value}):
            pass
    with pytest.raises((ValueError, TypeError), match=f"^ParallelMLP: {field}"):
        ubf.linen.ParallelMLP(F, **{field: value}).init(jax.random.key(0), jnp.ones((8, 2, D)))


def test_unknown_default_and_bad_config_are_named():
    with pytest.raises(ValueError, match="unknown settings \\['implementation'\\]"):
        with ubf.defaults(implementation="ub"):
            pass
    with pytest.raises(ValueError, match="config must be a jax_ub.flax.ParallelConfig"):
        ubf.ParallelMLP(D, F, config={"impl": "ub"}, rngs=nnx.Rngs(0))


def test_config_is_frozen_and_keys_the_cache():
    a, b = ubf.ParallelConfig(impl="ub"), ubf.ParallelConfig(impl="ub")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.impl = "xla"


def test_precedence_keyword_over_config_over_defaults():
    mesh = make_mesh((2, "tp"))
    config = ubf.ParallelConfig(impl="xla", seq_axis=1, mesh=mesh)
    with ubf.defaults(impl="ub", dtype=jnp.bfloat16):
        from_defaults = ubf.ColumnParallelLinear(D, F, rngs=nnx.Rngs(0))
        from_config = ubf.ColumnParallelLinear(D, F, config=config, rngs=nnx.Rngs(0))
        given = ubf.ColumnParallelLinear(D, F, config=config, impl="auto", rngs=nnx.Rngs(0))
    assert (from_defaults.impl, from_defaults.dtype) == ("ub", jnp.bfloat16)
    assert (from_config.impl, from_config.seq_axis, from_config.dtype) == ("xla", 1, None)
    assert (given.impl, given.seq_axis) == ("auto", 1)
    assert ubf.ColumnParallelLinear(D, F, rngs=nnx.Rngs(0)).impl == "auto"  # outside: none
    # A layer's settings are replaced through the record, checked.
    given.impl = "ub"
    assert given.config.impl == "ub"
    with pytest.raises(ValueError, match="impl must be one of"):
        given.impl = "nccl"


@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "ParallelGatedMLP"])
def test_settings_the_params_were_made_for_stay(layer):
    """fp8 into or out of delayed scaling (its amax histories are made with the params), the
    history length under it, axis_name and param_dtype raise naming the setting and the
    value built with; the rest (impl, current fp8) change, and the layer still runs."""
    make = getattr(ubf, layer)
    plain, delayed = (make(D, F, fp8=f, rngs=nnx.Rngs(0)) for f in (False, "delayed"))
    for target, name, value, built in [
        (plain, "fp8", "delayed", "False"),
        (delayed, "fp8", False, "'delayed'"),
        (delayed, "fp8", "current", "'delayed'"),
        (delayed, "amax_history_length", 8, "16"),
        (plain, "axis_name", "dp", "'tp'"),
        (plain, "param_dtype", jnp.bfloat16, ".*float32.*"),
    ]:
        with pytest.raises(
            ValueError,
            match=f"{layer}: {name} is fixed once the layer is built "
            f"\\(its params were made for {name}={built}\\)",
        ):
            setattr(target, name, value)
    plain.param_dtype = jnp.float32  # the dtype built with, however named
    plain.param_dtype = "float32"
    plain.fp8, plain.impl = "current", "xla"
    assert plain.config.fp8 == "current" and plain.config.impl == "xla"
    x = jax.random.normal(jax.random.key(1), (8, D))
    with jax.set_mesh(make_mesh((2, "tp"))):
        assert jnp.all(jnp.isfinite(jnp.asarray(plain(x))))


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.attn = ubf.ParallelSelfAttention(D, HEADS, rngs=rngs)
        self.mlp = ubf.ParallelMLP(D, F, rngs=rngs)
        self.gated = ubf.ParallelGatedMLP(D, F, rngs=rngs)
        self.col = ubf.ColumnParallelLinear(D, F, rngs=rngs)
        self.row = ubf.RowParallelLinear(F, D, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x, is_causal=True)
        x = x + self.mlp(x) + self.gated(x)
        return x + self.row(jnp.tanh(self.col(x)))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x + ubf.linen.ParallelSelfAttention(num_heads=HEADS)(x, is_causal=True)
        x = x + ubf.linen.ParallelMLP(F)(x) + ubf.linen.ParallelGatedMLP(F)(x)
        return x + ubf.linen.RowParallelLinear(D)(jnp.tanh(ubf.linen.ColumnParallelLinear(F)(x)))


def _layers(model):
    nodes = (m for _, m in nnx.iter_graph(model))
    return [m for m in nodes if isinstance(m, nnx.Module) and hasattr(m, "config")]


def test_nnx_layers_take_the_model_defaults(rand):
    """Every jax_ub layer of an NNX model built under defaults() runs as they say: batch
    major, with the impl given (userbuffers: custom calls in the HLO; XLA: none), and the
    same numbers either way."""
    mesh = make_mesh((2, "tp"))
    x = rand(BATCH, SEQ, D)
    out = {}
    for impl in ("ub", "xla"):
        with ubf.defaults(impl=impl, seq_axis=1, mesh=mesh):
            model = NnxModel(nnx.Rngs(0))
        layers = _layers(model)
        assert len(layers) == 7  # qkv, out, up_proj, down_proj, gated, col, row
        assert {(m.impl, m.seq_axis, m.mesh) for m in layers} == {(impl, 1, mesh)}
        f = nnx.jit(lambda m, x: m(x))
        out[impl] = f(model, x)
        graphdef, state = nnx.split(model)
        text = hlo(jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x)), state, x)
        assert ("jax_ub_all_gather_matmul" in text) == (impl == "ub")
    assert out["ub"].shape == (BATCH, SEQ, D)
    assert rel_err(out["ub"], out["xla"]) < 1e-5


def test_linen_layers_take_the_model_defaults(rand):
    mesh = make_mesh((2, "tp"))
    x = rand(BATCH, SEQ, D)
    model = LinenModel()
    out = {}
    for impl in ("ub", "xla"):
        with ubf.defaults(impl=impl, seq_axis=1, mesh=mesh):
            variables = model.init(jax.random.key(0), x)
            out[impl] = jax.jit(model.apply)(variables, x)
            text = hlo(jax.jit(model.apply), variables, x)
        assert ("jax_ub_all_gather_matmul" in text) == (impl == "ub")
        assert ("jax_ub_matmul_reduce_scatter" in text) == (impl == "ub")
    assert rel_err(out["ub"], out["xla"]) < 1e-5
    # seq_axis=1 reached every layer: the same model on [seq, batch, D] matches.
    with ubf.defaults(impl="xla", mesh=mesh):
        seq_major = jax.jit(model.apply)(variables, jnp.swapaxes(x, 0, 1))
    assert rel_err(jnp.swapaxes(seq_major, 0, 1), out["xla"]) < 1e-5


def test_defaults_docstring_runs():
    globs = dict(
        jax=jax, jnp=jnp, np=np, nn=nn, nnx=nnx, jax_ub=jax_ub,
        mesh=Mesh(np.array(jax.devices()[:4]), ("tp",)), x=jnp.ones((32, 2, 16)),
    )  # fmt: skip
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder().find(_settings, globs=globs):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_sequence_parallel_false_replicates_the_activations(rand, api):
    """sequence_parallel=False: replicated activations, the column projection local and
    the row projection summed by matmul_all_reduce (under impl="ub" its reduce-scatter
    custom call, then XLA's all-gather), the same numbers as sequence-parallel."""
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    out, texts = {}, {}
    for sp in (None, False):
        with ubf.defaults(impl="ub", mesh=mesh, sequence_parallel=sp):
            if api == "nnx":
                m = ubf.ParallelMLP(D, F, rngs=nnx.Rngs(0))
                f = jax.jit(lambda s, x, m=m: nnx.merge(nnx.graphdef(m), s)(x))
                args = (nnx.state(m), x)
            else:
                m = ubf.linen.ParallelMLP(F)
                f = jax.jit(m.apply)
                args = (m.init(jax.random.key(0), x), x)
            out[sp], texts[sp] = f(*args), hlo(f, *args)
    assert "jax_ub_all_gather_matmul" in texts[None]
    assert "jax_ub_all_gather_matmul" not in texts[False]
    assert "jax_ub_matmul_reduce_scatter" in texts[False]
    assert "stablehlo.all_gather" in texts[False] and "all_reduce" not in texts[False]
    assert rel_err(out[False], out[None]) < 1e-5


def test_sequence_parallel_true_needs_a_divisible_sequence(rand):
    mesh = make_mesh((2, "tp"))
    layer = ubf.ColumnParallelLinear(D, F, mesh=mesh, sequence_parallel=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* 5\) .* size 2"):
        layer(rand(5, BATCH, D))


def _masks(seq):
    causal = np.tril(np.ones((seq, seq), bool))
    causal[3, :] = False  # a row that attends nowhere as well
    causal[3, 0] = True
    return causal


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_masks_of_other_dtypes_attend_where_nonzero(rand, dtype):
    """flax's masks (nn.make_attention_mask) are float 0/1: nonzero attends, as a bool."""
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    mask = _masks(SEQ)
    attn = ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, impl="ub", rngs=nnx.Rngs(0))
    ref = attn(x, jnp.asarray(mask))
    assert jnp.array_equal(attn(x, jnp.asarray(mask, dtype)), ref)
    lin = ubf.linen.ParallelSelfAttention(num_heads=HEADS, mesh=mesh, impl="ub")
    variables = lin.init(jax.random.key(0), x, jnp.asarray(mask))
    ref = lin.apply(variables, x, jnp.asarray(mask))
    assert jnp.array_equal(lin.apply(variables, x, jnp.asarray(mask, dtype)), ref)
    flax_mask = nn.make_attention_mask(jnp.ones((BATCH, SEQ)), jnp.ones((BATCH, SEQ)))
    assert flax_mask.dtype == jnp.float32
    lin.apply(variables, x, flax_mask)  # [batch, 1, seq, seq]


def test_a_mask_of_no_number_dtype_is_named(rand):
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    attn = ubf.ParallelSelfAttention(D, HEADS, mesh=mesh, rngs=nnx.Rngs(0))
    mask = jnp.ones((SEQ, SEQ), jnp.complex64)
    with pytest.raises(ValueError, match=r"mask of dtype complex64.*\(8, 8\)"):
        attn(x, mask)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 8\) does not broadcast"):
        attn(x, jnp.ones((3, SEQ)))


def test_configure_reaches_layers_traced_before(rand):
    """A layer keeps one jitted shard_map per mesh; a trace-time setting changed after its
    first trace (keep_gathered here) still reaches the next program traced: the backward
    gathers x again (inside the gradient's reduce-scatter call)."""
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    with ubf.defaults(impl="ub", mesh=mesh):
        m = ubf.ParallelMLP(D, F, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(m)

    def grad_text():
        loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)  # noqa: E731
        return hlo(jax.jit(jax.grad(loss)), nnx.state(m), x)

    texts = []
    for keep in (True, False):  # conftest's _restore_config undoes the change
        jax_ub.configure(keep_gathered=keep)
        texts.append(grad_text())
    assert regathering_calls(texts[0])[1] == 0
    assert regathering_calls(texts[1])[1] > 0


def test_tuning_reaches_layers_traced_before(rand):
    """The trace-time tuning choices key a layer's jitted shard_map too: with
    transpose_w_in_place off after a first trace, the next gradient program materialises
    the weights' transposes."""
    mesh = make_mesh((2, "tp"))
    x = rand(SEQ, BATCH, D)
    with ubf.defaults(impl="ub", mesh=mesh):
        m = ubf.ParallelMLP(D, F, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(m)

    def transposes():
        loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)  # noqa: E731
        return hlo(jax.jit(jax.grad(loss)), nnx.state(m), x).count("stablehlo.transpose")

    in_place = transposes()
    use_tuning(transpose_w_in_place=False)
    assert transposes() > in_place


def test_gated_mlp_takes_a_partitioned_kernel_init():
    """A kernel_init wrapped by with_partitioning (NNX, linen) or with_logical_partitioning
    gives the gated block the values of the plain initializer (the names: below)."""
    base = nn.initializers.lecun_normal()
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    with jax.set_mesh(make_mesh((2, "tp"))), nn.logical_axis_rules([("mlp", "tp")]):
        plain = ubf.ParallelGatedMLP(D, F, kernel_init=base, rngs=nnx.Rngs(0))
        boxed = ubf.ParallelGatedMLP(
            D, F, kernel_init=nnx.with_partitioning(base, (None, "tp")), rngs=nnx.Rngs(0)
        )
        for name in ("gate_up", "down_proj"):
            assert jnp.array_equal(getattr(plain, name)[...], getattr(boxed, name)[...]), name
        want = ubf.linen.ParallelGatedMLP(F, kernel_init=base).init(jax.random.key(0), x)
        for wrap in (nn.with_partitioning(base, (None, "tp")),
                     nn.with_logical_partitioning(base, ("embed", "mlp"))):  # fmt: skip
            got = ubf.linen.ParallelGatedMLP(F, kernel_init=wrap).init(jax.random.key(0), x)
            for a, b in zip(
                jax.tree.leaves(nn.meta.unbox(got)), jax.tree.leaves(nn.meta.unbox(want))
            ):
                assert jnp.array_equal(a, b)


@pytest.mark.parametrize("block", ["ParallelMLP", "ParallelSelfAttention"])
def test_blocks_read_a_partitioned_kernel_init_as_model_then_split_dim(block):
    """A block's kernel_init boxed with names (NNX's and linen's with_partitioning, linen's
    with_logical_partitioning) names (model dim, split dim), as kernel_axes do: the column
    projection's kernel takes them as given, the row projection's ([split, model]) reversed,
    its bias unsplit; the values are the plain initializer's. A linen box handed to an NNX
    layer is refused naming the wrapper to use."""
    base = nn.initializers.lecun_normal()
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    col, row = ("up_proj", "down_proj") if block == "ParallelMLP" else ("qkv", "out")
    args = (F,) if block == "ParallelMLP" else (4,)
    want = {
        col: {"kernel": P(None, "tp"), "bias": P("tp")},
        row: {"kernel": P("tp", None), "bias": P(None)},
    }
    with jax.set_mesh(make_mesh((2, "tp"))), nn.logical_axis_rules([("mlp", "tp")]):
        plain = getattr(ubf, block)(D, *args, kernel_init=base, rngs=nnx.Rngs(0))
        boxed = getattr(ubf, block)(
            D, *args, kernel_init=nnx.with_partitioning(base, (None, "tp")), rngs=nnx.Rngs(0)
        )
        specs = nnx.get_partition_spec(nnx.state(boxed, nnx.Param))
        for name in (col, row):
            for p in ("kernel", "bias"):
                assert specs[name][p].get_value() == want[name][p], (name, p, specs[name][p])
                a, b = getattr(plain, name), getattr(boxed, name)
                assert jnp.array_equal(getattr(a, p)[...], getattr(b, p)[...]), (name, p)
        with pytest.raises(TypeError, match="linen's Partitioned.*nnx.with_partitioning"):
            getattr(ubf, block)(
                D, *args, kernel_init=nn.with_partitioning(base, (None, "tp")), rngs=nnx.Rngs(0)
            )
        plain = getattr(ubf.linen, block)(*args, kernel_init=base).init(jax.random.key(0), x)
        for wrap, names in (
            (nn.with_partitioning(base, (None, "tp")), (None, "tp")),
            (nn.with_logical_partitioning(base, ("embed", "mlp")), ("embed", "mlp")),
        ):
            got = getattr(ubf.linen, block)(*args, kernel_init=wrap).init(jax.random.key(0), x)
            boxes = got["params"]
            assert boxes[col]["kernel"].names == names
            assert boxes[row]["kernel"].names == names[::-1]
            spec = nn.get_partition_spec(got)
            spec = (nn.logical_to_mesh(spec) if names[0] else spec)["params"][row]["kernel"]
            assert spec == P("tp", None), spec
            for a, b in zip(
                jax.tree.leaves(nn.meta.unbox(got)), jax.tree.leaves(nn.meta.unbox(plain))
            ):
                assert jnp.array_equal(a, b)


def test_gated_block_reads_a_partitioned_kernel_init_as_kernel_axes():
    """The gated block reads the names its kernel_init boxes with as kernel_axes (model dim,
    split dim): NNX's and linen's logical ones give the params kernel_axes would give, an
    FSDP name on the model dim kept; linen's mesh axes are placed as given (gate_up
    (model, None, split), down_proj (split, model)); both given is refused."""
    base = nn.initializers.lecun_normal()
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    rules = [("mlp", "tp"), ("embed", "fsdp")]
    with jax.set_mesh(make_mesh((1, "fsdp"), (2, "tp"))), nn.logical_axis_rules(rules):
        axes = ("embed", "mlp")
        want = ubf.ParallelGatedMLP(D, F, kernel_axes=axes, rngs=nnx.Rngs(0))
        boxed = nnx.with_partitioning(base, axes)
        got = ubf.ParallelGatedMLP(D, F, kernel_init=boxed, rngs=nnx.Rngs(0))
        specs = [nnx.get_partition_spec(nnx.state(m, nnx.Param)) for m in (want, got)]
        for name in ("gate_up", "down_proj"):
            assert specs[0][name].get_value() == specs[1][name].get_value(), name
        assert specs[1]["gate_up"].get_value() == P("fsdp", None, "tp")  # through the rules
        with pytest.raises(ValueError, match="from kernel_axes=.* or from its kernel_init"):
            ubf.ParallelGatedMLP(D, F, kernel_axes=axes, kernel_init=boxed, rngs=nnx.Rngs(0))

        def names(**kw):
            boxes = ubf.linen.ParallelGatedMLP(F, **kw).init(jax.random.key(0), x)["params"]
            return {name: boxes[name].names for name in ("gate_up", "down_proj")}

        logical = nn.with_logical_partitioning(base, axes)
        assert names(kernel_init=logical) == names(kernel_axes=axes)
        assert names(kernel_init=logical)["down_proj"] == ("mlp", "embed")
        mesh_axes = names(kernel_init=nn.with_partitioning(base, ("fsdp", "tp")))
        assert mesh_axes == {"gate_up": ("fsdp", None, "tp"), "down_proj": ("tp", "fsdp")}


@pytest.mark.parametrize("names", [("embed", "mlp"), (None, "model")])
def test_nnx_block_takes_its_axis_from_a_boxed_kernel_init(names):
    """An NNX block whose kernel_init boxes (model dim, split dim) runs over the axis the
    split dim names, as kernel_axes would make it: mapped by the rules ("mlp" -> "model"),
    or a mesh axis named directly; the same outputs as with kernel_axes."""
    base = nn.initializers.lecun_normal()
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    rules = [("mlp", "model"), ("embed", None)]
    with jax.set_mesh(make_mesh((2, "model"))), nn.logical_axis_rules(rules):
        boxed = nnx.with_partitioning(base, names)
        got = ubf.ParallelMLP(D, F, kernel_init=boxed, rngs=nnx.Rngs(0))
        want = ubf.ParallelMLP(D, F, kernel_axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        assert got.up_proj.config.axis_name == got.down_proj.config.axis_name == "model"
        assert rel_err(got(x), want(x)) < 1e-5
