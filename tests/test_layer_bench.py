"""The layer benchmark (jax_ub.bench.layer) on 2 CPU devices: jax_ub's layer equals XLA's,
forward and gradients; the bound keeps the shapes; the table and JSON have every row."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from conftest import make_mesh, rel_err

from jax_ub.bench import layer

HIDDEN, FFN, SEQ, BATCH, HEAD_DIM = 32, 64, 16, 2, 8


@pytest.fixture(scope="module")
def setup():
    mesh = make_mesh((2, "tp"))
    inputs = layer.layer_inputs(mesh, HIDDEN, FFN, SEQ, BATCH, jnp.float32, seed=7)
    outs = {}
    for variant in layer.VARIANTS:
        fwd, fwd_bwd = layer.build(mesh, variant, HEAD_DIM)
        x, params, dy = inputs
        outs[variant] = (fwd(x, params), fwd_bwd(x, params, dy))
    return inputs, outs


def test_jax_ub_layer_equals_xla_forward_and_gradients(setup):
    (x, params, _), outs = setup
    (y_ub, (dx_ub, dp_ub)), (y_xla, (dx_xla, dp_xla)) = outs["jax_ub"], outs["xla"]
    assert y_ub.shape == x.shape and rel_err(y_ub, y_xla) < 1e-5
    assert rel_err(dx_ub, dx_xla) < 1e-5
    assert set(dp_ub) == set(params) == set(dp_xla)
    for name in params:
        assert dp_ub[name].shape == params[name].shape, name
        assert rel_err(dp_ub[name], dp_xla[name]) < 1e-5, name


def test_batch_major_layer_equals_xla_forward_and_gradients(setup):
    """The layer on batch-major rows (the ops with seq_axis=1) computes the same layer."""
    (x, params, dy), outs = setup
    fwd, fwd_bwd = layer.build(make_mesh((2, "tp")), layer.BATCH_MAJOR, HEAD_DIM)
    (y_xla, (dx_xla, dp_xla)) = outs["xla"]
    assert rel_err(fwd(x, params), y_xla) < 1e-5
    dx, dp = fwd_bwd(x, params, dy)
    assert rel_err(dx, dx_xla) < 1e-5
    for name in params:
        assert rel_err(dp[name], dp_xla[name]) < 1e-5, name


def test_bound_keeps_the_shapes_without_communicating(setup):
    (x, params, _), outs = setup
    y, (dx, dparams) = outs["bound"]
    assert y.shape == x.shape and dx.shape == x.shape
    assert all(dparams[n].shape == params[n].shape for n in params)
    # It computes other numbers: each rank's own rows stand in for its peers'.
    assert rel_err(y, outs["xla"][0]) > 1e-3


def test_layer_bench_table_and_json(tmp_path, capsys):
    out = tmp_path / "layer.json"
    rows = layer.main(
        f"--sizes {HIDDEN}x{FFN}x{SEQ} --batch {BATCH} --head-dim {HEAD_DIM} --tp 2 "
        f"--rounds 2 --iters 2 --json {out} --ub-variants reduce_scatter_fold_rows=-1 "
        "--batch-major".split()
    )
    tuned = "jax_ub[reduce_scatter_fold_rows=-1]"  # compiled under other tuning, checked too
    saved = json.loads(out.read_text())["results"]
    assert saved == json.loads(json.dumps(rows))
    assert [(r["hidden"], r["ffn"], r["seq"], r["tp"], r["pass"]) for r in saved] == [
        (HIDDEN, FFN, SEQ, 2, "fwd"),
        (HIDDEN, FFN, SEQ, 2, "fwd+bwd"),
    ]
    for r in saved:
        assert set(r["times_ms"]) == {*layer.VARIANTS, tuned, layer.BATCH_MAJOR}, r["times_ms"]
        assert all(t > 0 for t in r["times_ms"].values())
        assert r["over_bound"]["bound"] == 1.0 and r["speedup_vs_xla"] > 0
        # bf16: jax_ub's layer (outputs; gradients) checked against XLA's on random data.
        assert r["rel_err"]["jax_ub"] < 3e-2 and "bound" not in r["rel_err"], r["rel_err"]
        assert r["rel_err"][tuned] < 3e-2, r["rel_err"]
        # The batch-major layer computes the same layer: checked against XLA's too.
        assert r["rel_err"][layer.BATCH_MAJOR] < 3e-2, r["rel_err"]
    text = capsys.readouterr().out
    assert "not speed" in text and "fwd+bwd" in text
    assert all(v in text for v in layer.VARIANTS) and f"{tuned}:" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--sizes 30x64x16 --head-dim 8 --tp 2", "hidden must be a multiple of head_dim"),
        ("--sizes 32x64x15 --head-dim 8 --tp 2", "multiples of the 2 devices"),
        ("--sizes 32x64", "is not three positive sizes"),
        ("--rounds 0", "must be >= 1"),
        ("--ub-variants no_such_choice=1", "--ub-variants: unknown tuning choice"),
    ],
)
def test_layer_bench_bad_arguments_are_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        layer.main(argv.split())
    assert message in capsys.readouterr().err
