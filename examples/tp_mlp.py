"""A 2-layer tensor-parallel MLP, forward and backward, with overlapped communication.

Sequence-parallel activations x [seq, d] are all-gathered into the first matmul
(column-parallel W1 [d, f]) and the second matmul (row-parallel W2 [f, d]) is
reduce-scattered back to sequence-parallel, both with jax_ub. Gradients come from the
ops' custom VJPs, themselves overlapped. The same model on XLA's collectives
(impl="xla") checks the numbers.

Runs on all GPUs when there are any, else on 4 CPU devices:  python3 examples/tp_mlp.py
"""

from __future__ import annotations

import os
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Only affects the CPU backend: with no GPU, simulate 4 devices.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub


def make_step(mesh: Mesh, impl: str):
    def mlp_loss(x, w1, w2, target):
        h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)  # [seq, f/tp]
        y = jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", impl=impl)  # [seq/tp, d]
        return lax.psum(jnp.mean(jnp.square((y - target).astype(jnp.float32))), "tp")

    loss = jax.shard_map(
        mlp_loss,
        mesh=mesh,
        in_specs=(P("tp", None), P(None, "tp"), P("tp", None), P("tp", None)),
        out_specs=P(),
    )
    return jax.jit(jax.value_and_grad(loss, argnums=(1, 2)))


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    devices = jax.devices() if on_gpu else jax.devices()[:4]
    tp = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    seq, d, f = (8192, 4096, 16384) if on_gpu else (256, 64, 256)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    print(
        f"{tp} x {devices[0].device_kind}: 2-layer TP MLP, seq={seq} d={d} f={f} {dtype.__name__}"
    )

    keys = jax.random.split(jax.random.key(0), 4)
    shard = lambda a, spec: jax.device_put(a.astype(dtype), NamedSharding(mesh, spec))  # noqa: E731
    x = shard(jax.random.normal(keys[0], (seq, d)), P("tp", None))
    w1 = shard(jax.random.normal(keys[1], (d, f)) / np.sqrt(d), P(None, "tp"))
    w2 = shard(jax.random.normal(keys[2], (f, d)) / np.sqrt(f), P("tp", None))
    target = shard(jax.random.normal(keys[3], (seq, d)), P("tp", None))

    results = {}
    for impl in ("ub", "xla"):
        step = make_step(mesh, impl)
        loss, grads = step(x, w1, w2, target)
        jax.block_until_ready(grads)
        t0 = time.perf_counter()
        iters = 20
        for _ in range(iters):
            loss, grads = step(x, w1, w2, target)
        jax.block_until_ready(grads)
        ms = (time.perf_counter() - t0) / iters * 1e3
        results[impl] = (float(loss), grads)
        print(f"impl={impl:3s}: loss {float(loss):.5f}, forward+backward {ms:8.3f} ms/step")

    (loss_ub, g_ub), (loss_ref, g_ref) = results["ub"], results["xla"]
    for name, a, b in zip(("dW1", "dW2"), g_ub, g_ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"{name}: relative difference ub vs xla = {err:.2e}")
        assert np.isfinite(err) and err < 3e-2, f"{name} differs: {err}"
    assert abs(loss_ub - loss_ref) <= 1e-2 * abs(loss_ref), (loss_ub, loss_ref)
    print("OK: jax_ub matches XLA's collectives")
    if not on_gpu:
        print(
            "(on CPU the host protocol runs for correctness, not speed: its GEMM is a plain loop)"
        )


if __name__ == "__main__":
    main()
