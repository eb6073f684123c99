"""One process of a multi-process jax_ub test (started by tests/_mp_launch.py, for
test_multiprocess.py, test_multiprocess_faults.py and test_gpu_multiprocess.py).

argv: scenario process_id num_processes port devices_per_process
Prints "RESULT <json>" on success; exits non-zero with the error text otherwise.
"""

import json
import os
import sys
import time

from _mp_join import RS_SCHEDULES, join, rs_schedules

scenario, pid, nproc, port, ndev = sys.argv[1], *map(int, sys.argv[2:6])
if scenario == "different_hosts":
    os.environ["JAX_UB_HOST_ID"] = f"host{pid}"  # each process claims a machine of its own
# This process drives GPUs [pid * ndev, (pid + 1) * ndev) of the machine, or with
# JAX_UB_TEST_SHARE_GPU=1 every process drives GPU 0 (one device each): CUDA IPC works
# between processes of one GPU, so a machine of one GPU runs groups of several ranks.
# (with JAX_UB_TEST_SHARE_GPU=1 join() puts every process on GPU 0 instead)
GPUS = ",".join(str(pid * ndev + i) for i in range(ndev))
join(pid, nproc, port, gpus=GPUS, cpu_devices=ndev, timeout_s="8")

import jax  # noqa: E402

# The reference in full f32: XLA's GPU dots default to TF32, jax_ub's f32 GEMM does not.
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402
from jax_ub._src.settings import options  # noqa: E402


def whole_array(shape, seed):
    """The whole array of global_array's shards: the same in every process."""
    return np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32))


def global_array(mesh, spec, shape, seed):
    full = whole_array(shape, seed)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda idx: full[idx])


def ub_all_gather_matmul(mesh):
    """all_gather_matmul with impl="ub" over the mesh's "tp" axis, jitted: rows of x
    gathered, columns of w kept."""
    return jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )


def relerr(a, b):
    return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def run_ops(mesh, axis, other, m=8, k=16, n=24, impl="ub"):
    """Both ops, two copies of an RS, and the grads, `impl` vs xla, inside one shard_map;
    returns replicated errors."""
    tp = mesh.shape[axis]
    rows = P((*other, axis), None) if other else P(axis, None)

    def body(x, w1, w2):
        errs = []
        for op, a, b in (
            (jax_ub.all_gather_matmul, x, w1),
            (jax_ub.matmul_reduce_scatter, jnp.tile(x, (tp, 1)), w1),
        ):
            u, r = op(a, b, axis, impl=impl), op(a, b, axis, impl="xla")
            errs.append(lax.pmax(relerr(u, r), mesh.axis_names))
        # Two calls of one inner jitted function on independent inputs: XLA copies its body
        # into each caller, and the ranks must pair copy with copy whatever order each
        # runtime starts them in.
        rs = jax.jit(lambda a, b: jax_ub.matmul_reduce_scatter(a, b, axis, impl=impl))
        for a in (jnp.tile(x, (tp, 1)), jnp.tile(jnp.cos(x), (tp, 1))):
            r = jax_ub.matmul_reduce_scatter(a, w1, axis, impl="xla")
            errs.append(lax.pmax(relerr(rs(a, w1), r), mesh.axis_names))

        def loss(impl, x, w1, w2):
            h = jax_ub.all_gather_matmul(x, w1, axis, impl=impl)
            y = jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, axis, impl=impl)
            return lax.psum(jnp.sum(jnp.sin(y)), mesh.axis_names)

        gu = jax.grad(loss, argnums=(1, 2, 3))(impl, x, w1, w2)
        gr = jax.grad(loss, argnums=(1, 2, 3))("xla", x, w1, w2)
        errs += [lax.pmax(relerr(a, b), mesh.axis_names) for a, b in zip(gu, gr)]
        return jnp.stack(errs)

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(rows, P(None, axis), P(axis, None)),
            out_specs=P(),
            check_vma=False,
        )
    )
    x = global_array(mesh, rows, (mesh.size * m, k), 1)
    w1 = global_array(mesh, P(None, axis), (k, n * tp), 2)
    w2 = global_array(mesh, P(axis, None), (n * tp, k), 3)
    return [float(e) for e in np.asarray(f(x, w1, w2))]


def shard_errors(got, want) -> list[float]:
    """Per global array in `got`, the worst relative error of this process's shards against
    the same slices of the whole reference array in `want`; NaN where any shard has one
    (np.max keeps a NaN, where Python's max(0.0, nan) would drop it)."""
    errs = []
    for arr, ref in zip(got, want):
        ref = np.asarray(ref)
        per_shard = []
        for shard in arr.addressable_shards:
            a, b = np.asarray(shard.data).astype(np.float32), ref[shard.index]
            per_shard.append(np.linalg.norm(a - b) / np.linalg.norm(b))
        errs.append(float(np.max(per_shard)))
    return errs


def run_ops_without_collectives(mesh, axis, m, k, n, dtype, scale=0.3, epilogue=False):
    """Both ops (all_gather_matmul with its gathered x), and the grads of a loss through
    both, using no XLA collective at all: each process compares its own shards with a
    reference computed on one device. (NCCL refuses processes that share a GPU.) Returns
    relative errors of [gathered, AG, RS, dx, dw1, dw2]; with ``epilogue`` the AG adds a
    bias b1 and applies GELU in its GEMMs, the RS's result is gelu_mlp's (GELU's backward in
    a GEMM epilogue, no tanh), and the errors end with db1's."""
    tp = mesh.shape[axis]
    ag_kw = dict(activation="gelu") if epilogue else {}

    def model(x, w1, w2, *b1):
        h, g = jax_ub.all_gather_matmul(
            x, w1, axis, impl="ub", return_gathered=True, bias=b1[0] if b1 else None, **ag_kw
        )
        if epilogue:
            return h, g, jax_ub.gelu_mlp(x, w1, w2, axis, up_bias=b1[0], impl="ub")
        return h, g, jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, axis, impl="ub")

    def body(x, w1, w2, *b1):
        h, g, z = model(x, w1, w2, *b1)

        # The loss of this rank's rows; its grads through the ops' VJPs (ub ops only) are
        # this rank's shards of the global loss's grads.
        def local(*a):
            return jnp.sum(jnp.sin(model(*a)[2].astype(jnp.float32)))

        return (g, h, z, *jax.grad(local, argnums=tuple(range(3 + len(b1))))(x, w1, w2, *b1))

    specs = (P(axis, None), P(None, axis), P(axis, None)) + ((P(axis),) if epilogue else ())
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=specs,
            out_specs=(P(), P(None, axis), P(axis, None), *specs),
            check_vma=False,
        )
    )
    shapes = ((tp * m, k), (k, tp * n), (tp * n, k)) + (((tp * n,),) if epilogue else ())
    full = [
        scale * np.asarray(jax.random.normal(jax.random.key(i), shape, jnp.float32))
        for i, shape in enumerate(shapes)
    ]
    # The operands as the op sees them (rounded to dtype), in f32 for the reference.
    full = [np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in full]
    args = [
        jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i, a=a: a[i])
        for a, spec in zip(full, specs)
    ]
    got = f(*(a.astype(dtype) for a in args))

    # The reference: the same math on whole arrays on one device, f32 at full precision.
    def dense(x, w1, w2, *b1):
        h = jnp.dot(x, w1, precision="highest")
        if epilogue:
            h = jax.nn.gelu(h + b1[0], approximate=True)
            return h, x, jnp.dot(h, w2, precision="highest")
        return h, x, jnp.dot(jnp.tanh(h), w2, precision="highest")

    one = jax.local_devices()[0]
    full = [jax.device_put(a, one) for a in full]
    h, g, z = dense(*full)
    grads = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a)[2])), argnums=tuple(range(len(full))))(
        *full
    )
    return shard_errors(got, (g, h, z, *grads))


def run_fp8_without_collectives(mesh, axis, m, k, n, dtype):
    """Both ops in fp8 with given (delayed) scales, forward and the VJPs of a random
    cotangent, no XLA collective: each process compares its shards with a float32 reference
    from dequantized operands. Returns relative errors of [AG, dx, dw, RS, dx, dw]."""
    import ml_dtypes  # noqa: PLC0415

    tp = mesh.shape[axis]
    s1 = jax_ub.Fp8Scales(x=jnp.float32(0.01), w=jnp.float32(0.006), grad=jnp.float32(1e-4))
    s2 = jax_ub.Fp8Scales(x=jnp.float32(0.009), w=jnp.float32(0.005), grad=jnp.float32(2e-4))

    def body(x1, w1, ct1, x2, w2, ct2):
        def ag(x, w):
            return jax_ub.all_gather_matmul(x, w, axis, impl="ub", fp8=s1)

        def rs(x, w):
            return jax_ub.matmul_reduce_scatter(x, w, axis, impl="ub", fp8=s2)

        # No data path joins the forward AG and RS, nor the backward calls (each VJP's
        # cotangent is given): XLA's CPU runtime may start them in any order, and the
        # ranks still pair them by site (src/host/ordered_runner.h).
        h, vjp1 = jax.vjp(ag, x1, w1)
        z, vjp2 = jax.vjp(rs, x2, w2)
        return (h, *vjp1(ct1), z, *vjp2(ct2))

    rows, cols = P(axis, None), P(None, axis)
    specs = (rows, cols, cols, cols, rows, rows)
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=specs,
            out_specs=(cols, rows, cols, rows, cols, rows),
            check_vma=False,
        )
    )
    shapes = (
        (tp * m, k),
        (k, tp * n),
        (tp * m, tp * n),
        (tp * m, tp * k),
        (tp * k, n),
        (tp * m, n),
    )
    full = [
        np.asarray(jnp.asarray(jax.random.normal(jax.random.key(i), s, jnp.float32), dtype)).astype(
            np.float32
        )
        for i, s in enumerate(shapes)
    ]
    args = [
        jax.make_array_from_callback(a.shape, NamedSharding(mesh, sp), lambda i, a=a: a[i])
        for a, sp in zip(full, specs)
    ]
    got = f(*(a.astype(dtype) for a in args))

    def deq(a, scale, fmt=ml_dtypes.float8_e4m3fn):
        fmax = float(ml_dtypes.finfo(fmt).max)
        return np.clip(a / scale, -fmax, fmax).astype(fmt).astype(np.float32) * scale

    x1, w1, ct1, x2, w2, ct2 = full
    e5 = ml_dtypes.float8_e5m2
    q = lambda a, s: deq(a, float(s))  # noqa: E731
    g1, g2 = deq(ct1, float(s1.grad), e5), deq(ct2, float(s2.grad), e5)
    want = (
        q(x1, s1.x) @ q(w1, s1.w),
        g1 @ q(w1, s1.w).T,
        q(x1, s1.x).T @ g1,
        q(x2, s2.x) @ q(w2, s2.w),
        g2 @ q(w2, s2.w).T,
        q(x2, s2.x).T @ g2,
    )
    return shard_errors(got, want)


def replace_host_calls(**calls) -> None:
    """The host extension's functions named in ``calls`` replaced by those given, for the
    fault scenarios (a process that dies, or fails, at one step of the bootstrap)."""
    from jax_ub._src.runtime import extension

    class Replaced:
        def __init__(self, module):
            self._module = module

        def __getattr__(self, name):
            return calls[name] if name in calls else getattr(self._module, name)

    extension._host = Replaced(extension._host)


# The processes that report an outcome of their own: all but the one that dies (or sleeps)
# on purpose.
REPORTERS = [
    p
    for p in range(nproc)
    if not (scenario in ("killed_in_bootstrap", "absent_peer") and p == nproc - 1)
]


def exit_after_peers_reported(code: int) -> None:
    """Leave with `code`, skipping jax.distributed's shutdown barrier (it would wait for
    peers that died or wait elsewhere), but not before every peer expected to report has
    printed its error. Process 0 hosts the coordination service: if it left at once, a peer
    still on its way to its own error (a loaded machine can hold it back for seconds) would
    be aborted by its agent ("Socket closed") before printing anything. So each process
    publishes a key once its error is printed, and process 0 leaves after the other
    REPORTERS' keys have come (or 60 s have passed)."""
    from jax._src import distributed  # noqa: PLC0415

    client = distributed.global_state.client
    try:
        client.key_value_set(f"mp_test/reported/p{pid}", str(code))
        if pid == 0:
            deadline = time.monotonic() + 60
            for p in REPORTERS[1:]:
                left_ms = int(1000 * (deadline - time.monotonic()))
                client.blocking_key_value_get(f"mp_test/reported/p{p}", max(1, left_ms))
            # A peer's key comes just before its os._exit; give the exit a moment so that
            # the service's closing does not abort it first (its exit code stays `code`).
            time.sleep(1)
    except Exception as e:  # noqa: BLE001  (a peer gone or late: leave anyway)
        print(f"(leaving without every peer's report: {type(e).__name__}: {e})", flush=True)
    os._exit(code)


t0 = time.time()
devices = np.array(jax.devices())
try:
    if scenario == "tp_across_processes":
        result = run_ops(Mesh(devices, ("tp",)), "tp", ())
    elif scenario in ("protocol", "fp8"):
        # Every branch of the ops' step lists across processes: both ops and their grads,
        # reduce-scatters folded (in uneven pieces; in a ring above 2) and not, f32 and bf16
        # (in fp8: as outputs), the epochs of many calls; bf16's backward gathers x again
        # inside its reduce-scatter (keep_gathered off). No XLA collective, so processes may
        # share a GPU.
        check = {"protocol": run_ops_without_collectives, "fp8": run_fp8_without_collectives}
        mesh = Mesh(devices, ("tp",))
        result = {}
        for name in rs_schedules(nproc):
            fold, ring = RS_SCHEDULES[name]
            options.set_experimental_tuning(reduce_scatter_fold_rows=fold, reduce_scatter_ring=ring)
            for dtype in (jnp.float32, jnp.bfloat16):
                jax_ub.configure(keep_gathered=dtype == jnp.float32)
                key = f"{name},{jnp.dtype(dtype).name}"
                result[key] = check[scenario](mesh, "tp", 41, 64, 48, dtype)
        if scenario == "protocol":  # the AG's epilogue (bias, GELU) across the spans
            for dtype in (jnp.float32, jnp.bfloat16):
                jax_ub.configure(keep_gathered=dtype == jnp.float32)
                key = f"epilogue,{jnp.dtype(dtype).name}"
                result[key] = run_ops_without_collectives(
                    mesh, "tp", 41, 64, 48, dtype, epilogue=True
                )
        if scenario == "protocol" and nproc > 2:  # the AG in turn, one GEMM waiting per chunk
            options.set_experimental_tuning(all_gather_in_turn=True, all_gather_flag_gemm=True)
            for dtype in (jnp.float32, jnp.bfloat16):
                jax_ub.configure(keep_gathered=dtype == jnp.float32)
                key = f"flag_gemm,{jnp.dtype(dtype).name}"
                result[key] = run_ops_without_collectives(mesh, "tp", 41, 64, 48, dtype)
        if scenario == "protocol" and nproc > 2:  # the RS's partials in one GEMM signalling each
            options.set_experimental_tuning(
                all_gather_in_turn=None,
                all_gather_flag_gemm=None,
                reduce_scatter_fold_rows=-1,
                reduce_scatter_signal_gemm=True,
            )
            for dtype in (jnp.float32, jnp.bfloat16):
                jax_ub.configure(keep_gathered=dtype == jnp.float32)
                key = f"signal_gemm,{jnp.dtype(dtype).name}"
                result[key] = run_ops_without_collectives(mesh, "tp", 41, 64, 48, dtype)
    elif scenario == "dp_across_tp_inside":
        result = run_ops(Mesh(devices.reshape(nproc, ndev), ("dp", "tp")), "tp", ("dp",))
    elif scenario == "mismatched_shape":
        # Only the ub op (no XLA collective, which would trip over the mismatch first).
        mesh = Mesh(devices, ("tp",))
        m = 8 if pid == 0 else 16
        x = global_array(mesh, P("tp", None), (mesh.size * m, 16), 1)
        w = global_array(mesh, P(None, "tp"), (16, 8 * mesh.size), 2)
        f = ub_all_gather_matmul(mesh)
        out = f(x, w)
        result = [float(np.abs(np.asarray(s.data)).sum()) for s in out.addressable_shards]
        if devices.flat[0].platform == "gpu":
            # A GPU's device-side check of the peers' call descriptors turns the outputs
            # NaN and marks the communicator broken; check_health() raises naming both.
            print(f"SUMS {json.dumps(result)}", flush=True)
            jax_ub.check_health()
    elif scenario == "recompiled_alone":
        # Process 0 alone clears JAX's caches between two runs of one program: it lowers and
        # compiles it anew while its peers keep their executable; the calls still pair.
        mesh = Mesh(devices, ("tp",))
        x = global_array(mesh, P("tp", None), (mesh.size * 8, 16), 1)
        w = global_array(mesh, P(None, "tp"), (16, 8 * mesh.size), 2)
        want = whole_array(x.shape, 1).astype(np.float64) @ whole_array(w.shape, 2)
        f = ub_all_gather_matmul(mesh)
        result = []
        for run in range(3):
            if run > 0 and pid == 0:
                jax.clear_caches()
            result += shard_errors([f(x, w)], [want])
    elif scenario == "mismatched_setting":
        # The last process folds every reduce-scatter, its peers none: left to run, the
        # folding side would wait for a first piece never sent. Both ops must refuse at the
        # communicator's creation, naming the setting, in every process.
        options.set_experimental_tuning(reduce_scatter_fold_rows=0 if pid == nproc - 1 else -1)
        result = run_ops(Mesh(devices, ("tp",)), "tp", ())
    elif scenario == "absent_peer":
        if pid == nproc - 1:
            time.sleep(30)  # never calls the op; the others must give up with an error
            sys.exit(0)
        result = run_ops(Mesh(devices, ("tp",)), "tp", ())
    elif scenario == "killed_in_bootstrap":
        # The last process dies in the middle of the bootstrap: after publishing its
        # userbuffers, before mapping its peers'. The others must fail naming it.
        if pid == nproc - 1:
            replace_host_calls(connect=lambda *args: os._exit(9))
        result = run_ops(Mesh(devices, ("tp",)), "tp", ())
    elif scenario == "create_fails":
        # The last process cannot create its userbuffers (its GPU out of memory, say): the
        # others must fail at once with its reason, not wait out the timeout for its handles.
        if pid == nproc - 1:

            def create_communicator(*args, **kwargs):
                raise RuntimeError("cudaMalloc failed: out of memory (simulated)")

            replace_host_calls(create_communicator=create_communicator)
        result = run_ops(Mesh(devices, ("tp",)), "tp", ())
    elif scenario == "different_hosts":
        # The group spans "hosts": impl="auto" runs on XLA's collectives with one warning,
        # impl="ub" fails naming the devices and hosts.
        import warnings

        mesh = Mesh(devices, ("tp",))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            errs = run_ops(mesh, "tp", (), impl="auto")
        fallbacks = [str(w.message) for w in caught if "impl='auto' uses XLA" in str(w.message)]
        try:
            run_ops(mesh, "tp", (), k=32, impl="ub")  # another shape: compiled anew
            ub_error = ""
        except Exception as e:  # noqa: BLE001
            ub_error = f"{type(e).__name__}: {e}"
        result = {"errs": errs, "fallback_warnings": fallbacks, "ub_error": ub_error}
    else:
        raise SystemExit(f"unknown scenario {scenario}")
except Exception as e:  # noqa: BLE001
    print(f"ERROR after {time.time() - t0:.1f}s: {type(e).__name__}: {e}", flush=True)
    exit_after_peers_reported(3)
print("RESULT " + json.dumps({"errs": result, "seconds": time.time() - t0}), flush=True)
jax_ub.finalize()
