"""In-tree PEP 517 backend: scikit-build-core, plus cuBLAS headers when CUDA can be built.

The CUDA extension needs cuBLASLt headers, which come from the ``nvidia-cublas`` wheel. Only a
machine with ``nvcc`` builds that extension, so only there do we ask for the (large) wheel;
CPU-only machines build the host extension alone and never download it.
"""

from __future__ import annotations

import os
import shutil

from scikit_build_core import build as _skb
from scikit_build_core.build import *  # noqa: F403  (re-export the PEP 517 hooks)

_CUBLAS = "nvidia-cublas>=13; sys_platform == 'linux'"


def _cuda_buildable() -> bool:
    if os.environ.get("JAX_UB_DISABLE_CUDA", "0") not in ("", "0"):
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") is not None or os.path.exists(os.path.join(home, "bin", "nvcc"))


def _extra() -> list[str]:
    return [_CUBLAS] if _cuda_buildable() else []


def get_requires_for_build_wheel(config_settings=None):
    return _skb.get_requires_for_build_wheel(config_settings) + _extra()


def get_requires_for_build_editable(config_settings=None):
    return _skb.get_requires_for_build_editable(config_settings) + _extra()
