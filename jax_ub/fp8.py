"""fp8 scaling for jax_ub's ops: pass ``fp8=jax_ub.Fp8Scales(...)`` to either op.

``Fp8Scales()`` (every field ``None``) is current scaling. For delayed scaling carry an amax
history per tensor in the model state, pass ``delayed_scale(history)`` for each, and record
the gradient the op returns for each scale (this step's amax) with
``update_amax_history``::

    def loss(params, scales, x):
        y = jax_ub.all_gather_matmul(x, params["w"], "tp", fp8=scales)
        return jnp.sum(y ** 2)

    scales = jax_ub.Fp8Scales(  # inside shard_map
        x=fp8.delayed_scale(hist["x"]), w=fp8.delayed_scale(hist["w"]),
        grad=fp8.delayed_scale(hist["grad"], fp8.E5M2))
    g_params, g_scales = jax.grad(loss, argnums=(0, 1))(params, scales, x)
    hist = {k: fp8.update_amax_history(hist[k], getattr(g_scales, k)) for k in hist}

(as ``tests/test_fp8.py`` does).
An operand may also come already quantized, ``float8_e4m3fn`` with its scale given, e.g.
weights stored in fp8 for serving (the op then quantizes only ``x``)::

    sw = fp8.current_scale(w)  # per local shard of w, inside shard_map
    w_q = fp8.quantize(w, sw)  # kept with sw instead of w
    y = jax_ub.all_gather_matmul(x, w_q, "tp", fp8=jax_ub.Fp8Scales(w=sw))  # x.dtype

``delayed_scale_owg(history)`` is ``delayed_scale`` whose gradient is the updated history
itself, for state that a training step overwrites with its gradient (flax's
OVERWRITE_WITH_GRADIENT convention; the Flax layers' ``fp8="delayed"`` uses it).
"""

from jax_ub._src.settings.fp8 import (
    E4M3,
    E5M2,
    Fp8Scales,
    amax,
    current_scale,
    delayed_scale,
    delayed_scale_owg,
    quantize,
    scale_from_amax,
    update_amax_history,
)

__all__ = [
    "E4M3",
    "E5M2",
    "Fp8Scales",
    "amax",
    "current_scale",
    "delayed_scale",
    "delayed_scale_owg",
    "quantize",
    "scale_from_amax",
    "update_amax_history",
]
