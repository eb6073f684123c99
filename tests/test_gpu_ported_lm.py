"""GPU tier of test_flax_ported_lm: the same public-style LM, ported to jax_ub, on a
(data=1, tensor=2) mesh of 2 GPUs, matmuls at "highest" precision, f32 tolerance 1e-4.

Skipped without at least 2 GPUs.
"""

from __future__ import annotations

import pytest
from conftest import model_mesh, need_gpus
from test_flax_ported_lm import (
    Setup,
    check_bf16,
    check_custom_calls,
    check_decode,
    check_loss_and_grads,
    check_training,
    initial_params,
)

pytestmark = pytest.mark.gpu

GPUS = need_gpus(2)


@pytest.fixture(scope="module")
def setup():
    mesh = model_mesh(GPUS, ("data", "tensor"), most_tp=4)  # 4 heads
    return Setup(mesh, tol=1e-4, precision="highest")


@pytest.fixture(scope="module")
def params(setup):
    with setup.context():
        return initial_params(setup)


@pytest.fixture(scope="module")
def trained(setup, params):
    return check_training(setup, params)


@pytest.mark.parametrize("length", [16, 15])
def test_loss_and_grads_equal(setup, params, length):
    check_loss_and_grads(setup, params, length)


def test_training_curves(trained):
    assert trained["curve_err"] < 1e-4


def test_custom_calls_in_ported_step(setup, trained):
    with setup.context():
        check_custom_calls(trained["lowered"], trained["ref_lowered"])


def test_greedy_decode_token_equal(setup, trained):
    check_decode(setup, trained["trained"])


def test_bf16(setup, params):
    check_bf16(setup, params)
