"""XLA_FLAGS for the CPU test suite, set by conftest.py before jax is imported.

XLA's host platform is split into 8 devices, so that every tensor-parallel layout (1, 2, 4, 8
ranks; 2x4 and 4x2 meshes) runs in one process. Without GPUs the programs here are tiny and
compiling them dominates: LLVM at -O0 compiles them about a quarter faster, and XLA's
element-wise emitters instead of its fusion emitters (MLIR) a third on top (the same HLO
passes run; only machine code differs). Those two are left alone where a GPU is present (its
kernels' code is what the GPU tests check). A flag XLA_FLAGS already sets is kept as set.

Without GPUs the suite also shares one persistent compilation cache among all its processes
(pytest-xdist's workers and the processes tests start): many tests compile the same small
programs, and a process of a multi-process test often compiles what another has. The cache
is a fresh folder per run, removed when the process that made it exits, so every run
compiles each program once; a JAX_COMPILATION_CACHE_DIR set outside is used as it is."""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEVICES = 8
_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
_EMITTERS_ENV = "JAX_UB_TEST_ELEMENT_WISE_EMITTERS"
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def _element_wise_emitters() -> bool:
    """Whether to ask for the element-wise emitters: not before jaxlib 0.10 (they round float8
    conversions otherwise there), nor where this jaxlib lacks the flag (0.12 dropped it, and
    XLA aborts on an unknown flag). A child process is asked once; the answer is left in the
    environment for the processes the tests start."""
    known = os.environ.get(_EMITTERS_ENV)
    if known is None:
        jaxlib = importlib.metadata.version("jaxlib")
        usable = tuple(int(p) for p in re.findall(r"\d+", jaxlib)[:2]) >= (0, 10)
        if usable:
            env = dict(os.environ, XLA_FLAGS=_EMITTERS_FLAG, JAX_PLATFORMS="cpu")
            probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
            usable = subprocess.run(probe, env=env, capture_output=True).returncode == 0
        known = "1" if usable else "0"
        os.environ[_EMITTERS_ENV] = known
    return known == "1"


def set_flags() -> None:
    """Add the suite's flags to XLA_FLAGS."""
    flags = {"xla_force_host_platform_device_count": str(DEVICES)}
    if not os.path.exists("/dev/nvidiactl"):
        flags["xla_backend_optimization_level"] = "0"
        if _element_wise_emitters():
            flags["xla_cpu_use_fusion_emitters"] = "false"
        if _CACHE_ENV not in os.environ:
            os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jax_ub_tests_xla_cache_")
            atexit.register(shutil.rmtree, os.environ[_CACHE_ENV], ignore_errors=True)
            # Every program, however small or quick to compile (JAX's defaults skip those).
            os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
            os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    current = os.environ.get("XLA_FLAGS", "")
    for name, value in flags.items():
        if name not in current:
            current = f"{current} --{name}={value}".strip()
    os.environ["XLA_FLAGS"] = current
