"""Acceptance test: a Llama-style LM on flax's own ``nn.DenseGeneral`` projections
(``examples/dense_general_lm.py``: its own interleaved RoPE, packed-sequence masks, GQA and
KV cache) switched to jax_ub by passing jax_ub's ``ColumnParallelLinear`` / ``RowParallelLinear`` as
its projection constructors, and nothing else.

Against the same model on ``nn.DenseGeneral``, unsharded (plain JAX), f32: the same
checkpoint (param tree, shapes and values from the same key), equal loss and gradients at a
length tp divides (sequence-parallel) and one it does not (replicated activations), with
q/k/v and gate/up called one by one or run from one gather each (``project``), token-equal
greedy decoding through the model's own cache, and jax_ub's custom calls in the compiled
step. The helpers take a mesh and a tolerance so that ``test_gpu_general_lm.py`` runs the
same checks on GPUs.
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import make_mesh, rel_err
from flax import linen as nn

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
from dense_general_lm import (  # noqa: E402
    LM,
    RULES,
    Config,
    greedy,
    jax_ub_config,
    loss_fn,
    packed_batch,
)

BATCH = 4
CALL = re.compile(r'custom_call_target="(jax_ub_\w+)"')


def ported(gather: bool, **kw) -> Config:
    return jax_ub_config(gather, **kw)


def init_params(cfg: Config, mesh=None):
    batch = packed_batch(jax.random.key(1), BATCH, 16)
    model = LM(cfg)
    if mesh is None:  # jitted, as below: eagerly each initializer would be a program
        return nn.unbox(jax.jit(model.init)(jax.random.key(0), *batch)["params"])
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        # As a flax training loop places them: shardings from the params' logical names.
        abstract = jax.eval_shape(model.init, jax.random.key(0), *batch)
        specs = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
        variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), *batch)
    return nn.unbox(variables["params"])


def loss_and_grads(cfg: Config, params, batch, mesh=None):
    model = LM(cfg)
    f = jax.value_and_grad(functools.partial(loss_fn, model))
    if mesh is None:  # jitted: run eagerly, each of its ops would be a program of its own
        return jax.jit(f)(params, batch), None
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        step = jax.jit(f)
        text = step.lower(params, batch).compile().as_text()
        return step(params, batch), text


def check_same_checkpoint(mesh) -> None:
    reference = init_params(Config())
    ours = init_params(ported(False), mesh)
    assert jax.tree.structure(ours) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        # Equal up to rounding: the programs differ (shardings, fusions).
        assert a.shape == b.shape and rel_err(a, b) < 1e-6
    # The heads and the MLP's hidden units are split over "tensor", as the rules say.
    kernel = ours["block_0"]["attn"]["query"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)


def check_loss_and_grads(mesh, length: int, gather: bool, tol: float) -> None:
    params = init_params(Config())
    batch = packed_batch(jax.random.key(2), BATCH, length)
    (want, want_grads), _ = loss_and_grads(Config(), params, batch)
    (got, grads), text = loss_and_grads(ported(gather), params, batch, mesh)
    assert rel_err(got, want) < tol, (got, want)
    for path, a in jax.tree_util.tree_leaves_with_path(grads):
        b = functools.reduce(lambda t, k: t[k.key], path, want_grads)
        assert rel_err(a, b) < tol, (jax.tree_util.keystr(path), rel_err(a, b))
    calls = CALL.findall(text)
    if length % mesh.shape["tensor"] == 0:  # sequence-parallel: gathers and scatters
        per_layer = 2 if gather else 5  # q, k, v, gate, up (one gather each with project)
        assert calls.count("jax_ub_all_gather_matmul") >= per_layer * 2, calls
        assert "jax_ub_matmul_reduce_scatter" in calls, calls
    else:  # replicated activations: o and down summed (matmul_all_reduce, its scatter half)
        assert "jax_ub_matmul_reduce_scatter" in calls, calls


def check_decode(mesh, gather: bool) -> None:
    params = init_params(Config())
    prompt = jax.random.randint(jax.random.key(3), (BATCH, 4), 1, 64)
    want = greedy(LM(Config(decode=True)), params, prompt, 8)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        got = greedy(LM(ported(gather, decode=True)), params, prompt, 8)
    assert bool(jnp.all(got == want)), (got, want)


@pytest.fixture(scope="module", params=["tp2", "dp2_tp2"])
def mesh(request):
    if request.param == "tp2":
        return make_mesh((2, "tensor"))
    return make_mesh((2, "data"), (2, "tensor"))  # the layers split the rows over "data"


@pytest.fixture(scope="module")
def tol():
    return 2e-5


def test_same_checkpoint(mesh):
    check_same_checkpoint(mesh)


@pytest.mark.parametrize("gather", [False, True], ids=["one_by_one", "project"])
@pytest.mark.parametrize("length", [16, 15])
def test_loss_and_grads_equal(mesh, length, gather, tol):
    check_loss_and_grads(mesh, length, gather, tol)


@pytest.mark.parametrize("gather", [False, True], ids=["one_by_one", "project"])
def test_greedy_decode_token_equal(mesh, gather):
    check_decode(mesh, gather)
