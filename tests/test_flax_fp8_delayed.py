"""fp8="delayed" in the Flax layers and blocks (CPU devices, the host protocol emulating fp8):
the scales come from the amax histories kept in the model state (the forward equals a
float32 product of operands dequantized with ``max(history) / 448``), one step's gradients
of the histories are the histories with the tensors' amaxes rolled in front, a flax
training loop (nnx.Optimizer plus an overwrite; linen's TrainState) fills them with the
observed amaxes and follows the bf16 run, and bad settings are refused."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _layer_refs import nnx_in_shard_map
from conftest import make_mesh, rel_err
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax as ubf
import jax_ub.flax.linen as ubl
from jax_ub.flax import _fp8

TP = 4
SEQ, BATCH, D, HIDDEN = 16, 2, 32, 64
LENGTH = 4  # a short history, so that training runs past it and drops old amaxes
STEPS = 6
OWG = ubf.OverwriteWithGradient
NAMES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history")
BF16 = jnp.bfloat16


def amax(a) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32))))


def deq(a, scale) -> np.ndarray:
    """a quantized to e4m3 with ``scale`` (saturating), back in float32."""
    a = np.asarray(a, np.float32) / np.float32(scale)
    return np.clip(a, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


def history(*amaxes) -> jax.Array:
    """A [LENGTH] history holding ``amaxes`` newest first, zeros after."""
    return jnp.zeros((LENGTH,), jnp.float32).at[: len(amaxes)].set(jnp.array(amaxes))


# --- the forward uses the histories' scales ---------------------------------------------


@pytest.mark.parametrize("kind", ["column", "row"])
def test_nnx_forward_takes_its_scales_from_the_histories(mesh, kind):
    """float32: the output is the product of x and the kernel dequantized with the scales
    of their histories' maxima (within 1e-5), whatever the histories hold; with the
    tensors' own amaxes it is close to current scaling's."""
    cls, (n_in, n_out) = {
        "column": (ubf.ColumnParallelLinear, (D, HIDDEN)),
        "row": (ubf.RowParallelLinear, (HIDDEN, D)),
    }[kind]
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, n_in))
    kw = dict(mesh=mesh, amax_history_length=LENGTH, bias_init=nnx.initializers.normal(1.0))
    layer = cls(n_in, n_out, fp8="delayed", rngs=nnx.Rngs(0), **kw)
    current = cls(n_in, n_out, fp8="current", rngs=nnx.Rngs(0), **kw)
    kernel, bias = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
    np.testing.assert_array_equal(kernel, current.kernel[...])  # the same params

    def run(hx, hw):
        layer.input_amax_history[...] = hx
        layer.kernel_amax_history[...] = hw
        return nnx.jit(lambda model, x: model(x))(layer, x)

    ax, aw = amax(x), amax(kernel)
    outs = []
    # The tensors' amaxes, then histories whose maxima are not in front: x's 3x too large
    # (coarser steps), the kernel's 0.5x (it saturates).
    for hx, hw in [(history(ax), history(aw)), (history(0.5, 3 * ax), history(0.1, 0.5 * aw))]:
        y = run(hx, hw)
        sx, sw = float(jnp.max(hx)) / 448, float(jnp.max(hw)) / 448
        expected = deq(x, sx).reshape(-1, n_in) @ deq(kernel, sw) + bias
        assert rel_err(y, expected.reshape(y.shape)) < 1e-5
        outs.append(y)
    assert rel_err(outs[1], outs[0]) > 1e-3  # the histories did set the scales
    y_current = nnx.jit(lambda model, x: model(x))(current, x)
    # Current scaling takes a scale per kernel shard (and per x shard for the row layer):
    # the two recipes agree within a fraction of fp8's error (observed 0.007-0.015).
    assert rel_err(outs[0], y_current) < 0.03


# --- one step's gradients of the histories ------------------------------------------------


def _grads(model, x, target):
    """``(y, dy, grads)``: the output, its gradient ``y - target`` and the gradients of the
    params and the histories, of ``sum((y - target)**2) / 2``, ``y = model(x)``.

    The output gradient depends on the forward, as in training."""

    def loss(model):
        y = model(x).astype(jnp.float32)
        return jnp.sum((y - target) ** 2) / 2, y

    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, OWG))
    (_, y), grads = nnx.value_and_grad(loss, argnums=wrt, has_aux=True)(model)
    return y, y - target, grads


def test_nnx_mlp_history_gradients_are_the_updated_histories(mesh):
    """Each history's gradient is the history with this step's amax in front (the older
    entries moved back, the oldest dropped): x's and the kernels' exactly, the output
    gradient's exactly (it is ``ct``), the hidden activations' and their gradients' those of
    the float32 model within fp8's error. ``ct``: the output gradient."""
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    target = jax.random.normal(jax.random.key(2), (SEQ, BATCH, D))
    model = ubf.ParallelMLP(
        D, HIDDEN, mesh=mesh, fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(0)
    )
    plain = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0))
    old = history(7.0, 5.0, 3.0, 2.0)  # a full history; 2.0 is the oldest
    for layer in (model.up_proj, model.down_proj):
        for name in NAMES:
            getattr(layer, name)[...] = old

    _, ct, grads = nnx.jit(_grads)(model, x, target)
    # What the float32 model sees: the hidden activations and the up-projection's output
    # gradient (before gelu, where the op's epilogue differentiates it).
    h_pre = jnp.einsum("sbd,dh->sbh", x, plain.up_proj.kernel[...]) + plain.up_proj.bias[...]
    h = jax.nn.gelu(h_pre)
    dh = jnp.einsum("sbd,hd->sbh", ct, plain.down_proj.kernel[...])
    dh_pre = jax.vjp(jax.nn.gelu, h_pre)[1](dh)[0]
    expected = {
        ("up_proj", "input_amax_history"): (amax(x), 1e-6),
        ("up_proj", "kernel_amax_history"): (amax(model.up_proj.kernel[...]), 1e-6),
        ("up_proj", "output_grad_amax_history"): (amax(dh_pre), 0.1),
        ("down_proj", "input_amax_history"): (amax(h), 0.1),
        ("down_proj", "kernel_amax_history"): (amax(model.down_proj.kernel[...]), 1e-6),
        ("down_proj", "output_grad_amax_history"): (amax(ct), 1e-6),
    }
    for (layer, name), (seen, rtol) in expected.items():
        g = np.asarray(getattr(getattr(grads, layer), name)[...])
        np.testing.assert_allclose(g[0], seen, rtol=rtol, err_msg=f"{layer}.{name}")
        np.testing.assert_array_equal(g[1:], old[:-1], err_msg=f"{layer}.{name}")


# --- training ------------------------------------------------------------------------------


def _data():
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D), BF16)
    target = jax.random.normal(jax.random.key(3), (SEQ, BATCH, D), BF16)
    return x, target


def _mse(y, target):
    return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)


def _check_losses(losses8, losses16):
    """The fp8 run learns and follows the bf16 run within 5% at every step."""
    assert losses8[-1] < 0.8 * losses8[0], losses8
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses8, losses16)), (losses8, losses16)


@nnx.jit
def _nnx_train_step(model, optimizer, x, target):
    """flax's NNX step plus the overwrite: the optimizer steps the params (wrt=nnx.Param),
    the histories take their gradients."""
    loss = lambda model: _mse(model(x), target)  # noqa: E731
    value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, OWG)))(
        model
    )
    optimizer.update(model, grads)
    nnx.update(model, nnx.state(grads, OWG))
    return value


@pytest.mark.parametrize("blocks", [False, True], ids=["layers", "mlp"])
def test_nnx_training_fills_the_histories(mesh, blocks):
    """STEPS adamw steps in bf16 (more than the history is long): every history holds the
    amaxes of the last LENGTH steps, newest first, as computed from the tensors themselves,
    and the loss falls with the bf16 run's."""
    x, target = _data()

    def make(**kw):
        kw = dict(mesh=mesh, dtype=BF16, rngs=nnx.Rngs(0), **kw)
        if blocks:
            return ubf.ParallelMLP(D, HIDDEN, **kw)
        return nnx.Sequential(
            ubf.ColumnParallelLinear(D, HIDDEN, **kw),
            nnx.gelu,
            ubf.RowParallelLinear(HIDDEN, D, **kw),
        )

    model = make(fp8="delayed", amax_history_length=LENGTH)
    reference = make()  # bf16, no fp8
    up, down = (model.up_proj, model.down_proj) if blocks else (model.layers[0], model.layers[2])
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    opt_ref = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    # The optimizer keeps no state for the histories: they are not params.
    assert not jax.tree.leaves(nnx.state(opt.opt_state, lambda p, v: "amax_history" in str(p)))

    losses8, losses16, seen = [], [], {"up_w": [], "down_w": [], "dy": []}
    for _ in range(STEPS):
        # What this step's ops will see: the kernels (cast to bf16) and the output gradient.
        seen["up_w"].append(amax(up.kernel[...].astype(BF16)))
        seen["down_w"].append(amax(down.kernel[...].astype(BF16)))
        y = nnx.jit(lambda m: m(x))(model)
        seen["dy"].append(amax(jax.grad(_mse)(y, target)))
        losses8.append(float(_nnx_train_step(model, opt, x, target)))
        losses16.append(float(_nnx_train_step(reference, opt_ref, x, target)))
    _check_losses(losses8, losses16)

    last = lambda values: np.array(values[::-1][:LENGTH], np.float32)  # noqa: E731
    np.testing.assert_array_equal(up.input_amax_history[...], [amax(x)] * LENGTH)
    np.testing.assert_allclose(up.kernel_amax_history[...], last(seen["up_w"]), rtol=1e-6)
    np.testing.assert_allclose(down.kernel_amax_history[...], last(seen["down_w"]), rtol=1e-6)
    np.testing.assert_allclose(down.output_grad_amax_history[...], last(seen["dy"]), rtol=1e-2)
    for name in NAMES:  # the hidden side: filled, finite, positive
        h = np.asarray(getattr(up if name == "output_grad_amax_history" else down, name)[...])
        assert np.all(np.isfinite(h)) and np.all(h > 0), (name, h)
    assert len(set(seen["up_w"])) == STEPS  # the kernels did change: the history rolled


def test_nnx_histories_are_replicated_owg_variables(mesh):
    """The histories are OverwriteWithGradient variables (flax's bridge type for linen's
    collection) with replicated sharding metadata, placed on the mesh; with the partition
    specs of ``nnx.get_partition_spec`` the block runs inside a user's shard_map."""
    from flax.nnx import variablelib

    assert variablelib.variable_type_from_name(OVERWRITE_WITH_GRADIENT) is OWG
    model = ubf.ParallelMLP(D, HIDDEN, mesh=mesh, fp8="delayed", rngs=nnx.Rngs(0))
    state = nnx.state(model, OWG)
    paths = sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(state))
    assert paths == sorted(f"{layer}/{n}" for layer in ("down_proj", "up_proj") for n in NAMES)
    for _, v in nnx.to_flat_state(state):
        assert v[...].shape == (16,) and v[...].dtype == jnp.float32  # the default length
        assert v[...].sharding.spec == P(None)
    specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["up_proj"]["input_amax_history"].get_value() == P(None)
    assert specs["up_proj"]["kernel"].get_value() == P(None, "tp")

    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    for layer in (model.up_proj, model.down_proj):  # scales of non-trivial histories
        for i, name in enumerate(NAMES):
            getattr(layer, name)[...] = jnp.zeros(16).at[3].set(0.5 + i)
    local, state = nnx_in_shard_map(model, mesh)
    y = jax.jit(local)(state, x)
    np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(model, x), rtol=1e-6, atol=1e-6)


# --- linen ----------------------------------------------------------------------------------


def test_linen_mlp_training_with_train_state(mesh):
    """flax's TrainState over the whole variables dict steps "params" with the optimizer and
    overwrites "_overwrite_with_gradient" with its gradient: the histories fill with the
    observed amaxes, the loss follows the bf16 run, and the block matches NNX's."""
    x, target = _data()
    kw = dict(mesh=mesh, dtype=BF16)
    module = ubl.ParallelMLP(HIDDEN, fp8="delayed", amax_history_length=LENGTH, **kw)
    boxed = module.init(jax.random.key(0), x)
    owg_specs = nn.get_partition_spec(boxed)[OVERWRITE_WITH_GRADIENT]
    assert owg_specs["down_proj"]["output_grad_amax_history"] == P(None)
    variables = nn.meta.unbox(boxed)
    assert set(variables) == {"params", OVERWRITE_WITH_GRADIENT}
    reference = ubl.ParallelMLP(HIDDEN, **kw)

    @jax.jit
    def step(state):
        loss = lambda variables: _mse(state.apply_fn(variables, x), target)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(state.params)  # every collection's
        return state.apply_gradients(grads=grads), value

    def train(module, variables):
        state = TrainState.create(apply_fn=module.apply, params=variables, tx=optax.adamw(1e-2))
        losses, kernel_amaxes = [], []
        for _ in range(STEPS):
            kernel_amaxes.append(amax(state.params["params"]["up_proj"]["kernel"].astype(BF16)))
            state, value = step(state)
            losses.append(float(value))
        return state, losses, kernel_amaxes

    state, losses8, up_w = train(module, variables)
    _, losses16, _ = train(reference, {"params": variables["params"]})
    _check_losses(losses8, losses16)
    hist = state.params[OVERWRITE_WITH_GRADIENT]
    np.testing.assert_array_equal(hist["up_proj"]["input_amax_history"], [amax(x)] * LENGTH)
    np.testing.assert_allclose(
        hist["up_proj"]["kernel_amax_history"], up_w[::-1][:LENGTH], rtol=1e-6
    )

    # The same params and histories in the NNX block give the same output.
    model = ubf.ParallelMLP(
        D, HIDDEN, fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(0), **kw
    )
    trained = state.params
    pure = {
        layer: trained["params"][layer] | trained[OVERWRITE_WITH_GRADIENT][layer]
        for layer in ("up_proj", "down_proj")
    }
    nnx_state = nnx.state(model)
    nnx.replace_by_pure_dict(nnx_state, pure)
    nnx.update(model, nnx_state)
    y = jax.jit(module.apply)(trained, x)
    y_nnx = nnx.jit(lambda m, x: m(x))(model, x)
    np.testing.assert_allclose(y.astype(np.float32), y_nnx.astype(np.float32), rtol=1e-6)


# --- bad settings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(fp8="delayd"), ValueError, r"fp8 must be False, True .* got 'delayd'"),
        (dict(fp8=1), TypeError, "fp8 must be False, True .* got 1"),
        (dict(fp8="delayed", amax_history_length=0), ValueError, "amax_history_length .* got 0"),
        (dict(amax_history_length=2.5), ValueError, "amax_history_length .* got 2.5"),
        (dict(amax_history_length=True), ValueError, "amax_history_length .* got True"),
    ],
)
def test_bad_settings_are_refused(mesh, kwargs, error, match):
    with pytest.raises(error, match="ColumnParallelLinear: " + match):
        ubf.ColumnParallelLinear(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(error, match="ParallelMLP: " + match):
        ubf.ParallelMLP(D, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(error, match="RowParallelLinear: " + match):
        ubl.RowParallelLinear(D, mesh=mesh, **kwargs).init(
            jax.random.key(0), jnp.ones((SEQ, BATCH, HIDDEN))
        )


def test_nnx_attention_records_its_amaxes(mesh):
    """The attention block's two projections keep their own histories: qkv's input is x,
    out's output gradient is ``ct = y - target``; the core's activations reach out's input
    history."""
    x = jax.random.normal(jax.random.key(1), (SEQ, BATCH, D))
    target = jax.random.normal(jax.random.key(2), (SEQ, BATCH, D))
    model = ubf.ParallelSelfAttention(D, TP, mesh=mesh, fp8="delayed", rngs=nnx.Rngs(0))
    _, ct, grads = nnx.jit(_grads)(model, x, target)
    np.testing.assert_allclose(grads.qkv.input_amax_history[...][0], amax(x), rtol=1e-6)
    np.testing.assert_allclose(grads.out.output_grad_amax_history[...][0], amax(ct), rtol=1e-6)
    for layer in (grads.qkv, grads.out):
        for name in NAMES:
            h = np.asarray(getattr(layer, name)[...])
            assert h[0] > 0 and np.all(h[1:] == 0), (name, h)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("manual", ["tp", "dp_tp"])
def test_replicated_recipe_reports_whole_amaxes_beside_dp(rand, manual, check_vma):
    """The replicated layout's fp8 recipe (``jax_ub.flax._fp8.dense``) in a shard_map
    manual over tp alone or over dp and tp, types checked or not: each given scale's
    gradient is the amax of its whole tensor (``fp8_ops.reported_amax``), not a sum over
    the devices nor a value varying over dp."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w, ct = rand(16, 32), rand(32, 16), rand(16, 16)
    amax = lambda a: np.float32(np.max(np.abs(np.asarray(a))))  # noqa: E731
    scales = jax_ub.Fp8Scales(
        x=jnp.float32(amax(x) / 400), w=jnp.float32(amax(w) / 440), grad=jnp.float32(amax(ct) / 5e4)
    )
    rows = "dp" if manual == "dp_tp" else None
    f = jax.jit(
        jax.shard_map(
            lambda x, w, s: _fp8.dense(x, w, s, "tp"),
            mesh=mesh,
            in_specs=(P(rows, None), P(None, "tp"), P()),
            out_specs=P(rows, "tp"),
            check_vma=check_vma,
            **({} if manual == "dp_tp" else {"axis_names": {"tp"}}),
        )
    )
    y, vjp = jax.vjp(f, x, w, scales)
    dx, dw, dscales = vjp(ct)
    assert rel_err(y, np.asarray(x) @ np.asarray(w)) < 0.1  # fp8's precision
    assert np.isfinite(np.asarray(dx)).all() and np.isfinite(np.asarray(dw)).all()
    for got, want in ((dscales.x, amax(x)), (dscales.w, amax(w)), (dscales.grad, amax(ct))):
        np.testing.assert_allclose(float(got), want, rtol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_history_gradients_inside_a_users_shard_map(check_vma):
    """A delayed layer called on local shards inside the user's shard_map, types checked or
    not: each history's gradient is this step's amax, then the history rolled. Unchecked,
    shard_map sums a replicated input's cotangent over its devices: each history comes from
    one device (it was the history times the device count)."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    layer = ubf.ColumnParallelLinear(
        32, 64, impl="ub", fp8="delayed", amax_history_length=4, rngs=nnx.Rngs(0)
    )
    layer.kernel_amax_history[...] = jnp.array([0.5, 0.2, 1.0, 0.3])
    graphdef, state = nnx.split(layer)
    f = jax.shard_map(
        lambda s, x: nnx.merge(graphdef, s)(x),
        mesh=mesh,
        in_specs=(nnx.get_partition_spec(state), P("tp", "dp")),
        out_specs=P("tp", "dp"),
        check_vma=check_vma,
    )
    x = jax.random.normal(jax.random.key(1), (16, 4, 32))
    g = jax.jit(jax.grad(lambda s, x: jnp.sum(f(s, x) ** 2)))(state, x)
    kernel_amax = float(jnp.max(jnp.abs(layer.kernel[...])))
    np.testing.assert_allclose(
        np.asarray(g["kernel_amax_history"][...]), [kernel_amax, 0.5, 0.2, 1.0], rtol=1e-6
    )
    input_history = np.asarray(g["input_amax_history"][...])
    np.testing.assert_allclose(input_history[0], float(jnp.max(jnp.abs(x))), rtol=1e-6)
    assert not input_history[1:].any()  # a fresh history rolled


@pytest.mark.parametrize("impl", ["ub", "xla"])
def test_bfloat16_gradients_beside_dp_on_cpu(impl):
    """A delayed row-parallel layer computing in bfloat16, the batch over dp: its gradients
    run (XLA's CPU compiler aborted on the bias gradient's 16-bit all-reduce, which the
    float32 widening avoids; it was off for delayed layers, whose histories it would have
    summed over the devices), and the kernel's history gradient is the recurrence's."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    with jax.set_mesh(mesh):
        layer = ubf.RowParallelLinear(
            64, 32, impl=impl, fp8="delayed", dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
        )
        x = jax.device_put(
            jax.random.normal(jax.random.key(1), (16, 4, 64)),
            jax.sharding.NamedSharding(mesh, P(None, "dp", "tp")),
        )
        graphdef, state = nnx.split(layer)
        loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x).astype(jnp.float32) ** 2)  # noqa: E731
        g = jax.jit(jax.grad(loss))(state, x)
    history = np.asarray(g["kernel_amax_history"][...])
    kernel = layer.kernel[...].astype(jnp.bfloat16)  # its amax is taken as it computes
    np.testing.assert_allclose(history[0], float(jnp.max(jnp.abs(kernel))), rtol=1e-6)
    assert not history[1:].any()
    bias = np.asarray(g["bias"][...], np.float32)
    assert np.isfinite(bias).all() and bias.any()
