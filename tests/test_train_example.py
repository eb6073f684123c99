"""The tensor-parallel training example: the loss falls, and impl="ub" matches impl="xla"."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tp_transformer.py"
STEPS = 50
# Small enough for a few seconds per run on 2 CPU cores; 4 heads over tp=4.
CONFIG = dict(seq=32, batch=4, hidden=32, layers=1, heads=4, vocab=32, dtype="float32")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tp_transformer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def devices():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip(f"needs 4 devices, have {len(devices)}")
    return devices[:4]


@pytest.fixture(scope="module")
def runs(example, devices):
    """impl="ub" through train(), impl="xla" through the command line, same seed and data."""
    ub = example.train(steps=STEPS, impl="ub", devices=devices, progress=False, **CONFIG)
    flags = [f"--{k}={v}" for k, v in CONFIG.items()]
    results = example.main([f"--steps={STEPS}", "--impl=xla", "--no-progress", *flags])
    return {"ub": ub, "xla": results["xla"]}


def test_loss_decreases(runs):
    losses = np.asarray(runs["ub"].losses)
    assert losses.shape == (STEPS,) and np.all(np.isfinite(losses))
    assert losses[0] > 0.9 * np.log(CONFIG["vocab"])  # starts near chance
    assert losses[-5:].mean() < 0.5 * losses[:5].mean()
    assert runs["ub"].step_time_s > 0


def test_ub_matches_xla(runs):
    np.testing.assert_allclose(runs["ub"].losses, runs["xla"].losses, rtol=1e-3, atol=1e-4)


def test_dp_tp_mesh_matches_tp_only(example, devices):
    """--mesh dp=2,tp=2: the batch split over dp gives the same losses as tp=4 alone."""
    kw = dict(steps=10, impl="ub", devices=devices, progress=False, **CONFIG)
    dp_tp = example.train(mesh_shape={"dp": 2, "tp": 2}, **kw)
    tp_only = example.train(**kw)
    np.testing.assert_allclose(dp_tp.losses, tp_only.losses, rtol=1e-4, atol=1e-5)
    assert example.parse_mesh("dp=2,tp=2") == {"dp": 2, "tp": 2}


def test_fp8_training_follows_bf16(example, devices):
    """--fp8 (current scaling, the host emulating fp8): bf16 training whose loss follows the
    run without fp8 (what --compare-bf16 reports). hidden=64: the fused QKV projection's
    columns per rank (3 * hidden / tp) must be a multiple of 16 for fp8 GEMMs, on CPU devices
    as on GPUs."""
    config = {**CONFIG, "dtype": "bfloat16", "hidden": 64}
    kw = dict(steps=40, impl="ub", devices=devices, progress=False, **config)
    fp8 = np.asarray(example.train(fp8=True, **kw).losses)
    plain = np.asarray(example.train(**kw).losses)
    assert np.all(np.isfinite(fp8))
    assert not np.array_equal(fp8, plain)  # fp8 ran: quantization changes the numbers
    assert fp8[-5:].mean() < 0.5 * fp8[:5].mean()  # it learns
    # Within 5% of the bf16 run's loss over the last 10 steps.
    assert abs(fp8[-10:].mean() - plain[-10:].mean()) < 0.05 * plain[-10:].mean()
    assert "apart" in example.loss_gap_summary(list(fp8), list(plain))


def test_llama_example_runs_and_matches_xla():
    """examples/train_llama.py, as the README runs it, in a process of its own."""
    import subprocess
    import sys

    script = EXAMPLE.parent / "train_llama.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--seq", "32"],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    difference = float(done.stdout.strip().splitlines()[-1].split()[-1])
    assert difference < 1e-5, done.stdout


def _llama_example():
    spec = importlib.util.spec_from_file_location("train_llama", EXAMPLE.parent / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_example_data_follows_its_chain():
    """The synthetic language: every token is one of its predecessor's four successors, the
    successors' frequencies near 0.4, 0.3, 0.2, 0.1, the same batches for the same seed."""
    example = _llama_example()
    batches = example.markov_batches(vocab=50, steps=3, batch=4, seq=400)
    assert batches.shape == (3, 4, 400)
    np.testing.assert_array_equal(batches, example.markov_batches(50, 3, 4, 400))
    pairs = batches.reshape(-1, 400)
    follows: dict = {}
    for row in pairs:
        for a, b in zip(row[:-1], row[1:]):
            follows.setdefault(int(a), []).append(int(b))
    assert all(len(set(v)) <= 4 for v in follows.values())
    counts = sorted(np.bincount(v).max() / len(v) for v in follows.values() if len(v) > 60)
    assert counts and 0.25 < np.median(counts) < 0.55  # the likeliest successor's share: 0.4


def test_llama_example_spread_summary():
    """fp8's curve is within the seeds' spread where it is no further from their mean than
    their max - min; a curve far off is counted outside."""
    example = _llama_example()
    seeds = np.array([[5.0, 4.0, 3.0, 2.0], [5.2, 4.1, 3.2, 2.1], [4.9, 3.9, 3.1, 1.9]])
    near = example.spread_summary(np.array([5.1, 4.05, 3.1, 2.0]), seeds, "fp8")
    far = example.spread_summary(np.array([5.1, 4.05, 4.0, 3.0]), seeds, "fp8")
    assert "at 4 of 4 steps" in near
    assert "at 2 of 4 steps" in far


@pytest.mark.parametrize(
    "tp,devices,batch,match",
    [
        (8, 4, 4, r"--tp 8: the tensor-parallel size must be between 1 and the 4 devices"),
        (0, 4, 4, r"--tp 0: .* between 1 and the 4 devices"),
        (3, 4, 4, r"--tp 3 must divide .* heads 4, kv_heads 2, ffn 128, vocab 256"),
        (2, 8, 6, r"--batch 6 must be a multiple of dp = 8 devices // --tp 2 = 4"),
    ],
)
def test_llama_example_names_a_mesh_it_cannot_run(tp, devices, batch, match):
    """--tp larger than the devices, or not dividing the heads, ... is named before any
    JAX error (an IndexError, an IndivisibleError)."""
    import re

    from jax_ub.models import llama, llama_args

    problem = llama_args.mesh_problem(llama.PRESETS["tiny"], tp, devices, batch)
    assert problem is not None and re.search(match, problem), problem
    assert llama_args.mesh_problem(llama.PRESETS["tiny"], 2, 4, 4) is None


def test_tp_transformer_example_names_a_mesh_it_cannot_run(example):
    assert "sizes multiply to 3, but there are 4 devices" in example.mesh_problem({"tp": 3}, 4)
    assert "no 'tp' axis" in example.mesh_problem({"dp": 4}, 4)
    assert example.mesh_problem({"dp": 2, "tp": 2}, 4) is None
    with pytest.raises(SystemExit):  # argparse's error, a message and no traceback
        example.main(["--mesh", "tp=3", "--steps", "1"])


def test_llama_example_says_what_bf16_decoding_should_agree_on():
    """float32: every token equal. bfloat16: a row may differ from a token whose two
    candidates' logits (the reference's, after the common prefix) are a near-tie, never
    from one where they are far apart."""
    example = _llama_example()
    xla = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])
    ub = xla.copy()
    ub[1, 3:] = [9, 9]  # row 1 differs from token 1 after a prompt of 2 tokens

    def logits_at(gap):
        def at(prefix):
            assert prefix.shape == (2, 3)  # the common prefix of the differing row
            logits = np.zeros((2, 16), np.float32)
            logits[1, 4], logits[1, 9] = 4.0, 4.0 - gap  # XLA's token 4, jax_ub's 9
            return logits

        return at

    assert example.decode_agreement(xla, xla, 2, logits_at(0), "float32")[0]
    assert not example.decode_agreement(ub, xla, 2, logits_at(0.01), "float32")[0]
    ok, text = example.decode_agreement(ub, xla, 2, logits_at(0.01), "bfloat16")
    assert ok and "row 1 differs from token 1" in text and "a near-tie" in text, text
    ok, text = example.decode_agreement(ub, xla, 2, logits_at(1.0), "bfloat16")
    assert not ok and "NOT a near-tie" in text, text
