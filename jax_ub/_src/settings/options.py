"""What a communicator is created with: one frozen record, bound to C++'s CommOptions.

A communicator takes the user's settings that matter to it (``timeout_s``,
``allow_tf32``, ``gemm_cache``: :mod:`jax_ub._src.settings.config`) and the tuning choices
(internal defaults, below) when it is created, and keeps them for its lifetime.
``Options`` holds both, is the key communicators are cached under, and crosses to C++ as
a dict of the same names (``src/protocol/comm_options.h``). Each value is validated once, where it
enters: the user's in ``config``, the tuning choices in :class:`Tuning`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from jax_ub._src.settings import trace_key
from jax_ub._src.settings.config import TRACE_TIME, config, gemm_cache_path

_GEMM_ORDERS = ("auto", "column", "row")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Internal tuning choices; users are not meant to change them.

    Attributes:
      autotune_gemm: on GPUs, time cuBLASLt's candidate kernels the first time each GEMM
        shape runs (a first call of a shape blocks its device's thread for up to about two
        seconds) and keep the fastest, where it beats the heuristic's first pick (the
        kernel cuBLAS runs) by more than 3% and by more than the timing's rounds differ;
        else that first pick. A GEMM of 0.05 ms or more is ranked by 2 ms bursts on a hot
        GPU, and the fastest few timed in 8 rounds of sustained blocks (~1.2 s a shape), at
        the clock their own power leaves, as in a training loop, each round scored on its
        own and rounds a power-capped clock dipped in left out; shorter ones in bursts of
        3 runs.
      gemm_hold_first_pick: with ``autotune_gemm``, keep cuBLASLt's first pick unless
        tuning's fastest beats it by more than 3% and by more than the timing's rounds differ
        (a guard against tuning's noise, as ``autotune_gemm`` says). False: keep tuning's
        fastest however small its lead, to measure what the guard costs or saves.
      autotune_reduce_scatter: with ``autotune_gemm``, tune matmul_reduce_scatter's bf16,
        f16 and f32 GEMMs too; off, they take cuBLASLt's heuristic pick untimed (its fp8
        GEMMs are tuned either way). Short GEMMs' trials compare the heuristic's pick
        beside the op's copies too (``gemm_trials``); on 2 H200s (K=8192, N=28672), when
        every shape had trials, that made the tuned reduce-scatter as fast as the
        heuristic's at M=8192 and 4.3% faster at M=32768. Those GEMMs are now tuned in
        sustained blocks, without trials: not measured on 2+ GPUs since.
      gemm_order: how GPU GEMMs are described to cuBLASLt, which offers different kernels
        for each: "column" (the transposed column-major product), "row", or "auto" (time
        both). Tuning times kernels alone, not beside the op's copies, hence "column".
      gemm_trials: how many kernels a shape's first op calls compare, beside the op's
        copies, before keeping one (a warm-up and 4 timed calls each, ranked call by call
        against the others'): tuning's fastest, with cuBLASLt's heuristic pick in the last
        place if tuning ranked it lower.
        Until they end, results may differ from later calls' in the last bits. GEMMs
        tuned in sustained blocks have none: single calls in turn rank kernels by the
        clock the others left, as bursts do.
      reduce_scatter_fold_rows: on groups of 2, the smallest row piece for which
        matmul_reduce_scatter adds the peer's partial in its own GEMM's epilogue instead
        of a sum pass; 0 always, negative never. The same in every process of a group.
      reduce_scatter_ring: on groups above 2, matmul_reduce_scatter folds too (where its
        pieces have ``reduce_scatter_fold_rows`` rows and it gathers nothing beside): each
        row block's partial sum passes around the ring, each rank's GEMM adding its own
        partial (the epilogue's addend), instead of each rank sending every peer its
        partial and summing the group's in a pass of its own. Its sums round to the
        output's type at each rank. Off: on one H200 its compute side tied the default
        at long k and lost up to 1.96x at short k. The same in every process.
      reduce_scatter_early_sum: on groups of 4 or more, where matmul_reduce_scatter sums its
        partials in a pass of its own (it does not fold). True: the partials that land
        before the last peer's are summed in float32 on a copy stream while its GEMMs run,
        and after them it adds only its own partial and the last peer's (three operands
        read after the GEMMs, not tp; its buffer holds that float32 sum too). False: one
        pass over all tp partials after the GEMMs. None
        (the default): early where a partial's transfer outlasts its GEMM, x's local
        columns k < 2560 (src/protocol/schedule.h): on one H200 with partials landing at a
        modelled 270 GB/s, Llama 3 8B's o and down at tp=8 ran 1.00-1.02x the one-pass
        floor early, 1.08-1.11x in one pass (k 512-1792), 8B's and 70B's o at tp=4
        1.01-1.04x against 1.02-1.07x, 405B's o at tp=8 (k=2048) 0.98x against 1.02x; at
        k >= 3584 early lost up to 7% at tp=4 and tied at tp=8. It changes no transfer:
        processes may differ.
      all_gather_in_turn: True: all_gather_matmul pushes its chunk to one peer at a
        time, nearest first (so each GPU receives one chunk at a time), and multiplies
        the chunks as they land (each GEMM takes those landed by its start, one or, where
        w is wide and chunks pile up, several); False: every push starts at once, the chunks land
        together when the collective ends, and the remote ones are multiplied in at most
        two GEMMs, which hide behind the local chunk's GEMM only: where the collective
        outlasts that GEMM the op takes about the collective plus (tp - 1) / tp of the
        GEMM, as on 4 H200s (benchmarks/RESULTS.md: 70B's qkv 1.648 ms, the all-gather
        0.727, the GEMM 0.961); in turn pays its smaller GEMMs (a GEMM per chunk: 5-17% on
        an H200) and a copy's start after each copy. None (the default): in turn where the transfer
        outlasts twice the local chunk's GEMM, w's local columns n < 1280 (tp - 1), and
        the GEMM repays the serial copies, m k n > 1.75e9 (tp - 1) / (tp - 2) for x's
        local rows m (src/protocol/schedule.h), and wherever all_gather_flag_gemm takes the
        call by shape (n >= 3072); where a chunk's GEMM outlasts its landing (n >= 2560) and
        the flag GEMM cannot run, its GEMMs take turns on two streams. On one H200 with a
        modelled 270 GB/s link (benchmarks/tools/paced_gemm.cu), at tp=8 in turn ran 1.03-1.05x
        its floor (1.03-1.17x on two streams), all at once 1.24-1.70x. Not yet measured on 2+
        GPUs.
      two_gemm_lanes: on groups above 2, GPU GEMMs that would run back to back on one stream
        take turns with a second stream (and cuBLASLt workspace), so that each one's tiles
        start on the SMs the one before leaves idle in its last wave: the all-gather in turn's
        GEMMs (where its flag GEMM does not run), and a reduce-scatter's partials where it
        does not fold. True: wherever there
        are such GEMMs; False: never. None (the default): where a GEMM outlasts its data's
        transfer, w's local columns n >= 2560 (all-gather in turn), x's local columns k >=
        2560 (reduce-scatter) (src/protocol/schedule.h): on one H200 with a modelled 270 GB/s
        link, Llama 3 8B's gate/up all-gather at tp=8 1.25x -> 1.17x its floor, 70B's down
        reduce-scatter 1.083x -> 1.045x; where the link is the longer, two lanes lost up to 3%.
        It changes no transfer: processes may differ.
      all_gather_flag_gemm: on groups of 3 to 16, an all-gather in turn multiplies every chunk in
        one GEMM that waits for each remote chunk's flag inside its kernel, taking the chunks as
        they land, its own first (read from x where it lies): no GEMM boundary, no partial last
        wave per GEMM. GPUs: Hopper (sm_90) builds with CUTLASS's headers, bf16 without an
        epilogue, x's local rows a multiple of 256, k and n of 8; elsewhere the call keeps its
        GEMMs. True: wherever the all-gather goes in turn; False: never. None (the default): where
        a chunk's GEMM clearly outlasts its landing, w's local columns n >= 3072, and the op
        repays in turn's serial copies (as all_gather_in_turn's rule); such calls go in turn
        unless all_gather_in_turn is False. On one H200 with a modelled 270 GB/s link, op /
        floor against the schedule before it: Llama 3 8B's gate/up at tp=4 1.069x -> 1.001x,
        at tp=8 1.17x -> 1.02-1.03x, 405B's at tp=8 1.040x -> 0.984x; at n = 2560 (70B's qkv,
        tp=4) it lost 3%. It changes at most when pushes start: processes may differ.
      reduce_scatter_signal_gemm: on groups of 3 to 16, a reduce-scatter that sums its partials
        in a pass (it does not fold) computes every partial in one GEMM, the blocks in push order,
        which raises each block's flag from inside its kernel once the block is written; each
        push waits for its block's flag, not for a GEMM's end: no GEMM boundary, no partial last
        wave per partial. GPUs: Hopper (sm_90) builds with CUTLASS's headers, bf16, x's rows per
        rank a multiple of 256, k and n of 8; elsewhere the call keeps its GEMMs. True: wherever
        the reduce-scatter does not fold; False and None (the default): never (on one H200 with
        a modelled 270 GB/s link, in the library's schedule, Llama 3's o and down at tp 4 and 8:
        1.3-1.6% faster at 70B's down, inside the runs' spread, 0.4-2.8% slower at the six
        others). It changes no transfer,
        and our own partial joins the sum last (other last bits than without it): processes
        may differ.
      transpose_w_in_place: the backward passes read a weight transposed where it lies
        (the GEMM's transposed operand); else XLA materialises ``w.T`` first. Read when
        a backward pass is traced.
      dgelu_epilogue: ``gelu_mlp``'s backward runs GELU's gradient in a GEMM epilogue;
        else in XLA after the op. Read when a backward pass is traced.
      compute_on_caller_stream: on GPUs, a call's GEMMs, flag waits and check run on the
        stream XLA called it on; else on a stream of the communicator's, which waits for
        XLA's work first and which XLA's stream then waits for. The hop between streams
        cost the Llama step (2 H200s, Llama 3 8B shapes, 8 blocks, seq 8192) 1.2%: 1.024x
        the no-communication bound off, 1.012x on (benchmarks/RESULTS.md).
      fp8_fast_accumulation: on GPUs, fp8 GEMMs of two ``float8_e4m3fn`` operands (the
        forward's) accumulate in the tensor cores' fast mode (cuBLASLt's FAST_ACCUM),
        without promoting partial sums to float32 along k, as XLA's fp8 dots at default
        precision and TransformerEngine's forward GEMMs do; GEMMs with an ``e5m2``
        gradient (the backward's) always promote. Off: every fp8 GEMM promotes.
    """

    autotune_gemm: bool = True
    gemm_hold_first_pick: bool = True
    autotune_reduce_scatter: bool = True
    gemm_order: str = "column"
    gemm_trials: int = 3
    reduce_scatter_fold_rows: int = 2048
    reduce_scatter_ring: bool = False
    reduce_scatter_early_sum: bool | None = None
    all_gather_in_turn: bool | None = None
    two_gemm_lanes: bool | None = None
    all_gather_flag_gemm: bool | None = None
    reduce_scatter_signal_gemm: bool | None = None
    transpose_w_in_place: bool = True
    dgelu_epilogue: bool = True
    compute_on_caller_stream: bool = True
    fp8_fast_accumulation: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.type == "bool" and not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"{field.name} must be a bool, got {getattr(self, field.name)!r}")
        for name in (
            "all_gather_in_turn",
            "reduce_scatter_early_sum",
            "two_gemm_lanes",
            "all_gather_flag_gemm",
            "reduce_scatter_signal_gemm",
        ):
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        if self.gemm_order not in _GEMM_ORDERS:
            raise ValueError(f"gemm_order must be one of {_GEMM_ORDERS}, got {self.gemm_order!r}")
        trials = self.gemm_trials
        # The C++ options hold them as int and int64_t.
        if isinstance(trials, bool) or not isinstance(trials, int) or not 0 <= trials < 1 << 31:
            raise ValueError(f"gemm_trials must be an integer >= 0 (below 2**31), got {trials!r}")
        rows = self.reduce_scatter_fold_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or not -(1 << 63) <= rows < 1 << 63:
            raise ValueError(f"reduce_scatter_fold_rows must be an integer (64-bit), got {rows!r}")


_tuning = Tuning()


def tuning() -> Tuning:
    """The tuning choices communicators created now get."""
    return _tuning


def set_experimental_tuning(**changes: object) -> Tuning:
    """EXPERIMENTAL, for benchmarks and tests: communicators created from now on get these
    tuning choices (names of :class:`Tuning`); returns the previous ones, for
    :func:`restore_tuning`. Not a user setting: the defaults are what jax_ub is measured and
    tested with. A bad name or value raises, changing nothing."""
    global _tuning
    fields = [f.name for f in dataclasses.fields(Tuning)]
    unknown = [name for name in changes if name not in fields]
    if unknown:
        raise ValueError(f"unknown tuning choice {unknown}; known: {fields}")
    saved, _tuning = _tuning, dataclasses.replace(_tuning, **changes)
    _traced_tuning_changed()
    return saved


def restore_tuning(saved: Tuning) -> None:
    global _tuning
    _tuning = saved
    _traced_tuning_changed()


def _traced_tuning_changed() -> None:
    """Functions traced with other tuning choices are traced again: the trace-time ones
    shape the program, the rest the communicator its lowering takes."""
    trace_key.set_global("tuning", dataclasses.astuple(_tuning))


@contextlib.contextmanager
def experimental_tuning(**changes: object) -> Iterator[Tuning]:
    """:func:`set_experimental_tuning` inside the block only."""
    saved = set_experimental_tuning(**changes)
    try:
        yield _tuning
    finally:
        restore_tuning(saved)


@dataclasses.dataclass(frozen=True)
class Options:
    """Everything a communicator is created with; C++'s ``CommOptions`` by the same names."""

    timeout_s: float
    allow_tf32: bool
    autotune_gemm: bool
    gemm_hold_first_pick: bool
    autotune_reduce_scatter: bool
    gemm_order: str
    gemm_trials: int
    reduce_scatter_fold_rows: int
    reduce_scatter_ring: bool
    reduce_scatter_early_sum: bool | None
    all_gather_in_turn: bool | None
    two_gemm_lanes: bool | None
    all_gather_flag_gemm: bool | None
    reduce_scatter_signal_gemm: bool | None
    compute_on_caller_stream: bool
    fp8_fast_accumulation: bool
    gemm_cache: str

    def to_dict(self) -> dict[str, object]:
        """The form the extensions' create_communicator takes."""
        return dataclasses.asdict(self)

    # The settings every process of a group must share (bootstrap compares them and names
    # any difference): the protocol's schedule follows the first; with the second, a group
    # of two GPUs sends rank 0's GEMM kernel choices to the other, which must expect them.
    def agreed(self) -> dict[str, object]:
        return {
            "reduce_scatter_fold_rows": self.reduce_scatter_fold_rows,
            "reduce_scatter_ring": self.reduce_scatter_ring,
            "autotune_gemm": self.autotune_gemm,
        }


# Tuning choices that shape the traced program, not the communicator.
_TRACE_TIME = ("transpose_w_in_place", "dgelu_epilogue")
# The trace key holds the tuning from the start: otherwise its first set_experimental_tuning
# or restore_tuning, even to the defaults, changes the key, and JAX traces and compiles
# again every program it has (eager ones too) when next called.
_traced_tuning_changed()


def traced_settings() -> tuple[object, ...]:
    """The values of everything read when a call is traced (the config's ``TRACE_TIME``
    settings, the tuning's ``_TRACE_TIME`` choices): part of the key of any cache of traced
    functions (a layer's jitted shard_map), so that a change reaches calls traced after it."""
    settings = tuple(getattr(config, name) for name in TRACE_TIME)
    return settings + tuple(getattr(_tuning, name) for name in _TRACE_TIME)


def current_options() -> Options:
    """The options a communicator created now gets: the config's and the tuning's. A
    JAX_UB_* variable with invalid text fails it, naming the variable (``config.check``)."""
    config.check()
    tuned = {k: v for k, v in dataclasses.asdict(_tuning).items() if k not in _TRACE_TIME}
    return Options(
        timeout_s=config.timeout_s,
        allow_tf32=config.allow_tf32,
        gemm_cache=gemm_cache_path(config.gemm_cache),
        **tuned,
    )


def weight_transposed(w):
    """``(w, True)`` for a backward GEMM by ``w.T`` that reads ``w`` in place, or
    ``(w.T, False)`` where the tuning materialises the transpose."""
    return (w, True) if _tuning.transpose_w_in_place else (w.T, False)
