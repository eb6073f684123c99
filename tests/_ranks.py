"""N ranks on one GPU: ``pytest --ranks N`` runs the selected tests in N processes that all
drive one GPU (GPU 0, or ``JAX_UB_TEST_RANKS_GPU``), each one rank (one JAX device) of a
``jax.distributed`` group.

The CUDA path at tp 2, 4 and 8 needs no more than one GPU this way: jax_ub's userbuffers
are shared between the processes through CUDA IPC, as between processes on different
GPUs. The single-controller GPU tests run unchanged in each rank (the same program in
every process, as SPMD code runs), with three things made to work across processes:

- **XLA's collectives** (the tests' ``impl="xla"`` references, a loss's ``psum``, the
  dp gradient sums) run on NCCL, which refuses two ranks of one GPU in a communicator
  ("Duplicate GPU detected"). Each rank gets a host id of its own (``NCCL_HOSTID``, set by
  ``jax_ub.share_gpu``), so NCCL takes the ranks for separate machines and joins them over
  its socket transport on the loopback interface. Slow, and only for correctness:
  **timings from this mode are never performance figures.**
- **Fetching a global array** (``np.asarray``, ``float``, ``jax.device_get``) of which a
  rank holds only its shard gathers the whole array first, on every rank, through files
  in memory (a collective: each rank fetches the same arrays in the same order, as
  single-controller test code does), so the tests' checks see global values.
- **Meshes** are over all N ranks' devices; a test that builds a mesh of fewer devices
  (:func:`conftest.gpu_mesh`) is skipped in this mode: the ranks outside it would run
  none of its programs.

The ranks' kernels run side by side under an MPS daemon of the launcher's own, where the
machine has NVIDIA's ``nvidia-cuda-mps-control`` (``JAX_UB_TEST_RANKS_MPS``: ``auto``, the
default; ``1``: required; ``0``: none) and no MPS daemon runs already; without one the ranks'
CUDA contexts take turns on the GPU, and each step that waits for every rank waits for each
context's turn (on one H200, 8 ranks' Llama greedy decoding tests took 48 s with MPS, 78 s
without).

The parent process (the ``pytest --ranks N`` the user runs) only launches the ranks and
reports: rank 0's output is shown as it runs, every rank's is written to
``--ranks-logs`` (default: a temporary folder), a failed rank's tail is printed, and the
exit status is the worst rank's. A rank that hangs is ended by pytest-timeout (thread
method: its stacks are dumped into its log); the others are ended ``GRACE_S`` seconds
after the first rank ends.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
from _ranks_gpu import GPU_MIB_ENV, gpu_memory_mib, start_mps, stop_mps

RANK_ENV, RANKS_ENV, PORT_ENV = "JAX_UB_TEST_RANK", "JAX_UB_TEST_RANKS", "JAX_UB_TEST_RANKS_PORT"
GPU_ENV = "JAX_UB_TEST_RANKS_GPU"  # which GPU the ranks share (default 0)
SHARE_COMPILE_ENV = "JAX_UB_TEST_RANKS_SHARE_COMPILE"  # 0: every rank compiles for itself
FETCH_DIR_ENV = "JAX_UB_TEST_RANKS_FETCH_DIR"  # the launcher's folder for fetched shards
STACKS_SIGNAL = signal.SIGUSR1  # a rank prints its threads' stacks (faulthandler)
STACKS_ENV = "JAX_UB_TEST_RANKS_STACKS"  # the file it prints them into
STACKS_WAIT_S = 2.0
# Then, where cuda-gdb is on PATH (the GPU machines have no gdb), every thread's native stack
# (XLA's and jax_ub's C++ threads too: where each waits inside CUDA) into rank<i>_native.txt,
# all ranks at once, within this many seconds.
NATIVE_STACKS_S = 60.0
# After the first rank ends, how long the others may take to end too.
GRACE_S = float(os.environ.get("JAX_UB_TEST_RANKS_GRACE_S", "120"))
# How many ranks share the GPU in all (several groups of ranks may run on one GPU at once,
# e.g. N = 8, 4 and 2 side by side); default: this group's N.
ON_GPU_ENV = "JAX_UB_TEST_RANKS_ON_GPU"
GPU_MEMORY_SHARE = 0.85  # of the GPU's memory, for the XLA pools of every rank on it together
# The least a rank's pool may grow to however many share the GPU (MiB): a rank of
# test_gpu.py's largest case holds about 5 GiB (its global arrays fetched whole); a pool of
# 5.4 GiB (0.85/22 of an H200) ran it out of memory, 7.6 GiB did not. Above 0.85 of the
# GPU in all the caps overlap: device_run.sh runs the heavy files' items one after another
# (RANKS_HEAVY) and puts no more ranks on a GPU than fit at about 3.7 GiB each.
MIN_POOL_MIB = 7 * 1024
# How long a rank waits at a fetch for the others.
FETCH_TIMEOUT_MS = int(os.environ.get("JAX_UB_TEST_RANKS_FETCH_TIMEOUT_MS", "120000"))


def rank_count() -> int:
    """How many ranks share the GPU in this process's group (0: not in the N-ranks mode)."""
    return int(os.environ.get(RANKS_ENV, "0"))


def rank() -> int:
    return int(os.environ.get(RANK_ENV, "0"))


def ranks_on_gpu() -> int:
    """How many ranks share this rank's GPU in all: this group's N, or more where other
    groups run beside it (``JAX_UB_TEST_RANKS_ON_GPU``, set by device_run.sh's lanes)."""
    return int(os.environ.get(ON_GPU_ENV) or rank_count() or 1)


def shared_gpu() -> int:
    """The GPU the ranks share: ``JAX_UB_TEST_RANKS_GPU`` (default 0), so that a machine of
    several GPUs can run one group of ranks on each."""
    return int(os.environ.get(GPU_ENV, "0"))


# ------------------------------------------------------------------ in each rank


def prepare_environment() -> None:
    """Before JAX first uses a device: this rank on the shared GPU (``jax_ub.share_gpu``:
    allocated as it goes, and NCCL's view of it, a host of its own reached over loopback)."""
    import jax_ub

    jax_ub.share_gpu(rank(), gpu=shared_gpu())
    # N ranks compile every program N times on the host's cores: no autotuning (the GEMMs'
    # numbers stay cuBLAS's; only their speed, not measured here, may differ).
    env = os.environ
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    env.setdefault("NCCL_SET_THREAD_NAME", "1")  # NCCL's threads by name in hot_threads.py
    # Each rank's XLA pool grows as it needs and never shrinks: capped at its share of the
    # GPU, with room left for the userbuffers and the CUDA contexts, so that one rank's
    # large test cannot starve the others of memory (a later allocation anywhere on the
    # GPU would fail, or a rank's GPU not start at all).
    mib = gpu_memory_mib(shared_gpu())
    least = MIN_POOL_MIB / mib if mib else GPU_MEMORY_SHARE / 16
    share = min(max(GPU_MEMORY_SHARE / ranks_on_gpu(), least), GPU_MEMORY_SHARE)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{share:.3f}")


def join() -> None:
    """After jax is imported: join the group, and let global arrays be fetched whole."""
    import jax

    # The launcher, ended by a signal (a step's time limit), has every rank print its
    # threads' stacks first: where a hung group stopped. Into a file of their own beside
    # the rank's log: pytest captures what a test writes to stderr, and a killed rank's
    # capture is lost.
    if os.environ.get(STACKS_ENV):
        stacks = open(os.environ[STACKS_ENV], "w")  # noqa: SIM115 (open until the rank ends)
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    # CPU devices' collectives across the ranks (the mode's own test runs on CPU devices).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{os.environ[PORT_ENV]}",
        num_processes=rank_count(),
        process_id=rank(),
        initialization_timeout=120,
    )
    if os.environ.get(SHARE_COMPILE_ENV, "1") != "0":
        _share_compiled_programs(jax)
    _fetch_global_arrays_whole()


def _share_compiled_programs(jax) -> None:
    """Rank 0 compiles each program and hands it to the others through jax.distributed's
    key-value store (``jax_share_binary_between_hosts``), instead of every rank compiling
    it, which dominates this mode's time. JAX keys a program alike in every process only on
    GPUs (it strips the device assignment there); on CPU devices the keys differ and a rank
    would wait for a program never sent, so CPU runs never share. On by default
    (``JAX_UB_TEST_RANKS_SHARE_COMPILE=0``: off); a program that does not come fails the
    test after two minutes instead of hanging. The launcher removes the caches it needs
    (:func:`_compile_cache`) when its ranks have ended."""
    if not jax.devices() or jax.devices()[0].platform != "gpu":
        return
    # sharing needs the cache on
    jax.config.update("jax_compilation_cache_dir", _compile_cache(os.getppid(), rank()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", 120_000)


def _compile_cache(launcher_pid: int, rank: int) -> str:
    """The folder of one rank's compilation cache (:func:`_share_compiled_programs`)."""
    return os.path.join(tempfile.gettempdir(), f"jax_ub_ranks_cache_{launcher_pid}_{rank}")


def _fetch_global_arrays_whole() -> None:
    """``np.asarray(a)`` of an array sharded over several processes gathers it first (JAX
    refuses to fetch such an array). A collective: every rank must fetch it."""
    from jax._src import array as array_module

    cls = array_module.ArrayImpl
    if getattr(cls, "_jax_ub_test_gathers", False):
        return
    plain = cls._value

    def value(self):
        if self._npy_value is None and not (self.is_fully_addressable or self.is_fully_replicated):
            whole = _gather_through_files(self)
            whole.flags.writeable = False
            return whole
        return plain.fget(self)

    cls._value = property(value)
    cls._jax_ub_test_gathers = True


_fetches = itertools.count()


def _gather_through_files(a) -> np.ndarray:
    """The whole of global array ``a``, on every rank: each rank writes the shards it holds
    to a file of the launcher's fetch folder (:func:`_fetch_folder`, in memory where
    ``/dev/shm`` has room), waits at a barrier of jax.distributed's group, reads every rank's
    and puts them in place. The ranks share one host by construction, so this costs a copy
    in memory. JAX's own way (``process_allgather``) runs an XLA all-gather over NCCL's
    sockets: on one H200 with 8 ranks, 29 ms for a 16 KiB array (2.8 ms this way) and 1.3 s
    the first time, when NCCL sets up its communicator."""
    import jax
    from jax._src import distributed

    client, me, count = distributed.global_state.client, jax.process_index(), next(_fetches)
    path = os.path.join(os.environ[FETCH_DIR_ENV], f"{count}_{{}}.pkl")
    mine = [
        (tuple((i.start, i.stop) for i in s.index), np.asarray(s.data))
        for s in a.addressable_shards
    ]
    with open(path.format(me) + ".part", "wb") as f:
        pickle.dump(mine, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(path.format(me) + ".part", path.format(me))
    what = f"fetch {count} of a global array {a.dtype}{list(a.shape)}"
    _barrier(client, f"jax_ub_fetch_{count}_written", what)
    whole, covered = np.empty(a.shape, a.dtype), set()
    for r in range(jax.process_count()):
        with open(path.format(r), "rb") as f:
            for index, data in pickle.load(f):
                block = tuple(slice(*i) for i in index)
                whole[block] = data
                covered.add((index, data.size))
    if sum(size for _, size in covered) != whole.size:
        raise AssertionError(f"{what}: the ranks' shards do not cover it ({sorted(covered)})")
    _barrier(client, f"jax_ub_fetch_{count}_read", what)
    os.unlink(path.format(me))
    return whole


def _barrier(client, name: str, what: str) -> None:
    try:
        client.wait_at_barrier(name, FETCH_TIMEOUT_MS)
    except Exception as e:
        raise RuntimeError(
            f"{what}: not every rank reached barrier {name} within {FETCH_TIMEOUT_MS} ms (a rank"
            " gone, or one that fetches other arrays or in another order)"
        ) from e


def _fetch_folder() -> str:
    """Where the ranks of one launcher pass shards of fetched arrays: chosen by the launcher
    (the ranks must agree, and free space changes as they write), removed at its end."""
    base = tempfile.gettempdir()
    # Containers often give /dev/shm 64 MiB: too little for the larger tests' arrays.
    if os.access("/dev/shm", os.W_OK):
        shm = os.statvfs("/dev/shm")
        if shm.f_bavail * shm.f_frsize >= 8 << 30:
            base = "/dev/shm"
    # Not jax_ub_*: in /dev/shm those are the library's shared-memory regions.
    return os.path.join(base, f"jax-ub-ranks-fetch-{os.getpid()}")


def local_devices_of(mesh) -> list:
    """The devices of ``mesh`` that this process drives."""
    import jax

    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


# ------------------------------------------------------------------ the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip_ranks_options(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--ranks", "--ranks-logs"):
            skip = True
        elif not a.startswith(("--ranks=", "--ranks-logs=")):
            out.append(a)
    return out


def launch(ranks: int, args: list[str], logs: str | None, cwd: str) -> int:
    """Run ``pytest args`` in ``ranks`` processes, one rank each; the worst exit status."""
    if ranks < 1:
        raise SystemExit(f"--ranks must be at least 1, got {ranks}")
    logs = logs or tempfile.mkdtemp(prefix="jax_ub_ranks_")
    os.makedirs(logs, exist_ok=True)
    fetch_dir = _fetch_folder()
    os.makedirs(fetch_dir, exist_ok=True)
    mps: dict[str, str] = {}
    # Ended by a signal (timeout's TERM), the launcher still stops its daemon: daemonized,
    # it is in no process group that a kill of this one's would reach.
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        mps = start_mps(tempfile.mkdtemp(prefix="jax-ub-ranks-mps-"))
        extra = {FETCH_DIR_ENV: fetch_dir, **mps}
        mib = gpu_memory_mib(shared_gpu())
        if mib:  # found once here, not by every rank
            extra[GPU_MIB_ENV] = str(mib)
        return _run_ranks(ranks, args, logs, cwd, extra)
    finally:
        for i in range(ranks):
            shutil.rmtree(_compile_cache(os.getpid(), i), ignore_errors=True)
        shutil.rmtree(fetch_dir, ignore_errors=True)
        stop_mps(mps)
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _run_ranks(ranks: int, args: list[str], logs: str, cwd: str, extra: dict[str, str]) -> int:
    port = _free_port()
    cmd = [sys.executable, "-m", "pytest", *_strip_ranks_options(args), "-p", "no:cacheprovider"]
    # A hung test ends its rank, its stacks dumped, instead of waiting on forever.
    cmd += ["-o", "timeout_method=thread"]
    procs, files = [], []
    for i in range(ranks):
        env = dict(os.environ, **{RANK_ENV: str(i), RANKS_ENV: str(ranks), PORT_ENV: str(port)})
        # Each rank's compilation cache (_share_compiled_programs) would otherwise keep its
        # GEMM choices (gemm_cache "auto") from test to test: every test tunes, as it would
        # alone, unless the run names a file.
        env.setdefault("JAX_UB_GEMM_CACHE", "")
        env.update(extra)
        env[STACKS_ENV] = os.path.join(logs, f"rank{i}_stacks.txt")
        path = os.path.join(logs, f"rank{i}.log")
        files.append(path)
        log = open(path, "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=log), log))
    mps = "CUDA_MPS_PIPE_DIRECTORY" in {**os.environ, **extra}
    sharing = "under MPS" if mps else "taking turns"
    where = f"{ranks} processes on GPU {shared_gpu()} ({sharing}), logs in {logs}"
    print(f"jax_ub N-ranks mode: {where}", flush=True)
    try:
        first_end = _follow(files[0], [p for p, _ in procs])
    except BaseException:
        _print_stacks([p for p, _ in procs], logs)
        for p, _ in procs:
            p.kill()
        raise
    deadline = first_end + GRACE_S
    codes = []
    for i, (p, log) in enumerate(procs):
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
            print(
                f"rank {i} had not ended {GRACE_S:.0f} s after the first rank ended: killed",
                flush=True,
            )
        log.close()
    for i, code in enumerate(codes):
        if i and code not in (0, 5):
            with open(files[i]) as f:
                tail = f.read().splitlines()[-60:]
            print(f"\n---- rank {i} ended with status {code}; its log's end:", *tail, sep="\n")
    print(f"jax_ub N-ranks mode: exit status of each rank: {codes}", flush=True)
    failed = [c for c in codes if c not in (0, 5)]
    return failed[0] if failed else (5 if all(c == 5 for c in codes) else 0)


def _print_stacks(procs: list[subprocess.Popen], logs: str) -> None:
    """Have each rank still running print its threads' stacks (into ``rank<i>_stacks.txt``
    beside its log; join registers the signal), give them a moment to, then take every
    thread's native stack where cuda-gdb is there (``NATIVE_STACKS_S``)."""
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for _, p in running:
        try:
            p.send_signal(STACKS_SIGNAL)
        except OSError:
            pass
    if not running:
        return
    time.sleep(STACKS_WAIT_S)  # before an attach stops the rank
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return
    attaches = []
    for i, p in running:
        out = open(os.path.join(logs, f"rank{i}_native.txt"), "w")  # noqa: SIM115 (closed below)
        cmd = [gdb, "-p", str(p.pid), "-batch", "-ex", "set pagination off"]
        cmd += ["-ex", "thread apply all bt 30"]
        attaches.append(
            (subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out), out)
        )
    deadline = time.monotonic() + NATIVE_STACKS_S
    for a, out in attaches:
        try:
            a.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.kill()
            a.wait()
        out.close()


def _follow(path: str, procs: list[subprocess.Popen]) -> float:
    """Print the file at ``path`` (rank 0's log) as rank 0 writes it, until rank 0 ends or
    ``GRACE_S`` after any rank ended (rank 0 may wait forever at exit, in
    ``jax.distributed``'s shutdown, for a rank that is gone or stuck elsewhere); the time the
    first rank ended."""
    first_end = None
    with open(path) as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
            now = time.monotonic()
            if first_end is None and any(p.poll() is not None for p in procs):
                first_end = now
            if procs[0].poll() is not None or (first_end and now - first_end > GRACE_S):
                sys.stdout.write(f.read())
                sys.stdout.flush()
                return first_end if first_end is not None else now
            time.sleep(0.2)
