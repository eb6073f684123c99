"""TransformerEngine's JAX collective GEMM against jax_ub and XLA, side by side.

Runs as N processes x 1 GPU (TE's layout: its collective GEMM needs one GPU per process),
jax.distributed on localhost, one tensor-parallel group of all N GPUs. In the same processes
and interleaved rounds (jax_ub.bench.timing: each time is the median over --rounds of a loop
average of --iters async calls, per device), for each M of --ms with K, N (global sizes):

- AG+GEMM: x[M,K] sequence-sharded @ w[K,N] column-sharded. GEMM+RS: x[M,N] @ w[N,K], the
  contracted N sharded, the result row-sharded (reduce-scattered).
  bf16 rows: gemm (each device's GEMM alone, no communication: the bound), xla (XLA's
  all-gather + dot / dot + reduce-scatter), jax_ub, te (TE's gemm with collective_op
  ALL_GATHER / REDUCE_SCATTER), te_noov (TE's gemm with collective_op NONE: XLA's all-gather
  before it; for GEMM+RS TE's partitioning all-reduces, then keeps its rows). fp8 rows (e4m3,
  per-tensor scales): fp8_gemm (each device's fp8 GEMM alone, operands quantized beforehand:
  the bound), xla_fp8 and jax_ub_fp8 (Fp8Scales(): current scaling, x and w quantized in
  every call), te_fp8_cs (Float8CurrentScaling), te_fp8_ds (DelayedScaling, scales set from
  the operands' amax, as a warmed-up history gives).
- MLP: y = (x @ w1) @ w2, w1 [K,N] column-, w2 [N,K] row-parallel, forward (fwd) and
  forward+backward (bwd: the gradients of sum(y * dy)): TE's dense twice (collective_op_set
  AG, then RS), jax_ub's all_gather_matmul then matmul_reduce_scatter (what its
  ColumnParallelLinear and RowParallelLinear run), jax_ub_layer (those two Flax NNX layers
  themselves, kernels w1 and w2, no bias), XLA's; bf16 and fp8 current scaling; the bound
  (gemm) is the same MLP's per-device GEMMs without communication.

Each row prints ms, ms over its bound (bf16 and MLP rows over gemm, fp8 GEMM rows over
fp8_gemm), the rounds' spread and its relative error (Frobenius) against XLA's float32 product
at precision HIGHEST of the same bf16 data (MLP: the output, or the three gradients); errors
past rows.TOLERANCE (bf16 rounding; e4m3 operands, ~3-4e-2 per GEMM) are flagged. The fp8
implementations choose their scales differently (per tensor over the group or per shard), so
no single quantized reference matches them all: they are checked against that tolerance.

  PYTHONPATH=/tmp/te_site python3 benchmarks/te/compare.py --launch 2   # GPU machine
  python3 benchmarks/te/compare.py --cpu-smoke    # CPU: 2 processes x 1 CPU device, tiny shapes

Without TE (the import fails, or CPU devices) it says so on one line and runs the rest.
jax_ub's own numbers on 1 process x N GPUs come from `python -m jax_ub.bench --shapes
MxKxN,... --fp8` (--ub-bench runs it after, with the same shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # te_rows, and the repo's jax_ub
AXIS = "tp"
# NVLink multicast stays off (UB_SKIPMC: TE's userbuffers; te_rows sets it again).
NVLS_OFF = dict(
    NCCL_NVLS_ENABLE="0",
    TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    NVSHMEM_DISABLE_NVLS="1",
    UB_SKIPMC="1",
)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launch", type=int, default=0, help="start N processes of 1 GPU each")
    ap.add_argument(
        "--devices",
        choices=("visible", "ids"),
        default="ids",
        help="with --launch: each process sees all GPUs and JAX takes its own "
        "(local_device_ids, as TE's examples/jax/collective_gemm does; TE's userbuffers "
        "check peer access between the GPUs it sees), or sees its GPU alone "
        "(CUDA_VISIBLE_DEVICES, as jax_ub.bench --processes does)",
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU devices, tiny shapes, 2 procs")
    ap.add_argument("--ms", default="2048,8192,32768", help="comma-separated M (rows)")
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--sections", default="ag,rs,mlp", help="any of ag, rs, mlp")
    ap.add_argument("--no-fp8", action="store_true", help="bf16 rows only")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="", help="rank 0 writes every table here")
    ap.add_argument("--timeout", type=float, default=560, help="--launch: kill all after (s)")
    ap.add_argument("--ub-bench", action="store_true", help="then run python -m jax_ub.bench")
    for name in ("--process-id", "--num-processes"):
        ap.add_argument(name, type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cpu_smoke:  # tiny defaults, where not given
        smoke = dict(ms="32,64", k=64, n=128, rounds=2, iters=2, launch=2)
        for name, value in smoke.items():
            if getattr(args, name) == ap.get_default(name):
                setattr(args, name, value)
    return args


def pip_cudnn_env() -> dict[str, str]:
    """CUDNN_PATH and LD_LIBRARY_PATH naming the cuDNN of NVIDIA's pip wheel, the one JAX
    loads: TE otherwise dlopens a system cuDNN's sub-libraries beside it, and their symbol
    versions clash (``libcudnn_heuristic.so.9: undefined symbol ... libcudnn_graph.so.9``)."""
    import importlib.util  # noqa: PLC0415

    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except ModuleNotFoundError:  # no nvidia namespace at all
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = list(spec.submodule_search_locations)[0]
    path = ":".join(p for p in (f"{root}/lib", os.environ.get("LD_LIBRARY_PATH", "")) if p)
    return dict(CUDNN_PATH=root, CUDNN_HOME=root, LD_LIBRARY_PATH=path)


def launch(args, argv) -> int:
    """Start args.launch copies of this script, rank 0 printing, the others logging to
    $OUT (or /tmp)/te_compare_rank<i>.log; wait for all, at most args.timeout s."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    n, procs, logs = args.launch, [], {}
    for i in range(n):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **NVLS_OFF, **pip_cudnn_env())
        if args.devices == "visible" and not args.cpu_smoke:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, __file__, *argv, "--process-id", str(i), "--num-processes", str(n)]
        cmd += ["--coordinator", f"127.0.0.1:{port}"]
        out = None
        if i:
            logs[i] = Path(os.environ.get("OUT", "/tmp")) / f"te_compare_rank{i}.log"
            logs[i].parent.mkdir(parents=True, exist_ok=True)
            out = open(logs[i], "w")  # noqa: SIM115  (closed with the process)
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if i else None)
        )
    deadline, rc = time.time() + args.timeout, 0
    for p in procs:
        try:
            rc = max(rc, p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            print(f"compare: still running after {args.timeout:.0f} s: killing the processes")
            for q in procs:
                q.kill()
            rc = 124
    for i, path in logs.items():
        if procs[i].returncode:
            print(f"--- rank {i} exited {procs[i].returncode}; the end of {path}:")
            print("".join(open(path).readlines()[-15:]))
    if args.ub_bench and rc == 0:
        shapes = ",".join(f"{m}x{args.k}x{args.n}" for m in args.ms.split(","))
        cmd = [sys.executable, "-m", "jax_ub.bench", "--shapes", shapes, "--no-windowed-einsum"]
        cmd += [] if args.no_fp8 else ["--fp8"]
        print("\n$", " ".join(cmd[1:]), flush=True)
        rc = subprocess.call(cmd, env=dict(os.environ, **NVLS_OFF), cwd=HERE.parents[1])
    return rc


def worker(args) -> None:
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
        )
    import jax  # noqa: PLC0415  (after the environment is set)

    if args.cpu_smoke:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.num_processes > 1:
        ids = [args.process_id] if args.devices == "ids" and not args.cpu_smoke else None
        jax.distributed.initialize(
            args.coordinator, args.num_processes, args.process_id, local_device_ids=ids
        )
    import numpy as np  # noqa: PLC0415
    import te_rows  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415
    from rows import Bench  # noqa: PLC0415

    lead = jax.process_index() == 0
    say = (lambda *a: print(*a, flush=True)) if lead else (lambda *a: None)
    te, message = te_rows.load(jax.process_count(), jax.process_index())
    say(f"TE: {message}" if te else f"TE: not run: {message}")
    devices = jax.devices()
    mesh = Mesh(np.array(devices), (AXIS,))
    say(
        f"{len(devices)} x {devices[0].device_kind} in {jax.process_count()} process(es), "
        f"jax {jax.__version__}; K={args.k} N={args.n}; {args.rounds} rounds x {args.iters} calls"
    )
    if devices[0].platform == "cpu":
        say("CPU devices: this checks the benchmark's code, not speed")
    bench = Bench(mesh, args, te, say)
    results = []
    for M in (int(m) for m in args.ms.split(",")):
        for section in args.sections.split(","):
            results += bench.run(section, M)
            if args.json and lead:
                with open(args.json, "w") as fh:
                    json.dump(dict(device=devices[0].device_kind, te=message, results=results), fh)
    say(
        "\njax_ub alone, 1 process x all GPUs: python -m jax_ub.bench --shapes "
        + ",".join(f"{m}x{args.k}x{args.n}" for m in args.ms.split(","))
        + ("" if args.no_fp8 else " --fp8")
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.launch and args.process_id < 0:
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
