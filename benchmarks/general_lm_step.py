"""Step time of a user's own Llama-style LM on ``nn.DenseGeneral``
(``examples/dense_general_lm.py``) switched to jax_ub by its projection constructors,
against XLA and the no-communication bound, on the first ``--tp`` GPUs.

One training step, ``jax.value_and_grad`` of the loss (no optimizer), jitted under
``jax.set_mesh`` with the model's logical rules (heads and the MLP's hidden units over
"tensor"), params placed by them, batch replicated:

* ``jax_ub``: jax_ub's layers, q/k/v and gate/up each from one gather (``project``);
* ``jax_ub_one_by_one``: the same with every projection called on its own (5 gathers);
* ``jax_ub_xla``: the same layers with ``impl="xla"`` (lax collectives, same layout);
* ``xla``: the unchanged ``nn.DenseGeneral`` model, partitioned by XLA from the params'
  shardings (activations replicated, all-reduces after o and down);
* ``bound``: the same GEMMs with the communication removed: each GPU runs the model at
  1/tp width (its heads and hidden units) on the whole sequence, in a shard_map with no
  collective.

Method: bench's (``jax_ub.bench.timing.measure``): loops of async calls lasting
``--loop-seconds``, rounds interleaved across the variants, medians of rounds, the spread
of the rounds beside each. Gradients are compared with ``xla``'s.

    python3 benchmarks/general_lm_step.py --tp 2
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import dense_general_lm as lm  # noqa: E402

from jax_ub.bench import timing  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loop-seconds", type=float, default=1.0)
    args = ap.parse_args(argv)
    tp = args.tp
    devices = jax.devices()[:tp]
    mesh = Mesh(np.array(devices), ("tensor",))
    shape = dict(
        layers=args.layers,
        embed=args.embed,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=args.ffn,
        vocab=args.vocab,
        dtype=jnp.bfloat16,
        max_len=args.seq,
    )
    base = lm.Config(**shape)
    batch = lm.packed_batch(jax.random.key(1), args.batch, args.seq)
    print(
        f"{jax.devices()[0].device_kind} x{tp}, jax {jax.__version__}; {shape}, "
        f"batch {args.batch}, seq {args.seq}",
        flush=True,
    )

    def step(cfg):
        return jax.value_and_grad(functools.partial(lm.loss_fn, lm.LM(cfg)))

    # The bound: the model at 1/tp width on every GPU, no communication (its params made
    # outside the rules, replicated).
    narrow = dataclasses.replace(
        base, heads=args.heads // tp, kv_heads=args.kv_heads // tp, ffn=args.ffn // tp
    )
    narrow_params = nn.unbox(jax.jit(lm.LM(narrow).init)(jax.random.key(0), *batch)["params"])
    # Every input on every GPU before the loops (not copied from the first GPU each call).
    replicated = NamedSharding(mesh, P())
    narrow_params, batch = jax.device_put((narrow_params, batch), replicated)
    with jax.set_mesh(mesh), nn.logical_axis_rules(lm.RULES):
        # jax_ub's init: the same params as flax's (tests/test_flax_general_lm.py), which
        # cannot init its 3-dim logical kernels under a mesh (it constrains them while flat).
        model = lm.LM(lm.jax_ub_config(True, **shape))
        abstract = jax.eval_shape(model.init, jax.random.key(0), *batch)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, lm.RULES)
        init = jax.jit(model.init, out_shardings=shardings)
        params = nn.unbox(init(jax.random.key(0), *batch))["params"]
        variants = {
            "jax_ub": lm.jax_ub_config(True, **shape),
            "jax_ub_one_by_one": lm.jax_ub_config(False, **shape),
            "jax_ub_xla": dataclasses.replace(
                lm.jax_ub_config(True, **shape),
                column=functools.partial(lm.jax_ub_config().column, impl="xla"),
                row=functools.partial(lm.jax_ub_config().row, impl="xla"),
            ),
        }
        # Compiled here: jax_ub's layers read the rules when traced.
        impls = {
            name: (jax.jit(step(cfg)).lower(params, batch).compile(), (params, batch))
            for name, cfg in variants.items()
        }
    with jax.set_mesh(mesh):
        # flax's DenseGeneral cannot trace its 3-dim logical kernels under rules and a mesh
        # (it constrains them while flat): XLA partitions it from the params' shardings.
        impls = {"xla": (jax.jit(step(base)), (params, batch))} | impls
        bound = jax.shard_map(
            step(narrow), in_specs=(P(), P()), out_specs=P(), check_vma=False,
            axis_names={"tensor"},
        )  # fmt: skip
        impls["bound"] = (jax.jit(bound), (narrow_params, batch))
        measured = timing.measure(
            impls,
            impls["xla"],
            rounds=args.rounds,
            iters=3,
            loop_seconds=args.loop_seconds,
            say=print,
            unchecked=("bound",),
        )
    t = measured.times
    print(f"\n{'variant':<20}{'ms/step':>10}{'spread':>9}{'x bound':>9}{'vs xla':>9}  grad err")
    for name in impls:
        if name not in t:
            print(f"{name:<20} failed")
            continue
        err = measured.errs.get(name)
        print(
            f"{name:<20}{t[name]:>10.2f}{measured.spread[name]:>9.1%}{t[name] / t['bound']:>9.3f}"
            f"{t['xla'] / t[name]:>9.3f}  {'' if err is None else f'{err:.1e}'}"
        )


if __name__ == "__main__":
    main()
