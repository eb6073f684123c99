"""One process of test_gpu_gemm_cache.py: both ops on a group of one GPU, called until
their kernel trials are over, with the kernel choice file named by JAX_UB_GEMM_CACHE.

python _gemm_cache_worker.py OUT.npz [M,K,N CALLS]  (JAX_UB_TRACE=1 prints each GEMM's kernel
choice; the default shape's GEMMs are short: tuned in bursts, then trials)
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


def main(out: str, shape: tuple[int, int, int] = (M, K, N), calls: int = CALLS) -> None:
    m, k, n = shape
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("tp",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)

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
    for _ in range(calls):
        h, y = jax.block_until_ready(f(x, w))
    np.savez(
        out,
        h=np.asarray(h.astype(jnp.float32)),
        y=np.asarray(y.astype(jnp.float32)),
        x=np.asarray(x.astype(jnp.float32)),
        w=np.asarray(w.astype(jnp.float32)),
    )
    jax_ub.finalize()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        main(sys.argv[1], tuple(int(v) for v in sys.argv[2].split(",")), int(sys.argv[3]))
    else:
        main(sys.argv[1])
