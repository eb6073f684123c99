"""Small jax_ub run for compute-sanitizer: both ops, forward and backward, on 2 GPUs
(SANITIZE_TP=4: on 4; 1: a group of one GPU). SANITIZE_CASE=epilogue runs the epilogues
instead: gelu_mlp in fp8 with a bias (cuBLASLt's fp8 GELU_AUX_BIAS forward, fp8 DGELU
backward); SANITIZE_CASE=epilogue_bf16 the same in bf16. One MLP per program: with both in one
program compute-sanitizer 2025.3 itself crashes (segfault), with impl="xla" as well.

compute-sanitizer --tool memcheck python3 benchmarks/tools/sanitize_small.py
compute-sanitizer --tool racecheck python3 benchmarks/tools/sanitize_small.py

Only jax_ub's custom calls communicate (no psum, no impl="xla" comparison on the devices),
so NCCL, which is slow and noisy under the sanitizer, never starts; the reference is
computed with NumPy on the host. XLA's own GEMM autotuning is off to keep the run short.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_autotune_level=0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402

TP = int(os.environ.get("SANITIZE_TP", "2"))
mesh = Mesh(np.array(jax.devices()[:TP]), ("tp",))
rng = np.random.default_rng(0)
M, K, H = 256, 128, 256
x, w1, w2, ct = (
    rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0] if i in (1, 2) else 1)
    for i, s in enumerate([(M, K), (K, H), (H, K), (M, K)])
)


CASE = os.environ.get("SANITIZE_CASE", "plain")
b1 = rng.standard_normal(H).astype(np.float32)


def mlp(x, w1, w2):
    if CASE.startswith("epilogue"):
        fp8 = None if CASE == "epilogue_bf16" else (jax_ub.Fp8Scales(), jax_ub.Fp8Scales())
        return jax_ub.gelu_mlp(
            x, w1, w2, "tp", up_bias=jnp.asarray(b1, x.dtype), impl="ub", fp8=fp8
        )
    h = jax_ub.all_gather_matmul(x, w1, "tp", impl="ub")
    return jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", impl="ub")


f = jax.shard_map(
    mlp, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P("tp", None)), out_specs=P("tp")
)


@jax.jit
def fwd_bwd(x, w1, w2, ct):
    y, vjp = jax.vjp(f, x, w1, w2)
    return (y, *vjp(ct))


bf = [jnp.asarray(a, jnp.bfloat16) for a in (x, w1, w2, ct)]
for _ in range(3):
    outs = [np.asarray(o, np.float32) for o in fwd_bwd(*bf)]

# NumPy reference from the same bf16-rounded inputs.
xq, w1q, w2q, ctq = (np.asarray(a, np.float32) for a in bf)
if CASE.startswith("epilogue"):  # y = gelu(x w1 + b1) w2: y only, loosely (fp8)
    g = np.asarray(jax.nn.gelu(xq @ w1q + np.asarray(jnp.asarray(b1, jnp.bfloat16), np.float32)))
    y = g @ w2q
    err = float(np.linalg.norm(outs[0] - y) / np.linalg.norm(y))
    print("rel err (y):", err)
    assert all(np.isfinite(o).all() for o in outs) and err < 0.1, err
    jax_ub.check_health()
    jax_ub.finalize()
    print("SANITIZE_SMALL_OK")
    raise SystemExit(0)
h = xq @ w1q
y = np.tanh(h) @ w2q
dh = (ctq @ w2q.T) * (1 - np.tanh(h) ** 2)
want = [y, dh @ w1q.T, xq.T @ dh, np.tanh(h).T @ ctq]
errs = [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(outs, want)]
print("rel errs (y, dx, dw1, dw2):", errs)
assert all(np.isfinite(o).all() for o in outs)
assert all(e < 3e-2 for e in errs), errs
jax_ub.check_health()
jax_ub.finalize()
print("SANITIZE_SMALL_OK")
