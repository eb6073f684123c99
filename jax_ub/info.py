"""``python -m jax_ub.info``: what jax_ub runs on, to paste into a bug report.

Versions (Python, jax, jaxlib, JAX's CUDA plugin, flax, jax_ub; the jaxlib and XLA FFI API
the extensions were built against; CUDA runtime and driver, and the cuBLASLt library
loaded), the devices, the GPUs' peer-access matrix, which extensions loaded (and why the
CUDA one did not), the settings in force and the JAX_UB_* variables set (with the error of
any invalid one, which the first op would raise).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import sys

import jax

from jax_ub._src.runtime import extension
from jax_ub._src.settings import options
from jax_ub._src.settings.config import config

_PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-cuda12-plugin",
    "flax",
    "jax_ub",
    "nvidia-cublas",
)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_version(encoded: int) -> str:
    return f"{encoded // 1000}.{encoded % 1000 // 10}" if encoded else "none"


def _api(version: tuple[int, int] | None) -> str:
    return "unknown" if version is None else f"{version[0]}.{version[1]}"


def _loaded_library(fragment: str) -> str | None:
    """The path of a loaded shared library whose name contains `fragment` (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if fragment in path.rsplit("/", 1)[-1]:
                    return path
    except OSError:
        return None
    return None


def _settings() -> list[str]:
    """The settings in force, the JAX_UB_* variables set, and the error of each setting
    whose variable is invalid (which the first op would raise)."""
    problems = config.problems()
    shown = [
        f"{f.name}=INVALID" if f.name in problems else f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(config)
    ]
    lines = ["settings: " + ", ".join(shown)]
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAX_UB_")}
    if env:
        lines.append("JAX_UB_* variables: " + ", ".join(f"{k}={v!r}" for k, v in env.items()))
    lines += [f"  ERROR (raised by the first op): {message}" for message in problems.values()]
    return lines


def report() -> list[str]:
    """The report, line by line."""
    lines = [f"python {platform.python_version()} on {platform.platform()}"]
    lines += [f"{p} {v}" for p in _PACKAGES if (v := _version(p)) is not None]
    cuda = extension.cuda_module()
    runtime_api = extension.runtime_ffi_api()
    host = extension.module_for("cpu")
    lines.append(
        f"extensions built against jaxlib {host.BUILT_AGAINST_JAXLIB} (XLA FFI API "
        f"{_api(host.FFI_API_VERSION)}); this jaxlib's FFI API {_api(runtime_api)}"
    )
    lines.append("extensions: host (CPU) loaded; CUDA " + ("loaded" if cuda else "NOT loaded"))
    if cuda is None:
        lines.append(f"  CUDA extension: {extension.cuda_import_error()}")
    else:
        runtime, driver = cuda.cuda_versions()
        lines.append(f"CUDA runtime {_cuda_version(runtime)}, driver {_cuda_version(driver)}")
        lines.append(f"cuBLASLt: {_loaded_library('libcublasLt') or 'not loaded'}")
    devices = jax.devices()
    lines.append(f"devices ({jax.default_backend()}, {jax.process_count()} process(es)):")
    lines += [f"  {d.id}: {d.device_kind} (process {d.process_index})" for d in devices]
    gpus = [d for d in devices if d.platform == "gpu" and d.process_index == jax.process_index()]
    if cuda is not None and len(gpus) > 1:
        ordinals = [
            int(hw if (hw := getattr(d, "local_hardware_id", None)) is not None else d.id)
            for d in gpus
        ]
        lines.append("peer access (row can map column's memory):")
        lines.append("       " + " ".join(f"{b:>3}" for b in ordinals))
        for a in ordinals:
            row = " ".join(
                f"{'yes' if a == b or cuda.can_access_peer(a, b) else 'NO':>3}" for b in ordinals
            )
            lines.append(f"  {a:>3}  {row}")
    lines += _settings()
    tuning = dataclasses.asdict(options.tuning())
    lines.append("tuning (internal): " + ", ".join(f"{k}={v!r}" for k, v in tuning.items()))
    return lines


def main() -> None:
    print("\n".join(report()))


if __name__ == "__main__":
    sys.exit(main())
