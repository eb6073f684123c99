"""jax_ub: tensor-parallel communication overlapped with matmuls, through userbuffers.

Public API:
  all_gather_matmul(x, w, axis_name, *, bias=None, activation=None, impl="auto",
                    return_gathered=False, fp8=None, seq_axis=0)
  matmul_reduce_scatter(x, w, axis_name, *, bias=None, impl="auto", fp8=None, seq_axis=0)
  gelu_mlp(x, w_up, w_down, axis_name, *, up_bias=None, down_bias=None, impl="auto",
           fp8=None, seq_axis=0): the two ops around GELU, GELU's backward in a GEMM epilogue
  gated_mlp(x, w_gate_up, w_down, axis_name, *, activation="silu", impl="auto", fp8=None,
            seq_axis=0):
    SwiGLU / GeGLU, x gathered once for the gate and up projections
  Fp8Scales, and the fp8 scaling recipes in jax_ub.fp8
  initialize(mesh, axis_name, *, buffer_bytes=None) / finalize() / check_health()
  configure(**settings) / config
  explain_impl(op, x_shape, w_shape, dtype, axis_size, ...) -> ImplChoice: what impl="auto"
    (or "ub", "xla") runs for a call, and why
  dots_and_ops_saveable: a jax.checkpoint policy that saves the dots and the ops' results
"""

from jax_ub._src import cpu_runtime as _cpu_runtime
from jax_ub._src import extension as _extension  # registers the FFI handlers
from jax_ub._src.all_gather_matmul import all_gather_matmul
from jax_ub._src.auto_rule import ImplChoice, explain_impl
from jax_ub._src.communicator import Communicator, initialize, live_communicators
from jax_ub._src.config import Config, config, configure
from jax_ub._src.fp8 import Fp8Scales
from jax_ub._src.gated_mlp import gated_mlp, gated_mlp_reference
from jax_ub._src.matmul_reduce_scatter import matmul_reduce_scatter
from jax_ub._src.mlp import gelu_mlp
from jax_ub._src.reference import (
    all_gather_matmul_reference,
    matmul_reduce_scatter_reference,
)
from jax_ub._src.remat import dots_and_ops_saveable
from jax_ub._src.teardown import check_health, finalize

__all__ = [
    "Communicator",
    "Config",
    "Fp8Scales",
    "ImplChoice",
    "all_gather_matmul",
    "all_gather_matmul_reference",
    "check_health",
    "config",
    "configure",
    "dots_and_ops_saveable",
    "explain_impl",
    "finalize",
    "gated_mlp",
    "gated_mlp_reference",
    "gelu_mlp",
    "initialize",
    "live_communicators",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_reference",
]

# Before JAX creates its CPU client: enough worker threads for any number of calls in
# flight on CPU devices (cpu_runtime says why).
_cpu_runtime.install()
del _cpu_runtime, _extension
__version__ = "0.1.0"
