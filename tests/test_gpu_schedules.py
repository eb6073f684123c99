"""GPU tier: the schedules a tuning choice forces, blocks of uneven and empty pieces, and
chunks of any byte size, against the XLA reference at tp 2 and every GPU of the process, or
at tp=N in the N-ranks mode (``pytest --ranks N``). Skipped without at least 2 GPUs.

Each test forces the GPU to settle after ``finalize()`` and after XLA's references, so a
device fault surfaces at the phase that caused it (teardown, XLA's collectives, jax_ub's
calls), not at whatever CUDA call comes next.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conftest import gpu_rel_err, use_tuning
from test_gpu import TOL, TPS, _ag, _assert_copies_exact, _data, _mesh, _rs, _rs_gathering

import jax_ub
from jax_ub._src.runtime import extension
from jax_ub._src.runtime.communicator import live_communicators

pytestmark = pytest.mark.gpu


def _settle() -> None:
    """Run one small computation on this process's first GPU to its end: an earlier fault
    (CUDA's errors are sticky) raises here."""
    jnp.zeros((), device=jax.local_devices()[0]).block_until_ready()


def _finalize() -> None:
    jax_ub.finalize()
    _settle()  # a fault of the teardown before, not of what follows


# The schedules a Tuning choice forces (the defaults' other side), and the op each changes.
OPTIONAL_SCHEDULES = {
    "reduce_scatter_ring": ("rs", {"reduce_scatter_ring": True, "reduce_scatter_fold_rows": 0}),
    "reduce_scatter_one_pass": ("rs", {"reduce_scatter_early_sum": False}),
    "reduce_scatter_long_k": ("rs", {}),
    "all_gather_in_turn": ("ag", {"all_gather_in_turn": True}),
    "all_gather_in_turn_wide": ("ag", {"all_gather_in_turn": True}),
    "all_gather_at_once": ("ag", {"all_gather_in_turn": False}),
}


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("rows", [1, 129])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("schedule", sorted(OPTIONAL_SCHEDULES))
def test_optional_schedule(tp, rows, dtype, schedule):
    """The schedules a tuning choice forces: reduce_scatter_ring folds groups above 2 in a ring
    (each block's partial sum passes from rank to rank, each GEMM adding its partial in its
    epilogue; at tp=2 it is the fold); reduce_scatter_early_sum off sums every partial after
    the GEMMs (this test's short k sums the early ones beside them by default from tp=4);
    with a long k (2560 local columns) the reduce-scatter's GEMMs take turns on two lanes;
    all_gather_in_turn pushes to one peer at a time, each copy lane waiting for the one
    before, and multiplies each chunk as it lands (the default for this test's narrow w
    above 2 GPUs), or with a wide w (3584 local columns) runs of chunks a GEMM
    (Schedule::InTurnSpans) on two GEMM lanes; off, every push at once. Blocks of 129 rows
    and 1 row make uneven and empty pieces; three calls reuse the buffer as epochs advance."""
    _finalize()  # communicators take the setting when they are created
    op_kind, settings = OPTIONAL_SCHEDULES[schedule]
    use_tuning(**settings)
    try:
        mesh = _mesh(tp)
        key = jax.random.key(rows + 100 * tp)
        if op_kind == "rs":
            k = tp * (2560 if schedule.endswith("_long_k") else 128)
            op, (a, b) = _rs, _data(key, [(tp * rows, k), (k, 384)], dtype)
        else:
            cols = 3584 if schedule.endswith("_wide") else 128
            op, (a, b) = _ag, _data(key, [(tp * rows, 256), (256, tp * cols)], dtype)
        with jax.default_matmul_precision("highest"):
            ref = jax.block_until_ready(op(mesh, "xla")(a, b))
        for call in range(3):
            assert gpu_rel_err(op(mesh, "ub")(a * (call + 1), b), ref * (call + 1)) < TOL[dtype]
    finally:
        _finalize()


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("rows", [1, 129])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reduce_scatter_pieces_of_uneven_rows(tp, rows, dtype, fold, gather):
    """At tp=2 each block is sent in two row pieces and our own block's product adds the
    peer's partial in its epilogue (Schedule::ReduceScatterFolds, forced here for any
    size), or with the fold off in one piece and a sum pass; blocks of 129 rows and 1 row
    make uneven and empty pieces. On a group of one the GEMM writes the output itself.
    With ``gather`` the call also all-gathers a second input beside it (a backward's x,
    gathered again), whose every copy must match bit for bit."""
    if tp == 1 and not fold:
        pytest.skip("a group of one has nothing to fold")
    _finalize()  # communicators take the setting when they are created
    use_tuning(reduce_scatter_fold_rows=0 if fold else -1)
    try:
        mesh = _mesh(tp)
        h, v = _data(jax.random.key(rows + 10 * tp), [(tp * rows, 256), (256, 384)], dtype)
        with jax.default_matmul_precision("highest"):
            ref = jax.block_until_ready(_rs(mesh, "xla")(h, v))
        if not gather:
            assert gpu_rel_err(_rs(mesh, "ub")(h, v), ref) < TOL[dtype]
            return
        (g,) = _data(jax.random.key(rows + 10 * tp + 1), [(tp * rows, 384)], dtype)
        f = _rs_gathering(mesh, tp)
        for call in range(3):  # the buffer's gathered chunks reused, epochs advancing
            out, gathered = f(h, v, g + call)
            assert gpu_rel_err(out, ref) < TOL[dtype]
            _assert_copies_exact(gathered, g + call, call)
    finally:
        _finalize()


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [1, 3])
def test_odd_sizes(tp, rows, dtype):
    """Shapes whose chunks are not multiples of 16 bytes (n = 10 or 5 columns, k = 6 or 3):
    each rank's chunk and partial then starts mid-word in the userbuffer, where the GEMMs
    and the reduce-scatter's sum must still read and write the right bytes. Both ops and the
    reduce-scatter that gathers beside it, with and without the fold, three calls each."""
    _finalize()  # communicators take the setting when they are created
    try:
        mesh = _mesh(tp)
        for fold_rows in (-1, 0):
            use_tuning(reduce_scatter_fold_rows=fold_rows)
            _finalize()
            key = jax.random.key(rows + 10 * tp)
            x, w = _data(key, [(tp * rows, 6), (6, tp * 5)], dtype)
            h, v, g = _data(key, [(tp * rows, tp * 3), (tp * 3, 10), (tp * rows, 10)], dtype)
            with jax.default_matmul_precision("highest"):
                refs = _ag(mesh, "xla")(x, w), _rs(mesh, "xla")(h, v)
                ag_ref, rs_ref = jax.block_until_ready(refs)
            rs_gather = _rs_gathering(mesh, tp)
            for call in range(3):
                c = call + 1
                assert gpu_rel_err(_ag(mesh, "ub")(x * c, w), ag_ref * c) < TOL[dtype], call
                assert gpu_rel_err(_rs(mesh, "ub")(h * c, v), rs_ref * c) < TOL[dtype], call
                out, gathered = rs_gather(h * c, v, g + call)
                assert gpu_rel_err(out, rs_ref * c) < TOL[dtype], call
                _assert_copies_exact(gathered, g + call, call)
    finally:
        _finalize()


def _flag_gemm_calls(signals: bool = False) -> int:
    """FlagGemm (with `signals`: SignalGemm) kernels launched by this process's live CUDA
    communicators."""
    module = extension.module_for("cuda")
    count = module.signal_gemm_calls if signals else module.flag_gemm_calls
    return sum(n for c in live_communicators() if c.platform == "cuda" for _, n in count(c.id))


def _skip_where_the_kernel_cannot_run(what: str, tp: int) -> None:
    """The flag and signal GEMMs' kernels run from 3 ranks, on Hopper, in builds with them."""
    if tp < 3:
        pytest.skip(f"the {what} runs from 3 ranks")
    if not extension.module_for("cuda").flag_gemm_built():
        pytest.skip(f"this build has no {what} (CUTLASS's headers were not found)")
    if jax.local_devices()[0].compute_capability != "9.0":
        pytest.skip(f"the {what}'s kernel is Hopper's (compute capability 9.0)")


@pytest.mark.parametrize("tp", TPS)
def test_flag_gemm_kernel(tp):
    """The all-gather in turn's flag GEMM in its kernel (FlagGemm: bf16, x's local rows a
    multiple of 256, a Hopper GPU): the forward's (w as [k, n]) and, in matmul_reduce_scatter's
    gradient, the backward's all-gather of dy (w read transposed), against XLA's, over calls
    with new data; each call must have launched the kernel (its count rises)."""
    _skip_where_the_kernel_cannot_run("flag GEMM", tp)
    _finalize()  # communicators take the setting when they are created
    use_tuning(all_gather_in_turn=True, all_gather_flag_gemm=True)
    try:
        mesh = _mesh(tp)
        key = jax.random.key(7 + tp)
        x, w, h, v, g = _data(
            key,
            [
                (tp * 256, 512),
                (512, tp * 384),
                (tp * 256, tp * 256),
                (tp * 256, 384),
                (tp * 256, 384),
            ],
            jnp.bfloat16,
        )

        def rs_grad(impl):
            loss = lambda h, v: jnp.sum(_rs(mesh, impl)(h, v).astype(jnp.float32) * g)  # noqa: E731
            return jax.jit(jax.grad(loss))

        ag_ref = jax.block_until_ready(_ag(mesh, "xla")(x, w))
        dh_ref = jax.block_until_ready(rs_grad("xla")(h, v))
        for call in range(3):
            before = _flag_gemm_calls()
            assert gpu_rel_err(_ag(mesh, "ub")(x * (call + 1), w), ag_ref * (call + 1)) < 2e-2
            assert _flag_gemm_calls() > before, call
            before = _flag_gemm_calls()
            assert gpu_rel_err(rs_grad("ub")(h * (call + 1), v), dh_ref) < 2e-2
            assert _flag_gemm_calls() > before, call
    finally:
        _finalize()


@pytest.mark.parametrize("tp", TPS)
def test_signal_gemm_kernel(tp):
    """The reduce-scatter's signal GEMM in its kernel (SignalGemm: bf16, a rank's output rows a
    multiple of 256, a Hopper GPU), the fold off: the forward's (w as [k, n]), and in
    all_gather_matmul's gradient the backward's reduce-scatter of dy (w read transposed), against
    XLA's, over calls with new data (the blocks' tile counters start each call at 0); each call
    must have launched the kernel (its count rises)."""
    _skip_where_the_kernel_cannot_run("signal GEMM", tp)
    _finalize()  # communicators take the setting when they are created
    use_tuning(reduce_scatter_signal_gemm=True, reduce_scatter_fold_rows=-1)
    try:
        mesh = _mesh(tp)
        key = jax.random.key(11 + tp)
        h, v, x, w, g = _data(
            key,
            [
                (tp * 256, tp * 256),
                (tp * 256, 384),
                (tp * 256, 512),
                (512, tp * 384),
                (tp * 256, tp * 384),
            ],
            jnp.bfloat16,
        )

        def ag_grad(impl):  # dx = dy @ w.T: new data each call through dy
            loss = lambda x, w, dy: jnp.sum(_ag(mesh, impl)(x, w).astype(jnp.float32) * dy)  # noqa: E731
            return jax.jit(jax.grad(loss))

        rs_ref = jax.block_until_ready(_rs(mesh, "xla")(h, v))
        dx_ref = jax.block_until_ready(ag_grad("xla")(x, w, g))
        for call in range(3):
            before = _flag_gemm_calls(signals=True)
            assert gpu_rel_err(_rs(mesh, "ub")(h * (call + 1), v), rs_ref * (call + 1)) < 2e-2
            assert _flag_gemm_calls(signals=True) > before, call
            before = _flag_gemm_calls(signals=True)
            dx = ag_grad("ub")(x, w, g * (call + 1))
            assert gpu_rel_err(dx, dx_ref * (call + 1)) < 2e-2
            assert _flag_gemm_calls(signals=True) > before, call
    finally:
        _finalize()
