"""Small jax_ub run for compute-sanitizer: both ops, fwd and grad, on 2 GPUs.

compute-sanitizer --tool memcheck --target-processes all python3 benchmarks/sanitize_small.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub

mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(kx, (256, 128), jnp.bfloat16)
w1 = (jax.random.normal(k1, (128, 256)) / 11).astype(jnp.bfloat16)
w2 = (jax.random.normal(k2, (256, 128)) / 16).astype(jnp.bfloat16)


def loss(impl):
    def body(x, w1, w2):
        h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
        y = jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", impl=impl)
        return lax.psum(jnp.sum(jnp.sin(y.astype(jnp.float32))), "tp")

    f = jax.shard_map(
        body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P()
    )
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


for _ in range(3):
    (l_ub, g_ub), (l_ref, g_ref) = loss("ub")(x, w1, w2), loss("xla")(x, w1, w2)
errs = [
    float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
    for a, b in zip(g_ub, g_ref)
]
print("loss", float(l_ub), float(l_ref), "grad rel errs", errs)
assert all(e < 3e-2 for e in errs)
jax_ub.finalize()
print("SANITIZE_SMALL_OK")
