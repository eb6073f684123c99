"""fp8 in both ops (CPU devices, the host protocol emulating fp8): forward and gradients
against a reference that dequantizes and multiplies in float32, current and delayed
scaling, the amaxes reported for delayed scaling, impl="ub" against impl="xla", the fp8
bytes in the HLO, a short training loop with amax histories, and bad inputs."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _op_cases import OPS, op_call, op_operands, op_specs
from conftest import make_mesh, rel_err, smap
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub import fp8

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def fp8_fn(op, mesh, impl="ub"):
    """jit(shard_map(op, fp8=scales)) in op_specs' layout; scales replicated."""
    fn = op_call(op)
    in_specs, out_specs = op_specs(op)
    return smap(lambda x, w, s: fn(x, w, "tp", impl=impl, fp8=s), mesh, (*in_specs, P()), out_specs)


def deq(a, scale, dtype=E4M3) -> np.ndarray:
    """a quantized to `dtype` with `scale` (saturating), then back to float32."""
    a = np.asarray(a, np.float32) / np.float32(scale)
    fmax = float(ml_dtypes.finfo(dtype).max)
    return np.clip(a, -fmax, fmax).astype(dtype).astype(np.float32) * np.float32(scale)


def amax(a) -> np.float32:
    return np.float32(np.max(np.abs(np.asarray(a, np.float32))))


def shards(a, axis, tp):
    return np.split(np.asarray(a, np.float32), tp, axis=axis)


def reference_forward(op, x, w, tp, sx=None, sw=None):
    """The op's product in float32 from dequantized operands. Scales left None are current:
    the group's for a gathered x, each shard's own otherwise."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    cur = lambda a: amax(a) / np.float32(448.0)  # noqa: E731
    if op == "ag":  # x gathered (one scale), w column shards (a scale each)
        xs = deq(x, sx if sx is not None else cur(x))
        return np.concatenate(
            [xs @ deq(wj, sw if sw is not None else cur(wj)) for wj in shards(w, 1, tp)], 1
        )
    total = 0.0  # rs: sum over ranks of x's column shard times w's row shard
    for xj, wj in zip(shards(x, 1, tp), shards(w, 0, tp)):
        sxj = sx if sx is not None else cur(xj)
        swj = sw if sw is not None else cur(wj)
        total = total + deq(xj, sxj) @ deq(wj, swj)
    return total


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_forward_matches_dequantized_reference(mesh1d, rand, op, tp, scaling, dtype):
    x, w = op_operands(rand, op, tp, 8, 32, 16, dtype=dtype)
    if scaling == "current":
        scales, sx, sw = jax_ub.Fp8Scales(), None, None
    else:  # scales as a history would give them: not the tensors' own
        sx, sw = np.float32(1.3 * amax(x) / 448), np.float32(0.02)  # w saturates somewhat
        scales = jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw))
    out = fp8_fn(op, mesh1d(tp))(x, w, scales)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (x.shape[0], w.shape[1])
    assert rel_err(out, reference_forward(op, x, w, tp, sx, sw)) < TOL[dtype]
    # fp8 loses precision: far closer to its own reference than to the exact product.
    assert 1e-3 < rel_err(out, np.asarray(x, np.float32) @ np.asarray(w, np.float32)) < 0.1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", OPS)
def test_grads_and_amaxes_with_delayed_scaling(mesh1d, rand, op, dtype):
    tp = 2
    x, w = op_operands(rand, op, tp, 8, 32, 16, dtype=dtype)
    ct = rand(x.shape[0], w.shape[1], dtype=dtype)
    sx, sw, sg = (np.float32(v) for v in (amax(x) / 400, amax(w) / 440, amax(ct) / 50000))
    scales = jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw), grad=jnp.float32(sg))
    f = fp8_fn(op, mesh1d(tp))
    out, vjp = jax.vjp(f, x, w, scales)
    dx, dw, dscales = vjp(ct)
    dct = deq(ct, sg, E5M2)
    xq, wq = deq(x, sx), deq(w, sw)
    assert rel_err(out, xq @ wq) < TOL[dtype]
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert rel_err(dx, dct @ wq.T) < TOL[dtype]
    assert rel_err(dw, xq.T @ dct) < TOL[dtype]
    # Each given scale's gradient is its tensor's amax this step (over the whole group).
    np.testing.assert_allclose(float(dscales.x), amax(x), rtol=1e-6)
    np.testing.assert_allclose(float(dscales.w), amax(w), rtol=1e-6)
    np.testing.assert_allclose(float(dscales.grad), amax(ct), rtol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_ub_equals_xla_path_with_current_scaling(mesh1d, rand, op):
    """Both impls quantize alike; their results and gradients differ by rounding only."""
    x, w = op_operands(rand, op, 4, 8, 32, 16, dtype=jnp.bfloat16)

    def loss(impl, x, w):
        y = fp8_fn(op, mesh1d(4), impl)(x, w, jax_ub.Fp8Scales())
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    got = jax.value_and_grad(loss, argnums=(1, 2))("ub", x, w)
    want = jax.value_and_grad(loss, argnums=(1, 2))("xla", x, w)
    assert abs(float(got[0]) - float(want[0])) < 1e-2 * (1 + abs(float(want[0])))
    for a, b in zip(got[1], want[1]):
        assert rel_err(a, b) < 1e-2


def test_gather_moves_fp8(mesh1d, rand):
    """The all-gather's custom call takes x in float8_e4m3fn: half of bf16's bytes move."""
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=jnp.bfloat16)
    hlo = fp8_fn("ag", mesh1d(2)).lower(x, w, jax_ub.Fp8Scales()).as_text()
    calls = [ln for ln in hlo.splitlines() if "jax_ub_all_gather_matmul" in ln]
    assert calls and all("f8E4M3FN" in ln for ln in calls), calls
    assert "all-gather" not in hlo and "all_gather" not in hlo.replace("jax_ub_all_gather", "")


def test_delayed_scaling_training_loop(mesh1d, rand):
    """A two-layer MLP trained for 12 SGD steps in fp8 with amax histories (zeros at first:
    scale 1): the loss falls, every history fills with the tensors' amaxes, and the run
    follows the bf16 run."""
    tp, hist_len = 2, 4
    x = rand(32, 64, dtype=jnp.bfloat16)
    target = rand(32, 64, dtype=jnp.bfloat16, scale=0.5)
    params = {"w1": rand(64, 128, scale=0.1), "w2": rand(128, 64, scale=0.1)}
    names = ("x1", "w1", "g1", "x2", "w2", "g2")
    hist0 = {n: jnp.zeros((hist_len,), jnp.float32) for n in names}  # scale 1 until seen

    def model(params, scales, x, use_fp8):
        def body(x, w1, w2, s1, s2):
            kw = lambda s: {"fp8": s} if use_fp8 else {}  # noqa: E731
            h = jax_ub.all_gather_matmul(x, w1.astype(x.dtype), "tp", **kw(s1))
            return jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2.astype(x.dtype), "tp", **kw(s2))

        f = smap(body, mesh1d(tp), (P("tp"), P(None, "tp"), P("tp"), P(), P()), P("tp"))
        return f(x, params["w1"], params["w2"], *scales)

    def scales_of(hist):
        d = lambda n, dt=fp8.E4M3: fp8.delayed_scale(hist[n], dt)  # noqa: E731
        return (
            jax_ub.Fp8Scales(x=d("x1"), w=d("w1"), grad=d("g1", fp8.E5M2)),
            jax_ub.Fp8Scales(x=d("x2"), w=d("w2"), grad=d("g2", fp8.E5M2)),
        )

    @functools.partial(jax.jit, static_argnums=2)
    def step(params, hist, use_fp8=True):
        def loss(params, scales):
            y = model(params, scales, x, use_fp8)
            return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

        value, (gp, gs) = jax.value_and_grad(loss, argnums=(0, 1))(params, scales_of(hist))
        params = jax.tree.map(lambda p, g: p - 0.2 * g, params, gp)
        if use_fp8:
            seen = dict(zip(names, (gs[0].x, gs[0].w, gs[0].grad, gs[1].x, gs[1].w, gs[1].grad)))
            hist = {n: fp8.update_amax_history(hist[n], seen[n]) for n in names}
        return params, hist, value

    p8, h8, pb = params, hist0, params
    losses8, lossesb = [], []
    for _ in range(12):
        p8, h8, l8 = step(p8, h8)
        pb, _, lb = step(pb, hist0, use_fp8=False)
        losses8.append(float(l8))
        lossesb.append(float(lb))
    assert losses8[-1] < 0.8 * losses8[0], losses8
    assert all(abs(a - b) < 0.05 * b for a, b in zip(losses8, lossesb)), (losses8, lossesb)
    for n in names:
        h = np.asarray(h8[n])
        assert np.all(np.isfinite(h)) and np.all(h > 0), (n, h)
    np.testing.assert_allclose(float(h8["x1"][0]), amax(x), rtol=1e-6)


@pytest.mark.parametrize(
    "scales,error,match",
    [
        ((1.0, None), TypeError, "fp8 must be a jax_ub.Fp8Scales, got tuple"),
        (
            jax_ub.Fp8Scales(x=jnp.ones((2,), jnp.float32)),
            ValueError,
            r"fp8.x must be a float32 scalar scale, got shape=\(2,\)",
        ),
        (
            jax_ub.Fp8Scales(w=jnp.float16(1.0)),
            ValueError,
            "fp8.w must be a float32 scalar scale, got shape=\\(\\) dtype=float16",
        ),
        (jax_ub.Fp8Scales(grad=jnp.ones((1, 1), jnp.float32)), ValueError, "fp8.grad must be"),
    ],
)
@pytest.mark.parametrize("op", OPS)
def test_bad_scales_are_refused(mesh1d, rand, op, scales, error, match):
    x, w = op_operands(rand, op, 2, 8, 32, 16, dtype=jnp.bfloat16)
    in_specs, out_specs = op_specs(op)
    f = smap(lambda x, w: op_call(op)(x, w, "tp", fp8=scales), mesh1d(2), in_specs, out_specs)
    with pytest.raises(error, match=match):
        f(x, w)


def test_return_gathered_with_fp8_is_refused(mesh1d, rand):
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=jnp.bfloat16)
    f = smap(
        lambda x, w: jax_ub.all_gather_matmul(
            x, w, "tp", fp8=jax_ub.Fp8Scales(), return_gathered=True
        )[0],
        mesh1d(2),
        (P("tp"), P(None, "tp")),
        P(None, "tp"),
    )
    with pytest.raises(ValueError, match="return_gathered is not available with fp8"):
        f(x, w)


def test_fp8_on_global_arrays(mesh1d, rand):
    """Plain jit under jax.set_mesh: the scales travel replicated into the op's shard_map."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, "ag", 2, 8, 32, 16, dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", fp8=jax_ub.Fp8Scales()))(x, w)
    assert rel_err(y, reference_forward("ag", x, w, 2)) < 1e-2


# fp8 shapes that cuBLASLt's fp8 GEMMs refuse: (k, n) per rank, the one not divisible by 16.
UNALIGNED = [(100, 16), (32, 24)]


@pytest.mark.parametrize("k,n", UNALIGNED)
@pytest.mark.parametrize("op", OPS)
def test_fp8_shapes_gpus_refuse_are_refused_on_cpu_too(mesh1d, rand, op, k, n):
    """fp8 with k or n (this rank's) not divisible by 16: the host path could run it, but
    it decides as the GPU path does, so that a CPU run finds out before the GPU job:
    impl="ub" raises naming the rule and the shapes, impl="auto" takes XLA's fp8 path (and
    explain_impl says why), impl="xla" runs (XLA pads its fp8 dots on GPUs)."""
    x, w = op_operands(rand, op, 2, 8, k, n, dtype=jnp.bfloat16)
    local_x = (8, k) if op == "ag" else (16, k)
    with pytest.raises(ValueError) as e:
        fp8_fn(op, mesh1d(2), "ub")(x, w, jax_ub.Fp8Scales())
    assert str(e.value).startswith(
        f"{'all_gather_matmul' if op == 'ag' else 'matmul_reduce_scatter'}: impl='ub' cannot "
        "run this call: fp8 GEMMs need k and n divisible by 16"
    ), str(e.value)
    assert f"got k={k}, n={n} in this rank's shards x.shape={local_x}, w.shape={(k, n)}" in str(
        e.value
    )
    auto = fp8_fn(op, mesh1d(2), "auto")(x, w, jax_ub.Fp8Scales())
    xla = fp8_fn(op, mesh1d(2), "xla")(x, w, jax_ub.Fp8Scales())
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(xla, np.float32))
    assert rel_err(xla, reference_forward(op, x, w, 2)) < 1e-2
    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    choice = jax_ub.explain_impl(name, local_x, (k, n), jnp.bfloat16, 2, fp8=True)
    assert choice.impl == "xla" and "divisible by 16" in choice.reason, choice


def test_fp8_aligned_shapes_still_run_the_userbuffer_op_on_cpu():
    """k and n multiples of 16: impl="auto" on CPU devices still runs the host protocol."""
    choice = jax_ub.explain_impl("all_gather_matmul", (8, 32), (32, 16), jnp.bfloat16, 2, fp8=True)
    assert choice.impl == "ub", choice


DP_MODES = ["partial_auto-vma", "partial_auto-novma", "all_manual-vma", "all_manual-novma", "jit"]


def _dp_tp_fp8_fn(op, mesh, mode):
    """The fp8 op on a (dp, tp) mesh, called one way: shard_map manual over tp only (dp
    left to XLA) or over both, check_vma on or off; or plain jit on global arrays."""
    fn = op_call(op)
    if mode == "jit":  # called under jax.set_mesh(mesh): see _vjp_on
        return jax.jit(lambda x, w, s: fn(x, w, "tp", fp8=s))
    manual, vma = mode.split("-")
    in_specs, out_specs = op_specs(op, dp=manual == "all_manual")
    kw = {} if manual == "all_manual" else {"axis_names": {"tp"}}
    return smap(
        lambda x, w, s: fn(x, w, "tp", fp8=s),
        mesh,
        (*in_specs, P()),
        out_specs,
        check_vma=vma == "vma",
        **kw,
    )


def _vjp_on(mesh, mode, f, args, ct):
    """(f(*args), the cotangents of args for ``ct``), plain jit's under jax.set_mesh(mesh)."""
    with jax.set_mesh(mesh) if mode == "jit" else contextlib.nullcontext():
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)


# Partial-auto with 2-D x: the op warns that it runs on every row over dp, as it should.
NO_BATCH_DIM = pytest.mark.filterwarnings("ignore:jax_ub. x of shape.*has no batch dim")


@NO_BATCH_DIM
@pytest.mark.parametrize("mode", DP_MODES)
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("op", OPS)
def test_delayed_scaling_beside_dp_in_every_way_to_call(rand, op, tp, mode):
    """Delayed scaling beside dp = 2, at tp = 1 (the amax's max over a group of one:
    ``unfused.all_max``) and 2: forward and gradients against the dequantized float32
    math, and each given scale's gradient the amax of its whole tensor, which shard_map
    would otherwise sum over devices (check_vma off) or refuse as varying over dp (on)."""
    mesh = make_mesh((2, "dp"), (tp, "tp"))
    x, w = op_operands(rand, op, tp, 8, 32, 16, dp=2)
    ct = rand(x.shape[0], w.shape[1])
    sx, sw, sg = amax(x) / 400, amax(w) / 440, amax(ct) / 50000
    scales = jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw), grad=jnp.float32(sg))
    out, (dx, dw, dscales) = _vjp_on(mesh, mode, _dp_tp_fp8_fn(op, mesh, mode), (x, w, scales), ct)
    xq, wq, dct = deq(x, sx), deq(w, sw), deq(ct, sg, E5M2)
    assert rel_err(out, xq @ wq) < 1e-5
    assert rel_err(dx, dct @ wq.T) < 1e-5
    assert rel_err(dw, xq.T @ dct) < 1e-5
    np.testing.assert_allclose(float(dscales.x), amax(x), rtol=1e-6)
    np.testing.assert_allclose(float(dscales.w), amax(w), rtol=1e-6)
    np.testing.assert_allclose(float(dscales.grad), amax(ct), rtol=1e-6)


@NO_BATCH_DIM
@pytest.mark.parametrize("mode", DP_MODES)
@pytest.mark.parametrize("op", OPS)
def test_current_scaling_on_a_group_of_one_beside_dp(rand, op, mode):
    """Current scaling at tp = 1 beside dp = 2 (a gathered x's amax over a group of one):
    forward against the dequantized float32 math (each dp shard with its own amax where dp
    is manual, one amax where XLA partitions it), gradients against the float32 math within
    e5m2's precision."""
    mesh = make_mesh((2, "dp"), (1, "tp"))
    x, w = op_operands(rand, op, 1, 8, 32, 16, dp=2)
    ct = rand(x.shape[0], w.shape[1])
    f = _dp_tp_fp8_fn(op, mesh, mode)
    out, (dx, dw, _) = _vjp_on(mesh, mode, f, (x, w, jax_ub.Fp8Scales()), ct)
    halves = (x[:8], x[8:]) if mode.startswith("all_manual") else (x,)
    want = np.concatenate([deq(h, amax(h) / 448) @ deq(w, amax(w) / 448) for h in halves])
    assert rel_err(out, want) < 1e-5
    x32, w32, ct32 = (np.asarray(a, np.float32) for a in (x, w, ct))
    assert rel_err(dx, ct32 @ w32.T) < 0.1
    assert rel_err(dw, x32.T @ ct32) < 0.1
