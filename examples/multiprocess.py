"""jax_ub across processes started with plain `python`, no MPI and no special launcher.

Each process calls jax.distributed.initialize(); jax_ub bootstraps its communicators
through the distributed key-value store. Launch, for example, 2 processes on one machine
(CPU devices, the tensor-parallel group spanning both processes):

    python3 examples/multiprocess.py --process-id 0 --num-processes 2 &
    python3 examples/multiprocess.py --process-id 1 --num-processes 2

Under SLURM (or any launcher that sets the usual variables) leave the flags out:
jax.distributed.initialize() reads the coordinator address, process count and id from the
environment (SLURM, Open MPI, ...), e.g.
`srun -N2 --ntasks-per-node=1 python3 examples/multiprocess.py`.
With GPUs, give each host one process and keep the tp axis inside the host: the mesh
(dp, tp) = (num_hosts, gpus_per_host), as below with --layout dp_tp.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

USAGE = """\
Start one process per id, each knowing its place; e.g. 2 processes on this machine:

    python3 examples/multiprocess.py --process-id 0 --num-processes 2 &
    python3 examples/multiprocess.py --process-id 1 --num-processes 2

or under a launcher that JAX reads (SLURM, Open MPI, ...), without the flags:

    srun -N 2 --ntasks-per-node=1 python3 examples/multiprocess.py --layout dp_tp
"""

ap = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    epilog=USAGE,
    formatter_class=argparse.RawDescriptionHelpFormatter,
)
ap.add_argument(
    "--coordinator",
    default="127.0.0.1:29477",
    help="host:port of process 0's coordination service, with --process-id (default: %(default)s)",
)
ap.add_argument(
    "--process-id",
    type=int,
    default=None,
    help="this process's id, 0 .. NUM_PROCESSES-1 (leave out under a launcher)",
)
ap.add_argument(
    "--num-processes",
    type=int,
    default=None,
    help="how many processes the job has, with --process-id (leave out under a launcher)",
)
ap.add_argument("--cpu-devices", type=int, default=2, help="CPU devices per process")
ap.add_argument(
    "--layout",
    choices=["tp", "dp_tp"],
    default="tp",
    help="tp: one group over all devices; dp_tp: dp across processes, tp inside",
)
args = ap.parse_args()
if (args.process_id is None) != (args.num_processes is None):
    ap.error(
        "--process-id and --num-processes go together, got "
        f"--process-id={args.process_id} --num-processes={args.num_processes}"
    )
if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
    ap.error(
        f"--process-id must be in 0 .. {args.num_processes - 1} for --num-processes="
        f"{args.num_processes}, got {args.process_id}"
    )
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    ).strip()

import jax  # noqa: E402

# CPU collectives for the xla reference (the CPU client only; GPUs use NCCL).
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def no_launcher(error: ValueError) -> bool:
    """Whether jax.distributed.initialize() failed because nothing told it where the
    coordinator is: no JAX_COORDINATOR_ADDRESS and no cluster it detects (SLURM, Open MPI,
    Cloud TPU, Kubernetes, ...). Any other error is JAX's to report."""
    return "coordinator_address" in str(error) and not os.environ.get("JAX_COORDINATOR_ADDRESS")


if args.process_id is None:
    try:
        jax.distributed.initialize()  # coordinator, count and id from the launcher's environment
    except ValueError as e:
        if not no_launcher(e):
            raise
        print(
            "examples/multiprocess.py runs as one of several processes, and none of "
            "--process-id/--num-processes, a launcher's variables (SLURM, Open MPI, ...) or "
            "JAX_COORDINATOR_ADDRESS says which.\n" + USAGE,
            file=sys.stderr,
        )
        sys.exit(2)
else:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402

devices = np.array(jax.devices())
if args.layout == "dp_tp":
    mesh = Mesh(devices.reshape(jax.process_count(), -1), ("dp", "tp"))
    rows = P(("dp", "tp"), None)
else:
    mesh = Mesh(devices, ("tp",))
    rows = P("tp", None)
tp = mesh.shape["tp"]
seq, d, f = 32 * mesh.size, 64, 32 * tp


def make(spec, shape, seed):
    full = np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32)) / np.sqrt(
        shape[0]
    )
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: full[i])


x, w1, w2 = make(rows, (seq, d), 0), make(P(None, "tp"), (d, f), 1), make(P("tp", None), (f, d), 2)


def mlp(x, w1, w2, impl):
    h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
    y = jax_ub.matmul_reduce_scatter(jax.nn.gelu(h), w2, "tp", impl=impl)
    return lax.psum(jnp.sum(y * y), mesh.axis_names)


losses = {}
for impl in ("ub", "xla"):
    step = jax.jit(
        jax.shard_map(
            jax.value_and_grad(functools.partial(mlp, impl=impl), argnums=(1, 2)),
            mesh=mesh,
            in_specs=(rows, P(None, "tp"), P("tp", None)),
            out_specs=(P(), (P(None, "tp"), P("tp", None))),
            check_vma=False,
        )
    )
    loss, grads = step(x, w1, w2)
    losses[impl] = float(loss)
print(
    f"process {jax.process_index()}/{jax.process_count()}: mesh {dict(mesh.shape)}, "
    f"loss ub {losses['ub']:.6f} vs xla {losses['xla']:.6f}",
    flush=True,
)
assert abs(losses["ub"] - losses["xla"]) <= 1e-4 * abs(losses["xla"])
jax_ub.finalize()
