"""The extensions and the jaxlib they run with: XLA rejects FFI handlers compiled against a
newer FFI API than its own, and its backend then fails for every JAX program. The build
compiles against the jaxlib already installed where jax_ub is going, and the import refuses
an extension built against a newer one with an error that says what to do."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import re
import sys
import types

import pytest

from jax_ub._src.runtime import extension

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fake_extension(api: tuple[int, int], jaxlib: str = "9.9.9") -> types.ModuleType:
    module = types.ModuleType("jax_ub._src._fake")
    module.FFI_API_VERSION = api
    module.BUILT_AGAINST_JAXLIB = jaxlib
    return module


def test_the_built_extension_matches_this_jaxlib():
    """The installed extension records the API it was built against; this jaxlib takes it."""
    host = extension.module_for("cpu")
    runtime = extension.runtime_ffi_api()
    assert runtime is not None, "jaxlib ships no XLA FFI headers to read the API from"
    assert len(host.FFI_API_VERSION) == 2 and tuple(host.FFI_API_VERSION) <= runtime
    built = host.BUILT_AGAINST_JAXLIB
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", built), built


@pytest.mark.parametrize("built", [(0, 3), (0, 4)])
def test_older_or_equal_api_registers(built):
    extension.check_ffi_api(_fake_extension(built), (0, 4))
    extension.check_ffi_api(_fake_extension(built), None)  # headers missing: nothing to check


def test_newer_api_is_refused_naming_both_and_the_remedy():
    with pytest.raises(ImportError) as e:
        extension.check_ffi_api(_fake_extension((0, 5), "0.12.0"), (0, 4))
    text = str(e.value)
    for needle in (
        "jax_ub._src._fake",
        "jaxlib 0.12.0",
        "FFI API 0.5",
        "FFI API 0.4",
        "--force-reinstall",
        "upgrade jax and jaxlib to 0.12.0",
    ):
        assert needle in text, (needle, text)


BACKEND = ROOT / "_build_backend" / "backend.py"
# The build backend's tests read the source tree; the wheel check runs the suite from a
# copy of tests/ beside an installed wheel, where there is none.
needs_source = pytest.mark.skipif(not BACKEND.exists(), reason="needs jax_ub's source tree")


def _load_backend(monkeypatch) -> types.ModuleType:
    """``_build_backend/backend.py``, as pip loads it (its folder on the path), with
    scikit-build-core, which only pip's build environment holds, stood in for: these tests
    call none of its hooks."""
    skb = types.ModuleType("scikit_build_core")
    skb.build = types.ModuleType("scikit_build_core.build")
    monkeypatch.setitem(sys.modules, "scikit_build_core", skb)
    monkeypatch.setitem(sys.modules, "scikit_build_core.build", skb.build)
    monkeypatch.syspath_prepend(str(BACKEND.parent))
    spec = importlib.util.spec_from_file_location("_jax_ub_backend", BACKEND)
    backend = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(backend)
    return backend


def _backend(monkeypatch, installed: str | None) -> types.ModuleType:
    """The build backend with the target environment's jaxlib faked."""
    backend = _load_backend(monkeypatch)
    monkeypatch.setattr(backend, "_installed_jaxlib", lambda: installed)
    return backend


@needs_source
@pytest.mark.parametrize(
    "installed, wanted",
    [
        ("0.11.2", "jaxlib==0.11.2"),
        (None, "jaxlib>={min}"),
        ("0.5.0", "jaxlib>={min}"),
        ("not-a-version", "jaxlib>={min}"),
    ],
)
def test_build_compiles_against_the_installed_jaxlib(monkeypatch, installed, wanted):
    backend = _backend(monkeypatch, installed)
    assert backend._jaxlib_requirement() == wanted.format(min=backend._MIN_JAXLIB)


@needs_source
def test_build_minimum_is_the_projects(monkeypatch):
    """The build's jaxlib floor is pyproject's ``jax>=`` (jax and jaxlib release together)."""
    backend = _backend(monkeypatch, None)
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'dependencies = \["jax>=([^"]+)"', pyproject)
    assert floor and floor[1] == backend._MIN_JAXLIB


@needs_source
def test_installed_jaxlib_sees_past_build_isolation(monkeypatch):
    """pip hides the target environment behind PYTHONPATH and PYTHONNOUSERSITE; the probe
    drops both and finds this interpreter's jaxlib."""
    backend = _load_backend(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", "/nonexistent")
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    assert backend._installed_jaxlib() == importlib.metadata.version("jaxlib")
