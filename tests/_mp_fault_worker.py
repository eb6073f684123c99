"""One process of a multi-process fault test (started by check_killed_peer in
tests/_mp_launch.py, for test_multiprocess_faults.py and test_gpu_multiprocess.py).

argv: scenario process_id num_processes port
One device per process (a CPU device, or with JAX_UB_TEST_GPU=1 GPU number process_id, or
GPU 0 for every process with JAX_UB_TEST_SHARE_GPU=1);
one tensor-parallel group spans all processes.

Scenario "killed_peer": every process runs a loop of userbuffer ops (all_gather_matmul and
matmul_reduce_scatter, alternating, each checked against numpy). The last process SIGKILLs
itself right after op KILL_AT completes. The survivors must then:
  1. fail the next op within the deadline (JAX_UB_TIMEOUT_S) with an error naming the op
     and the dead rank, not hang;
  2. fail the op after that at once, saying the communicator is broken;
  3. after jax_ub.finalize(), run both ops correctly on a mesh of the surviving processes
     (re-initialize after an error).
Each survivor prints "RESULT <json>" and exits 0; any other outcome prints "ERROR ..." and
exits non-zero. On GPUs step 1 differs: the op has returned before the device finds the
peer gone, so the timed-out call must hand back NaN (never stale numbers) within the
deadline, and jax_ub.check_health() must raise naming the dead rank. Only userbuffer ops
run (no XLA collective, which would itself block on the dead process).
"""

import json
import os
import signal
import sys
import time
import warnings

from _mp_join import ON_GPU, join

scenario, pid, nproc, port = sys.argv[1], *map(int, sys.argv[2:5])
join(pid, nproc, port, gpus=str(pid), cpu_devices=1, timeout_s="5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402

KILL_AT = 3  # the victim dies after this many ops have completed
M, K, N = 8, 16, 12  # per-rank row block, contracting dim, per-rank columns


def global_array(mesh, spec, full):
    return jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda i: full[i])


def make_ops(mesh):
    tp = mesh.shape["tp"]
    ag = jax.jit(
        jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"),
            mesh=mesh,
            in_specs=(P("tp", None), P(None, "tp")),
            out_specs=P(None, "tp"),
        )
    )
    rs = jax.jit(
        jax.shard_map(
            lambda h, v: jax_ub.matmul_reduce_scatter(h, v, "tp", impl="ub"),
            mesh=mesh,
            in_specs=(P(None, "tp"), P("tp", None)),
            out_specs=P("tp", None),
        )
    )
    rng = np.random.default_rng(0)  # same data in every process
    x = rng.standard_normal((tp * M, K), np.float32)
    w = rng.standard_normal((K, tp * N), np.float32)
    h = rng.standard_normal((tp * M, tp * K), np.float32)
    v = rng.standard_normal((tp * K, N), np.float32)
    args_ag = (global_array(mesh, P("tp", None), x), global_array(mesh, P(None, "tp"), w))
    args_rs = (global_array(mesh, P(None, "tp"), h), global_array(mesh, P("tp", None), v))
    return [
        ("all_gather_matmul", ag, args_ag, x @ w),
        ("matmul_reduce_scatter", rs, args_rs, h @ v),
    ]


def check(out, expected):
    """Compares every local shard of `out` with the same block of the numpy product (a NaN
    anywhere fails: np.max keeps it)."""
    errs = []
    for shard in out.addressable_shards:
        got, want = np.asarray(shard.data), expected[shard.index]
        errs.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    worst = float(np.max(errs))
    if not worst < 1e-5:
        raise AssertionError(f"wrong result: relative error {worst}")
    return worst


def exit_together(code):
    """Survivors leave together: process 0 hosts jax.distributed's coordination service, and
    if it left first, the other survivors' agents would abort them."""
    from jax._src import distributed  # noqa: PLC0415

    client = distributed.global_state.client
    client.key_value_set(f"fault_test/done/p{pid}", str(code))
    if pid == 0:
        for p in range(1, nproc - 1):
            client.blocking_key_value_get(f"fault_test/done/p{p}", 60_000)
        # A survivor's key comes just before its os._exit; on a loaded machine the exit can
        # lag, and the service closing in that gap made its agent abort it (exit 134).
        time.sleep(2)
    os._exit(code)


def _run_expecting_failure(f, args, key):
    """Runs f(*args), which must fail; returns what failed, how and how fast. Nothing of the
    failed result stays referenced (finalize() would wait on it: see RELIABILITY.md)."""
    t0 = time.monotonic()
    try:
        jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001
        return {
            f"{key}_type": type(e).__name__,
            f"{key}_seconds": time.monotonic() - t0,
            f"{key}_error": str(e),
        }
    raise AssertionError(f"{key}: the op succeeded although a peer process is dead")


def _run_expecting_nan(f, args, new_kernel=False):
    """GPU: the call returns; its outputs must be NaN, and check_health() must say why. With
    ``new_kernel``, a program never run before is dispatched right behind the stuck call: its
    kernels load while the device waits on the dead peer (CUDA loads a kernel at its first use
    and may wait for the device to drain meanwhile), and it must neither hang the watchdog
    nor compute wrong numbers once the call is released."""
    t0 = time.monotonic()
    out = f(*args)
    if new_kernel:
        probe = np.arange(33 * 77, dtype=np.float32).reshape(33, 77) / 1000
        fresh = jax.jit(lambda p: jnp.tanh(p * 1.7) @ p.T)(probe)
    local = [np.asarray(s.data) for s in out.addressable_shards]
    del out
    seconds = time.monotonic() - t0
    if not all(np.isnan(a).all() for a in local):
        raise AssertionError("the timed-out call returned numbers instead of NaN")
    if new_kernel:
        want = np.tanh(probe * 1.7) @ probe.T
        err = float(np.abs(np.asarray(fresh) - want).max() / np.abs(want).max())
        if not err < 1e-2:
            raise AssertionError(f"the program behind the stuck call is off by {err}")
    try:
        jax_ub.check_health()
    except RuntimeError as e:
        return {"failed_type": "NaN", "failed_seconds": seconds, "failed_error": str(e)}
    raise AssertionError("check_health() found nothing wrong although a peer process is dead")


def killed_peer(new_kernel=False):
    victim = nproc - 1
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    ops = make_ops(mesh)
    for i in range(KILL_AT):
        name, f, args, expected = ops[i % 2]
        check(f(*args), expected)
    if pid == victim:
        print(f"KILLING myself (pid {os.getpid()}) after {KILL_AT} ops", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    result = {}
    # 1. The next op cannot complete: it must fail within the deadline. (In a multi-process
    # CPU run JAX raises the op's error from the call itself, as a ValueError, not as
    # jax.errors.JaxRuntimeError from block_until_ready: catch broadly, record the type.)
    name, f, args, _ = ops[KILL_AT % 2]
    if ON_GPU:
        result.update(failed_op=name, **_run_expecting_nan(f, args, new_kernel))
    else:
        result.update(failed_op=name, **_run_expecting_failure(f, args, "failed"))
    # 2. The communicator is broken: the next op fails at once.
    name, f, args, _ = ops[(KILL_AT + 1) % 2]
    result.update(broken_op=name, **_run_expecting_failure(f, args, "broken"))
    # check_health() says so too, and that the dead process has exited.
    try:
        jax_ub.check_health()
        result.update(health_error="")
    except RuntimeError as e:
        result.update(health_error=str(e))

    # 3. finalize() and start afresh on the surviving processes.
    # The dead process will never say it is done with the communicator; finalize() sees
    # that it has exited (bootstrap.teardown) instead of waiting out the deadline.
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax_ub.finalize()
    result.update(
        finalize_seconds=time.monotonic() - t0,
        finalize_warnings=[str(w.message) for w in caught],
    )
    t0 = time.monotonic()
    survivors = [d for d in jax.devices() if d.process_index != victim]
    sub = Mesh(np.array(survivors), ("tp",))
    errs = []
    for _ in range(2):
        for _name, f, args, expected in make_ops(sub):
            errs.append(check(f(*args), expected))
    result.update(
        rerun_errs=errs,
        rerun_seconds=time.monotonic() - t0,
        comms=[c.group_size for c in jax_ub.live_communicators()],
    )
    jax_ub.finalize()
    print("RESULT " + json.dumps(result), flush=True)
    exit_together(0)


try:
    if scenario == "killed_peer":
        killed_peer()
    elif scenario == "killed_peer_new_kernel":  # GPU only
        killed_peer(new_kernel=True)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
except BaseException as e:  # noqa: BLE001
    print(f"ERROR: {type(e).__name__}: {e}", flush=True)
    os._exit(3)  # skip jax.distributed's shutdown barrier, which would wait for the peers
