"""Teardown: finalize() with work in flight, at interpreter exit, after a timeout and after
an error whose result is still referenced; nothing leaks over 100 initialize/finalize
rounds or 100 shared-memory communicators; stale shared-memory names are removed."""

import os
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import bits, open_fds, place, shm_names
from conftest import ag_fn, comm_options, make_mesh, rel_err, smap, to_f32
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter


pytestmark = pytest.mark.usefixtures("fresh_communicators")


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _mappings() -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for _ in fh)


# --------------------------------------------------------------------------- leaks


def test_hundred_initialize_finalize_rounds_leak_nothing(mesh1d):
    """100 rounds of initialize / one op that fills the whole buffer / finalize, always
    through the same jitted function.

    finalize() destroys the communicator the compiled program points at and clears JAX's
    caches, so each round traces and compiles again (about 0.1 s here); a stale executable
    would fail with "finalized". Every round: a new communicator, the only one alive and the
    one used (not replaced), none left after finalize(), the right product. 20 inputs take
    turns, so consecutive rounds see different data, and each gives the same bits in every
    round it runs. They are placed with their final sharding once, so no resharding program
    is compiled with each round. After 10 warm-up rounds: host communicators, open file
    descriptors, memory mappings and resident memory. Each round's buffers are 4 x 512 KiB,
    every byte written by the op, so a leaked round would add 2 MiB of RSS: 90 leaked rounds
    are 180 MiB, against a tolerance of 24 MiB.
    """
    tp, buffer_bytes = 4, 512 << 10
    mesh = mesh1d(tp)
    k = 256
    m = buffer_bytes // tp // (k * 4)  # one chunk per rank: the op needs the whole buffer
    rng = np.random.default_rng(3)
    xs_host = [rng.standard_normal((tp * m, k), np.float32) for _ in range(20)]
    w_host = rng.standard_normal((k, tp * 8), np.float32)
    xs = [place(mesh, P("tp"), x) for x in xs_host]
    w = place(mesh, P(None, "tp"), w_host)
    f = ag_fn(mesh)
    first, seen, samples = {}, set(), {}
    for i in range(100):
        j = i % len(xs)
        comm = jax_ub.initialize(mesh, "tp", buffer_bytes=buffer_bytes)
        assert comm.id not in seen
        seen.add(comm.id)
        assert comm.capacity_bytes == buffer_bytes
        assert jax_ub.live_communicators() == [comm]
        assert _host.num_communicators() == 1
        out = bits(f(xs[j], w))
        assert rel_err(out.view(np.float32), xs_host[j] @ w_host) < 1e-5, f"round {i}"
        np.testing.assert_array_equal(out, first.setdefault(j, out), err_msg=f"round {i}")
        assert [c.id for c in jax_ub.live_communicators()] == [comm.id]  # used, not replaced
        jax_ub.finalize()
        assert jax_ub.live_communicators() == []
        assert _host.num_communicators() == 0
        if i in (9, 54, 99):
            samples[i] = (open_fds(), _mappings(), _rss_mib())
    (fd0, maps0, rss0), (fd1, maps1, rss1), (fd2, maps2, rss2) = samples.values()
    assert fd2 - fd0 <= 2, f"open file descriptors grew {fd0} -> {fd1} -> {fd2}"
    assert maps2 - maps0 <= 8, f"memory mappings grew {maps0} -> {maps1} -> {maps2}"
    assert rss2 - rss0 < 24, f"RSS grew {rss0:.0f} -> {rss1:.0f} -> {rss2:.0f} MiB"


def test_shared_memory_communicators_leak_nothing():
    """100 shared-memory host communicators (what a multi-process run creates), created,
    connected, unlinked (even rounds) or not (odd rounds: destroy must unlink), destroyed:
    no name left in /dev/shm, no mapping and no file descriptor left open."""
    prefix = f"/jax_ub_reltest_{os.getpid()}"
    before = (open_fds(), _mappings(), shm_names(prefix[1:]))
    for i in range(100):
        cid = _host.create_communicator(
            2, [0, 1], 256 << 10, comm_options(timeout_s=1.0), shm_prefix=f"{prefix}_{i}"
        )
        names = list(_host.region_names(cid))
        assert names == [f"{prefix}_{i}_0", f"{prefix}_{i}_1"]
        assert shm_names(f"jax_ub_reltest_{os.getpid()}_{i}_") == [n[1:] for n in names]
        _host.connect(cid, names)
        if i % 2 == 0:
            _host.unlink(cid)
            assert shm_names(f"jax_ub_reltest_{os.getpid()}_{i}_") == []
        assert _host.destroy_communicator(cid)
    after = (open_fds(), _mappings(), shm_names(prefix[1:]))
    assert after == before, f"(fds, mappings, /dev/shm names) {before} -> {after}"


def test_stale_shared_memory_names_are_removed(tmp_path, monkeypatch):
    """Names a crashed bootstrap left in /dev/shm go once older than any bootstrap runs;
    fresh names (a bootstrap in progress) and other files stay."""
    from jax_ub._src.runtime import bootstrap

    monkeypatch.setattr(bootstrap, "_SHM_DIR", str(tmp_path))
    now = time.time()
    stale, fresh, other = (tmp_path / n for n in ("jax_ub_4242_3_0", "jax_ub_4242_3_1", "x_1_2"))
    for p in (stale, fresh, other):
        p.write_bytes(b"\0" * 64)
    os.utime(stale, (now - 3600, now - 3600))
    os.utime(other, (now - 3600, now - 3600))
    os.utime(fresh, (now - 60, now - 60))
    assert bootstrap.remove_stale_regions(timeout_s=30.0, now=now) == ["jax_ub_4242_3_0"]
    assert not stale.exists() and fresh.exists() and other.exists()
    # A long timeout stretches the limit: 4 timeouts of 1000 s outlast an hour.
    os.utime(fresh, (now - 3600, now - 3600))
    assert bootstrap.remove_stale_regions(timeout_s=1000.0, now=now) == []
    assert fresh.exists()


def test_a_dead_process_s_shared_memory_names_are_removed_at_once(tmp_path, monkeypatch):
    """A fresh name (jax_ub_<pid>_<seq>_n<PID namespace>_<slot>) goes at once where its process
    is of this PID namespace and has exited; a live process's stays, and so does a name
    of another namespace, whose pid says nothing here (until it is old: the test above)."""
    from jax_ub._src.runtime import bootstrap, process_identity

    namespace = process_identity.pid_namespace_id()
    if not namespace:
        pytest.skip("no /proc/self/ns/pid here")
    monkeypatch.setattr(bootstrap, "_SHM_DIR", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    dead, live = child.pid, os.getpid()
    names = {
        "dead": f"jax_ub_{dead}_0_n{namespace}_1",
        "live": bootstrap.shm_prefix(7)[1:] + "_0",
        "elsewhere": f"jax_ub_{dead}_0_n{int(namespace) + 1}_1",
    }
    assert names["live"] == f"jax_ub_{live}_7_n{namespace}_0"
    for n in names.values():
        (tmp_path / n).write_bytes(b"\0" * 64)
    assert bootstrap.remove_stale_regions(timeout_s=30.0) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["elsewhere"]])
    # Names this process is about to make (communicator number 7's): an exited process with
    # this pid left them (pids are reused); its other names stay.
    mine = bootstrap.shm_prefix(8)[1:] + "_0"
    (tmp_path / mine).write_bytes(b"\0" * 64)
    assert bootstrap.remove_stale_regions(timeout_s=30.0, sequence=7) == [names["live"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, names["elsewhere"]])


# --------------------------------------------------------------------------- work in flight


def _loop_program(mesh):
    """30 AG + RS rounds in one program: long enough to still run when dispatch returns."""

    def body(x, w):
        def step(i, x):
            y = AG(x, w, "tp", impl="ub")  # [4m, 4m]
            return jnp.tanh(RS(y, w.T, "tp", impl="ub") * 0.1 + x)

        return lax.fori_loop(0, 30, step, x)

    return smap(body, mesh, (P("tp"), P()), P("tp"))


def test_finalize_with_work_in_flight(mesh1d, rand):
    """finalize() right after dispatch (no block_until_ready) must not break that work.

    Dispatch is asynchronous: when finalize() is called, the program may not have reached
    the custom call on every device yet. Ranks that start after the communicator is gone
    must not fail while their peers wait for them until timeout_s.
    """
    mesh = mesh1d(4)
    jax_ub.configure(timeout_s=1.0)  # bound the hang when this fails
    f = _loop_program(mesh)
    w, x = rand(16, 16, scale=0.3), rand(4 * 4, 16)
    expected = np.asarray(f(x, w))  # compiles; the answer
    assert np.isfinite(expected).all()
    out = f(x, w)  # cached executable: dispatch returns at once, work still in flight
    jax_ub.finalize()
    try:
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-6)
    finally:
        # Wait out every shard so that no device thread is still blocked in a wait when
        # the next test runs.
        for shard in out.addressable_shards:
            try:
                shard.data.block_until_ready()
            except jax.errors.JaxRuntimeError:
                pass


def test_finalize_with_discarded_work_in_flight(mesh1d, rand):
    """The same with the in-flight result already dropped (fire and forget, then finalize).

    Nothing references that result any more, but its program still runs. Here rank 3 is
    busy before the op, so ranks 0-2 are inside it, waiting for rank 3, when finalize()
    runs. If finalize() destroys the communicator under them, rank 3 then fails at once
    ("finalized") while ranks 0-2 wait for it until timeout_s: the error goes nowhere,
    and the next program on those devices sits behind them for the whole timeout_s.
    """
    mesh = mesh1d(4)
    # Long, so that stuck ranks (a whole timeout_s) and a slow machine (a re-trace and a run
    # took 3.9 s on 2 busy cores) stay far apart; a passing run does not wait for it.
    timeout_s = 20.0
    jax_ub.configure(timeout_s=timeout_s)

    def body(x, w, m):
        def busy(x, m):
            y = lax.fori_loop(0, 20000, lambda i, y: jnp.tanh(y @ m), m)  # ~0.2 s
            return x + 0.0 * y[0, 0]

        x = lax.cond(lax.axis_index("tp") == 3, busy, lambda x, m: x, x, m)
        return AG(x, w, "tp", impl="ub")

    f = smap(body, mesh, (P("tp"), P(None, "tp"), P()), P(None, "tp"))
    x, w, m = rand(4 * 4, 16), rand(16, 4 * 8), rand(64, 64, scale=0.1)
    expected = np.asarray(f(x, w, m))
    assert np.isfinite(expected).all()
    f(x, w, m)  # result discarded at once; the work is still in flight
    time.sleep(0.02)  # ranks 0-2 enter the op; rank 3 is still busy
    jax_ub.finalize()
    start = time.monotonic()
    out = np.asarray(f(x, w, m))  # traced again, on a new communicator
    elapsed = time.monotonic() - start
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    # A re-trace and a run take about a second here; stuck ranks cost timeout_s.
    assert elapsed < timeout_s / 2, f"next call took {elapsed:.1f} s (timeout_s={timeout_s})"


def test_finalize_at_interpreter_exit_with_work_in_flight():
    """A program that exits with a live communicator and an op still running exits cleanly:
    the atexit hook finalizes (no warning, no traceback, exit status 0)."""
    script = textwrap.dedent(
        """
        import numpy as np, jax, jax_ub
        from jax.sharding import Mesh, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
        f = jax.jit(jax.shard_map(
            lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl="ub"), mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp")))
        x, w = np.ones((4 * 64, 64), np.float32), np.ones((64, 4 * 64), np.float32)
        print(float(f(x, w)[0, 0]), flush=True)
        f(x, w)  # dispatched, not waited for
        print("exiting", len(jax_ub.live_communicators()), flush=True)
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["64.0", "exiting", "1"], res.stdout
    assert "Traceback" not in res.stderr and "finalize at exit failed" not in res.stderr, (
        res.stderr[-3000:]
    )


# --------------------------------------------------------------------------- after a fault


def _rank0_only(x, w):
    """Rank 0 runs all_gather_matmul; rank 1 never does (its peer times out)."""
    return lax.cond(
        lax.axis_index("tp") == 0,
        lambda: AG(x, w, "tp", impl="ub"),
        lambda: jnp.zeros((2 * 4, w.shape[1]), x.dtype) + 0 * x[0, 0] + 0 * w[0, 0],
    )


def test_finalize_after_a_timeout_is_prompt_and_quiet(mesh1d, rand):
    """finalize() after a timeout neither waits for the rank that never called (its call
    count will never catch up) nor warns about calls in flight: a broken communicator makes
    no more progress. (It spent timeout_s and warned before commit 826e05a.)"""
    timeout_s = 1.0
    jax_ub.configure(timeout_s=timeout_s)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 4)
    f = smap(_rank0_only, mesh, (P("tp"), P()), P("tp"))
    try:
        jax.block_until_ready(f(x, w))
    except jax.errors.JaxRuntimeError as e:
        assert "timed out" in str(e), str(e)
    else:
        pytest.fail("the call was expected to time out but returned a result")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        jax_ub.finalize()
        seconds = time.monotonic() - t0
    assert _host.num_communicators() == 0
    assert seconds < timeout_s / 4, f"finalize() took {seconds:.2f} s after a timeout"
    assert not caught, [str(c.message) for c in caught]


def test_groups_that_make_different_numbers_of_calls_are_idle(rand):
    """dp groups whose tp ranks branch alike but unlike each other (a cond on the dp index):
    values right, and check_health() and finalize() return at once, without a warning. They
    waited timeout_s and finalize() warned of calls in flight, comparing call counts across
    groups, which such a program never evens out."""
    timeout_s = 3.0
    jax_ub.configure(timeout_s=timeout_s)
    mesh = make_mesh((2, "dp"), (2, "tp"))
    x, w = rand(2 * 2 * 4, 8), rand(8, 2 * 6)

    def body(x, w):
        extra = lax.cond(
            lax.axis_index("dp") == 0,
            lambda: AG(jnp.cos(x), w, "tp", impl="ub"),
            lambda: jnp.zeros((2 * x.shape[0], w.shape[1]), x.dtype),
        )
        return AG(x, w, "tp", impl="ub") + extra

    f = smap(body, mesh, (P(("dp", "tp")), P(None, "tp")), P("dp", "tp"), check_vma=False)
    got = np.asarray(f(x, w))
    halves = np.split(np.asarray(x), 2)  # dp 0's rows, dp 1's
    want = np.concatenate([halves[0] @ w + np.cos(halves[0]) @ w, halves[1] @ w])
    assert rel_err(got, want) < 1e-5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        jax_ub.check_health()
        jax_ub.finalize()
        seconds = time.monotonic() - t0
    assert seconds < timeout_s / 4, f"check_health() and finalize() took {seconds:.2f} s"
    assert not caught, [str(c.message) for c in caught]


def test_finalize_after_error_while_failed_result_is_referenced(mesh1d, rand):
    """Re-initialize after an error, when the program still holds the failed result (as a
    training loop holds its last loss): finalize() must not raise, must free the broken
    communicator, and the next call must run on a fresh one."""
    jax_ub.configure(timeout_s=0.5)
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 2 * 4)
    good = ag_fn(mesh)
    assert rel_err(good(x, w), to_f32(x) @ to_f32(w)) < 1e-5  # compiled on the communicator

    (comm,) = jax_ub.live_communicators()
    failed = smap(_rank0_only, mesh, (P("tp"), P(None, "tp")), P(None, "tp"))(x, w)
    with pytest.raises(jax.errors.JaxRuntimeError, match="timed out"):
        failed.block_until_ready()
    try:
        jax_ub.finalize()
        finalize_error = None
    except jax.errors.JaxRuntimeError as e:
        finalize_error = str(e)
    leaked = comm.id if _host.destroy_communicator(comm.id) else None  # clean up either way
    if finalize_error is not None:
        try:
            out, rerun_error = np.asarray(good(x, w)), None
        except jax.errors.JaxRuntimeError as e:
            out, rerun_error = None, str(e)
        del failed
        jax.clear_caches()
    else:
        del failed
        out, rerun_error = np.asarray(good(x, w)), None
    assert finalize_error is None, f"finalize() raised: {finalize_error}"
    assert leaked is None, f"communicator {leaked} was left alive by finalize()"
    assert rerun_error is None, rerun_error
    assert rel_err(out, to_f32(x) @ to_f32(w)) < 1e-5
