"""The implementations compared, per op and shape, each with its operands.

Every builder returns ``{name: (compiled function, args)}`` and the reference (XLA's
unfused op): GEMM alone, the collective alone, XLA's op, a ``ppermute`` ring, JAX's Pallas
Mosaic-GPU collective matmul (AG, Hopper), jax_ub, jax_ub's own GEMM alone, and jax_ub under
other tuning choices (``--ub-variants``). XLA's windowed einsum needs its own XLA flags,
so it runs in a child process.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src.settings import options
from jax_ub.bench.timing import loop_time_ms

AXIS = "tp"
SOLO = "solo"  # a size-1 axis: jax_ub's op as a GEMM alone


OPS = {
    "ag": jax_ub.all_gather_matmul,
    "rs": jax_ub.matmul_reduce_scatter,
    "ar": jax_ub.matmul_all_reduce,
}


def _smap(mesh, f, in_specs, out_specs):
    return jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    )


def ring_all_gather_matmul(x, w):
    """Collective matmul from ppermute: each step multiplies the chunk in hand, passes it on."""
    size = lax.axis_size(AXIS)
    idx = lax.axis_index(AXIS)
    m = x.shape[0]
    out = jnp.zeros((size * m, w.shape[1]), x.dtype)
    perm = [(j, (j - 1) % size) for j in range(size)]
    chunk = x
    for i in range(size):
        src = (idx + i) % size
        out = lax.dynamic_update_slice(out, chunk @ w, (src * m, 0))
        if i < size - 1:
            chunk = lax.ppermute(chunk, AXIS, perm)
    return out


def _mgpu_all_gather_matmul(mesh, m_local, k, n_local, dtype):
    """JAX's Pallas Mosaic-GPU collective matmul (Hopper, AG only), or None if unavailable."""
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
    except Exception:  # noqa: BLE001  (optional baseline)
        return None
    try:
        cfg = cm.TuningConfig(
            tile_m=128,
            tile_n=128,
            tile_k=64,
            max_concurrent_steps=4,
            grid_minor_dim=cm.MatmulDimension.M,
            grid_tile_width=16,
            wg_dimension=cm.MatmulDimension.N,
        )
        fn = functools.partial(cm.all_gather_lhs_matmul, axis_name=AXIS, config=cfg, dtype=dtype)
    except Exception:  # noqa: BLE001
        return None
    return _smap(mesh, fn, (P(AXIS, None), P(None, AXIS)), P(None, AXIS))


def _put(host: np.ndarray, mesh, spec) -> jax.Array:
    """A global array from the same host data in every process (works with several)."""
    return jax.make_array_from_callback(
        host.shape, NamedSharding(mesh, spec), lambda index: host[index]
    )


def _random(seed: int, shape, dtype, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, np.float32) * scale).astype(dtype)


def _solo_mesh(mesh) -> Mesh:
    """The same GPUs, each in a tensor-parallel group of its own (axis SOLO, size 1)."""
    return Mesh(np.array(mesh.devices).reshape(-1, 1), (AXIS, SOLO))


def _fp8_scales(x: np.ndarray, w: np.ndarray):
    """Given (delayed) per-tensor scales of x and w, their amax over e4m3's largest value:
    ``(sx, sw, Fp8Scales)``."""
    sx = np.float32(np.abs(x.astype(np.float32)).max() / 448)
    sw = np.float32(np.abs(w.astype(np.float32)).max() / 448)
    return sx, sw, jax_ub.Fp8Scales(x=jnp.float32(sx), w=jnp.float32(sw))


def _add_fp8(impls, mesh, op, x, w, specs, gemm_specs, variants=()) -> None:
    """fp8 rows (``--fp8``), given (delayed) scales: jax_ub's op and XLA's unfused op on
    operands already quantized, as the fp8 GEMM alone (``fp8_gemm``, XLA's
    dequantize-then-dot pattern) takes them, and jax_ub's op under each of ``variants``;
    and jax_ub's op from bf16 operands, quantizing x and w in the call as a training step
    does (``jax_ub_fp8_hp``)."""
    from jax_ub import fp8  # noqa: PLC0415
    from jax_ub._src.lowering.unfused import scaled_matmul  # noqa: PLC0415
    from jax_ub._src.lowering.wire_format import pack_scales  # noqa: PLC0415

    call = OPS[op]
    sx, sw, scales = _fp8_scales(x, w)

    def quantized(arrays):
        return tuple(
            jax.device_put(fp8.quantize(a, s), a.sharding) for a, s in zip(arrays, (sx, sw))
        )

    def op_fn(impl):
        return _smap(mesh, lambda a, b: call(a, b, AXIS, impl=impl, fp8=scales), *specs)

    operands = quantized(impls["jax_ub"][1])
    impls["jax_ub_fp8"] = (op_fn("ub"), operands)
    _add_variants(impls, lambda: op_fn("ub"), operands, variants, "jax_ub_fp8")
    impls["xla_fp8"] = (op_fn("xla"), operands)
    impls["jax_ub_fp8_hp"] = (op_fn("ub"), impls["jax_ub"][1])
    packed = pack_scales(sx, sw)
    gemm = _smap(mesh, lambda a, b: scaled_matmul(a, b, packed, out_dtype=x.dtype), *gemm_specs)
    impls["fp8_gemm"] = (gemm, quantized(impls["gemm"][1]))


def _add_solo_rows(impls, mesh, op, x, w, specs, args, fp8: bool) -> None:
    """Rows of the op on groups of one GPU at the ``gemm`` row's shapes (no communication):
    ``ub_gemm``, jax_ub's own GEMM through the whole FFI path; with ``fp8``, ``fp8_nocomm``,
    the fp8 op as ``jax_ub_fp8_hp`` calls it (quantizing x and w from bf16 with the same
    scales) through XLA: that row's no-communication bound."""
    solo = _solo_mesh(mesh)
    call = OPS[op]
    impls["ub_gemm"] = (_smap(solo, lambda a, b: call(a, b, SOLO, impl="ub"), *specs), args)
    if fp8:
        scales = _fp8_scales(x, w)[2]
        f = _smap(solo, lambda a, b: call(a, b, SOLO, impl="xla", fp8=scales), *specs)
        impls["fp8_nocomm"] = (f, args)


# Rows with an epilogue (``--epilogue``) compute another function than the reference; each is
# checked against the row named here instead.
EPILOGUE_CHECKS = {"jax_ub_bias_gelu": "xla_bias_gelu", "gemm_bias_gelu": "xla_bias_gelu"}


def _add_epilogue(impls, mesh, seed, N, dtype, specs, gemm_specs) -> None:
    """Epilogue rows (``--epilogue``, AG): gelu(x @ w + bias) by jax_ub's op (bias and GELU in
    its GEMMs' epilogue), by XLA's unfused op and by XLA's dot alone (whatever epilogue
    fusion XLA does itself); bias column-sharded like w."""
    b = _put(_random(seed + 2, (N,), dtype), mesh, P(AXIS))

    def op(impl):
        def f(a, w, bias):
            return jax_ub.all_gather_matmul(a, w, AXIS, bias=bias, activation="gelu", impl=impl)

        return _smap(mesh, f, (*specs[0], P(AXIS)), specs[1])

    impls["jax_ub_bias_gelu"] = (op("ub"), (*impls["jax_ub"][1], b))
    impls["xla_bias_gelu"] = (op("xla"), (*impls["jax_ub"][1], b))
    gemm = _smap(
        mesh,
        lambda a, w, bias: jax.nn.gelu(a @ w + bias, approximate=True),
        (*gemm_specs[0], P(AXIS)),
        gemm_specs[1],
    )
    impls["gemm_bias_gelu"] = (gemm, (*impls["gemm"][1], b))


def build_ag(mesh, M, K, N, dtype, seed, variants=(), fp8=False, epilogue=False):
    tp = mesh.shape[AXIS]
    x = _random(seed, (M, K), dtype)
    w = _random(seed + 1, (K, N), dtype, 1 / np.sqrt(K))
    xs, xr, ws = _put(x, mesh, P(AXIS, None)), _put(x, mesh, P()), _put(w, mesh, P(None, AXIS))
    row, col = (P(AXIS, None), P(None, AXIS)), P(None, AXIS)
    row_solo = (P(), P(None, AXIS))

    def ub():
        return _smap(mesh, lambda a, b: jax_ub.all_gather_matmul(a, b, AXIS, impl="ub"), row, col)

    impls = {
        "gemm": (_smap(mesh, lambda a, b: a @ b, (P(), P(None, AXIS)), col), (xr, ws)),
        "comm": (_smap(mesh, lambda a, b: lax.all_gather(a, AXIS, tiled=True), row, P()), (xs, ws)),
        "xla_seq": (
            _smap(mesh, lambda a, b: jax_ub.all_gather_matmul(a, b, AXIS, impl="xla"), row, col),
            (xs, ws),
        ),
        "ring": (_smap(mesh, ring_all_gather_matmul, row, col), (xs, ws)),
        "jax_ub": (ub(), (xs, ws)),
    }
    _add_variants(impls, ub, (xs, ws), variants)
    if fp8:
        _add_fp8(impls, mesh, "ag", x, w, (row, col), ((P(), P(None, AXIS)), col), variants)
    if epilogue:
        _add_epilogue(impls, mesh, seed, N, dtype, (row, col), ((P(), P(None, AXIS)), col))
    if jax.process_count() == 1:  # the Pallas kernel and the ring: one-process baselines
        # jax_ub's own GEMM alone: the op on groups of one GPU, the "gemm" row's shapes.
        solo = _solo_mesh(mesh)
        solo_args = (_put(x, solo, P()), _put(w, solo, P(None, AXIS)))
        _add_solo_rows(impls, mesh, "ag", x, w, (row_solo, col), solo_args, fp8)
        on_gpu = mesh.devices.flat[0].platform == "gpu"  # a Mosaic-GPU kernel
        mgpu = _mgpu_all_gather_matmul(mesh, M // tp, K, N // tp, dtype) if on_gpu else None
        if mgpu is not None:
            impls["pallas_mgpu"] = (mgpu, (xs, ws))
    else:
        del impls["ring"]
    return impls, impls["xla_seq"]


def build_rs(mesh, M, K, N, dtype, seed, variants=(), fp8=False, epilogue=False):
    x = _random(seed, (M, N), dtype)
    w = _random(seed + 1, (N, K), dtype, 1 / np.sqrt(N))
    xs, ws = _put(x, mesh, P(None, AXIS)), _put(w, mesh, P(AXIS, None))
    ins, out = (P(None, AXIS), P(AXIS, None)), P(AXIS, None)
    y_local = _put(np.ones((M * mesh.shape[AXIS], K), dtype), mesh, P(AXIS, None))

    def ub():
        return _smap(
            mesh, lambda a, b: jax_ub.matmul_reduce_scatter(a, b, AXIS, impl="ub"), ins, out
        )

    impls = {
        "gemm": (_smap(mesh, lambda a, b: a @ b, ins, P(AXIS, None)), (xs, ws)),
        "comm": (
            _smap(
                mesh,
                lambda a: lax.psum_scatter(a, AXIS, tiled=True),
                (P(AXIS, None),),
                P(AXIS, None),
            ),
            (y_local,),
        ),
        "xla_seq": (
            _smap(
                mesh, lambda a, b: jax_ub.matmul_reduce_scatter(a, b, AXIS, impl="xla"), ins, out
            ),
            (xs, ws),
        ),
        "jax_ub": (ub(), (xs, ws)),
    }
    _add_variants(impls, ub, (xs, ws), variants)
    if fp8:
        _add_fp8(impls, mesh, "rs", x, w, (ins, out), (ins, P(AXIS, None)), variants)
    if jax.process_count() == 1:
        solo = _solo_mesh(mesh)
        solo_args = (_put(x, solo, P(None, AXIS)), _put(w, solo, P(AXIS, None)))
        _add_solo_rows(impls, mesh, "rs", x, w, (ins, out), solo_args, fp8)
    return impls, impls["xla_seq"]


def build_ar(mesh, M, K, N, dtype, seed, variants=(), fp8=False, epilogue=False):
    """GEMM + all-reduce: x [M, K] split over K (features), w [K, N] over its rows; every
    device ends with all of psum(x @ w) [M, N]. The ``gemm`` row is each device's local
    product, the no-communication bound; ``comm`` XLA's all-reduce of [M, N] alone. No fp8
    or epilogue rows (the command line refuses them)."""
    x = _random(seed, (M, K), dtype)
    w = _random(seed + 1, (K, N), dtype, 1 / np.sqrt(K))
    xs, ws = _put(x, mesh, P(None, AXIS)), _put(w, mesh, P(AXIS, None))
    ins = (P(None, AXIS), P(AXIS, None))
    y_local = _put(np.ones((M * mesh.shape[AXIS], N), dtype), mesh, P(AXIS, None))

    def op(impl):
        return _smap(mesh, lambda a, b: jax_ub.matmul_all_reduce(a, b, AXIS, impl=impl), ins, P())

    impls = {
        "gemm": (_smap(mesh, lambda a, b: a @ b, ins, P(AXIS, None)), (xs, ws)),
        "comm": (_smap(mesh, lambda a: lax.psum(a, AXIS), (P(AXIS, None),), P()), (y_local,)),
        "xla_seq": (op("xla"), (xs, ws)),
        "jax_ub": (op("ub"), (xs, ws)),
        "jax_ub_auto": (op("auto"), (xs, ws)),
    }
    _add_variants(impls, lambda: op("ub"), (xs, ws), variants)
    return impls, impls["xla_seq"]


def parse_variants(text: str) -> list[dict]:
    """ "name=value,name=value;name=value" -> one dict of tuning choices per variant
    (jax_ub._src.settings.options.Tuning's names, and ``gemm_cache``).
    Values are read as Python literals where they parse (ints, floats, True), else kept as
    strings ("auto")."""
    variants = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        settings = {}
        for item in part.split(","):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r} is not name=value")
            try:
                settings[name.strip()] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                settings[name.strip()] = value.strip()
        variants.append(settings)
    for settings in variants:  # a bad name or value fails now, not after compiling
        with configured(settings):
            pass
    return variants


def variant_name(settings: dict, row: str = "jax_ub") -> str:
    """The name of ``row``'s variant under ``settings``: ``row[name=value,...]``."""
    return row + "[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]"


# jax_ub settings (jax_ub.configure's) a variant may set beside the tuning choices: the
# GEMM kernels' choice file, to compare kernel sets in one process.
_USER_SETTINGS = ("gemm_cache",)


@contextlib.contextmanager
def configured(settings: dict):
    """The tuning choices `settings` inside the block, through the experimental hook, and
    its user settings (``_USER_SETTINGS``) through jax_ub.configure (a bad name or value
    raises there, changing nothing)."""
    user = {k: v for k, v in settings.items() if k in _USER_SETTINGS}
    saved = {k: getattr(jax_ub.config, k) for k in user}
    with options.experimental_tuning(**{k: v for k, v in settings.items() if k not in user}):
        jax_ub.configure(**user)
        try:
            yield
        finally:
            jax_ub.configure(**saved)


def _add_variants(impls, make, args, variants, row: str = "jax_ub") -> None:
    """jax_ub's op (the ``row`` that ``make`` builds) again under other settings, one row
    each, interleaved with the rest.
    Communicators take their settings when they are created, at lowering: so each variant
    is compiled now, with its settings configured, and keeps a communicator of its own."""
    for settings in variants:
        impls[variant_name(settings, row)] = (compiled_with(settings, make(), *args), args)


def compiled_with(settings: dict, f, *args):
    """The jitted ``f`` lowered and compiled for ``args`` now, under ``settings``
    (``configured``): it keeps a communicator made with them."""
    with configured(settings):
        return f.lower(*args).compile()


def windowed_einsum_ms(M, K, N, dtype_name, rounds, iters, tp) -> float | None:
    """XLA's windowed einsum (its own process: it needs its own XLA flags)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_gpu_threshold_for_windowed_einsum_mib=0"
        " --xla_gpu_multi_streamed_windowed_einsum=true"
    )
    cmd = [
        sys.executable,
        "-m",
        "jax_ub.bench",
        "--windowed-einsum-child",
        "--shapes",
        f"{M}x{K}x{N}",
        "--dtype",
        dtype_name,
        "--rounds",
        str(rounds),
        "--iters",
        str(iters),
        "--tp",
        str(tp),
    ]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        for line in res.stdout.splitlines():
            if line.startswith("WINDOWED_EINSUM_MS"):
                return float(line.split()[1])
        print("  windowed einsum child said:", res.stderr[-500:], flush=True)
    except subprocess.TimeoutExpired:
        print("  windowed einsum child timed out", flush=True)
    return None


def _windowed_einsum_child(M, K, N, dtype, rounds, iters, tp) -> None:
    mesh = Mesh(np.array(jax.devices()[: tp or None]), (AXIS,))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(kx, (M, K), dtype), NamedSharding(mesh, P(AXIS, None)))
    w = jax.device_put(jax.random.normal(kw, (K, N), dtype), NamedSharding(mesh, P(None, AXIS)))
    f = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P(None, AXIS)))
    ts = [loop_time_ms(f, (x, w), iters) for _ in range(rounds)]
    print(f"WINDOWED_EINSUM_MS {statistics.median(ts):.4f}", flush=True)
