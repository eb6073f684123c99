"""Communicator lifecycle: initialize() and finalize() around ops and gradients, several
communicators in one program, buffer sizes and growth, settings reaching new communicators.
Teardown with work in flight, after faults, and leaks are in test_teardown.py."""

import re
import subprocess
import sys
import textwrap

import jax
import pytest
from conftest import rel_err, smap, to_f32
from jax.sharding import PartitionSpec as P

import jax_ub
from jax_ub._src import _host
from jax_ub._src.runtime import communicator
from jax_ub._src.settings import options

AG = jax_ub.all_gather_matmul
RS = jax_ub.matmul_reduce_scatter


def _ag(mesh, axis="tp"):
    return smap(
        lambda x, w: AG(x, w, axis, impl="ub"),
        mesh,
        in_specs=(P(axis), P(None, axis)),
        out_specs=P(None, axis),
    )


pytestmark = pytest.mark.usefixtures("fresh_communicators")


def _ag_run_once(mesh1d, rand):
    """``(f, x, w, f(x, w), its communicator)``: a 2-rank all_gather_matmul run once, the
    one live communicator it created."""
    f = _ag(mesh1d(2))
    x, w = rand(2 * 4, 8), rand(8, 2 * 4)
    out = jax.block_until_ready(f(x, w))
    (communicator,) = jax_ub.live_communicators()
    return f, x, w, out, communicator


def test_op_after_finalize_creates_communicator(mesh1d, rand):
    f, x, w, first, c1 = _ag_run_once(mesh1d, rand)
    jax_ub.finalize()
    jax_ub.finalize()  # idempotent
    second = f(x, w)  # traced again, no initialize() needed
    (c2,) = jax_ub.live_communicators()
    assert c2.id != c1.id
    assert rel_err(first, to_f32(x) @ to_f32(w)) < 1e-5
    assert rel_err(second, first) == 0.0


def test_grad_after_finalize(mesh1d, rand):
    mesh = mesh1d(4)

    def loss(x, w):
        out = smap(
            lambda x, w: RS(x, w, "tp", impl="ub"),
            mesh,
            (P(None, "tp"), P("tp")),
            P("tp"),
            jit=False,
        )(x, w)
        return (out**2).sum()

    g = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x, w = rand(4 * 4, 4 * 8), rand(4 * 8, 8)
    dx1, dw1 = jax.block_until_ready(g(x, w))  # finalize() with work in flight: see below
    jax_ub.finalize()
    dx2, dw2 = g(x, w)
    # d/dx sum((x @ w)^2) = 2 (x @ w) w.T ;  d/dw = 2 x.T (x @ w)
    y = to_f32(x) @ to_f32(w)
    assert rel_err(dx1, 2 * y @ to_f32(w).T) < 1e-5
    assert rel_err(dw1, 2 * to_f32(x).T @ y) < 1e-5
    assert rel_err(dx2, dx1) == 0.0 and rel_err(dw2, dw1) == 0.0


def test_initialize_returns_the_live_communicator(mesh1d, mesh2d):
    mesh = mesh1d(4)
    c1 = jax_ub.initialize(mesh, "tp")
    c2 = jax_ub.initialize(mesh, "tp")
    assert c1 is c2
    assert (c1.platform, c1.axis_name, c1.group_size, c1.num_groups) == ("cpu", "tp", 4, 1)
    c3 = jax_ub.initialize(mesh2d(2, 4), "dp")
    assert (c3.axis_name, c3.group_size, c3.num_groups) == ("dp", 2, 4)
    assert c3.id != c1.id
    assert _host.num_communicators() == 2


def test_initialize_buffer_bytes_is_honoured(mesh1d):
    """initialize(buffer_bytes=N) allocates N bytes per device, as documented.

    (A floor meant for lazily sized buffers must not override an explicit size: on CUDA
    that floor is 256 MiB, so asking for 64 MiB would silently take 256 MiB per GPU.)
    """
    comm = jax_ub.initialize(mesh1d(2), "tp", buffer_bytes=64 << 10)
    assert comm.capacity_bytes == 64 << 10


@pytest.mark.parametrize("allow_grow", [False, True])
def test_buffer_bytes_is_the_buffer_not_a_floor(mesh1d, rand, allow_grow):
    """configure(buffer_bytes=N): the first op that needs more than N bytes raises, naming
    both sizes, unless allow_grow, which then sizes the buffer to what the op needs."""
    jax_ub.configure(buffer_bytes=1024, allow_grow=allow_grow)
    x, w = rand(2 * 64, 16), rand(16, 2 * 8)  # 64 x 16 f32 chunks: 2 x 4096 bytes needed
    f = _ag(mesh1d(2))
    if not allow_grow:
        with pytest.raises(ValueError, match=r"needs 8192 bytes per device, buffer_bytes is 1024"):
            f(x, w)
        return
    assert rel_err(f(x, w), x @ w) < 1e-5
    (comm,) = jax_ub.live_communicators()
    assert comm.capacity_bytes == 8192


def test_configured_settings_reach_the_communicator(mesh1d):
    jax_ub.configure(buffer_bytes=3 << 20, timeout_s=7.5)
    comm = jax_ub.initialize(mesh1d(2), "tp")
    assert comm.capacity_bytes == 3 << 20
    assert comm.timeout_s == 7.5


def _comm_id_in(f, *args) -> int:
    """The communicator id that f's lowered program passes to jax_ub's custom call."""
    (found,) = set(re.findall(r"comm_id = (\d+)", f.lower(*args).as_text()))
    return int(found)


def test_configure_after_first_use_applies_to_new_traces(mesh1d, rand):
    """A setting a communicator is created with, changed after the first op, reaches the
    programs traced afterwards through a new communicator; the program compiled before keeps
    its own and still computes right; going back to the old values finds the old one."""
    mesh = mesh1d(2)
    x, w = rand(8, 6), rand(6, 10)
    ref = x @ w
    first = _ag(mesh)
    assert rel_err(first(x, w), ref) < 1e-5
    old = jax_ub.initialize(mesh, "tp")
    assert _comm_id_in(first, x, w) == old.id

    jax_ub.configure(timeout_s=old.timeout_s + 1.5)
    new = jax_ub.initialize(mesh, "tp")
    assert new.id != old.id and new.timeout_s == old.timeout_s + 1.5
    assert _host.num_communicators() == 2
    second = _ag(mesh)  # traced now: the new communicator
    assert _comm_id_in(second, x, w) == new.id
    assert rel_err(second(x, w), ref) < 1e-5
    assert rel_err(first(x, w), ref) < 1e-5  # compiled before: still the old one

    # Tuning choices are part of what a communicator is created with, too.
    fold = options.tuning().reduce_scatter_fold_rows
    with options.experimental_tuning(reduce_scatter_fold_rows=fold + 1):
        tuned = jax_ub.initialize(mesh, "tp")
        assert tuned.id not in (old.id, new.id)
    assert _host.num_communicators() == 3

    jax_ub.configure(timeout_s=old.timeout_s)
    assert jax_ub.initialize(mesh, "tp").id == old.id
    assert _host.num_communicators() == 3


def test_two_communicators_in_one_program(mesh2d, rand):
    """Ops over "dp" and over "tp" of one 2-D mesh, interleaved in a single program."""
    mesh = mesh2d(2, 4)
    both = ("dp", "tp")

    def body(impl):
        def f(x, w_tp, w_dp, h):
            a = AG(x, w_tp, "tp", impl=impl)  # [4m, n] per (dp, tp)
            b = AG(x, w_dp, "dp", impl=impl)  # [2m, n]
            c = RS(h, w_tp.T, "tp", impl=impl)  # [M/4, k]
            d = RS(h, w_tp.T, "dp", impl=impl)  # [M/2, k]
            return a, b, c, d

        return f

    def run(impl):
        return smap(
            body(impl),
            mesh,
            in_specs=(P(both), P(), P(), P(both)),
            # every device's output, stacked: a and b are replicated in value over the
            # gathered axis, and each copy is checked.
            out_specs=(P(both),) * 4,
        )(x, w_tp, w_dp, h)

    x = rand(8 * 4, 16)
    w_tp, w_dp = rand(16, 8), rand(16, 8)
    h = rand(8 * 8, 8)
    for _ in range(3):  # the two communicators' epochs advance independently
        out, ref = run("ub"), run("xla")
        for i, (o, r) in enumerate(zip(out, ref)):
            assert rel_err(o, r) < 1e-5, f"output {i}"
        x = rand(8 * 4, 16)
        h = rand(8 * 8, 8)
    comms = {c.axis_name: c for c in jax_ub.live_communicators()}
    assert sorted(comms) == ["dp", "tp"]
    assert (comms["dp"].group_size, comms["dp"].num_groups) == (2, 4)
    assert (comms["tp"].group_size, comms["tp"].num_groups) == (4, 2)


def test_growth(mesh1d, rand):
    """A bigger op grows the buffer; programs compiled against the old one keep working."""
    mesh = mesh1d(4)
    jax_ub.configure(buffer_bytes=4096, allow_grow=True)
    f_small, f_big = _ag(mesh), _ag(mesh)
    w = rand(16, 4 * 8)
    x_small = rand(4 * 4, 16)  # 4 ranks x 4 x 16 x 4 bytes = 1 KiB
    x_big = rand(4 * 64, 16)  # 4 ranks x 64 x 16 x 4 bytes = 16 KiB

    assert rel_err(f_small(x_small, w), to_f32(x_small) @ to_f32(w)) < 1e-5
    (small,) = jax_ub.live_communicators()
    assert small.capacity_bytes == 4096

    assert rel_err(f_big(x_big, w), to_f32(x_big) @ to_f32(w)) < 1e-5
    (big,) = jax_ub.live_communicators()
    assert big.id != small.id
    assert big.capacity_bytes >= 16 << 10
    assert _host.num_communicators() == 2  # the old one stays for f_small's executable
    # Both hold memory: listed by all_communicators (the model benchmark's userbuffer
    # bytes), with or without the options they were made with, and by no other options.
    made_with = options.current_options()
    for listed in (communicator.all_communicators(), communicator.all_communicators(made_with)):
        assert sorted(c.id for c in listed) == sorted((small.id, big.id))
    with options.experimental_tuning(reduce_scatter_fold_rows=0):
        assert communicator.all_communicators(options.current_options()) == []

    # Interleave the two executables (old and new buffer) with fresh data.
    for i in range(5):
        xs, xb = rand(4 * 4, 16), rand(4 * 64, 16)
        out_s, out_b = f_small(xs, w), f_big(xb, w)
        assert rel_err(out_s, to_f32(xs) @ to_f32(w)) < 1e-5, f"round {i}"
        assert rel_err(out_b, to_f32(xb) @ to_f32(w)) < 1e-5, f"round {i}"
    jax_ub.finalize()
    assert _host.num_communicators() == 0


def test_growth_within_one_program(mesh1d, rand):
    """The second op of a program outgrows the buffer the first one was lowered with."""
    mesh = mesh1d(4)
    jax_ub.configure(buffer_bytes=4096, allow_grow=True)

    def body(x_small, x_big, w):
        return AG(x_small, w, "tp", impl="ub"), AG(x_big, w, "tp", impl="ub")

    f = smap(body, mesh, (P("tp"), P("tp"), P(None, "tp")), (P(None, "tp"), P(None, "tp")))
    w = rand(16, 4 * 8)
    for i in range(3):
        xs, xb = rand(4 * 4, 16), rand(4 * 64, 16)
        out_s, out_b = f(xs, xb, w)
        assert rel_err(out_s, to_f32(xs) @ to_f32(w)) < 1e-5, f"round {i}"
        assert rel_err(out_b, to_f32(xb) @ to_f32(w)) < 1e-5, f"round {i}"
    (comm,) = jax_ub.live_communicators()
    assert comm.capacity_bytes >= 16 << 10


def test_user_clear_caches_reuses_communicator(mesh1d, rand):
    """jax.clear_caches() alone re-traces but keeps (and reuses) the live communicator."""
    f, x, w, a, c1 = _ag_run_once(mesh1d, rand)
    jax.clear_caches()
    b = f(x, w)
    assert jax_ub.live_communicators() == [c1]
    assert rel_err(b, a) == 0.0


_EXIT_WHILE_RUNNING = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import jax_ub
mesh = jax.sharding.Mesh(jax.devices()[:2], ("tp",))
def body(x, w):
    def step(x, _):
        return jnp.tanh(jax_ub.all_gather_matmul(x, w, "tp", impl="ub"))[: x.shape[0]], None
    return jax.lax.scan(step, x, None, length=300)[0]
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp")))
y = f(jnp.ones((64, 32)), jnp.ones((32, 32)) * 0.01)
del y  # dropped unread: the program still runs when the interpreter exits
print("dispatched", flush=True)
"""


def test_exit_while_a_program_runs():
    """The interpreter exits (finalize at exit) while a program's calls still run, its
    outputs dropped unread: the communicator goes, the calls after it fail, nothing hangs.
    (Destroying it under the registry's lock deadlocked with the next call's lookup.)"""
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXIT_WHILE_RUNNING)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "dispatched" in run.stdout, run.stderr[-2000:]
