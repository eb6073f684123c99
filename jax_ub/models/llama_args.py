"""The command-line arguments of the Llama-style model's runs (``examples/train_llama.py``,
``python -m jax_ub.bench.model``): its shapes, counts checked by argparse, and whether a
mesh can run it."""

from __future__ import annotations

import argparse
import math

from jax_ub.models.llama import PRESETS, REMAT_POLICIES, LlamaConfig, split_dims


def count_arg(least: int):
    """An argparse type: an integer >= ``least`` (argparse names a bad one)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return value

    return parse


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """The model's and the run's shapes, as the training example and the benchmark take
    them: --preset, --layers, --seq, --batch, --tp, --remat."""
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="the model's shapes (default: tiny, for CPU devices)",
    )
    parser.add_argument(
        "--layers", type=count_arg(1), help="number of blocks (default: the preset's)"
    )
    parser.add_argument("--seq", type=count_arg(2), default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=count_arg(1), default=4, help="global batch (default 4)")
    parser.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel size; dp = devices / tp (default 2)"
    )
    parser.add_argument(
        "--remat",
        default="dots",
        choices=sorted(REMAT_POLICIES),
        help="rematerialization policy of each block (default: dots)",
    )


def mesh_problem(cfg: LlamaConfig, tp: int, devices: int, batch: int) -> str | None:
    """Why a ``(dp, tp)`` mesh of ``devices // tp`` x ``tp`` devices cannot run ``cfg`` on
    a ``batch``, or None: ``tp`` must be between 1 and ``devices`` and divide the heads,
    the key/value heads, the MLP's hidden units and the vocabulary (each split over tp),
    and ``dp`` the batch."""
    if not 1 <= tp <= devices:
        return f"--tp {tp}: the tensor-parallel size must be between 1 and the {devices} devices"
    dims = split_dims(cfg)
    split = [f"{name} {size}" for name, size in dims.items() if size % tp]
    if split:
        return (
            f"--tp {tp} must divide what the model splits over tp; it does not divide "
            f"{', '.join(split)} (try a divisor of {math.gcd(*dims.values())})"
        )
    dp = devices // tp
    if batch % dp:
        return f"--batch {batch} must be a multiple of dp = {devices} devices // --tp {tp} = {dp}"
    return None
