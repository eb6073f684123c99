"""Shared fixtures for the CPU test suite. XLA_FLAGS (8 CPU devices, faster compiles:
_xla_cpu_flags.py) must be in the environment before jax is imported, hence at the very top
of this file."""

import _ranks
import _ranks_gpu
import _xla_cpu_flags

_xla_cpu_flags.set_flags()
if _ranks.rank_count():  # pytest --ranks N: this process is one of N ranks on GPU 0
    _ranks.prepare_environment()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ub  # noqa: E402
from jax_ub._src import _host as _host_module  # noqa: E402
from jax_ub._src import jax_compat  # noqa: E402
from jax_ub._src.settings import options as _options  # noqa: E402
from jax_ub._src.settings.config import config as _config  # noqa: E402
from jax_ub._src.settings.options import current_options  # noqa: E402

if _ranks.rank_count():
    _ranks.join()

NUM_DEVICES = _xla_cpu_flags.DEVICES


def cpu_devices():
    """This process's CPU devices (in the N-ranks mode each rank has its own)."""
    return jax.local_devices(backend="cpu")


def gpus() -> list:
    """This process's GPUs (an empty list without any)."""
    return _gpus_and_why()[0]


def _gpus_and_why() -> tuple[list, str]:
    try:
        return jax.devices("gpu"), ""
    except RuntimeError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
    # JAX logs a GPU plugin's failure to start and then knows no such backend: its reason.
    failed = jax_compat.backend_errors()
    errors = [f"{name}: {err}" for name, err in failed.items() if name in ("cuda", "rocm", "gpu")]
    return [], "; ".join(errors) or why


def need_gpus(count: int) -> list:
    """The GPUs of this process (in the N-ranks mode: every rank's, one each); the calling
    test module is skipped (at import) where there are fewer than ``count``. A GPU that is
    there but fails to start (out of memory, a driver error) says so in the skip's reason."""
    found, why = _gpus_and_why()
    if not found and RANKS and _ranks_gpu.has_gpu():
        # The N-ranks mode on a GPU machine exists to run these: a rank whose GPU did not
        # start (a broken MPS daemon, a driver error) fails instead of skipping them.
        pytest.fail(
            f"rank {_ranks.rank()} of {RANKS}: the machine has a GPU, but JAX found none "
            f"(jax.devices('gpu') raised: {why or 'nothing'})",
            pytrace=False,
        )
    if len(found) < count:
        need = "a GPU" if count == 1 else f"at least {count} GPUs"
        reason = f"needs {need}"
        if why and "Unknown backend" not in why and "No visible" not in why:
            reason += f" (jax.devices('gpu') raised: {why})"
        pytest.skip(reason, allow_module_level=True)
    return found


RANKS = _ranks.rank_count()  # N in the N-ranks mode (pytest --ranks N), else 0


def gpu_mesh(devices, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    """A mesh of ``shape`` over the first prod(shape) of ``devices``. In the N-ranks mode a
    mesh of fewer than N devices skips the test: the ranks outside it would run none of its
    programs (it runs when the mode has as many ranks)."""
    n = int(np.prod(shape))
    if RANKS and n != RANKS:
        pytest.skip(f"a mesh of {n} devices; this run has {RANKS} ranks")
    assert len(devices) >= n, (len(devices), shape)
    return Mesh(np.array(devices[:n]).reshape(shape), names)


def model_mesh(devices, names: tuple[str, str], most_tp: int) -> Mesh:
    """A (dp, tp) mesh for a whole-model test whose shapes split over at most ``most_tp``
    ranks (its heads): (1, 2) on GPUs; in the N-ranks mode over every rank, tp = min(N,
    most_tp) and dp the rest."""
    tp = min(RANKS, most_tp) if RANKS else 2
    return gpu_mesh(devices, ((RANKS or 2) // tp, tp), names)


def group_sizes(devices) -> list[int]:
    """Tensor-parallel sizes a GPU test runs: 2 and every GPU; in the N-ranks mode, N
    alone."""
    return [RANKS] if RANKS else sorted({min(2, len(devices)), len(devices)})


def make_mesh(*shape_and_names, devices=None) -> Mesh:
    """Mesh from (size, name) pairs, e.g. make_mesh((2, "dp"), (4, "tp")).

    Built with jax.sharding.Mesh directly: jax.make_mesh gives Explicit axes in this JAX.
    `devices` (a list of CPU devices) overrides the default order devices[0..n).
    """
    sizes = tuple(s for s, _ in shape_and_names)
    names = tuple(n for _, n in shape_and_names)
    n = int(np.prod(sizes))
    devs = list(devices) if devices is not None else cpu_devices()[:n]
    assert len(devs) == n, (len(devs), n)
    return Mesh(np.array(devs, dtype=object).reshape(sizes), names)


@pytest.fixture(scope="module")
def mesh(request) -> Mesh:
    """A 1-D "tp" mesh of the test module's ``TP`` CPU devices (the Flax test modules')."""
    return make_mesh((request.module.TP, "tp"))


@pytest.fixture
def mesh1d():
    """mesh1d(n) -> 1-D mesh ("tp",) over the first n CPU devices."""

    def factory(n: int, name: str = "tp") -> Mesh:
        return make_mesh((n, name))

    return factory


@pytest.fixture
def mesh2d():
    """mesh2d(dp, tp, order=("dp", "tp")) -> 2-D mesh; the ops run over "tp"."""

    def factory(dp: int, tp: int, order=("dp", "tp"), devices=None) -> Mesh:
        sizes = {"dp": dp, "tp": tp}
        return make_mesh(*[(sizes[a], a) for a in order], devices=devices)

    return factory


def smap(f, mesh, in_specs, out_specs, *, jit=True, **kw):
    g = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw)
    return jax.jit(g) if jit else g


@functools.partial(jax.jit, static_argnums=1)
def _normal_pool(key, size):
    key, sub = jax.random.split(key)
    return key, jax.random.normal(sub, (size,), jnp.float32)


class Rand:
    """Fresh random arrays: a different key for every test and every call, never zeros.

    Numbers come from jax.random in a few fixed pool sizes (one compile each) and are cut
    to shape on the host: compiling jax.random for every shape would dominate the runtime.
    """

    def __init__(self, seed: int):
        self._key = jax.random.key(seed)

    def __call__(self, *shape, dtype=jnp.float32, scale=1.0):
        size = int(np.prod(shape))
        pool = 1 << max(12, (size - 1).bit_length())
        with jax.default_device(cpu_devices()[0]):
            self._key, values = _normal_pool(self._key, pool)
        x = np.asarray(values)[:size].reshape(shape) * np.float32(scale)
        # Keep every entry away from zero so no test passes on all-zero data.
        x = x + np.where(x >= 0, np.float32(0.05), np.float32(-0.05))
        return jnp.asarray(x.astype(jnp.dtype(dtype)))


@pytest.fixture
def rand(request):
    """rand(*shape, dtype=...) -> random array; seeded from the test's node id."""
    return Rand(zlib.crc32(request.node.nodeid.encode()))


def to_f32(a) -> np.ndarray:
    """A host float32 copy of any array (bfloat16 and float16 included)."""
    return np.asarray(a).astype(np.float32)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float32, failing loudly on NaN/Inf or a shape mismatch."""
    a, b = to_f32(a), to_f32(b)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    assert np.all(np.isfinite(a)), "result has NaN/Inf"
    assert np.all(np.isfinite(b)), "reference has NaN/Inf"
    nb = float(np.linalg.norm(b))
    assert nb > 0, "reference is all zeros: the test would prove nothing"
    return float(np.linalg.norm(a - b)) / nb


@jax.jit
def _rel_err_terms(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    terms = jnp.isfinite(a).all(), jnp.isfinite(b).all(), jnp.linalg.norm(a - b), jnp.linalg.norm(b)
    return jnp.stack([t.astype(jnp.float32) for t in terms])


def gpu_rel_err(a, b) -> float:
    """rel_err of two arrays, where they are: for jax arrays on the same devices, computed
    there and only four scalars fetched. On large global arrays this keeps the GPU tests'
    host copies (every rank's whole array, in the N-ranks mode) out of the check."""
    if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)) or (
        a.sharding.device_set != b.sharding.device_set
    ):
        return rel_err(a, b)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    finite_a, finite_b, diff, nb = (float(v) for v in np.asarray(_rel_err_terms(a, b)))
    assert finite_a == 1, "result has NaN/Inf"
    assert finite_b == 1, "reference has NaN/Inf"
    assert nb > 0, "reference is all zeros: the test would prove nothing"
    return diff / nb


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}


def tol(dtype) -> float:
    return TOL[jnp.dtype(dtype).type]


@pytest.fixture(autouse=True)
def _restore_config():
    """Every test starts from, and leaves behind, the same jax_ub.config and tuning."""
    saved = dataclasses.asdict(_config)
    saved_tuning = _options.tuning()
    yield
    for name, value in saved.items():
        setattr(_config, name, value)
    _options.restore_tuning(saved_tuning)


def use_tuning(**changes) -> None:
    """Tuning choices for the rest of the test (restored after it by _restore_config)."""
    _options.set_experimental_tuning(**changes)


@pytest.fixture(autouse=True, scope="session")
def _check_device_count():
    n = len(cpu_devices())
    assert n >= NUM_DEVICES, (
        f"the CPU suite needs {NUM_DEVICES} host devices, got {n}: was jax imported before "
        "tests/conftest.py could set XLA_FLAGS=--xla_force_host_platform_device_count?"
    )


@pytest.fixture
def fresh_communicators():
    """The test starts and ends with no communicator alive (a fault test leaves one broken);
    modules of such tests use it with ``pytest.mark.usefixtures``."""
    jax_ub.finalize()
    assert _host_module.num_communicators() == 0
    yield
    jax_ub.finalize()


@pytest.fixture(autouse=True, scope="module")
def _finalize_after_module():
    yield
    jax_ub.finalize()


def comm_options(**changes) -> dict:
    """The options dict the extensions' create_communicator takes: the ones in force now,
    with `changes` (for tests that create communicators directly)."""
    current = dataclasses.asdict(current_options())
    current.update(changes)
    return current


def ag_fn(mesh, impl="ub", axis="tp", **kw):
    """jit(shard_map(all_gather_matmul)): x row-sharded, w column-sharded over tp."""
    return smap(
        lambda x, w: jax_ub.all_gather_matmul(x, w, axis, impl=impl, **kw),
        mesh,
        in_specs=(P("tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )


def rs_fn(mesh, impl="ub", axis="tp"):
    """jit(shard_map(matmul_reduce_scatter)): x column-sharded, w row-sharded over tp."""
    return smap(
        lambda x, w: jax_ub.matmul_reduce_scatter(x, w, axis, impl=impl),
        mesh,
        in_specs=(P(None, "tp"), P("tp")),
        out_specs=P("tp"),
    )


_CHILD_ENV = "JAX_UB_TEST_IN_CHILD"


def in_own_process(request, timeout_s: float = 300) -> bool:
    """Run the calling test in a fresh Python process, so that a crash (a segfault in XLA's
    compiler, an abort) fails that test alone instead of ending the session.

    Returns True in that process, where the test's body runs; in the parent it runs the
    child, fails with the child's output (and the signal, if it died of one) unless the
    child passed, and returns False. Usage: ``if not in_own_process(request): return``.
    """
    import subprocess
    import sys

    if os.environ.get(_CHILD_ENV) == "1" or RANKS:  # a rank is a process of its own
        return True
    # The parent already holds its share of the GPUs: the child allocates as it goes.
    env = dict(os.environ, **{_CHILD_ENV: "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    cmd.append(request.node.nodeid)
    try:
        done = subprocess.run(
            cmd,
            cwd=request.config.rootpath,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{request.node.nodeid} did not finish in {timeout_s} s:\n{e.stdout}")
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    if done.returncode < 0:
        pytest.fail(f"the test's process died of signal {-done.returncode}:\n{tail}")
    if done.returncode == 0 and re.search(r"^1 skipped", done.stdout, re.MULTILINE):
        reason = re.search(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", done.stdout, re.MULTILINE)
        pytest.skip(reason.group(1) if reason else "skipped in its own process")
    if done.returncode != 0 or not re.search(r"^1 passed", done.stdout, re.MULTILINE):
        pytest.fail(f"the test failed in its own process (rc={done.returncode}):\n{tail}")
    return False


# The slow tier, ``pytest -m slow`` (``-m "not slow"`` leaves it out): whole models and
# benchmarks, the examples (README's and the docstrings'), bfloat16 training on CPU
# devices, and several processes joined by jax.distributed: these files,
# and the whole-model tests of other files, marked ``slow`` where they are. What every op,
# layer and gradient path does is in the fast tier; these run them end to end.
SLOW_FILES = frozenset(
    {
        "test_bench.py",
        "test_cpu_bf16_all_reduce.py",
        "test_docstrings.py",
        "test_flax_general_lm.py",
        "test_flax_ported_lm.py",
        "test_flax_public_lm.py",
        "test_layer_bench.py",
        "test_llama.py",
        "test_llama_decode.py",
        "test_model_bench.py",
        "test_multiprocess.py",
        "test_multiprocess_example.py",
        "test_multiprocess_faults.py",
        "test_ranks_mode.py",
        "test_step_trace.py",
        "test_train_example.py",
    }
)


def pytest_addoption(parser):
    group = parser.getgroup("jax_ub")
    group.addoption(
        "--ranks",
        type=int,
        default=0,
        help="run the selected GPU tests in N processes sharing GPU 0, each one rank of a "
        "jax.distributed group: the CUDA path at tp=N on one GPU (tests/_ranks.py)",
    )
    group.addoption("--ranks-logs", default=None, help="folder for each rank's log (--ranks)")


def pytest_cmdline_main(config):
    ranks = config.getoption("ranks")
    if ranks and not RANKS:  # the launcher: it runs no test itself
        args = list(config.invocation_params.args)
        cwd = str(config.invocation_params.dir)
        return _ranks.launch(ranks, args, config.getoption("ranks_logs"), cwd)
    return None


def pytest_configure(config):
    # Here, not in pyproject.toml: the tests also run from a copy outside the source tree
    # (.ci/wheel_check.sh).
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
    config.addinivalue_line(
        "markers", "own_processes: starts processes of its own (skipped under --ranks)"
    )
    config.addinivalue_line(
        "markers",
        "single_controller(why): needs one process driving every rank (skipped under --ranks)",
    )
    config.addinivalue_line(
        "markers", "slow: the slow tier: whole models, benchmarks, examples (SLOW_FILES)"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if RANKS and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="the N-ranks mode runs GPU tests only"))
        elif RANKS and "own_processes" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="starts processes of its own: run it alone"))
        elif RANKS and "single_controller" in item.keywords:
            reason = item.get_closest_marker("single_controller").args[0]
            item.add_marker(pytest.mark.skip(reason=f"one process drives every rank: {reason}"))
