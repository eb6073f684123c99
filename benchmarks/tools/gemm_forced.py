"""jax_ub's own GEMM (a group of one GPU) with each of cuBLASLt's candidate kernels forced
through a kernel choice file, timed in the op beside XLA's dot and jax_ub's tuned pick, in
shuffled rounds of loops: which kernel the op runs fastest for good, and how far tuning's pick
is from it. A device investigation tool, not part of the library.

JAX_UB_TRACE=1 python benchmarks/tools/gemm_forced.py 8192,8192,8192 [m,k,n ...]
  [--rounds 5 --seconds 0.2 --pick-only --rows]
(the trace shows tuning's times per candidate and each forced kernel taken from its file)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gemm_sources import check_close, jax_loop, loop_ms, own_gemm  # noqa: E402

import jax_ub  # noqa: E402
from jax_ub.bench.timing import round_order  # noqa: E402

CANDIDATES = 8  # the column description's heuristic list that tuning times (kCandidates)


def forced_gemms(a, b, folder: str, pick_only: bool, rows: bool) -> dict:
    """{"pick": the tuned op, "colI": the op forced to candidate I of the column description
    ("rowI": of the row description, with ``rows``)}, each run a few times."""
    tuned = os.path.join(folder, "tuned.txt")
    jax_ub.configure(gemm_cache=tuned)
    fns = {"pick": own_gemm()}
    for _ in range(30):  # past tuning and any trials
        fns["pick"](a, b).block_until_ready()
    key, choice = Path(tuned).read_text().strip().split(" | ")
    print(f"tuned pick (row, index): {choice}", flush=True)
    descriptions = (0, 1) if rows else (0,)
    forced = [] if pick_only else [(row, i) for row in descriptions for i in range(CANDIDATES)]
    for row, index in forced:
        name = f"{'row' if row else 'col'}{index}"
        path = os.path.join(folder, f"{name}.txt")
        Path(path).write_text(f"{key} | {row} {index}\n")
        jax_ub.configure(gemm_cache=path)  # new settings: a new communicator reads it
        fns[name] = own_gemm()
        for _ in range(30):  # as many as the pick's: a refused kernel's trials end in them
            fns[name](a, b).block_until_ready()
        # A kernel the heuristic list lacks here is tuned instead, and the tuned pick then
        # recorded after our line: that op is not this candidate's.
        if len(Path(path).read_text().splitlines()) > 1:
            print(f"{name}: not in cuBLASLt's list here (tuned instead): left out", flush=True)
            del fns[name]
    jax_ub.configure(gemm_cache="")
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="m,k,n")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--pick-only", action="store_true", help="the tuned pick and XLA only")
    ap.add_argument("--rows", action="store_true", help="the row description's candidates too")
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("gemm_forced.py times cuBLASLt's kernels: it needs a GPU")
    for shape in args.shapes:
        m, k, n = map(int, shape.split(","))
        rng = np.random.default_rng(0)
        a = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.01, jnp.bfloat16)
        print(f"== {shape}", flush=True)
        fns = {"xla": jax.jit(lambda a, b: a @ b)}
        fns.update(forced_gemms(a, b, tempfile.mkdtemp(), args.pick_only, args.rows))
        want = fns["xla"](a, b)
        for name, fn in fns.items():  # every kernel computes the product
            check_close(name, fn(a, b), want)
        impls = {name: jax_loop(fn, a, b) for name, fn in fns.items()}
        times: dict[str, list[float]] = {name: [] for name in impls}
        for r in range(args.rounds):
            for name in round_order(impls, r):
                times[name].append(loop_ms(*impls[name], args.seconds))
        base = statistics.median(times["xla"])
        for name, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            med = statistics.median(ts)
            spread = 100 * (max(ts) - min(ts)) / med
            print(f"  {name:5s} {med:7.3f} ms  x{med / base:.3f} of XLA  spread {spread:4.1f}%")


if __name__ == "__main__":
    main()
