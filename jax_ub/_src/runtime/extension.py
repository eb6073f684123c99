"""Loads the compiled extensions and registers their FFI handlers with XLA: the host
extension at import, its CPU handlers when the first CPU call is lowered (the backend must
be up), the CUDA extension and its handlers when first asked for."""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import re
from types import ModuleType

import jax

from jax_ub._src import _host
from jax_ub._src.settings.config import export_trace_setting

# Platform name in lowering contexts -> name XLA registers custom calls under.
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}


def _register(module: ModuleType, platform: str) -> None:
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


@functools.cache
def runtime_ffi_api() -> tuple[int, int] | None:
    """The XLA FFI API version of this process's jaxlib, read from the headers that jaxlib
    ships (None where they are missing)."""
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    found = [re.search(rf"#define XLA_FFI_API_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
    if not all(found):
        return None
    return int(found[0][1]), int(found[1][1])


def check_ffi_api(module: ModuleType, runtime: tuple[int, int] | None) -> None:
    """ImportError where ``module``'s handlers were compiled against a newer XLA FFI API
    than ``runtime``: XLA rejects such handlers when its backend starts, and the backend then
    fails for every JAX program, not only jax_ub's. Older handlers register."""
    built = tuple(module.FFI_API_VERSION)
    if runtime is None or built <= tuple(runtime):
        return
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = "unknown"
    raise ImportError(
        f"jax_ub's extension {module.__name__} was built against jaxlib "
        f"{module.BUILT_AGAINST_JAXLIB} (XLA FFI API {built[0]}.{built[1]}), newer than this "
        f"process's jaxlib {jaxlib} (FFI API {runtime[0]}.{runtime[1]}), which would reject "
        "its handlers and then fail to start. Build jax_ub again in this environment, "
        "against the jaxlib installed here: `pip install --force-reinstall --no-deps "
        "--no-cache-dir <jax_ub's source or sdist>`; or upgrade jax and jaxlib to "
        f"{module.BUILT_AGAINST_JAXLIB} or newer."
    )


check_ffi_api(_host, runtime_ffi_api())


@functools.cache
def register_cpu_handlers() -> None:
    """Register the CPU handlers with XLA, once, when the first CPU call is lowered.

    They keep a state per compiled call (src/bindings/ffi_cpu.h), whose type XLA must know
    before the handlers. Registered before the CPU backend starts, both would wait for it,
    and it takes waiting handlers before waiting types (and then fails to start); by the
    time a call is lowered, the backend is up and takes each at once, in this order.
    Importing jax_ub must not start the backend: jax.distributed.initialize() may follow."""
    jax.ffi.register_ffi_type("jax_ub_call_copy", _host.call_copy_type(), platform="cpu")
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
    export_trace_setting()  # the extension reads JAX_UB_TRACE as "1" or "0"
    try:
        _preload_cublaslt()
        from jax_ub._src import _cuda  # noqa: PLC0415

        check_ffi_api(_cuda, runtime_ffi_api())
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
