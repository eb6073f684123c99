"""jax_ub: tensor-parallel communication overlapped with matmuls, through userbuffers.

Public API (each name's own help, e.g. help(jax_ub.all_gather_matmul), has its shapes,
shardings and options in full; this page lists them and the rules they share):
  all_gather_matmul(x, w, axis_name, *, bias=None, activation=None, impl="auto",
                    return_gathered=False, fp8=None, seq_axis=0)
  matmul_reduce_scatter(x, w, axis_name, *, bias=None, impl="auto", fp8=None, seq_axis=0)
  matmul_all_reduce(x, w, axis_name, *, bias=None, impl="auto", seq_axis=0): the
    row-parallel GEMM with activations replicated over the axis (decode), its
    reduce-scatter half overlapped
  gelu_mlp(x, w_up, w_down, axis_name, *, up_bias=None, down_bias=None, impl="auto",
           fp8=None, seq_axis=0): the two ops around GELU, GELU's backward in a GEMM epilogue
  gated_mlp(x, w_gate_up, w_down, axis_name, *, activation="silu", impl="auto", fp8=None,
            seq_axis=0):
    SwiGLU / GeGLU, x gathered once for the gate and up projections
  all_gather_matmul_reference, matmul_reduce_scatter_reference,
  matmul_all_reduce_reference, gated_mlp_reference: the same math on lax collectives
  Fp8Scales: per-tensor fp8 scales (the fp8= argument); the scaling recipes in jax_ub.fp8
  initialize(mesh, axis_name, *, buffer_bytes=None, platform=None) -> Communicator: one
    made now, not on first use; finalize() / check_health(); live_communicators()
  share_gpu(process_id, *, gpu=0): this process one of several ranks on one GPU (tp > 1 developed
    and tested on a machine of one GPU), before JAX first uses a device
  configure(**settings) / config: the settings, a Config (help(jax_ub.Config) lists them
    and their JAX_UB_* environment variables)
  explain_impl(op, x_shape, w_shape, dtype, axis_size, ...) -> ImplChoice: what impl="auto"
    (or "ub", "xla") runs for a call, and why
  dots_and_ops_saveable: a jax.checkpoint policy that saves the dots and the ops' results
  Subpackages: jax_ub.flax (tensor-parallel Flax layers), jax_ub.fp8, jax_ub.models (a
    Llama-style model), jax_ub.bench (benchmarks), jax_ub.info (python -m jax_ub.info)

The rules behind the options (each function's docstring has its shapes and shardings):

  impl: "ub" runs the userbuffer op at any size; "xla" the same math on lax collectives
    (the *_reference functions); "auto" (default) the userbuffer op where the platform,
    dtype and extension allow it and, on GPUs, only for a group of two or more GPUs whose
    collective moves at least config.auto_min_bytes per rank (6x for matmul_all_reduce;
    default 8 MiB, calibrated on
    2x H200: jax_ub._src.settings.auto_rule), else XLA's op. On CPU devices "auto" runs the host
    protocol at any size: it is CI's test of the protocol, not a speed path. explain_impl
    says what a call runs and why; the "jax_ub" logger logs each decision at DEBUG when a
    call is traced. "none" runs the same GEMMs with the communication removed (a gather
    becomes tp copies of the local rows, a reduce-scatter a sum of row blocks): wrong
    numbers, to time a model's no-communication bound (the benchmarks' "bound"), on XLA's
    GEMMs or on jax_ub's own (configure(bound_gemms="ub"): each call on a group of one).
  seq_axis: the dim of x split over the axis (the sequence): 0 (default) for
    [seq, batch, ..., k], 1 for batch-major [batch, seq, ..., k]. Results keep it in place;
    the Flax layers take it too (jax_ub.flax.ParallelConfig).
  float32: the ops' GEMMs and their weight gradients' dots run at full float32 precision
    unless configure(allow_tf32=True); impl="xla" (and "auto" where it picks XLA) runs
    XLA's dots at JAX's default precision, which on GPUs is TF32 for float32.
  fp8: fp8=Fp8Scales(...) quantizes x and w to float8_e4m3fn with per-tensor scales, moves
    fp8 bytes in the all-gather and returns x.dtype; gradients go through float8_e5m2.
    cuBLASLt's fp8 GEMMs need compute capability 8.9 or newer and k and n of each rank's
    shards divisible by 16, checked on CPU devices too (impl="ub" refuses other shapes,
    "auto" takes XLA's fp8 path). The forward's e4m3 x e4m3 GEMMs accumulate in the tensor
    cores' fast mode, as XLA's fp8 dots at default precision do; GEMMs with an e5m2
    gradient promote partial sums to float32. Scaling recipes: jax_ub.fp8.
  Failures: every wait on a peer has a deadline (config.timeout_s), and every call carries
    a descriptor (op, dtype, shape, call number) that its peers check, so a missing rank or
    ranks that disagree give an error naming them, not a hang or wrong numbers. On GPUs
    most failures are found on the device after the op has returned to XLA: the call's
    outputs are NaN, the reason is printed at once, and check_health() (or the next jax_ub
    call) raises it. JAX_UB_TRACE=1 prints on stderr which call each GPU's handler thread
    has reached, for diagnosing a hang. Guarantees and their tests: tests/RELIABILITY.md.
  GPU kernel choice: a GEMM shape's first call on a GPU drains that GPU once, times
    cuBLASLt's best candidate kernels (about 1 s per shape, 2 s at most: a model's first step
    takes seconds per distinct GEMM shape) and loads them before anything waits on a peer
    (CUDA's lazy kernel loading could otherwise hang a group). A GEMM of 0.05 ms or more
    keeps the fastest at once, unless cuBLASLt's own first pick (the kernel cuBLAS runs) is
    within 3% of it, or within its lead's spread over the timed rounds, which then holds; a
    shorter one's next 15 calls compare the 3 fastest beside the op's copies and keep the
    fastest. From then on results are bitwise reproducible,
    though the kernel kept may differ between processes. configure(gemm_cache=path) keeps
    each shape's kernel in a file (keyed by GPU model, cuBLASLt version and shape) that
    later processes, and other GPUs of the same model, run from their first call, with no
    tuning and no trials; by default that file lies in JAX's persistent compilation cache
    folder where that cache is on (jax_compilation_cache_dir), else there is none. The
    tuning choices themselves are internal (jax_ub._src.settings.options.Tuning).
"""

# The public names are re-exported ("name as name") and there is no __all__: pydoc would print
# every name of an __all__ in full, some 700 lines, where this docstring lists them and each
# name's own help() has its details. A star import takes these names (and any subpackage
# imported by then).
from jax_ub._src.lowering.unfused import (
    all_gather_matmul_reference as all_gather_matmul_reference,
)
from jax_ub._src.lowering.unfused import (
    matmul_all_reduce_reference as matmul_all_reduce_reference,
)
from jax_ub._src.lowering.unfused import (
    matmul_reduce_scatter_reference as matmul_reduce_scatter_reference,
)
from jax_ub._src.ops.all_gather_matmul import all_gather_matmul as all_gather_matmul
from jax_ub._src.ops.checkpoint_policy import dots_and_ops_saveable as dots_and_ops_saveable
from jax_ub._src.ops.gated_mlp import gated_mlp as gated_mlp
from jax_ub._src.ops.gated_mlp import gated_mlp_reference as gated_mlp_reference
from jax_ub._src.ops.impl_choice import explain_impl as explain_impl
from jax_ub._src.ops.matmul_all_reduce import matmul_all_reduce as matmul_all_reduce
from jax_ub._src.ops.matmul_reduce_scatter import matmul_reduce_scatter as matmul_reduce_scatter
from jax_ub._src.ops.mlp import gelu_mlp as gelu_mlp
from jax_ub._src.runtime import cpu_runtime as _cpu_runtime
from jax_ub._src.runtime import extension as _extension  # loads the host extension
from jax_ub._src.runtime.communicator import Communicator as Communicator
from jax_ub._src.runtime.communicator import initialize as initialize
from jax_ub._src.runtime.communicator import live_communicators as live_communicators
from jax_ub._src.runtime.shared_gpu import share_gpu as share_gpu
from jax_ub._src.runtime.teardown import check_health as check_health
from jax_ub._src.runtime.teardown import finalize as finalize
from jax_ub._src.settings.auto_rule import ImplChoice as ImplChoice
from jax_ub._src.settings.config import Config as Config
from jax_ub._src.settings.config import config as config
from jax_ub._src.settings.config import configure as configure
from jax_ub._src.settings.fp8 import Fp8Scales as Fp8Scales

# Before JAX creates its CPU client: enough worker threads for any number of calls in
# flight on CPU devices (cpu_runtime says why).
_cpu_runtime.install()
del _cpu_runtime, _extension
__version__ = "0.1.0"
