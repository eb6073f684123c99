"""In-tree PEP 517 backend: scikit-build-core, plus what the CUDA extension needs to build.

The CUDA extension needs cuBLASLt headers, which come from the ``nvidia-cublas`` wheel, and
a CUDA compiler. A machine with a working CUDA toolkit (``nvcc``) builds with it. On Linux
x86-64 without one, nvcc, its tools and the CUDA headers come from NVIDIA's PyPI wheels
(CUDA 13.0, see ``_CUDA_WHEELS``), so ``pip install "jax_ub[cuda13]"`` builds the extension
on a machine with no toolkit. ``JAX_UB_DISABLE_CUDA=1`` builds the host extension alone and
downloads none of these; ``JAX_UB_CUDA_FROM_WHEELS=1`` takes the wheels even where a toolkit
is installed.

The extensions compile against the XLA FFI headers of a jaxlib, and XLA rejects handlers
built against a newer FFI API than its own (and its backend then fails to start), while it
takes older ones. So the build takes the jaxlib already installed where jax_ub is going,
when there is one (pip's build isolation hides it: see ``_installed_jaxlib``), and the
newest otherwise, which is also what installing jax_ub's ``jax`` dependency then picks.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

from scikit_build_core import build as _skb
from scikit_build_core.build import *  # noqa: F403  (re-export the PEP 517 hooks)

_CUBLAS = "nvidia-cublas>=13; sys_platform == 'linux'"
# CUTLASS's headers, for the flag GEMM (src/cuda/gemm/flag_gemm.h): its scheduler derives from
# CUTLASS 4.2's. Without them the extension builds without that kernel.
_CUTLASS = "nvidia-cutlass==4.2.*"
# CUDA 13.0: a driver cannot JIT PTX made by a newer toolkit than its own, and the oldest
# driver that JAX's CUDA 13 plugin runs on is 580 (CUDA 13.0). nvidia-cuda-nvcc requires the
# other wheels unpinned: pin each, so that cicc (nvidia-nvvm) and ptxas agree.
_CUDA_WHEELS = [
    f"{name}==13.0.*"
    for name in (
        "nvidia-cuda-nvcc",  # nvcc, cudafe++, ptxas, fatbinary, nvlink
        "nvidia-nvvm",  # cicc, libdevice
        "nvidia-cuda-runtime",  # runtime headers, libcudart_static.a
        "nvidia-cuda-crt",  # include/crt
        "nvidia-cuda-cccl",  # include/cccl (cuda_bf16.h needs <nv/target>)
    )
]


# Keep with pyproject.toml's ``jax>=`` (jax and jaxlib release together).
_MIN_JAXLIB = "0.9.2"


def _installed_jaxlib() -> str | None:
    """The jaxlib version of the environment jax_ub is being installed into, or None.

    pip runs this backend with the target environment's interpreter and hides that
    environment's packages through PYTHONPATH (a sitecustomize) and PYTHONNOUSERSITE; the
    same interpreter without those sees them. Where the build runs in an environment of its
    own (``python -m build``, uv), this finds no jaxlib and the build takes the newest."""
    hidden = ("PYTHONPATH", "PYTHONNOUSERSITE")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    code = "import importlib.metadata as m; print(m.version('jaxlib'))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _jaxlib_requirement() -> str:
    from packaging.version import InvalidVersion, Version  # scikit-build-core needs it

    installed = _installed_jaxlib()
    try:
        if installed and Version(installed) >= Version(_MIN_JAXLIB):
            return f"jaxlib=={installed}"
    except InvalidVersion:
        pass
    return f"jaxlib>={_MIN_JAXLIB}"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "off", "false", "no")


def _toolkit_nvcc() -> bool:
    """Whether a CUDA toolkit's nvcc is there and runs (a wrapper script left on PATH by a
    removed toolkit does not count)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [os.path.join(h, "bin", "nvcc") for h in homes if h]
    for nvcc in filter(None, candidates):
        try:
            subprocess.run([nvcc, "--version"], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        return True
    return False


def _wheels_possible() -> bool:
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


def _extra() -> list[str]:
    if _flag("JAX_UB_DISABLE_CUDA"):
        return []
    if not _flag("JAX_UB_CUDA_FROM_WHEELS") and _toolkit_nvcc():
        return [_CUBLAS, _CUTLASS]
    if _wheels_possible():
        return [_CUBLAS, _CUTLASS, *_CUDA_WHEELS]
    return []


def get_requires_for_build_wheel(config_settings=None):
    return _skb.get_requires_for_build_wheel(config_settings) + [_jaxlib_requirement(), *_extra()]


def get_requires_for_build_editable(config_settings=None):
    return _skb.get_requires_for_build_editable(config_settings) + [
        _jaxlib_requirement(),
        *_extra(),
    ]
