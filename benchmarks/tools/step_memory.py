"""What fills the Llama step's peak device memory, per variant of ``python -m
jax_ub.bench.model`` (jax_ub, jax_ub_keep, xla, bound).

python benchmarks/tools/step_memory.py --preset llama3-8b --layers 8 --seq 8192 --batch 1 \\
    --param-dtype bfloat16 --scan-unroll 0 --variants jax_ub,xla [--out DIR]

Compiles each variant's step (nothing runs) with XLA's dump of the optimized module's live
ranges, and prints XLA's memory estimate (arguments, outputs, temporaries), the buffers live
at the peak, largest first, with the HLO instruction and shape of each, and the same buffers
summed by the JAX operation they came from, and XLA's allocations by kind (the
preallocated temporaries are one heap: its size over the peak's temporaries is
fragmentation). ``--out DIR`` keeps each variant's live ranges and buffer assignment.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import tempfile

# The dump's flags must be set before JAX starts its backends.
_DUMP = pathlib.Path(tempfile.mkdtemp(prefix="step_memory_"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*"
    + " --xla_dump_hlo_pass_re=^$"
).strip()

# "  Live ranges at 314 (peak):" then "    name{index}: 524288 bytes (cumulative: ...)"
_PEAK_ENTRY = re.compile(r"^\s+(\S+)\{[\d,]*\}: (\d+) bytes")
# "  %name = bf16[8192,4096]{1,0} op(...)" in the optimized module (shape up to the op)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?\[[^\]]*\](?:\{[^}]*\})?|\([^=]*?\)) "
)
# "├── op_name (5.4%, total: 262 144 bytes, current: 262 144 bytes, remaining: ...)"
_STACK_ENTRY = re.compile(r"[├└]── (.*) \([\d.]+%, total: ([\d ]+) bytes, current: ([\d ]+) bytes")


def peak_buffers(live_range: str, module: str) -> list[tuple[float, str, str]]:
    """(MiB, instruction, shape) of each buffer live at the peak, largest first."""
    shapes = {}
    for line in module.splitlines():
        if m := _INSTRUCTION.match(line):
            shapes[m.group(1)] = m.group(2)
    section = live_range.split("(peak):", 1)[1].split("Stack trace breakdown", 1)[0]
    out = []
    for line in section.splitlines():
        if m := _PEAK_ENTRY.match(line):
            out.append((int(m.group(2)) / 2**20, m.group(1), shapes.get(m.group(1), "?")))
    return sorted(out, reverse=True)


def peak_by_source(live_range: str) -> list[tuple[float, str]]:
    """(MiB, JAX op name) of the buffers live at the peak, by where JAX traced them."""
    section = live_range.split("Stack trace breakdown for peak usage", 1)[1]
    out = [
        (int(cur.replace(" ", "")) / 2**20, name)
        for name, _, cur in _STACK_ENTRY.findall(section)
        if int(cur.replace(" ", ""))
    ]
    return sorted(out, reverse=True)


# "allocation 12: size 1048576, parameter 4, shape |f32[..]| ...", "..., preallocated-temp:";
# GPU dumps put "page 0, " before the kind.
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (?:page \d+, )?([a-z\-]+)", re.M)


def allocations_by_kind(assignment: str) -> dict[str, float]:
    """The buffer assignment's allocations summed by kind (parameter, preallocated-temp,
    output, constant, ...): what XLA's memory estimate is made of."""
    kinds: dict[str, float] = {}
    for size, kind in _ALLOCATION.findall(assignment):
        kinds[kind] = kinds.get(kind, 0.0) + int(size) / 2**30
    return {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    out = pathlib.Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if out:
        i = argv.index("--out")
        argv = argv[:i] + argv[i + 2 :]
    import jax

    from jax_ub.bench import model as bench_model

    args = bench_model._parser().parse_args(argv)
    cfg, mesh, tokens = bench_model.setup(args)
    for variant in args.variants.split(","):
        before = set(_DUMP.iterdir())
        compiled, state, used = bench_model.compiled_step(variant, cfg, mesh, tokens, args)
        del state, compiled
        jax.clear_caches()
        new = sorted(set(_DUMP.iterdir()) - before)
        ranges = [p for p in new if p.name.endswith("after_optimizations-live-range.txt")]
        print(f"== {variant}: XLA's estimate {used / 2**30:.3f} GiB", flush=True)
        for live_range in ranges:
            module = live_range.with_name(live_range.name.replace("-live-range", ""))
            text = live_range.read_text()
            if out:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"live_range_{variant}.txt").write_text(text)
            buffers = peak_buffers(text, module.read_text())
            total = sum(b[0] for b in buffers)
            print(f"  {len(buffers)} buffers live at the peak, {total / 1024:.3f} GiB; largest:")
            for mib, name, shape in buffers[:30]:
                print(f"  {mib:9.1f} MiB  {name}  {shape}")
            print("  by where JAX traced them (largest):")
            for mib, name in peak_by_source(text)[:25]:
                print(f"  {mib:9.1f} MiB  {name[-150:]}")
        for assignment in [
            p for p in new if p.name.endswith("after_optimizations-buffer-assignment.txt")
        ]:
            text = assignment.read_text()
            if out:
                (out / f"buffers_{variant}.txt").write_text(text)
            print("  allocations by kind (GiB):", allocations_by_kind(text))
        if not ranges:
            print("  (no live-range file in the dump:", [p.name for p in new][:8], ")")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        shutil.rmtree(_DUMP, ignore_errors=True)  # the whole dump: every module, every pass
