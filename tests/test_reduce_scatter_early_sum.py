"""matmul_reduce_scatter's sum in two (Tuning.reduce_scatter_early_sum; by default where x's
local columns k < 2560): from four ranks, a reduce-scatter that sums its partials in a pass of
its own sums those that land before the last peer's on its own copy lane, beside its GEMMs,
and after them adds only its own partial and the last peer's. The step lists themselves
(every rank's, read from the host extension), with the last sender derived from all ranks'
pushes; then the op's values and gradients on CPU devices, where the host runs those very
lists."""

import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import op_fn
from conftest import comm_options, rel_err, to_f32, tol, use_tuning
from test_gelu_mlp import assert_grads_match_xla, operands

import jax_ub
from jax_ub._src.runtime import communicator, extension
from jax_ub._src.settings import options

SIZES = [2, 3, 4, 5, 8]
M, K, N = 2, 3, 5  # a rank's output rows, x's local columns, w's columns: float32 partials
PARTIAL = M * N * 4


def steps(rank: int, size: int, early: bool | None, gathered: bool = False, k: int = K) -> list:
    options = comm_options(reduce_scatter_early_sum=early, reduce_scatter_fold_rows=-1)
    return extension._host.call_steps(
        "matmul_reduce_scatter", rank, size, M, k, N, gathered, options
    )


def sum_lanes(step_list: list) -> list[int]:
    return [lane for kind, lane, *_ in step_list if kind == "Sum"]


def test_by_shape_early_below_k_2560():
    """By default (None) the sum goes in two where k < 2560 and the group has 4 ranks or
    more; True forces it at any k, False never."""
    for size in (3, 4, 8):
        for k, early in [(3, None), (2559, None), (2560, None), (2560, True), (3, False)]:
            two = size >= 4 and (early is True or (early is None and k < 2560))
            got = sum_lanes(steps(size - 1, size, early, k=k))
            assert got == ([size - 1, -1] if two else [-1]), (size, k, early)


def push_order(step_list: list, rank: int) -> list[int]:
    """The peers `rank` sends a partial to, in list order (a partial's copy runs on the
    receiver's lane, from our staging area in the buffer)."""
    return [
        lane
        for kind, lane, _, _, _, region, *_ in step_list
        if kind == "Copy" and lane not in (-1, rank) and region == "Buffer"
    ]


def last_sender(size: int, rank: int) -> int:
    """Whose partial reaches `rank` last: the sender that pushes to it at the latest step of
    its own order, from every rank's list (each sends one partial per GEMM step)."""
    step_of = {j: push_order(steps(j, size, True), j).index(rank) for j in range(size) if j != rank}
    latest = max(step_of.values())
    (sender,) = [j for j, s in step_of.items() if s == latest]
    return sender


def bits(mask: int) -> list[int]:
    return [j for j in range(64) if mask >> j & 1]


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("size", SIZES)
def test_sums_in_the_list(size, gathered):
    """From 4 ranks: a first sum on our own lane over every partial but ours and the last
    sender's, after waits there for exactly those peers; the compute lane joins that lane,
    waits for the last sender alone and adds ours and its to the output. Together the sums
    take each rank's partial once. Below 4 ranks, or with the choice off: one sum of all on
    the compute lane after waits for every peer."""
    for rank in range(size):
        for early in (True, False, None):
            got = steps(rank, size, early, gathered)
            sums = [s for s in got if s[0] == "Sum"]
            everyone = list(range(size))
            if early is False or size < 4:
                ((_, lane, _, _, _, _, _, parts, addend, *_),) = sums
                assert (lane, bits(parts), addend) == (-1, everyone, "None"), (rank, early)
                continue
            last = last_sender(size, rank)
            assert last == (rank + 1) % size
            first, second = sums
            early_parts = [j for j in everyone if j not in (rank, last)]
            assert (first[1], bits(first[7]), first[8]) == (rank, early_parts, "None")
            # The second starts from the first's float32 sum, in the buffer.
            assert (second[1], bits(second[7]), second[8]) == (-1, sorted([rank, last]), "Buffer")
            assert sorted(bits(first[7]) + bits(second[7])) == everyone
            # Both sum the received partials, laid out by sender from the buffer's start.
            assert all(s[5] == "Buffer" and s[6] == 0 for s in sums)
            at_first, at_second = got.index(first), got.index(second)
            waits_on_own_lane = [
                s[2] for s in got[:at_first] if s[0] == "Wait" and s[1] == rank and s[2] != rank
            ]
            # A gathering call's own lane also waits for each peer (its chunk), after the sum.
            assert waits_on_own_lane[-len(early_parts) :] == early_parts
            between = got[at_first + 1 : at_second]
            assert ("Join", -1, -1, rank) in [tuple(s[:4]) for s in between]
            compute_waits = [s[2] for s in between if s[0] == "Wait" and s[1] == -1]
            assert compute_waits == [last]
            assert not [s for s in got[:at_first] if s[0] == "Wait" and s[1] == -1]


@pytest.mark.parametrize("n_dev", [4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_values_with_and_without(mesh1d, rand, n_dev, dtype):
    """Each rank's block is the sum over ranks of that block's partials, early sum on or
    off, checked against float32 math over three calls with new data (the float32 partial
    sum reused call after call). Both accumulate in float32 and round once: they agree to
    float32 rounding, in bfloat16 to one output ulp at most."""
    data = [
        (
            rand(n_dev * 4, n_dev * 6, dtype=dtype, scale=1.0 + call),
            rand(n_dev * 6, 10, dtype=dtype),
        )
        for call in range(3)
    ]
    outs = {}
    for early in (True, False):  # k = 6: by shape it would be early
        jax_ub.finalize()  # communicators take the setting when they are created
        try:
            use_tuning(reduce_scatter_early_sum=early)
            f = op_fn("rs", mesh1d(n_dev), "ub")
            for call, (x, w) in enumerate(data):
                out = f(x, w)
                assert out.dtype == dtype and not np.isnan(to_f32(out)).any()
                want = to_f32(x) @ to_f32(w)
                assert rel_err(out, want) < (1e-5 if dtype == jnp.float32 else tol(dtype)), call
            outs[early] = to_f32(out)
        finally:
            jax_ub.finalize()
    if dtype == jnp.float32:
        assert rel_err(outs[True], outs[False]) < 1e-6
    else:  # float32 sums in another association: at most one bf16 ulp apart, mostly equal
        ulp = np.abs(outs[False]) * 2.0**-7
        assert (np.abs(outs[True] - outs[False]) <= ulp).all()
        assert (outs[True] == outs[False]).mean() > 0.9


def test_gradients_with_gathers_beside(mesh1d, rand):
    """gelu_mlp's gradients at 8 devices: its backward's reduce-scatters sum early, one of
    them all-gathering x beside it on the same own lane, against XLA's."""
    jax_ub.finalize()
    try:
        assert_grads_match_xla(mesh1d(8), operands(rand, 8))
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize("gathers", [False, True])
def test_buffer_holds_the_float32_sum_only_where_it_sums_early(gathers):
    """The buffer a call needs: received and staged partials (and gathered chunks), plus,
    where the call sums early, two chunks for the float32 sum after them, 256-byte aligned.
    One pass (k >= 2560, three ranks, the choice off, or a fold) needs none."""
    chunk, rows = 1000, 10
    base = (3 if gathers else 2) * chunk

    def need(size, k, **tuning):
        with options.experimental_tuning(**tuning):
            return communicator.required_bytes(
                "cpu", "matmul_reduce_scatter", chunk, size, gathers, rows, k
            )

    for size in (2, 3, 4, 8):
        one_pass = base * size
        early = -(-one_pass // 256) * 256 + 2 * chunk
        assert need(size, 6) == (early if size >= 4 else one_pass), size
        assert need(size, 2560) == one_pass
        assert need(size, 6, reduce_scatter_early_sum=False) == one_pass
        assert need(size, 9999, reduce_scatter_early_sum=True) == (early if size >= 4 else one_pass)
        if size >= 4 and not gathers:  # the ring folds these rows: no sum pass
            assert need(size, 6, reduce_scatter_ring=True, reduce_scatter_fold_rows=0) == one_pass
    all_gather = communicator.required_bytes("cpu", "all_gather_matmul", chunk, 4, False, rows, 6)
    assert all_gather == 4 * chunk


def test_an_exact_buffer_runs_both_ways(mesh1d, rand):
    """A communicator of exactly the bytes a one-pass call needs runs it (k = 2560); a
    call that sums early needs its float32 sum too: without growth it is refused at trace
    time, naming the bytes; with the bytes it needs it runs."""
    mesh = mesh1d(4)
    x, w = rand(4 * 2, 4 * 2560), rand(4 * 2560, 8, scale=0.02)
    small_x, small_w = rand(4 * 2, 4 * 6), rand(4 * 6, 8)
    one_pass = 2 * 4 * (2 * 8 * 4)  # received and staged: 4 ranks' float32 [2, 8] partials
    early = -(-one_pass // 256) * 256 + 2 * (2 * 8 * 4)
    jax_ub.finalize()
    try:
        jax_ub.configure(buffer_bytes=one_pass, allow_grow=False)
        assert rel_err(op_fn("rs", mesh, "ub")(x, w), to_f32(x) @ to_f32(w)) < 1e-5
        with pytest.raises(ValueError, match=rf"userbuffer too small.* needs {early} bytes"):
            op_fn("rs", mesh, "ub")(small_x, small_w)
        jax_ub.finalize()
        jax_ub.configure(buffer_bytes=early, allow_grow=False)
        out = op_fn("rs", mesh, "ub")(small_x, small_w)
        assert rel_err(out, to_f32(small_x) @ to_f32(small_w)) < 1e-5
    finally:
        jax_ub.finalize()
