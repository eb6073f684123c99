"""What the tests read in lowered and compiled programs: the tiny Llama's step, how many
times each of jax_ub's calls runs in it, and which reduce-scatters gather beside them."""

import collections
import dataclasses
import re

import jax
from jax.sharding import PartitionSpec as P


def regathering_calls(hlo_text: str) -> tuple[int, int]:
    """(reduce-scatter custom calls, those of them that all-gather a second input beside
    them: a backward's x gathered again) in a program's StableHLO text."""
    rows = re.findall(
        r"custom_call @jax_ub_matmul_reduce_scatter\(.*-> \(tensor<[^>]*>, tensor<(\d+)x", hlo_text
    )
    return len(rows), sum(int(r) > 0 for r in rows)


def llama_step_texts(
    mesh, *, layers: int = 2, scan_unroll=True, impl: str = "ub", cfg=None
) -> tuple[str, str]:
    """(lowered StableHLO, compiled HLO) of the tiny Llama's (or ``cfg``'s) training step
    with jax_ub's ops (``impl``) on ``mesh`` ("dp", "tp"), its blocks scanned over stacked
    params."""
    from flax import nnx

    from jax_ub.models import llama

    cfg = dataclasses.replace(cfg or llama.PRESETS["tiny"], layers=layers)
    tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg.vocab)
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, jax.NamedSharding(mesh, P("dp", None)))
        model = llama.Llama(cfg, impl=impl, scan_unroll=scan_unroll, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split((model, llama.make_optimizer(model)))

        def step(state, tokens):
            model, optimizer = nnx.merge(graphdef, state)
            loss = llama.loss_and_update(model, optimizer, tokens)
            # The updated state is returned: without it XLA would drop the backward pass.
            return loss, nnx.state((model, optimizer))

        lowered = jax.jit(step).lower(state, tokens)
        return lowered.as_text(), lowered.compile().as_text()


def assert_each_call_compiled_once(compiled: str, layers: int) -> None:
    """The compiled step of :func:`llama_step_texts` runs each of jax_ub's calls once: per
    block (``layers``: the blocks unrolled; 1 for a loop's body) the forward's two
    all-gathers (q/k/v, gate/up) and two reduce-scatters (output, down projection) and the
    backward's swapped pair of each, plus the LM head's all-gather and its backward's
    reduce-scatter. A repeated call would run its GEMMs and transfers twice (XLA's GPU
    dynamic-slice fusion once kept a fused copy beside the original call)."""
    got = collections.Counter(re.findall(r'custom_call_target="(jax_ub_\w+)"', compiled))
    want = {
        "jax_ub_all_gather_matmul": 4 * layers + 1,
        "jax_ub_matmul_reduce_scatter": 4 * layers + 1,
    }
    assert got == want, (got, want)
