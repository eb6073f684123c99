"""GPU tier of test_flax_general_lm: the Llama-style LM on ``nn.DenseGeneral`` switched to
jax_ub by its projection constructors, on a tensor=2 mesh of 2 GPUs, matmuls at "highest"
precision (XLA's default f32 dot may be TF32 on GPUs), f32 tolerance 1e-4.

Skipped without at least 2 GPUs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import gpus
from jax.sharding import Mesh
from test_flax_general_lm import check_decode, check_loss_and_grads, check_same_checkpoint

pytestmark = pytest.mark.gpu

GPUS = gpus()
if len(GPUS) < 2:
    pytest.skip("needs at least 2 GPUs", allow_module_level=True)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(GPUS[:2]), ("tensor",))


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def test_same_checkpoint(mesh):
    check_same_checkpoint(mesh)


@pytest.mark.parametrize("gather", [False, True], ids=["one_by_one", "project"])
@pytest.mark.parametrize("length", [16, 15])
def test_loss_and_grads_equal(mesh, length, gather):
    check_loss_and_grads(mesh, length, gather, tol=1e-4)


@pytest.mark.parametrize("gather", [False, True], ids=["one_by_one", "project"])
def test_greedy_decode_token_equal(mesh, gather):
    check_decode(mesh, gather)
