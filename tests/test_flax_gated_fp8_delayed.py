"""fp8="delayed" in ParallelGatedMLP (nnx and linen; CPU devices, the host protocol
emulating fp8): each projection's scales come from its own amax histories (the output equals
a float32 product of operands quantized at ``max(history) / fp8_max``, 1 while a history is
all zeros), a training step overwrites each history with this step's amax of its tensor
rolled in front, the gradients are the float32 block's within fp8's error, impl="ub" equals
impl="xla", and the replicated layout (a sequence tp does not divide: decoding one token)
records the same amaxes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import make_mesh, rel_err
from flax import nnx
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub.flax as ubf

TP = 2
SEQ, BATCH, D, F = 8, 2, 16, 32
LENGTH = 4
OWG = ubf.OverwriteWithGradient
PROJECTIONS = ("gate_up", "down_proj")
# The ops' scale field -> flax's name, as the histories are named: f"{projection}_{name}".
FIELDS = {"x": "input_amax_history", "w": "kernel_amax_history", "grad": "output_grad_amax_history"}
NAMES = [f"{p}_{n}" for p in PROJECTIONS for n in FIELDS.values()]
FP8 = {"x": ml_dtypes.float8_e4m3fn, "w": ml_dtypes.float8_e4m3fn, "grad": ml_dtypes.float8_e5m2}
# The forward against the emulated quantized math: float32 sums in another order (observed
# <= 2e-7). Other scales move it by fp8's steps (> 1e-3, checked).
EXACT = 1e-5
OUT_TOL, GRAD_TOL = 0.1, 0.15  # fp8 against float32 (tests/test_flax_fp8.py's)
QUANTIZED = 1e-3  # fp8's error is above this
# The recorded amaxes against the emulation's: float32 sums in another order (observed
# <= 5e-7, the gradients' through the quantized backward too).
RTOL = 1e-5


def amax(a) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32))))


def scale(history, field) -> float:
    m = float(np.max(history))
    return m / float(ml_dtypes.finfo(FP8[field]).max) if m > 0 else 1.0


def deq(a, s, field="x") -> np.ndarray:
    """``a`` quantized at scale ``s`` (saturating) to the field's fp8 format, in float32."""
    fmax = float(ml_dtypes.finfo(FP8[field]).max)
    q = np.clip(np.asarray(a, np.float32) / np.float32(s), -fmax, fmax).astype(FP8[field])
    return q.astype(np.float32) * np.float32(s)


def hidden(gu, dh=None) -> np.ndarray:
    """``silu(gate) * up`` of ``gu = [gate | up]`` (numpy); with ``dh``, its VJP: ``dgu``."""
    gate, up = gu[..., :F], gu[..., F:]
    sig = 1 / (1 + np.exp(-gate))
    if dh is None:
        return gate * sig * up
    return np.concatenate([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], -1)


def reference(x, gate_up, down, hist, dy=None):
    """The delayed-fp8 block in float32 with the scales of ``hist`` ({name: history}), as
    the ops quantize: ``(y, {name: the amax its history records})``; with ``dy``, the output
    gradient (quantized to e5m2 going back), the gradients' amaxes too."""
    s = {f"{p}_{n}": scale(hist[f"{p}_{n}"], f) for p in PROJECTIONS for f, n in FIELDS.items()}
    w_gu = deq(np.asarray(gate_up).reshape(D, 2 * F), s["gate_up_kernel_amax_history"])
    w_down = deq(down, s["down_proj_kernel_amax_history"])
    gu = deq(x, s["gate_up_input_amax_history"]) @ w_gu
    h = hidden(gu)
    y = deq(h, s["down_proj_input_amax_history"]) @ w_down
    seen = {
        "gate_up_input_amax_history": amax(x),
        "gate_up_kernel_amax_history": amax(gate_up),
        "down_proj_input_amax_history": amax(h),
        "down_proj_kernel_amax_history": amax(down),
    }
    if dy is not None:
        dh = deq(dy, s["down_proj_output_grad_amax_history"], "grad") @ w_down.T
        seen["gate_up_output_grad_amax_history"] = amax(hidden(gu, dh))
        seen["down_proj_output_grad_amax_history"] = amax(dy)
    return y, seen


def check_step(old, new, seen):
    """Each history is the old one with this step's amax in front, the oldest dropped."""
    for name in NAMES:
        np.testing.assert_allclose(new[name][0], seen[name], rtol=RTOL, err_msg=name)
        np.testing.assert_array_equal(new[name][1:], old[name][:-1], err_msg=name)


def _loss(y, target):
    """The training loss: its output gradient ``y - target`` depends on the forward, as in
    training (with one that does not, such as ``sum(y * ct)``, the ranks' host protocol on
    CPU may run the output projection's backward before the forward: see
    tests/test_flax_fp8_delayed.py's ``_grads``)."""
    return jnp.sum((y.astype(jnp.float32) - target) ** 2) / 2


@nnx.jit
def _nnx_train_step(model, optimizer, x, target):
    """flax's NNX step plus the overwrite; returns this step's output."""

    def loss(model):
        y = model(x)
        return _loss(y, target), y

    (_, y), grads = nnx.value_and_grad(
        loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, OWG)), has_aux=True
    )(model)
    optimizer.update(model, grads)
    nnx.update(model, nnx.state(grads, OWG))
    return y


def test_nnx_steps_use_and_record_the_histories(mesh, rand):
    """Two sgd steps from zero histories: the first forward uses scale 1, the second the
    scales of the amaxes the first recorded; after each, every history holds the step's
    amax of its tensor in front of the previous entries."""
    x, target = rand(SEQ, BATCH, D), rand(SEQ, BATCH, D)
    model = ubf.ParallelGatedMLP(
        D, F, mesh=mesh, impl="ub", fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(0)
    )
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    histories = lambda: {n: np.asarray(getattr(model, n)[...]) for n in NAMES}  # noqa: E731
    assert all(np.array_equal(h, np.zeros(LENGTH)) for h in histories().values())
    ys = []
    for _ in range(2):
        old, params = histories(), (np.asarray(model.gate_up[...]), model.down_proj[...])
        y = _nnx_train_step(model, optimizer, x, target)
        want, seen = reference(x, *params, old, dy=np.asarray(y) - target)
        assert rel_err(y, want) < EXACT
        check_step(old, histories(), seen)
        ys.append((y, want, params))
    # The recorded scales did set the second output: at scale 1 it would be another.
    _, want, params = ys[1]
    assert rel_err(reference(x, *params, {n: np.zeros(LENGTH) for n in NAMES})[0], want) > 1e-3
    assert amax(ys[0][2][0]) != amax(ys[1][2][0])  # sgd moved gate_up: two amaxes rolled in


def test_linen_steps_and_names_match_nnx(mesh, rand):
    """linen: the histories are in the "_overwrite_with_gradient" collection under the NNX
    block's names (replicated); TrainState over the whole variables dict uses and records
    them as the NNX block does."""
    x, target = rand(SEQ, BATCH, D), rand(SEQ, BATCH, D)
    module = ubf.linen.ParallelGatedMLP(
        F, mesh=mesh, impl="ub", fp8="delayed", amax_history_length=LENGTH
    )
    boxed = module.init(jax.random.key(0), x)
    specs = nn.get_partition_spec(boxed)
    assert sorted(specs[OVERWRITE_WITH_GRADIENT]) == sorted(NAMES)
    assert all(s == P(None) for s in specs[OVERWRITE_WITH_GRADIENT].values())
    variables = nn.meta.unbox(boxed)
    state = TrainState.create(apply_fn=module.apply, params=variables, tx=optax.sgd(0.05))

    @jax.jit
    def step(state):
        def loss(variables):
            y = state.apply_fn(variables, x)
            return _loss(y, target), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), y

    for _ in range(2):
        old = {n: np.asarray(v) for n, v in state.params[OVERWRITE_WITH_GRADIENT].items()}
        params = state.params["params"]
        state, y = step(state)
        want, seen = reference(
            x, params["gate_up"], params["down_proj"], old, np.asarray(y) - target
        )
        assert rel_err(y, want) < EXACT
        check_step(old, state.params[OVERWRITE_WITH_GRADIENT], seen)

    # The NNX block names its variables alike: the trained state loads into it as it is.
    model = ubf.ParallelGatedMLP(
        D, F, mesh=mesh, fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(1)
    )
    owg = nnx.state(model, OWG)
    assert sorted(str(p[0]) for p, _ in nnx.to_flat_state(owg)) == sorted(NAMES)
    assert all(v[...].sharding.spec == P(None) for _, v in nnx.to_flat_state(owg))
    pure = state.params["params"] | state.params[OVERWRITE_WITH_GRADIENT]
    nnx_state = nnx.state(model)
    nnx.replace_by_pure_dict(nnx_state, pure)
    nnx.update(model, nnx_state)
    hist = {n: np.asarray(h) for n, h in state.params[OVERWRITE_WITH_GRADIENT].items()}
    want, _ = reference(x, pure["gate_up"], pure["down_proj"], hist)
    assert rel_err(nnx.jit(lambda m, x: m(x))(model, x), want) < EXACT


def _f32(x, gate_up, down, target):
    """The unfused float32 block (numpy): its output and the gradients of :func:`_loss` with
    respect to x, gate_up and down."""
    x, w, down = (np.asarray(a, np.float32) for a in (x, gate_up, down))
    w = w.reshape(D, 2 * F)
    gu = x @ w
    h = hidden(gu)
    y = h @ down
    dy = y - np.asarray(target)
    dgu = hidden(gu, dy @ down.T)
    dw = np.einsum("sbk,sbn->kn", x, dgu).reshape(D, 2, F)
    return y, (dgu @ w.T, dw, np.einsum("sbf,sbn->fn", h, dy))


def _fitting_histories(x, gate_up, down, target):
    """Histories holding, a step back, the amaxes the float32 block sees: scales that fit."""
    gu = np.asarray(x) @ np.asarray(gate_up).reshape(D, 2 * F)
    dy = _f32(x, gate_up, down, target)[0] - target
    dgu = hidden(gu, dy @ np.asarray(down).T)
    seen = [amax(x), amax(gate_up), amax(dgu), amax(hidden(gu)), amax(down), amax(dy)]
    return {n: np.zeros(LENGTH, np.float32) + [0, a, 0, 0] for n, a in zip(NAMES, seen)}


def test_grads_near_f32_and_ub_equals_xla_over_dp_tp(rand):
    """Over (dp, tp) from jit under the mesh, with histories holding fitting amaxes: the
    output and the gradients of x and the kernels are the float32 block's within fp8's
    error (and not equal: it did quantize); impl="ub" equals impl="xla", in the outputs,
    the gradients and the histories' gradients."""
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x = jax.device_put(rand(SEQ, BATCH, D), NamedSharding(mesh, P("tp", "dp")))
    target = rand(SEQ, BATCH, D)

    def run(model, x):
        loss = lambda model, x: (_loss(y := model(x), target), y)  # noqa: E731
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, OWG))
        (_, y), grads = nnx.value_and_grad(loss, argnums=(wrt, 1), has_aux=True)(model, x)
        return y, grads

    runs = {}
    with jax.set_mesh(mesh):
        for impl in ("ub", "xla"):
            model = ubf.ParallelGatedMLP(
                D, F, impl=impl, fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(0)
            )
            params = (np.asarray(model.gate_up[...]), np.asarray(model.down_proj[...]))
            for name, h in _fitting_histories(x, *params, target).items():
                getattr(model, name)[...] = h
            runs[impl] = nnx.jit(run)(model, x)
    y_ref, grads_ref = _f32(x, *params, target)
    (y, (g_model, g_x)), (y_xla, (g_xla, g_x_xla)) = runs["ub"], runs["xla"]
    got = {"y": y, "x": g_x, "gate_up": g_model.gate_up[...], "down": g_model.down_proj[...]}
    want = dict(zip(["y", "x", "gate_up", "down"], [y_ref, *grads_ref]))
    errors = {k: rel_err(got[k], want[k]) for k in got}
    assert errors["y"] < OUT_TOL and all(e < GRAD_TOL for e in errors.values()), errors
    assert all(e > QUANTIZED for e in errors.values()), errors
    assert rel_err(y, y_xla) < 1e-2 and rel_err(g_x, g_x_xla) < 1e-2
    for name in ("gate_up", "down_proj", *NAMES):
        a, b = getattr(g_model, name)[...], getattr(g_xla, name)[...]
        np.testing.assert_allclose(a, b, rtol=1e-2, err_msg=name)
    history = np.asarray(g_model.down_proj_output_grad_amax_history[...])
    dy = np.asarray(y) - target
    np.testing.assert_allclose(history[:3], [amax(dy), 0, amax(y_ref - target)], rtol=1e-6)


@pytest.mark.parametrize("seq", [1, 3])
def test_replicated_layout_records_the_same_amaxes(mesh, rand, seq):
    """A sequence tp does not divide (one token decoded; 3 on tp=2) runs with the
    activations replicated over tp, in XLA, with the same recipe: the forward equals the
    quantized math at the histories' scales, and one step records the same amaxes."""
    x, target = rand(seq, BATCH, D), rand(seq, BATCH, D)
    model = ubf.ParallelGatedMLP(
        D, F, mesh=mesh, fp8="delayed", amax_history_length=LENGTH, rngs=nnx.Rngs(0)
    )
    params = (np.asarray(model.gate_up[...]), np.asarray(model.down_proj[...]))
    old = _fitting_histories(x, *params, target)
    for name, h in old.items():
        getattr(model, name)[...] = h
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    y = _nnx_train_step(model, optimizer, x, target)
    want, seen = reference(x, *params, old, dy=np.asarray(y) - target)
    assert rel_err(y, want) < EXACT
    check_step(old, {n: np.asarray(getattr(model, n)[...]) for n in NAMES}, seen)
