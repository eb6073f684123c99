"""Repro of the (dp=2, tp=1) crash; variant chosen by argv[1]."""
import os, sys
variant = sys.argv[1]
platform = sys.argv[2] if len(sys.argv) > 2 else "gpu"
if platform == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import faulthandler; faulthandler.enable()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_ub
from jax_ub._src import primitives, layout
if os.environ.get("DIAG_GSPMD"):
    jax.config.update("jax_use_shardy_partitioner", False)
if os.environ.get("DIAG_ZSPEC"):
    from jax._src import mesh as mesh_lib, sharding_impls
    from jax._src.interpreters import mlir
    from jax.sharding import AxisType
    def _lower_nested(prim, ctx, mesh, manual, *operands, **params):
        auto = tuple(a for a in mesh.axis_names if a not in manual)
        spec = layout.batch_spec(ctx.avals_in[0], mesh, auto)
        types = {a: AxisType.Manual for a in manual}
        abstract = mesh.abstract_mesh.update_axis_types(types) if types else mesh.abstract_mesh
        sp = lambda a: P() if 0 in a.shape else spec
        out_specs = [sp(a) for a in ctx.avals_out] if prim.multiple_results else sp(ctx.avals_out[0])
        in_specs = tuple(sp(a) if i in primitives._BATCHED[prim] else P() for i, a in enumerate(ctx.avals_in))
        def nested(*ops):
            return jax.shard_map(lambda *o: prim.bind(*o, **params), mesh=abstract, in_specs=in_specs,
                out_specs=out_specs, axis_names=frozenset(auto), check_vma=False)(*ops)
        with mesh_lib.use_abstract_mesh(abstract), sharding_impls._internal_use_concrete_mesh(mesh):
            return mlir.lower_fun(nested, multiple_results=prim.multiple_results)(ctx, *operands)
    primitives._lower_nested = _lower_nested
if os.environ.get("DIAG_NOSIDE"):
    _orig = jax.ffi.ffi_lowering
    primitives.jax.ffi.ffi_lowering = lambda t, has_side_effect=False, **kw: _orig(t, has_side_effect=False, **kw)

devs = jax.devices()[:2]
dp, tp = (1, 2) if "tp2" in variant else (2, 1)
mesh = Mesh(np.array(devs).reshape(dp, tp), ("dp", "tp"))
dt = jnp.float32 if "f32" in variant else jnp.bfloat16
kx, kw = jax.random.split(jax.random.key(0))
x = jax.device_put(jax.random.normal(kx, (512, 4, 256), dt), NamedSharding(mesh, P("tp", "dp")))
w = jax.device_put(jax.random.normal(kw, (256, 512), dt), NamedSharding(mesh, P(None, "tp")))
op = "rs" if variant.startswith("rs") else "ag"
if op == "rs":
    w = jax.device_put(jax.random.normal(kw, (256, 512), dt), NamedSharding(mesh, P("tp", None)))
    x = jax.device_put(jax.random.normal(kx, (512, 4, 256), dt), NamedSharding(mesh, P(None, "dp", "tp")))
rg = "gathered" in variant
def body(x, w):
    if op == "ag":
        r = jax_ub.all_gather_matmul(x, w, "tp", impl="ub", return_gathered=rg)
        return r[0] if rg else r
    return jax_ub.matmul_reduce_scatter(x, w, "tp", impl="ub")
if "setmesh" in variant:
    with jax.set_mesh(mesh):
        y = jax.jit(body)(x, w)
elif "full" in variant:
    spec_in = (P("tp", "dp"), P(None, "tp")) if op == "ag" else (P(None, "dp", "tp"), P("tp", None))
    out = P(None, "dp", "tp") if op == "ag" else P("tp", "dp")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec_in, out_specs=out)
    y = jax.jit(f)(x, w)
else:
    spec_in = (P("tp"), P(None, "tp")) if op == "ag" else (P(None, None, "tp"), P("tp", None))
    out = P(None, None, "tp") if op == "ag" else P("tp")
    f = jax.shard_map(body, mesh=mesh, in_specs=spec_in, out_specs=out, axis_names={"tp"})
    y = jax.jit(f)(x, w)
y = np.asarray(y.astype(jnp.float32))
xf, wf = (np.asarray(a.astype(jnp.float32)) for a in (x, w))
ref = np.einsum("mbk,kn->mbn", xf, wf)
print(variant, platform, "rel err", np.linalg.norm(y - ref) / np.linalg.norm(ref), flush=True)
