"""Each sustained tuning of a JAX_UB_TRACE=1 log (src/cuda/gemm/tune.cc), one line a shape:
the candidates' scores (each round's time over the round's geometric mean, the middle over
rounds: what tuning ranks by), the kernel it kept, and what the rounds' plain means would
have picked, with the first pick's lead both ways: whether a clock that dips in some rounds
(one H100 at its 700 W cap) moved the choice.

python benchmarks/tools/tuning_trace.py LOG [LOG ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

TUNING = re.compile(r"GPU (\d+) tuning, ms a run \(sustained blocks, ([0-9.]+) s\): (.*)")
SHAPE = re.compile(
    r"GPU (\d+) GEMM m=(\d+) k=(\d+) n=(\d+): (\w+) description, algo \d+ tile (\d+)"
)
STEADY = re.compile(r"(\d+) steady rounds")
ENTRY = re.compile(r"(row|col)(\d+) tile (\d+): [0-9.]+ x([0-9.]+) \[([^\]]*)\]")


def tunings(text: str) -> list[dict]:
    """The sustained tunings of a log, each with the shape and kernel the next GEMM line of
    its GPU names."""
    found, pending = [], {}
    for line in text.splitlines():
        if m := TUNING.search(line):
            rounds = {
                f"{d}{i} tile {t}": (float(score), [float(x.split("@")[0]) for x in r.split()])
                for d, i, t, score, r in ENTRY.findall(m.group(3))
            }
            pending[m.group(1)] = {
                "seconds": float(m.group(2)),
                "rounds": rounds,
                "held": "first pick holds" in m.group(3),
                "steady": (s.group(1) if (s := STEADY.search(m.group(3))) else "?"),
            }
        elif (m := SHAPE.search(line)) and m.group(1) in pending:
            t = pending.pop(m.group(1))
            t["shape"] = "x".join(m.group(2, 3, 4))
            t["kept_tile"] = int(m.group(6))
            found.append(t)
    return found


def report(t: dict) -> str:
    names = list(t["rounds"])
    by_score = min(names, key=lambda n: t["rounds"][n][0])
    means = {n: sum(r) / len(r) for n, (_, r) in t["rounds"].items() if r}
    by_mean = min(means, key=means.get)
    first = next((n for n in names if n.startswith("col0 ") or n.startswith("row0 ")), None)
    lead = f"; the first pick {means[first] / means[by_mean]:.3f}x by means" if first else ""
    return (
        f"{t['shape']}: kept tile {t['kept_tile']}{' (held)' if t['held'] else ''}, "
        f"fastest by score {by_score} ({t['steady']} steady rounds), by means {by_mean}{lead} "
        f"({t['seconds']:.2f} s; "
        + ", ".join(f"{n} x{s:.3f}" for n, (s, _) in t["rounds"].items())
        + ")"
    )


def main() -> None:
    for path in sys.argv[1:]:
        print(f"# {path}")
        for t in tunings(Path(path).read_text(errors="replace")):
            print(report(t))


if __name__ == "__main__":
    main()
