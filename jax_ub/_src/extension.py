"""Loads the compiled extensions and registers their FFI handlers with XLA."""

from __future__ import annotations

import ctypes
import functools
import os
from types import ModuleType

import jax

from jax_ub._src import _host

# Platform name in lowering contexts -> name XLA registers custom calls under.
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


def _register(module: ModuleType, platform: str) -> None:
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register(_host, _XLA_PLATFORM["cpu"])


def _preload_cublaslt() -> None:
    """Make libcublasLt resolvable for the CUDA module from the nvidia-cublas wheel."""
    try:
        import nvidia  # noqa: PLC0415
    except ImportError:
        return
    for root in getattr(nvidia, "__path__", []):
        lib = os.path.join(root, "cu13", "lib", "libcublasLt.so.13")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


_cuda_import_error: list[str] = []  # why the CUDA extension did not load, once tried


@functools.cache
def cuda_module() -> ModuleType | None:
    """The CUDA extension, registered with XLA, or None when it was not built or cannot
    load (:func:`cuda_import_error` says why)."""
    try:
        _preload_cublaslt()
        from jax_ub._src import _cuda  # noqa: PLC0415
    except ImportError as e:
        _cuda_import_error.append(str(e))
        return None
    _register(_cuda, _XLA_PLATFORM["cuda"])
    return _cuda


def cuda_import_error() -> str | None:
    """Why the CUDA extension is not loaded ("not built": no CUDA compiler at install), or
    None when it is."""
    if cuda_module() is not None:
        return None
    message = _cuda_import_error[0] if _cuda_import_error else ""
    if "No module named" in message:
        return (
            "not built (no CUDA compiler, a toolkit's or NVIDIA's wheels, was found when "
            "jax_ub was installed, or JAX_UB_DISABLE_CUDA was set)"
        )
    return message or "unknown"


def normalize_platform(platform: str) -> str:
    """JAX calls CUDA devices "gpu" (jax.default_backend, Device.platform); lowering says "cuda"."""
    return "cuda" if platform == "gpu" else platform


def module_for(platform: str) -> ModuleType | None:
    """The extension implementing userbuffers on `platform` ("cpu", "cuda"), if any."""
    platform = normalize_platform(platform)
    if platform == "cpu":
        return _host
    if platform == "cuda":
        return cuda_module()
    return None


def supported(platform: str) -> bool:
    platform = normalize_platform(platform)
    return platform in _XLA_PLATFORM and module_for(platform) is not None
