"""GPU tier of the gradient matrices (``test_grad_matrix.py``, ``test_grad_matrix_flax.py``):
every public op and every Flax layer on the userbuffer path against ``jax.grad`` of plain
unsharded JAX, float32 at full precision, on the GPU meshes there are: (dp, tp) = (1, 2),
and with 4 GPUs (2, 2) and (1, 4); in the N-ranks mode (``pytest --ranks N``, N processes
on one GPU) (1, N), and for N >= 4 (2, N/2): dp beside tp at tp 2 and 4 (jax_ub's code
sees the tp group and whether dp is manual, not dp's size). The ops in three ways to call
them (an unchecked shard_map over every axis, a checked partial-auto one, plain jit with
and without a mesh set); the layers with
``sequence_parallel`` True, False and unset on sequences tp does and does not divide.

Skipped without at least 2 GPUs."""

from __future__ import annotations

import jax
import pytest
from conftest import RANKS, gpu_mesh, need_gpus
from test_grad_matrix import OPS, check_op
from test_grad_matrix_flax import LAYERS, check_layer

pytestmark = pytest.mark.gpu

GPUS = need_gpus(2)

if RANKS:
    MESHES = [(1, RANKS)] + ([(2, RANKS // 2)] if RANKS >= 4 else [])
else:
    MESHES = [(1, 2)] + ([(2, 2), (1, 4)] if len(GPUS) >= 4 else [])
# Reduction orders differ from the reference's (the split K, the chunked reduce-scatter).
TOL = 1e-4


def _mesh(dp: int, tp: int):
    return gpu_mesh(GPUS, (dp, tp), ("dp", "tp"))


@pytest.fixture(autouse=True)
def _full_precision():
    """XLA's float32 dots (the reference's, impl="xla"'s) at full precision, not TF32."""
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("mode", ["smap_novma", "partial_vma", "jit", "jit_nomesh"])
@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dp_tp", MESHES, ids=lambda m: f"dp{m[0]}xtp{m[1]}")
def test_op_gradients_on_gpus(rand, dp_tp, name, mode):
    check_op(rand, name, mode, "ub", _mesh(*dp_tp), TOL)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dp_tp", MESHES, ids=lambda m: f"dp{m[0]}xtp{m[1]}")
def test_layer_gradients_on_gpus(rand, dp_tp, name, framework):
    check_layer(rand, name, framework, "ub", _mesh(*dp_tp), TOL)
