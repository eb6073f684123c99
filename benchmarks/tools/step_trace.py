"""What a traced training step's kernels say by HLO instruction (profile_train_step.py's
tables): custom calls named by op, shape and pass; wall time per run; idle gaps by the
instructions around them; peer copies' start inside each call; kernels that differ between
the GPUs; what the host's threads spent their time on."""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import re
import statistics
from typing import NamedTuple

from profile_kernels import device_events, trace_events

TRACED_STEPS = 3  # the steps each trace holds
HLO_ROWS = 30
COPY = re.compile(r"memcpy|memset", re.IGNORECASE)  # copy-engine work, on streams of its own
# An HLO instruction's line: its name, its result shape (one array, or a tuple holding arrays
# and tuples of them, as async starts have), its opcode.
INSTRUCTION = re.compile(r"%?([\w.\-]+) = (\((?:[^()]|\([^()]*\))*\)|\S+) ([\w\-]+)\(")
OP_NAME = re.compile(r'op_name="([^"]+)"')


class Event(NamedTuple):
    start: float
    end: float
    op: str  # the HLO instruction ("" where the trace names none)
    name: str
    cid: int | None  # the correlation id of its launch on the host
    copy: bool
    stream: int  # the trace's thread id of its stream


@functools.cache
def events_by_gpu(trace_dir: str) -> dict[int, list[Event]]:
    """Every device event of the trace per GPU, in order of start. Cached: do not change it."""
    per_gpu: dict[int, list[Event]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        args = e.get("args", {})
        cid = args.get("correlation_id")
        start = float(e["ts"])
        per_gpu[e["pid"]].append(
            Event(start, start + float(e["dur"]), args.get("hlo_op", ""), e["name"],
                  None if cid is None else int(cid), bool(COPY.search(e["name"])),
                  int(e.get("tid", 0)))
        )  # fmt: skip
    for evs in per_gpu.values():
        evs.sort()
    return dict(per_gpu)


def _gaps_in(evs: list[Event], min_us: float) -> list[tuple[float, float, Event, Event]]:
    """One GPU's stretches of at least `min_us` with no kernel running (copies aside), as
    (start, microseconds, the kernel that ended last before it, the kernel that ended it)."""
    gaps = []
    kernels = [e for e in evs if not e.copy]
    last = kernels[0]
    for e in kernels[1:]:
        if e.start - last.end >= min_us:
            gaps.append((last.end, e.start - last.end, last, e))
        if e.end > last.end:
            last = e
    return gaps


def _idle_gaps_by_gpu(
    trace_dir: str, min_us: float
) -> list[list[tuple[float, float, Event, Event]]]:
    """Each GPU's idle stretches (_gaps_in), GPUs in the trace's order."""
    return [_gaps_in(evs, min_us) for _, evs in sorted(events_by_gpu(trace_dir).items())]


def gaps_at_copy_ends(
    trace_dir: str, ndev: int, hlo_text: str, min_us: float = 5.0, near_us: float = 3.0
) -> None:
    """Print how much idle time ends within `near_us` of a copy ending on another stream:
    a kernel that started only as a transfer within the GPU finished, with no kernel of its
    own stream in the way (seen before jax_ub's GEMMs as XLA's copies of saved activations
    and the calls' own gathered-x copies ended); by the copy's HLO instruction, and whether
    the kernel held back was a jax_ub call's."""
    calls = describe_custom_calls(hlo_text)
    total, at = [0.0, 0], [0.0, 0]
    by_copy: dict[str, float] = collections.defaultdict(float)
    held_in_call = 0.0
    for evs in events_by_gpu(trace_dir).values():
        copies = sorted((e.end, e) for e in evs if e.copy)
        ends = [end for end, _ in copies]
        for _, us, _, after in _gaps_in(evs, min_us):
            total[0] += us
            total[1] += 1
            lo = bisect.bisect_left(ends, after.start - near_us)
            hi = bisect.bisect_right(ends, after.start + near_us)
            near = [c for _, c in copies[lo:hi] if c.stream != after.stream]
            if near:
                at[0] += us
                at[1] += 1
                by_copy[near[0].op or near[0].name] += us
                held_in_call += us if after.op in calls else 0.0
    scale = 1e-3 / TRACED_STEPS / ndev
    per_gpu = 1 / TRACED_STEPS / ndev
    top = ", ".join(
        f"{op} {us * scale:.2f}" for op, us in sorted(by_copy.items(), key=lambda kv: -kv[1])[:4]
    )
    print(
        f"  idle gaps ending within {near_us:g} us of a copy's end on another stream: "
        f"{at[0] * scale:.2f} ms/step/GPU in {at[1] * per_gpu:.1f} gaps/step/GPU (of "
        f"{total[0] * scale:.2f} in {total[1] * per_gpu:.1f}); the kernel held a jax_ub "
        f"call's: {held_in_call * scale:.2f}{'; by copy: ' + top if top else ''}"
    )


def _runs(trace_dir: str) -> dict[tuple[int, str], list[tuple[Event, float]]]:
    """Per (GPU, HLO instruction): its runs, as (first kernel, last event's end). A run ends
    where another instruction's kernel starts (copies, on streams of their own, end none):
    a loop's instruction runs once per iteration."""
    runs: dict[tuple[int, str], list[tuple[Event, float]]] = collections.defaultdict(list)
    for pid, evs in events_by_gpu(trace_dir).items():
        first, last = None, 0.0
        for e in [e for e in evs if e.op] + [None]:
            if e is not None and first is not None and e.op == first.op:
                last = max(last, e.end)
            elif e is None or not e.copy:
                if first is not None:
                    runs[(pid, first.op)].append((first, last))
                first, last = e, e.end if e is not None else 0.0
    return runs


def uneven_gpus(trace_dir: str) -> None:
    """Print the kernels whose time differs most between the GPUs (ms/step, per GPU): the
    same program on every GPU, so a GPU doing more is slowed (clocks, memory traffic), and
    at each collective the others wait for it."""
    per: dict[str, dict[int, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    pids = set()
    for e in device_events(trace_dir):
        per[e["name"][:70]][e["pid"]] += float(e["dur"])
        pids.add(e["pid"])
    if len(pids) < 2:
        return
    pids = sorted(pids)
    spread = {n: max(v[p] for p in pids) - min(v[p] for p in pids) for n, v in per.items()}
    print("  kernels differing most between GPUs (ms/step per GPU):")
    for name in sorted(spread, key=lambda n: -spread[n])[:8]:
        cells = " ".join(f"{per[name][p] * 1e-3 / TRACED_STEPS:7.2f}" for p in pids)
        print(f"    {cells}  {name}")


@functools.cache
def describe_custom_calls(hlo_text: str) -> dict[str, str]:
    """Custom-call instruction name -> its target, result shape and whether it is in the
    backward pass (``transpose(`` in its op name): one row per op and shape. Cached (every
    table reads it, the text is megabytes): do not change it."""
    described = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.search(line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if not (m and target and m.group(3) == "custom-call"):
            continue
        shape = re.sub(r"\{[\d,]*\}", "", m.group(2))  # layouts say nothing here
        bwd = " (bwd)" if "transpose(" in line else ""
        tw = " w.T" if "transpose_w = true" in line else ""
        # Where JAX traced it (autodiff, remat, scan), without the jit and the op itself.
        op_name = OP_NAME.search(line)
        where = op_name.group(1).split("/")[1:-1] if op_name else []
        where = "/".join(w for w in where if w != "shard_map")
        described[m.group(1)] = (
            f"{target.group(1).removeprefix('jax_ub_')}{tw} -> {shape}{bwd} [{where}]"
        )
    return described


@functools.cache
def instruction_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the op name JAX gave it (its metadata), the name written as
    XLA names the instruction's kernels: dots as underscores. Cached: do not change it."""
    names = {}
    for line in hlo_text.splitlines():
        m, op_name = INSTRUCTION.search(line), OP_NAME.search(line)
        if m and op_name:
            names[m.group(1).replace(".", "_")] = op_name.group(1)
    return names


def time_in_scope(trace_dir: str, ndev: int, hlo_text: str, scope: str) -> tuple[float, float]:
    """(ms/step/GPU, launches/step/GPU) of the kernels and copies of the HLO instructions
    whose op name holds the named scope `scope`. A kernel is its instruction's where the
    trace names one, else (inside a CUDA graph, which the trace names instead) the
    instruction named as the kernel is."""
    op_names = instruction_op_names(hlo_text)
    us = launches = 0.0
    for evs in events_by_gpu(trace_dir).values():
        for e in evs:
            inside_graph = not e.op or e.op.startswith("command_buffer")
            instruction = (e.name if inside_graph else e.op).replace(".", "_")
            if f"{scope}/" in op_names.get(instruction, ""):
                us += e.end - e.start
                launches += 1
    return us * 1e-3 / TRACED_STEPS / ndev, launches / TRACED_STEPS / ndev


def by_hlo_op(trace_dir: str, ndev: int, hlo_text: str) -> None:
    """Print the HLO instructions whose kernels took the most GPU time (the trace's
    ``hlo_op`` annotation), custom calls of one target and shape summed over their
    instances (the layers'): which op's GEMMs run long, where kernel names do not say.
    Per row: the instances' wall time (_runs), their kernels' time without copies, and
    how many instructions it sums; then the kernels of the largest jax_ub rows."""
    described = describe_custom_calls(hlo_text)
    events = events_by_gpu(trace_dir)
    if not any(e.op for evs in events.values() for e in evs):
        print("  (the trace names no HLO instructions)")
        return
    rows: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, set()])
    kernels_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (_, op), runs in _runs(trace_dir).items():
        rows[described.get(op, op)][0] += sum(end - first.start for first, end in runs)
    for evs in events.values():
        for e in (e for e in evs if e.op):
            what = described.get(e.op, e.op)
            if not e.copy:
                rows[what][1] += e.end - e.start
            kernels_of[what][e.name[:60]] += e.end - e.start
            calls_of[what][e.name[:60]] += 1
            rows[what][2].add(e.op)
    scale = 1e-3 / TRACED_STEPS / ndev
    print(
        "  HLO instructions by wall time (ms/step/GPU: wall, kernels without copies; "
        "instructions; what):"
    )
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])
    for what, (wall, busy, ops) in ranked[:HLO_ROWS]:
        print(f"    {wall * scale:7.2f} {busy * scale:7.2f}  {len(ops):4d}  {what}")
    for what, _ in [kv for kv in ranked if kv[0] in described.values()][:6]:
        print(f"  kernels of {what} (ms/step/GPU, launches/step/GPU):")
        for name, us in kernels_of[what].most_common(6):
            n = calls_of[what][name] / TRACED_STEPS / ndev
            print(f"      {us * scale:7.2f}  {n:5.1f}  {name}")


def gaps_by_hlo_op(trace_dir: str, ndev: int, hlo_text: str, min_us: float = 5.0) -> None:
    """Print the GPUs' idle stretches (no kernel running, copies aside) summed by the HLO
    instructions around them: a gap inside one jax_ub call (the same instruction on both
    sides) is that call waiting on a peer; one between instructions is XLA's or the host's."""
    described = describe_custom_calls(hlo_text)
    # A gap the host caused: the kernel after it was launched (its API call on the host
    # began) only after the GPU had run out of work.
    launched = _launch_times(trace_dir)
    # Per GPU as well as summed: a GPU that runs slower than its peers never waits for them,
    # so the step's time is that GPU's, and its own idle time is the part that counts.
    by_gpu = _idle_gaps_by_gpu(trace_dir, min_us)
    around: dict[tuple[str, str], list[list[float]]] = collections.defaultdict(
        lambda: [[] for _ in by_gpu]
    )
    starved, known = [0.0, 0], 0
    for gpu, gpu_gaps in enumerate(by_gpu):
        for start, us, before, after in gpu_gaps:
            ops = [described.get(x.op, x.op or "?") for x in (before, after)]
            around[(ops[0], ops[1])][gpu].append(us)
            known += after.cid in launched
            if after.cid is not None and launched.get(after.cid, -1.0) > start:
                starved[0] += us
                starved[1] += 1
    scale = 1e-3 / TRACED_STEPS / ndev
    print(
        f"  idle waiting for the host's launch: {starved[0] * scale:.2f} ms/step/GPU in "
        f"{starved[1] / TRACED_STEPS / ndev:.1f} gaps/step/GPU (of the gaps >= {min_us} us; "
        f"the launch of the kernel after the gap found for {known} of {sum(map(len, by_gpu))})"
    )
    print(
        "  idle gaps by HLO instruction (ms/step/GPU, gaps/step/GPU, then ms/step on each GPU;"
        " before -> after):"
    )
    print("    " + " ".join(f"{sum(g[1] for g in gg) * scale * ndev:6.2f}" for gg in by_gpu)
          + "  all gaps on each GPU")  # fmt: skip
    rows = sorted(around.items(), key=lambda kv: -sum(map(sum, kv[1])))[:HLO_ROWS]
    for (before, after), per_gpu in rows:
        where = f"within {before}" if before == after else f"{before}  ->  {after}"
        each = " ".join(f"{sum(v) * scale * ndev:6.2f}" for v in per_gpu)
        total, count = sum(map(sum, per_gpu)), sum(map(len, per_gpu))
        per_step = count / TRACED_STEPS / ndev
        print(f"    {total * scale:6.2f}  {per_step:5.1f}  {each}  {where[:200]}")


def peer_copies(trace_dir: str, hlo_text: str) -> None:
    """Print, per jax_ub call of one op and shape, when its peer copies (MemcpyP2P) start
    after the call's first kernel (its local chunk's GEMM), how long they take, and how long
    that first kernel takes: a copy that starts only as the first GEMM ends waits on
    something else (a false dependency, a credit) rather than on the link."""
    described = describe_custom_calls(hlo_text)
    runs = _runs(trace_dir)
    rows: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for pid, evs in events_by_gpu(trace_dir).items():
        for e in evs:
            if "P2P" not in e.name or e.op not in described or not runs[(pid, e.op)]:
                continue
            first, _ = min(runs[(pid, e.op)], key=lambda r: abs(r[0].start - e.start))
            rows[described[e.op]].append(
                (e.start - first.start, e.end - e.start, first.end - first.start)
            )
    if rows:
        print(
            "  peer copies by call (mean us: start after the first kernel's, copy, first kernel):"
        )
    for what, v in sorted(rows.items(), key=lambda kv: -len(kv[1]))[:8]:
        mean = [sum(x[i] for x in v) / len(v) for i in range(3)]
        print(f"    {mean[0]:7.1f} {mean[1]:7.1f} {mean[2]:7.1f}  {what[:150]}")


@functools.cache
def _host_events(trace_dir: str) -> list[dict]:
    """The host's timed events (on no GPU's track), in trace order. Cached: do not change it."""
    gpus = events_by_gpu(trace_dir)
    return [
        e
        for e in trace_events(trace_dir)
        if e.get("ph") == "X" and e.get("pid") not in gpus and "dur" in e
    ]


def _correlation_id(e: dict) -> int | None:
    """A host event's correlation id: set on CUDA API calls, shared with their device work."""
    cid = e.get("args", {}).get("correlation_id")
    return None if cid is None else int(cid)


def _launch_times(trace_dir: str) -> dict[int, float]:
    """Correlation id -> when its launch API call began on the host (trace microseconds)."""
    return {
        cid: float(e["ts"])
        for e in _host_events(trace_dir)
        if (cid := _correlation_id(e)) is not None
    }


def call_timelines(trace_dir: str, hlo_text: str, calls: int = 3, before_us: float = 150) -> None:
    """Print, for the jax_ub calls (one op and shape) that idle the GPU most inside or just
    before themselves, one instance's events in order from `before_us` before its first
    kernel: start after that kernel, duration, stream, when the host launched it (the same
    clock; "-" where the trace does not say) and the kernel. The instance is the median by
    idle time, on the first GPU: which step of the protocol (a flag wait, a copy, a GEMM,
    the host) the idle time sits behind."""
    described = describe_custom_calls(hlo_text)
    gpus = events_by_gpu(trace_dir)
    launched = _launch_times(trace_dir)
    pid = min(gpus)
    evs_all = gpus[pid]
    starts = [e.start for e in evs_all]  # sorted: a run's events by bisection
    # The latest end of any kernel (copies aside) among the events up to each one.
    reach_upto = list(itertools.accumulate((0.0 if e.copy else e.end for e in evs_all), max))
    idle_of: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for (p, op), runs in _runs(trace_dir).items():
        if p != pid or op not in described:
            continue
        for first, end in runs:
            # Idle from the end of the kernels before the call (none where one still runs
            # as it starts) to its end, less its own kernels' time.
            lo, hi = bisect.bisect_left(starts, first.start), bisect.bisect_right(starts, end)
            prior = min(reach_upto[lo - 1], first.start) if lo > 0 else first.start
            busy, reach = 0.0, prior
            for e in evs_all[lo:hi]:
                if e.op == op and not e.copy:
                    busy += max(0.0, e.end - max(e.start, reach))
                    reach = max(reach, e.end)
            idle_of[described[op]].append((end - prior - busy, first.start, end))
    ranked = sorted(idle_of.items(), key=lambda kv: -sum(i for i, _, _ in kv[1]))
    for what, instances in ranked[:calls]:
        idle, t0, end = sorted(instances)[len(instances) // 2]
        mean = sum(i for i, _, _ in instances) / len(instances)
        print(
            f"  timeline of {what[:140]} (idle before and inside: median {idle:.0f} us, mean "
            f"{mean:.0f}; us from its first kernel: start, duration, stream, host launch):"
        )
        for e in evs_all:
            if t0 - before_us <= e.end and e.start <= end:
                at = launched.get(e.cid) if e.cid is not None else None
                host = "-" if at is None else f"{at - t0:.0f}"
                label = e.name if e.op in described else f"{e.name} ({e.op})"
                print(f"    {e.start - t0:8.1f} {e.end - e.start:7.1f} {e.stream:5d} {host:>9s}  "
                      f"{label[:70]}")  # fmt: skip


def arrival_skew(trace_dir: str, hlo_text: str) -> None:
    """Print, per jax_ub op and shape, how far apart the GPUs reach its calls: the start of
    each call's first kernel (its local GEMM, which waits on no peer) on the other GPUs
    less the first GPU's, the n-th run of an instruction against its n-th run elsewhere.
    A peer that arrives late makes the early GPU wait at the call's first flag; a mean far
    from zero says the same GPU is late every time (slower work before the call)."""
    described = describe_custom_calls(hlo_text)
    runs = _runs(trace_dir)
    pids = sorted({p for p, _ in runs})
    if len(pids) < 2:
        return
    diffs: dict[str, list[float]] = collections.defaultdict(list)
    for op in {o for _, o in runs if o in described}:
        first_gpu = runs.get((pids[0], op), [])
        for p in pids[1:]:
            for (a, _), (b, _) in zip(first_gpu, runs.get((p, op), [])):
                diffs[described[op]].append(b.start - a.start)
    print("  arrival skew by call (us, later GPUs minus the first: mean, mean |d|, share > 0):")
    for what, v in sorted(diffs.items(), key=lambda kv: -sum(map(abs, kv[1])))[:8]:
        mean = sum(v) / len(v)
        spread = sum(map(abs, v)) / len(v)
        later = sum(d > 0 for d in v) / len(v)
        print(f"    {mean:8.1f} {spread:8.1f} {later:5.2f}  {what[:150]}")


def host_time(trace_dir: str, rows: int = 24) -> None:
    """Print what the host's threads spent their traced time on, per step: each event name's
    ms and count summed over the threads (XLA's host events nest, so an outer one holds
    the inner ones' time), and per thread the CUDA API calls (events with a correlation
    id) it made: what enqueuing a step costs, and on which threads."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)  # durations, us
    api_by_name: dict[str, list[float]] = collections.defaultdict(list)
    api_by_thread: dict[tuple[int, int], list[float]] = collections.defaultdict(list)
    for e in _host_events(trace_dir):
        name, us = e.get("name", "?")[:90], float(e["dur"])
        by_name[name].append(us)
        if _correlation_id(e) is not None:
            api_by_name[name].append(us)
            api_by_thread[(e["pid"], e.get("tid", 0))].append(us)
    scale = 1e-3 / TRACED_STEPS
    print("  host time by event name (ms/step summed over threads, events/step, name):")
    for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"    {sum(v) * scale:8.2f} {len(v) / TRACED_STEPS:7.0f}  {name}")
    # A call that usually returns in microseconds but sometimes takes far longer waited:
    # for room in a full launch queue (the host far ahead), or for a lock.
    print("  CUDA API calls by name (ms/step, calls/step, median and max us, name):")
    for name, v in sorted(api_by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(
            f"    {sum(v) * scale:8.2f} {len(v) / TRACED_STEPS:7.0f} "
            f"{statistics.median(v):7.1f} {max(v):8.1f}  {name}"
        )
    print("  CUDA API calls by host thread (ms/step, calls/step, pid/tid):")
    for (pid, tid), v in sorted(api_by_thread.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {sum(v) * scale:8.2f} {len(v) / TRACED_STEPS:7.0f}  {pid}/{tid}")
