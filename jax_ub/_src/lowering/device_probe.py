"""The devices a program is compiled for, where no concrete mesh is set.

A training loop often jits its step on arrays sharded over a mesh without ``jax.set_mesh``:
the arrays' types then carry the mesh's axes (an ``AbstractMesh``), not its devices, so a
shard_map over a tensor-parallel axis traces and lowers, but the userbuffer calls inside
it cannot tell which devices form their group. The devices are known where the program is
lowered: the module's device assignment. :func:`probe` marks a value of the program; its
lowering, which runs before that of any call traced after it (lowering follows the order
of the program), records the device assignment of the module being lowered, and
:func:`concrete_mesh` then rebuilds the concrete mesh from an abstract one for the calls of
that module.

A mesh rebuilt so is the one whose devices, in order, are the program's device assignment:
JAX takes that assignment from the arrays' (or ``in_shardings``') mesh.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh

from jax_ub._src import jax_compat

device_probe_p = Primitive("jax_ub_device_probe")
device_probe_p.def_impl(lambda x: x)
device_probe_p.def_abstract_eval(lambda aval: aval)
ad.deflinear2(device_probe_p, lambda ct, _: [ct])
batching.primitive_batchers[device_probe_p] = lambda args, dims: (
    device_probe_p.bind(*args),
    dims[0],
)

# The device assignment of the modules lowered most recently, by module. Bounded: a module
# is lowered once, and its calls lower right after its probe.
_KEEP = 16
_assignments: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def probe(x):
    """``x`` itself, marked so that the lowering of the program records its devices."""
    return device_probe_p.bind(x)


def _lower_probe(ctx, x):
    devices = getattr(ctx.module_context.axis_context, "device_assignment", None)
    if devices:
        with _lock:
            _assignments[id(ctx.module_context.module)] = (ctx.module_context.module, devices)
            while len(_assignments) > _KEEP:
                _assignments.popitem(last=False)
    return [x]


jax_compat.register_uncached_lowering(device_probe_p, _lower_probe)
# JAX lowers a program without its devices unless a primitive in it asks for them.
jax_compat.lowering_needs_devices(device_probe_p)


def concrete_mesh(ctx: mlir.LoweringRuleContext, abstract) -> Mesh | None:
    """The concrete mesh of ``abstract`` (an ``AbstractMesh``) on the devices of the module
    ``ctx`` lowers, as a :func:`probe` in it recorded them; None where none did."""
    with _lock:
        found = _assignments.get(id(ctx.module_context.module))
    if found is None or found[0] is not ctx.module_context.module:
        return None
    devices = found[1]
    if len(devices) != int(np.prod(abstract.axis_sizes)):
        return None
    types = tuple(AxisType.Auto if t == AxisType.Manual else t for t in abstract.axis_types)
    grid = np.array(devices, dtype=object).reshape(abstract.axis_sizes)
    return Mesh(grid, abstract.axis_names, axis_types=types)


def clear() -> None:
    """Forget every recorded assignment (a reset path; tests)."""
    with _lock:
        _assignments.clear()
