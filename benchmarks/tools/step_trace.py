"""What a traced training step's kernels say by HLO instruction (profile_train_step.py's
tables): custom calls named by op, shape and pass; wall time per run; idle gaps by the
instructions around them; peer copies' start inside each call; kernels that differ between
the GPUs."""

from __future__ import annotations

import collections
import re

from profile_kernels import device_events, trace_events

TRACED_STEPS = 3  # the steps each trace holds
HLO_ROWS = 30


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


def describe_custom_calls(hlo_text: str) -> dict[str, str]:
    """Custom-call instruction name -> its target, result shape and whether it is in the
    backward pass (``transpose(`` in its op name): one row per op and shape."""
    described = {}
    for line in hlo_text.splitlines():
        m = re.search(r"%?([\w.\-]+) = ((?:\([^)]*\))|\S+) custom-call\(", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if not (m and target):
            continue
        shape = re.sub(r"\{[\d,]*\}", "", m.group(2))  # layouts say nothing here
        bwd = " (bwd)" if "transpose(" in line else ""
        tw = " w.T" if "transpose_w = true" in line else ""
        # Where JAX traced it (autodiff, remat, scan), without the jit and the op itself.
        op_name = re.search(r'op_name="([^"]+)"', line)
        where = op_name.group(1).split("/")[1:-1] if op_name else []
        where = "/".join(w for w in where if w != "shard_map")
        described[m.group(1)] = (
            f"{target.group(1).removeprefix('jax_ub_')}{tw} -> {shape}{bwd} [{where}]"
        )
    return described


def by_hlo_op(trace_dir: str, ndev: int, hlo_text: str) -> None:
    """Print the HLO instructions whose kernels took the most GPU time (the trace's
    ``hlo_op`` annotation), custom calls of one target and shape summed over their
    instances (the layers'): which op's GEMMs run long, where kernel names do not say.
    Per row: the instances' wall time (_walls), their kernels' time without copies, and
    how many instructions it sums; then the kernels of the largest jax_ub rows."""
    described = describe_custom_calls(hlo_text)
    events: dict[tuple[int, str], list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        op = e.get("args", {}).get("hlo_op")
        if op:
            start = float(e["ts"])
            events[(e["pid"], op)].append((start, start + float(e["dur"]), e["name"]))
    if not events:
        print("  (the trace names no HLO instructions)")
        return
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    rows: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, set()])
    kernels_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls_of: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    walls = _walls(trace_dir)
    for (pid, op), evs in events.items():
        row = rows[described.get(op, op)]
        row[0] += walls[(pid, op)]
        for a, b, name in evs:
            if not copy.search(name):
                row[1] += b - a
            kernels_of[described.get(op, op)][name[:60]] += b - a
            calls_of[described.get(op, op)][name[:60]] += 1
        row[2].add(op)
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
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        if copy.search(e["name"]):
            continue
        op = e.get("args", {}).get("hlo_op", "?")
        start = float(e["ts"])
        per_gpu[e["pid"]].append((start, start + float(e["dur"]), described.get(op, op)))
    around: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for iv in per_gpu.values():
        iv.sort()
        end, last = iv[0][1], iv[0][2]
        for a, b, op in iv[1:]:
            if a - end >= min_us:
                around[(last, op)].append(a - end)
            if b > end:
                end, last = b, op
    # A gap the host caused: the kernel after it was launched (its API call on the host
    # began) only after the GPU had run out of work.
    launched = {}
    for e in trace_events(trace_dir):
        cid = e.get("args", {}).get("correlation_id")
        if cid is not None and e.get("ph") == "X" and e.get("pid") not in per_gpu:
            launched[int(cid)] = float(e["ts"])
    starved = [0.0, 0]
    for e_list in _gaps_after(trace_dir, min_us):
        for gap_start, gap_us, cid in e_list:
            if cid is not None and launched.get(cid, -1.0) > gap_start:
                starved[0] += gap_us
                starved[1] += 1
    scale = 1e-3 / TRACED_STEPS / ndev
    print(
        f"  idle waiting for the host's launch: {starved[0] * scale:.2f} ms/step/GPU in "
        f"{starved[1] / TRACED_STEPS / ndev:.1f} gaps/step/GPU (of the gaps >= {min_us} us)"
    )
    print("  idle gaps by HLO instruction (ms/step/GPU, gaps/step/GPU; before -> after):")
    for (before, after), v in sorted(around.items(), key=lambda kv: -sum(kv[1]))[:HLO_ROWS]:
        where = f"within {before}" if before == after else f"{before}  ->  {after}"
        print(f"    {sum(v) * scale:6.2f}  {len(v) / TRACED_STEPS / ndev:5.1f}  {where[:230]}")


def _gaps_after(trace_dir: str, min_us: float) -> list[list[tuple[float, float, int | None]]]:
    """Per GPU: (start, microseconds, correlation id of the kernel that ended it) of each
    idle stretch of at least `min_us` (copies aside)."""
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, int | None]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        if not copy.search(e["name"]):
            cid = e.get("args", {}).get("correlation_id")
            start = float(e["ts"])
            per_gpu[e["pid"]].append((start, start + float(e["dur"]), cid and int(cid)))
    out = []
    for iv in per_gpu.values():
        iv.sort()
        gaps, end = [], iv[0][1]
        for a, b, cid in iv[1:]:
            if a - end >= min_us:
                gaps.append((end, a - end, cid))
            end = max(end, b)
        out.append(gaps)
    return out


def peer_copies(trace_dir: str, hlo_text: str) -> None:
    """Print, per jax_ub call of one op and shape, when its peer copies (MemcpyP2P) start
    after the call's first kernel (its local chunk's GEMM), how long they take, and how long
    that first kernel takes: a copy that starts only as the first GEMM ends waits on
    something else (a false dependency, a credit) rather than on the link."""
    described = describe_custom_calls(hlo_text)
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, str, str]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        op = e.get("args", {}).get("hlo_op")
        if op:
            start = float(e["ts"])
            per_gpu[e["pid"]].append((start, start + float(e["dur"]), op, e["name"]))
    rows: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for evs in per_gpu.values():
        evs.sort()
        firsts: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        last_op = None  # a run's first kernel follows another instruction's kernel
        for a, b, op, name in evs:
            if copy.search(name):
                continue
            if op != last_op:
                firsts[op].append((a, b))
            last_op = op
        for a, b, op, name in evs:
            if "P2P" not in name or op not in described or not firsts[op]:
                continue
            first = min(firsts[op], key=lambda f: abs(f[0] - a))
            rows[described[op]].append((a - first[0], b - a, first[1] - first[0]))
    if rows:
        print(
            "  peer copies by call (mean us: start after the first kernel's, copy, first kernel):"
        )
    for what, v in sorted(rows.items(), key=lambda kv: -len(kv[1]))[:8]:
        mean = [sum(x[i] for x in v) / len(v) for i in range(3)]
        print(f"    {mean[0]:7.1f} {mean[1]:7.1f} {mean[2]:7.1f}  {what[:150]}")


def _walls(trace_dir: str) -> dict[tuple[int, str], float]:
    """Per (GPU, HLO instruction): the summed wall time of its runs, a run lasting from its
    first kernel's start to its last event's end, and ending where another instruction's
    kernel starts (copies, on streams of their own, end none): a loop's instruction runs
    once per iteration."""
    copy = re.compile(r"memcpy|memset", re.IGNORECASE)
    per_gpu: dict[int, list[tuple[float, float, str, bool]]] = collections.defaultdict(list)
    for e in device_events(trace_dir):
        op = e.get("args", {}).get("hlo_op")
        if op:
            start = float(e["ts"])
            per_gpu[e["pid"]].append(
                (start, start + float(e["dur"]), op, bool(copy.search(e["name"])))
            )
    walls: dict[tuple[int, str], float] = collections.defaultdict(float)
    for pid, evs in per_gpu.items():
        evs.sort()
        op, first, last = None, 0.0, 0.0
        for a, b, this, is_copy in evs + [(0.0, 0.0, None, False)]:
            if this == op:
                last = max(last, b)
            elif not is_copy:
                if op is not None:
                    walls[(pid, op)] += last - first
                op, first, last = this, a, b
    return walls
