"""TransformerEngine's side of benchmarks/te/compare.py: import and bootstrap, and its rows.

TE's collective GEMM runs on global arrays under a mesh and a ``MeshResource`` whose
``tpsp_resource`` is the tensor-parallel axis (TE's examples/jax/collective_gemm): AG+GEMM takes
x ``[batch, seq, k]`` split over the sequence (dim 1), w ``[k, n]`` over columns; GEMM+RS x
``[batch, seq, n]`` and w ``[n, k]`` split over n. TE's partitioning callbacks read that
resource when a call is lowered, so each row is compiled here, inside ``autocast``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.metadata
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "tp"
RECIPES = {"cs": "Float8CurrentScaling", "ds": "DelayedScaling"}


def load(nproc: int, pid: int):
    """``(te, message)``: TE's JAX modules bootstrapped for a TP group of all ``nproc``
    processes (one GPU each), or ``(None, why not)``."""
    if jax.devices()[0].platform != "gpu":
        return None, "needs GPUs (CPU devices here)"
    if jax.local_device_count() != 1:
        return None, "collective GEMM needs one GPU per process: use --launch N"
    # Never NVLink multicast: TE's userbuffers create a multicast object on Hopper unless
    # UB_SKIPMC is set, which can put a shared host's GPUs out of service (read at bootstrap).
    os.environ["UB_SKIPMC"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        # The extension links libnccl.so.2: load the one of JAX's pip NCCL first.
        lib = importlib.metadata.distribution("nvidia-nccl-cu13").locate_file("nvidia/nccl/lib")
        if os.path.exists(f"{lib}/libnccl.so.2"):
            ctypes.CDLL(f"{lib}/libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import transformer_engine.jax as tej  # noqa: PLC0415
        import transformer_engine.jax.cpp_extensions as tex  # noqa: PLC0415
        from transformer_engine.common import recipe  # noqa: PLC0415
        from transformer_engine.jax import dense  # noqa: PLC0415
        from transformer_engine.jax.cpp_extensions.gemm import (  # noqa: PLC0415
            CollectiveOp,
            CollectiveOpSet,
            collective_gemm_bootstrap,
        )
        from transformer_engine.jax.quantize import QuantizerFactory, noop_quantizer_set  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001  (any failure: the rest still runs)
        return None, f"import transformer_engine.jax failed: {type(e).__name__}: {e}"
    try:
        collective_gemm_bootstrap(
            num_total_devices=nproc,
            num_devices_per_process=1,
            process_id=pid,
            tensor_parallel_size=nproc,
        )
    except Exception as e:  # noqa: BLE001
        return None, f"collective_gemm_bootstrap failed: {type(e).__name__}: {e}"
    warnings.filterwarnings("ignore", message=".*Shardy.*")  # we constrain every output
    te = dict(
        tej=tej,
        tex=tex,
        op=CollectiveOp,
        op_set=CollectiveOpSet,
        dense=dense.dense,
        recipe=recipe,
        factory=QuantizerFactory,
        noop=noop_quantizer_set,
    )
    version = importlib.metadata.version("transformer_engine_cu13")
    return te, f"TransformerEngine {version} (transformer_engine_jax at {tex.__file__})"


def _ctx(te, mesh, kind) -> contextlib.ExitStack:
    """Mesh, recipe and TE's mesh resource for compiling a row (kind: None, "cs", "ds")."""
    rec = getattr(te["recipe"], RECIPES[kind])() if kind else None
    resource = te["tej"].MeshResource(tpsp_resource=AXIS)
    stack = contextlib.ExitStack()
    stack.enter_context(mesh)
    stack.enter_context(
        te["tej"].autocast(enabled=kind is not None, recipe=rec, mesh_resource=resource)
    )
    return stack


def _quantizers(te, mesh, kind, n, amax):
    """``n`` quantizer sets for the recipe (inside its autocast); delayed scaling's scales are
    set from the operands' amax (x, kernel) as a warmed-up history would, its state made
    replicated global arrays (several processes)."""
    if kind is None:
        return [te["noop"]] * n
    sets = te["factory"].create_set(n_quantizer_sets=n)
    sets = list(sets) if isinstance(sets, tuple) else [sets]
    if kind == "ds":
        fp8_max = float(jnp.finfo(jnp.float8_e4m3fn).max)
        sets = [
            dataclasses.replace(
                s,
                x=dataclasses.replace(s.x, scale=jnp.full((1,), fp8_max / ax, jnp.float32)),
                kernel=dataclasses.replace(
                    s.kernel, scale=jnp.full((1,), fp8_max / aw, jnp.float32)
                ),
            )
            for s, (ax, aw) in zip(sets, amax)
        ]
    rep = NamedSharding(mesh, P())

    def replicated(a):
        host = np.asarray(a)
        return jax.make_array_from_callback(host.shape, rep, lambda i: host[i])

    return [jax.tree.map(replicated, s) for s in sets]


def gemm_row(te, mesh, op, kind, overlap, x3, w, amax):
    """TE's AG+GEMM (op "ag") or GEMM+RS ("rs") as ``(compiled, args)``, returning the 2-D result
    laid out as jax_ub's: bf16 (kind None) or fp8 with current ("cs") or delayed ("ds")
    scaling; ``overlap`` False: the same GEMM with XLA's collective (CollectiveOp.NONE)."""
    C = te["op"]
    cop = (C.ALL_GATHER if op == "ag" else C.REDUCE_SCATTER) if overlap else C.NONE
    out = NamedSharding(mesh, P(None, None, AXIS) if op == "ag" else P(None, AXIS, None))

    def f(x, w, qs):
        y = te["tex"].gemm(x, w, contracting_dims=((2,), (0,)), collective_op=cop, quantizer_set=qs)
        return jax.lax.with_sharding_constraint(y, out)[0]

    with _ctx(te, mesh, kind):
        (qs,) = _quantizers(te, mesh, kind, 1, [amax])
        return jax.jit(f).lower(x3, w, qs).compile(), (x3, w, qs)


def mlp_rows(te, mesh, kind, x3, w1, w2, dy3, amax):
    """TE's ``dense`` twice, column- then row-parallel (collective_op_set AG, then RS): the
    forward ``y = (x @ w1) @ w2`` and forward+backward (gradients of ``sum(y * dy)``) as
    ``{"fwd": (compiled, args), "fwd_bwd": (compiled, args)}``."""
    ag = te["op_set"].create(forward_collective_op=te["op"].ALL_GATHER)
    rs = te["op_set"].create(forward_collective_op=te["op"].REDUCE_SCATTER)
    h_out = NamedSharding(mesh, P(None, None, AXIS))
    y_out = NamedSharding(mesh, P(None, AXIS, None))
    dense = te["dense"]

    def fwd(x, w1, w2, q1, q2):
        h = dense(x, w1, contracting_dims=((2,), (0,)), collective_op_set=ag, quantizer_set=q1)
        h = jax.lax.with_sharding_constraint(h, h_out)
        y = dense(h, w2, contracting_dims=((2,), (0,)), collective_op_set=rs, quantizer_set=q2)
        return jax.lax.with_sharding_constraint(y, y_out)

    def grads(x, w1, w2, dy, q1, q2):
        def loss(x, w1, w2):
            return jnp.sum(fwd(x, w1, w2, q1, q2).astype(jnp.float32) * dy.astype(jnp.float32))

        gx, g1, g2 = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
        return gx[0], g1, g2

    with _ctx(te, mesh, kind):
        q1, q2 = _quantizers(te, mesh, kind, 2, amax)
        args_f, args_b = (x3, w1, w2, q1, q2), (x3, w1, w2, dy3, q1, q2)
        return {
            "fwd": (jax.jit(lambda *a: fwd(*a)[0]).lower(*args_f).compile(), args_f),
            "fwd_bwd": (jax.jit(grads).lower(*args_b).compile(), args_b),
        }
