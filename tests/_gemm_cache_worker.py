"""One process of test_gpu_gemm_cache.py: both ops on a group of one GPU, called until
their kernel trials are over, with the kernel choice file named by JAX_UB_GEMM_CACHE.

python _gemm_cache_worker.py OUT.npz  (JAX_UB_TRACE=1 prints each GEMM's kernel choice)
"""

import os
import sys

os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402

M, K, N = 1024, 512, 2048
CALLS = 40  # past the trials: 3 candidates x (1 warm-up + 4 timed rounds)


def main(out: str) -> None:
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("tp",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.bfloat16)

    def both(x, w):
        h = jax_ub.all_gather_matmul(x, w, "tp", impl="ub")
        return h, jax_ub.matmul_reduce_scatter(h, w.T, "tp", impl="ub")

    f = jax.jit(
        jax.shard_map(
            both,
            mesh=mesh,
            in_specs=(P("tp"), P(None, "tp")),
            out_specs=(P(None, "tp"), P("tp")),
        )
    )
    for _ in range(CALLS):
        h, y = jax.block_until_ready(f(x, w))
    np.savez(out, h=np.asarray(h.astype(jnp.float32)), y=np.asarray(y.astype(jnp.float32)))
    jax_ub.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
