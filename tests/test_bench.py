"""The benchmark's plumbing on CPU devices (no timings are checked: those vary by machine)."""

from __future__ import annotations

import json
import os
import re
import runpy
import sys

import jax
import jax.numpy as jnp
import pytest

from jax_ub import bench


def test_bench_writes_every_implementation_and_checks_results(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(
        "--shapes 64x32x64 --tp 2 --rounds 2 --iters 2 --loop-seconds 0.02 "
        f"--no-windowed-einsum --json {out}".split()
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["op"], r["M"], r["tp"]) for r in rows] == [("ag", 64, 2), ("rs", 64, 2)]
    for r in rows:
        assert {"gemm", "comm", "xla_seq", "jax_ub", "ub_gemm"} <= set(r["times_ms"]), r["times_ms"]
        assert all(t > 0 for t in r["times_ms"].values())
        # jax_ub's output was compared with XLA's on fresh random data.
        assert r["rel_err"]["jax_ub"] < 2e-2
        # jax_ub's GEMM alone (groups of one device) was compared with XLA's dot.
        assert r["rel_err"]["ub_gemm"] < 2e-2
        assert r["ub_over_own_gemm"] > 0
        # Loops of >= 20 ms took at least --iters calls each.
        assert min(r["calls"].values()) >= 2


def test_bench_all_reduce_rows(tmp_path):
    """--ops ar: GEMM + all-reduce at a decode size (one row, padded by ub) and a prefill
    size, jax_ub's and impl="auto"'s results checked against XLA's dot + psum."""
    out = tmp_path / "bench.json"
    bench.main(
        "--ops ar --shapes 64x32x48 --sweep-m 1 --tp 2 --rounds 1 --iters 2 "
        f"--no-windowed-einsum --json {out}".split()
    )
    rows = json.loads(out.read_text())["results"]
    assert [(r["op"], r["M"]) for r in rows] == [("ar", 64), ("ar", 1)]
    for r in rows:
        assert {"gemm", "comm", "xla_seq", "jax_ub", "jax_ub_auto"} <= set(r["times_ms"])
        assert r["rel_err"]["jax_ub"] < 2e-2 and r["rel_err"]["jax_ub_auto"] < 2e-2


def test_bench_fp8_rows(tmp_path):
    """--fp8 adds jax_ub's and XLA's ops in fp8 (on quantized operands; jax_ub's also
    quantizing in the call) and the fp8 GEMM alone, each op checked against XLA's bf16 op
    (fp8's quantization error, not more)."""
    out = tmp_path / "bench.json"
    bench.main(
        "--shapes 64x32x64 --tp 2 --rounds 1 --iters 2 --fp8 --no-windowed-einsum "
        f"--json {out}".split()
    )
    for r in json.loads(out.read_text())["results"]:
        rows = {"jax_ub_fp8", "xla_fp8", "jax_ub_fp8_hp", "fp8_gemm", "fp8_nocomm"}
        assert rows <= set(r["times_ms"])
        assert 1e-3 < r["rel_err"]["jax_ub_fp8"] < 0.1, r["rel_err"]
        assert abs(r["rel_err"]["jax_ub_fp8"] - r["rel_err"]["xla_fp8"]) < 1e-2, r["rel_err"]
        # The same scales: quantizing in the call gives the same fp8 operands.
        assert abs(r["rel_err"]["jax_ub_fp8"] - r["rel_err"]["jax_ub_fp8_hp"]) < 1e-3, r
        assert r["ub_fp8_over_fp8_gemm"] > 0 and r["ub_fp8_hp_over_nocomm"] > 0
        # The fp8 op without communication quantizes as fp8_gemm's operands were.
        assert r["rel_err"]["fp8_nocomm"] < 1e-2, r["rel_err"]


def test_bench_epilogue_rows(tmp_path):
    """--epilogue adds gelu(x @ w + bias) by jax_ub (in its GEMMs' epilogue), by XLA's op and
    after XLA's dot alone, each checked against XLA's op with the same epilogue."""
    out = tmp_path / "bench.json"
    bench.main(
        "--shapes 64x32x64 --tp 2 --rounds 1 --iters 2 --ops ag --epilogue "
        f"--no-windowed-einsum --json {out}".split()
    )
    (r,) = json.loads(out.read_text())["results"]
    assert {"jax_ub_bias_gelu", "xla_bias_gelu", "gemm_bias_gelu"} <= set(r["times_ms"])
    assert r["rel_err"]["jax_ub_bias_gelu"] < 1e-2, r["rel_err"]  # bf16 rounding only
    assert r["rel_err"]["gemm_bias_gelu"] < 1e-2, r["rel_err"]
    assert r["ub_epilogue_over_ub"] > 0 and r["ub_epilogue_over_gemm"] > 0


def test_rounds_take_shuffled_orders_that_every_process_shares():
    """Each round times the implementations in an order of its own (a loop's time depends on
    the one before it), the same in every process for a given round (their collectives must
    match), every name exactly once."""
    from jax_ub.bench.timing import round_order  # noqa: PLC0415

    names = [f"impl{i}" for i in range(8)]
    orders = [round_order(names, r) for r in range(5)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [round_order(list(names), r) for r in range(5)]
    assert len({tuple(o) for o in orders}) == 5
    assert len({o[0] for o in orders}) > 1


def test_bench_refuses_loop_seconds_across_processes():
    with pytest.raises(SystemExit):
        bench.main("--processes 2 --loop-seconds 1".split())


@pytest.mark.slow
def test_bench_in_processes_that_share_one_gpu(tmp_path, monkeypatch):
    """--processes 2 --share-gpu: two processes joined by jax.distributed, each a rank (on
    GPUs, both on GPU 0 through jax_ub.share_gpu): the ops run across them at tp=2 and are
    checked against XLA's; process 0 writes the JSON."""
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv(
        "XLA_FLAGS", re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    )
    out = tmp_path / "bench.json"
    argv = "--processes 2 --share-gpu --shapes 64x32x64 --ops ag,rs --rounds 1 --iters 2"
    with pytest.raises(SystemExit) as done:
        bench.main([*argv.split(), "--json", str(out)])
    assert done.value.code == 0
    report = json.loads(out.read_text())
    assert (report["tp"], report["processes"]) == (2, 2)
    assert [r["op"] for r in report["results"]] == ["ag", "rs"]
    for r in report["results"]:
        assert 0 <= r["rel_err"]["jax_ub"] < 2e-2, r["rel_err"]


@pytest.mark.parametrize(
    "argv,got",
    [
        ("--share-gpu", "--processes 0, --gpus-per-process 1"),
        ("--share-gpu --processes 2 --gpus-per-process 2", "--processes 2, --gpus-per-process 2"),
    ],
)
def test_bench_share_gpu_needs_processes_of_one_gpu(capsys, argv, got):
    with pytest.raises(SystemExit):
        bench.main(argv.split())
    err = capsys.readouterr().err
    assert "--share-gpu needs --processes >= 2 and one GPU a process; got " + got in err


def test_bench_refuses_an_epilogue_without_the_all_gather(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--ops", "rs", "--epilogue"])
    err = capsys.readouterr().err
    assert "--epilogue adds the all-gather's (ag) rows: --ops rs has none" in err


@pytest.mark.parametrize("tp", [-1, -6, len(jax.devices()) + 1])
def test_bench_refuses_a_tp_outside_the_devices(capsys, tp):
    with pytest.raises(SystemExit):
        bench.main(["--tp", str(tp)])
    assert f"--tp must be between 1 and the {len(jax.devices())} devices" in capsys.readouterr().err


def test_bench_measures_settings_variants_in_the_same_rounds(tmp_path):
    """--ub-variants adds jax_ub rows compiled under other settings, each checked against
    XLA like jax_ub's own row."""
    out = tmp_path / "bench.json"
    bench.main(
        "--shapes 32x16x32 --tp 2 --rounds 2 --iters 2 --no-windowed-einsum "
        "--ub-variants reduce_scatter_fold_rows=0;reduce_scatter_fold_rows=-1,gemm_trials=0 "
        f"--json {out}".split()
    )
    names = [
        "jax_ub[reduce_scatter_fold_rows=0]",
        "jax_ub[reduce_scatter_fold_rows=-1,gemm_trials=0]",
    ]
    for r in json.loads(out.read_text())["results"]:
        for name in names:
            assert r["times_ms"][name] > 0, r["times_ms"]
            assert r["rel_err"][name] < 2e-2, r["rel_err"]
    # The variants' settings were put back: later traces get the default communicator.
    assert bench.options.tuning() == bench.options.Tuning()


def test_bench_variants_may_set_the_gemm_choice_file(tmp_path):
    """A variant's ``gemm_cache`` (a user setting, not a tuning choice) reaches its own
    communicator, to compare kernel sets in one process, and is put back afterwards."""
    import jax_ub
    from jax_ub._src.runtime import communicator
    from jax_ub.bench.impls import configured as configure_variant

    choices = tmp_path / "choices.txt"
    out = tmp_path / "bench.json"
    bench.main(
        "--shapes 32x16x32 --tp 2 --rounds 1 --iters 2 --no-windowed-einsum --ops ag "
        f"--ub-variants gemm_cache={choices} --json {out}".split()
    )
    (r,) = json.loads(out.read_text())["results"]
    assert r["rel_err"][f"jax_ub[gemm_cache={choices}]"] < 2e-2, r["rel_err"]
    with configure_variant({"gemm_cache": str(choices)}):
        with_file = bench.options.current_options()
    assert communicator.live_communicators(with_file), "the variant has no communicator"
    assert communicator.live_communicators(bench.options.current_options())  # jax_ub's row
    assert jax_ub.config.gemm_cache == "auto"


@pytest.mark.parametrize(
    "bad", ["no_such_setting=1", "gemm_order=sideways", "timeout_s", "gemm_cache=/no/such/dir/f"]
)
def test_bench_refuses_bad_variants(bad):
    with pytest.raises(SystemExit):
        bench.main(["--ub-variants", bad])


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--rounds 0", "--rounds and --iters must be >= 1, got 0"),
        ("--shapes 30x8x8 --tp 4", "M=30 and N=8 must be multiples of the 4 devices"),
        ("--shapes 8x8", "is not three positive sizes"),
        ("--shapes axbxc", "is not MxKxN"),
        ("--ops ag,xy", "--ops takes ag, rs, ar, got ['xy']"),
    ],
)
def test_bench_bad_arguments_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv.split())
    assert message in capsys.readouterr().err


def test_bench_on_cpu_says_so_and_skips_a_png_it_cannot_draw(tmp_path, capsys, monkeypatch):
    """CPU devices: CPU-sized default shapes, a note that times say nothing about GPUs, no
    Pallas GPU kernel; --png without matplotlib is a one-line note, the JSON is written."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "bench.json"
    bench.main(f"--ops ag --tp 2 --rounds 1 --iters 1 --json {out} --png {tmp_path}/b.png".split())
    text = capsys.readouterr().out
    assert "times say nothing about GPUs" in text and "CPU-sized shapes 256x128x256" in text
    assert "pallas_mgpu" not in text and "per-device ms" in text
    assert "skipped, matplotlib is missing" in text
    rows = json.loads(out.read_text())["results"]
    assert [(r["op"], r["M"], r["K"], r["N"]) for r in rows] == [("ag", 256, 128, 256)]


def _bench_parsers():
    """(module name, parser) of every command line in jax_ub.bench: each module there that
    builds one with _parser()."""
    import importlib
    import pkgutil

    found = []
    for info in pkgutil.iter_modules(bench.__path__):
        if info.name.startswith("_"):  # __main__ would run the benchmark
            continue
        module = importlib.import_module(f"jax_ub.bench.{info.name}")
        if callable(getattr(module, "_parser", None)):
            found.append((module.__name__, module._parser()))
    return found


# Options that only the benchmark's own child processes pass (hidden from --help).
INTERNAL_OPTIONS = {"--process-id", "--coordinator", "--windowed-einsum-child", "--child"}


def test_every_bench_cli_describes_itself_and_every_option(capsys):
    """`--help` of each bench command line: a one-paragraph description in full sentences
    (not a module docstring's first line, cut or about the code), and help for every
    option; the help text formats (a stray % would break it)."""
    import argparse
    import re

    parsers = _bench_parsers()
    assert {name for name, _ in parsers} >= {"jax_ub.bench.cli", "jax_ub.bench.layer"}
    for name, ap in parsers:
        text = ap.description or ""
        assert re.fullmatch(r"[A-Z][^\n]*\.", text), (name, text)
        assert len(text.split()) >= 30 and text.count(". ") >= 1, (name, text)
        assert "benchmark" in text.lower() and text.count("(") == text.count(")"), (name, text)
        for action in ap._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            option = action.option_strings[0] if action.option_strings else action.dest
            if action.help == argparse.SUPPRESS:
                assert option in INTERNAL_OPTIONS, f"{name}: {option} is hidden from --help"
                continue
            assert action.help and len(action.help.split()) >= 3, f"{name}: {option} has no help"
        ap.format_help()
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Overlap benchmark: times jax_ub's all_gather_matmul" in out
    assert "Command line: parse" not in out


def test_gemm_table_runs_and_checks_its_rows(capsys, monkeypatch):
    # benchmarks/gemm_table.py on CPU devices, its "tiny" model: every row printed with
    # jax_ub's outputs checked against XLA's (torch absent or not, its cells may be nan),
    # with one GEMM per timed call and with several; per kind five cells, the last the
    # noise gauge (XLA's program timed again, over the same fastest), and a sixth with
    # --ub-variant (jax_ub compiled under other tuning choices, over the same fastest); with
    # --slot-ms, the implementations take turns in slots within each round.
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gemm_table.py")
    runs = [
        (["--per-call", "1"], ["qkv", "o", "gate/up", "down"]),
        (["--fp8", "--per-call", "3", "--projections", "gate/up,o"], ["o", "gate/up"]),
        (["--per-call", "2", "--projections", "o", "--ub-variant", "autotune_gemm=False"], ["o"]),
        (["--per-call", "2", "--projections", "qkv,down", "--slot-ms", "4"], ["qkv", "down"]),
    ]
    for extra, names in runs:
        per_kind = 6 if "--ub-variant" in extra else 5
        argv = [script, "--models", "tiny", "--tp", "2", "--tokens", "64", "--seconds", "0.01"]
        monkeypatch.setattr(sys, "argv", argv + ["--rounds", "1", *extra])
        runpy.run_path(script, run_name="__main__")
        lines = capsys.readouterr().out.splitlines()
        rows = [line for line in lines if "tiny" in line and "(tp2)" in line]
        assert [r.split("|")[1].split()[1] for r in rows] == names
        kinds = 1 if "--fp8" in extra else 2
        # After the ratios: spread, host us, jax_ub's kernel and the variant's, then the end.
        tail = 4 + (per_kind == 6)
        head = next(line for line in lines if line.startswith("| projection"))
        for r in rows:
            assert len(r.split("|")) == 2 + per_kind * kinds + tail == len(head.split("|")), r
            ratios = [float(c) for c in r.split("|")[2:-tail] if c.strip() != "nan"]
            assert ratios and all(v > 0 for v in ratios), r
        # Then the summary: a projection a line, its tp's cell jax_ub / the fastest per kind
        # (the variant's in brackets, torch / XLA beside them where torch ran), the same
        # ratios as the rows'.
        summary = [line for line in lines if "tiny" in line and "(tp2)" not in line]
        assert [r.split("|")[1].split()[1] for r in summary] == names
        for r, row in zip(summary, rows):
            cell, _, variant = r.split("|")[2].split("(")[0].partition("[")
            cells = row.split("|")
            assert [float(v) for v in cell.split(";")] == [
                float(cells[5 + per_kind * i]) for i in range(kinds)
            ], (r, row)
            if per_kind == 6:
                assert [float(v) for v in variant.rstrip("] ").split(";")] == [
                    float(cells[7 + per_kind * i]) for i in range(kinds)
                ], (r, row)


def test_gemm_table_refuses_outputs_off_xlas():
    """gemm_table.py's check of jax_ub's outputs (on the device): close ones pass; one off
    by 5%, or NaN, stops the row."""
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gemm_table.py")
    check_close = runpy.run_path(script)["check_close"]
    want = jax.random.normal(jax.random.key(0), (64, 48), jnp.bfloat16)
    noise = jax.random.normal(jax.random.key(1), want.shape, jnp.float32)
    check_close("close", [want + 1e-3 * noise.astype(want.dtype)], [want])
    for bad in (want + 0.05 * jnp.abs(want), want.at[3, 4].set(jnp.nan)):
        with pytest.raises(AssertionError, match="jax_ub's output is off XLA's"):
            check_close("bad", [want, bad], [want, want])
