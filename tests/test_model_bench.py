"""python -m jax_ub.bench.model on CPU devices: every in-process variant runs and reports,
jax_ub's first loss equals XLA's, and the bound (no communication) is traced apart from
jax_ub's ops traced before it."""

import json

import pytest

from jax_ub.bench import model


def test_variants_run_and_agree(tmp_path, capsys, order="jax_ub,jax_ub_regather,xla,bound"):
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
    assert "first-step loss, jax_ub vs XLA" in out and "/bound" in out
    results = json.loads(path.read_text())["results"]
    losses = {v: results[v]["first_loss"] for v in ("jax_ub", "jax_ub_regather", "xla", "bound")}
    for v in ("jax_ub", "jax_ub_regather"):
        assert abs(losses[v] - losses["xla"]) <= 1e-5 * abs(losses["xla"]), losses
    # Gathering x again in the backward keeps less than keeping the gathered x.
    memory = {v: results[v]["memory_bytes"] for v in ("jax_ub", "jax_ub_regather")}
    assert memory["jax_ub_regather"] < memory["jax_ub"], memory
    # The bound multiplies copies of the local rows, not the gathered sequence.
    assert abs(losses["bound"] - losses["xla"]) > 1e-4
    assert all(results[v]["step_ms"] > 0 for v in losses)


def test_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="unknown variants \\['nccl'\\]"):
        model.main(["--variants", "jax_ub,nccl"])


def test_bound_is_refused_with_fp8():
    """The bound's GEMMs are bf16: no bound of an fp8 step, so the bench refuses it."""
    with pytest.raises(SystemExit, match="bound variant has no fp8 GEMMs"):
        model.main(["--variants", "jax_ub,bound", "--fp8", "current"])
