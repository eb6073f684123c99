"""GPU tier of test_flax_general_lm: its tests, the Llama-style LM on ``nn.DenseGeneral``
switched to jax_ub by its projection constructors, on a tensor=2 mesh of 2 GPUs, matmuls at
"highest" precision (XLA's default f32 dot may be TF32 on GPUs), f32 tolerance 1e-4.

Skipped without at least 2 GPUs.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import RANKS, model_mesh, need_gpus
from jax.sharding import Mesh
from test_flax_general_lm import (  # noqa: F401  (collected here with this file's fixtures)
    test_greedy_decode_token_equal,
    test_loss_and_grads_equal,
    test_same_checkpoint,
)

pytestmark = pytest.mark.gpu

GPUS = need_gpus(2)


@pytest.fixture(scope="module")
def mesh():
    if RANKS:  # the model's 2 kv heads split over tp <= 2; dp takes the other ranks
        return model_mesh(GPUS, ("data", "tensor"), most_tp=2)
    return Mesh(np.array(GPUS[:2]), ("tensor",))


@pytest.fixture(scope="module")
def tol():
    return 1e-4


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield
