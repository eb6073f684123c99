"""The step profiler's tables (benchmarks/tools/step_trace.py) on a made-up trace of two GPUs:
a jax_ub call per step after an XLA fusion, its local GEMM, a peer copy beside it, and its
second GEMM (starting as a copy of XLA's on another stream ends), then two fusions, the second
in a CUDA graph; the second GPU reaches every call 30 us after the first."""

import gzip
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tools"))
step_trace = pytest.importorskip("step_trace")

HLO = (
    '%cc.1 = (bf16[8,4]{1,0}) custom-call(%a), custom_call_target="jax_ub_all_gather_matmul", '
    'metadata={op_name="jit(step)/jvp()/all_gather_matmul"}'
)
LATE_US = 30.0


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
        for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (9, "/host:CPU"))
    ]
    cid = 0

    def kernel(pid, ts, dur, name, op, tid=7):
        nonlocal cid
        cid += 1
        args = {"hlo_op": op, "correlation_id": cid}
        events.append(
            {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}
        )
        launch = {"correlation_id": cid}
        events.append({"ph": "X", "pid": 9, "tid": 1, "ts": ts - 500, "dur": 3, "args": launch})

    for step in range(step_trace.TRACED_STEPS):
        for pid, late in ((1, 0.0), (2, LATE_US)):
            t = step * 1000 + late
            kernel(pid, t, 50, "fusion_1", "fusion.1")
            kernel(pid, t + 80, 100, "nvjet_gemm", "cc.1")
            kernel(pid, t + 85, 60, "MemcpyP2P", "cc.1", tid=9)
            kernel(pid, t + 150, 49, "MemcpyD2D", "dus.1", tid=11)  # XLA's, ends as the GEMM starts
            kernel(pid, t + 200, 100, "nvjet_gemm", "cc.1")
            kernel(pid, t + 320, 30, "fusion_2", "fusion.2")
            kernel(pid, t + 350, 20, "loop_add_fusion_3", "command_buffer_5")  # in a CUDA graph
    folder = tmp_path_factory.mktemp("trace")
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    return str(folder)


def test_call_timeline_starts_at_the_first_kernel(trace_dir, capsys):
    step_trace.call_timelines(trace_dir, HLO)
    out = capsys.readouterr().out
    assert "timeline of all_gather_matmul -> (bf16[8,4]) [jvp()]" in out
    # 30 us idle before the call and 20 inside it; the fusion before it, 80 us earlier.
    assert "median 50 us" in out
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[0][:2] == ["-80.0", "50.0"] and rows[0][-1] == "(fusion.1)"
    assert rows[1][:4] == ["0.0", "100.0", "7", "-500"]  # launched 500 us ahead
    assert rows[2][:3] == ["5.0", "60.0", "9"] and rows[2][-1] == "MemcpyP2P"


def test_arrival_skew_names_the_late_gpu(trace_dir, capsys):
    step_trace.arrival_skew(trace_dir, HLO)
    row = capsys.readouterr().out.splitlines()[1].split()
    assert [float(x) for x in row[:3]] == [LATE_US, LATE_US, 1.0]


def test_gaps_find_every_launch_and_copies_their_start(trace_dir, capsys):
    step_trace.gaps_by_hlo_op(trace_dir, 2, HLO)
    step_trace.peer_copies(trace_dir, HLO)
    out = capsys.readouterr().out
    # 20 us a step inside the call on each GPU, beside the sum over GPUs' mean.
    assert "0.02    1.0    0.02   0.02  within all_gather_matmul" in out
    gaps = sum(map(len, step_trace._idle_gaps_by_gpu(trace_dir, 5.0)))
    assert f"found for {gaps} of {gaps}" in out
    assert "5.0    60.0   100.0  all_gather_matmul" in out


def test_time_in_scope_sums_the_scopes_kernels_in_and_out_of_graphs(trace_dir):
    hlo = "\n".join([
        HLO,
        '%fusion.1 = bf16[8]{0} fusion(%a), kind=kLoop, metadata={op_name="jit(step)/mul"}',
        '%fusion.2 = bf16[8]{0} fusion(%b), kind=kLoop, '
        'metadata={op_name="jit(step)/jvp()/bound_stand_in/concatenate"}',
        '%loop_add_fusion.3 = bf16[8]{0} fusion(%c), kind=kLoop, '
        'metadata={op_name="jit(step)/transpose(jvp())/bound_stand_in/add_any"}',
    ])  # fmt: skip
    ms, launches = step_trace.time_in_scope(trace_dir, 2, hlo, "bound_stand_in")
    assert (round(ms * 1e3, 6), launches) == (50.0, 2.0)  # 30 + 20 us per step and GPU
    assert step_trace.time_in_scope(trace_dir, 2, hlo, "other_scope") == (0.0, 0.0)


def test_gaps_at_copy_ends_find_the_gemm_held_until_a_copy_ended(trace_dir, capsys):
    step_trace.gaps_at_copy_ends(trace_dir, 2, HLO)
    out = capsys.readouterr().out
    # Per step and GPU 30 + 20 + 20 us inside a step and 630 between steps (2 of 3 steps);
    # only the 20 us before the second GEMM (the jax_ub call's) end as the copy does.
    assert "0.02 ms/step/GPU in 1.0 gaps/step/GPU (of 0.49 in 3.7)" in out
    assert "the kernel held a jax_ub call's: 0.02; by copy: dus.1 0.02" in out


def test_host_time_sums_each_threads_api_calls_per_step(trace_dir, capsys):
    step_trace.host_time(trace_dir)
    out = capsys.readouterr().out
    # 7 launches of 3 us per GPU and step, all on host thread 9/1.
    assert "    0.04      14  9/1" in out
    assert "    0.04      14     3.0      3.0  ?" in out
