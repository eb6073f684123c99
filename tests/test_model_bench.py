"""python -m jax_ub.bench.model on CPU devices: every in-process variant runs and reports,
jax_ub's first loss equals XLA's, and the bound (no communication) is traced apart from
jax_ub's ops traced before it, in bf16 and in fp8."""

import json
import re
import statistics

import pytest

from jax_ub.bench import model, model_report


def test_variants_run_and_agree(tmp_path, capsys, order="jax_ub,jax_ub_keep,xla,bound,bound_ub"):
    path = tmp_path / "model.json"
    model.main(
        [
            "--variants",
            order,
            "--rounds",
            "1",
            "--steps",
            "1",
            "--seq",
            "32",
            "--dtype",
            "float32",
            "--json",
            str(path),
        ]
    )
    out = capsys.readouterr().out
    assert "first-step loss, jax_ub vs XLA" in out and "/bound_ub" in out
    results = json.loads(path.read_text())["results"]
    losses = {v: results[v]["first_loss"] for v in order.split(",")}
    for v in ("jax_ub", "jax_ub_keep"):
        assert abs(losses[v] - losses["xla"]) <= 1e-5 * abs(losses["xla"]), losses
    # Gathering x again in the backward keeps less than keeping the gathered x.
    memory = {v: results[v]["memory_bytes"] for v in ("jax_ub", "jax_ub_keep")}
    assert memory["jax_ub"] < memory["jax_ub_keep"], memory
    # The bound multiplies copies of the local rows, not the gathered sequence; on jax_ub's
    # GEMMs (each call on a group of one) the same math.
    assert abs(losses["bound"] - losses["xla"]) > 1e-4
    assert abs(losses["bound_ub"] - losses["bound"]) <= 1e-5 * abs(losses["bound"]), losses
    assert all(results[v]["step_ms"] > 0 for v in losses)


def test_xla_overlap_without_gpus_says_it_needs_them(capfd):
    """xla_overlap's process on CPU devices ends naming what it needs, and the run reports
    no row for it (its GPU flags would time plain XLA under its name)."""
    model.main(["--variants", "xla_overlap", "--rounds", "1", "--steps", "1", "--seq", "32"])
    out, err = capfd.readouterr()
    assert "xla_overlap needs GPUs" in err and "runs on cpu devices" in err, err[-2000:]
    assert "xla_overlap: the process failed" in out
    assert not re.search(r"^xla_overlap\s+[0-9]", out, flags=re.M), out


def test_one_gpu_step_runs_jax_ubs_own_gemms(tmp_path):
    """At tp=1 (dp over every device) the jax_ub variant runs jax_ub's calls, its own GEMMs
    on groups of one (the compiled step is checked for them), with XLA's first loss."""
    path = tmp_path / "model.json"
    argv = ["--tp", "1", "--batch", "8", "--seq", "32", "--dtype", "float32"]
    model.main(
        [*argv, "--variants", "jax_ub,xla", "--rounds", "1", "--steps", "1", "--json", str(path)]
    )
    results = json.loads(path.read_text())["results"]
    ub, xla = results["jax_ub"]["first_loss"], results["xla"]["first_loss"]
    assert abs(ub - xla) <= 1e-5 * abs(xla), (ub, xla)


@pytest.mark.parametrize("wrong", [3.1, float("nan")])
def test_a_variant_whose_loss_differs_from_xlas_ends_the_run(wrong):
    """Every variant but the bounds (wrong numbers by design) must have XLA's first loss."""
    args = type("Args", (), {"dtype": "float32", "fp8": "none"})()
    rows = {v: {"first_loss": 3.0} for v in ("xla", "jax_ub", "xla_overlap")}
    rows["bound"] = {"first_loss": 9.0}
    model_report.check_losses(rows, args, lambda *a: None)
    rows["jax_ub_keep"] = {"first_loss": wrong}
    with pytest.raises(SystemExit, match="differ from XLA's.*jax_ub_keep"):
        model_report.check_losses(rows, args, lambda *a: None)


def test_a_variant_that_times_the_wrong_thing_is_refused():
    mesh = type("Mesh", (), {"shape": {"dp": 8, "tp": 1}})()
    with pytest.raises(SystemExit, match=r"variant jax_ub: the compiled step has no jax_ub call"):
        model._check_calls("jax_ub", 'custom_call_target="xla_ffi_python"', mesh)
    with pytest.raises(SystemExit, match="variant bound: the compiled step has 1 jax_ub calls"):
        model._check_calls("bound", 'custom_call_target="jax_ub_all_gather_matmul"', mesh)


def test_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="unknown variants \\['nccl'\\]"):
        model.main(["--variants", "jax_ub,nccl"])


@pytest.mark.parametrize(
    "flag,value,least",
    [
        ("--processes", "0", 1),
        ("--layers", "0", 1),
        ("--steps", "0", 1),
        ("--rounds", "0", 1),
        ("--batch", "0", 1),
        ("--seq", "1", 2),
        ("--scan-unroll", "-1", 0),
        ("--warmup", "x", 0),
    ],
)
def test_counts_out_of_range_are_refused_before_anything_runs(capsys, flag, value, least):
    with pytest.raises(SystemExit):
        model.main([flag, value])
    assert f"{flag}: must be an integer >= {least}, got '{value}'" in capsys.readouterr().err


def test_fp8_bound_runs_xlas_fp8_gemms_without_communication(tmp_path):
    """With --fp8 the bound is the xla variant's fp8 step with its gathers and
    reduce-scatters replaced by local copies and sums: fp8 GEMMs, no row collectives. Run
    in current scaling, then its compiled programs read (delayed scaling swaps the same
    collectives for the same stand-ins)."""
    path = tmp_path / "model.json"
    argv = ["--variants", "xla,bound", "--rounds", "1", "--steps", "1", "--warmup", "0"]
    argv += ["--fp8", "current", "--seq", "32"]
    model.main([*argv, "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert results["bound"]["step_ms"] > 0
    assert results["bound"]["first_loss"] != results["xla"]["first_loss"]  # copies, not the rows

    args = model._parser().parse_args(argv)
    cfg, mesh, tokens = model.setup(args)
    texts = {}
    for variant in ("xla", "bound"):
        compiled, _, _ = model.compiled_step(variant, cfg, mesh, tokens, args)
        texts[variant] = compiled.as_text()
    for variant, text in texts.items():
        assert "f8e4m3fn" in text, variant  # fp8 GEMM operands in both
    # The ops' gathers and reduce-scatters (JAX's op names); what stays in the bound: the
    # scales' all-reduces, the loss's, and dp's (the embedding's gradient).
    ops = {
        v: re.findall(r'op_name="[^"]*shard_map/(all_gather|reduce_scatter)"', t)
        for v, t in texts.items()
    }
    assert "all_gather" in ops["xla"] and "reduce_scatter" in ops["xla"]
    assert ops["bound"] == []
    # The bound's copies and sums, forward and backward, carry the scope its profile sums.
    scoped = re.findall(r'op_name="([^"]*)/bound_stand_in/', texts["bound"])
    assert any("transpose(" in s for s in scoped) and any("transpose(" not in s for s in scoped)
    assert "bound_stand_in" not in texts["xla"]


def test_ub_variants_run_under_their_own_communicators(tmp_path):
    """--ub-variants adds jax_ub under other tuning choices: the same loss, and each jax_ub
    variant reports the userbuffers of its own communicator, not every live one's."""
    from jax_ub._src.runtime import communicator

    path = tmp_path / "model.json"
    tuned = "jax_ub[reduce_scatter_fold_rows=-1]"
    argv = ["--variants", "jax_ub", "--ub-variants", "reduce_scatter_fold_rows=-1"]
    model.main([*argv, "--rounds", "1", "--steps", "1", "--seq", "32", "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert results[tuned]["first_loss"] == pytest.approx(results["jax_ub"]["first_loss"], rel=1e-5)
    ub = [results[v]["userbuffer_bytes"] for v in ("jax_ub", tuned)]
    live = sum(c.capacity_bytes for c in communicator.live_communicators())
    assert min(ub) > 0 and sum(ub) <= live, (ub, live)


def test_processes_time_the_variants_in_fresh_processes(tmp_path, capsys):
    """--processes N: the in-process variants timed in N processes of their own, one after
    another; each process's times and ratios printed, per variant the median over them. A
    --ub-variants variant (its name holds a comma) runs in each process too: jax_ub under a
    tuning choice (the default tuning's jax_ub runs in the tests above)."""
    path = tmp_path / "model.json"
    argv = ["--variants", "bound", "--processes", "2", "--rounds", "1", "--steps", "1"]
    tuned = "reduce_scatter_fold_rows=-1,gemm_trials=0"
    model.main([*argv, "--ub-variants", tuned, "--warmup", "0", "--seq", "32", "--json", str(path)])
    out = capsys.readouterr().out
    results = json.loads(path.read_text())["results"]
    assert results["_processes"] == 2
    for v in ("bound", f"jax_ub[{tuned}]"):
        ms = results[v]["per_process_ms"]
        assert len(ms) == 2 and min(ms) > 0, ms
        assert results[v]["step_ms"] == statistics.median(ms)
    for i in (1, 2):
        ub = re.escape(f"jax_ub[{tuned}]")
        assert re.search(rf"process {i}: bound [\d.]+ ms, {ub} [\d.]+ ms \([\d.]+x the bound", out)
    assert "the median over 2 processes" in out
