"""Values a settings check takes as a user writes them, and refuses where they would
mislead: NumPy integers and floats for the numeric settings, a peer wait too short to
wait, and ``JAX_UB_TRACE`` read as every boolean ``JAX_UB_*`` variable is."""

import os
import subprocess
import sys

import numpy as np
import pytest

import jax_ub
from jax_ub._src.settings import config as config_module


@pytest.fixture
def restore_config():
    saved = {n: getattr(jax_ub.config, n) for n in ("buffer_bytes", "timeout_s", "auto_min_bytes")}
    yield
    jax_ub.configure(**saved)


@pytest.mark.parametrize(
    "name,value,want",
    [
        ("buffer_bytes", np.int64(1 << 20), 1 << 20),
        ("buffer_bytes", np.uint32(3 << 20), 3 << 20),
        ("auto_min_bytes", np.int32(4096), 4096),
        ("timeout_s", np.float32(2.5), 2.5),
        ("timeout_s", np.int64(7), 7),
    ],
)
def test_numpy_numbers_are_taken_as_python_numbers(restore_config, name, value, want):
    jax_ub.configure(**{name: value})
    got = getattr(jax_ub.config, name)
    assert got == want and type(got) is type(want), (got, type(got))


@pytest.mark.parametrize("value", [np.float64(1.5), np.bool_(True), True])
def test_buffer_bytes_still_refuses_what_is_no_integer(value):
    with pytest.raises(ValueError, match="buffer_bytes must be an integer"):
        jax_ub.configure(buffer_bytes=value)


@pytest.mark.parametrize("value", [1e-9, 0.01, 0.099])
def test_a_timeout_too_short_to_wait_is_refused_naming_the_setting(value):
    with pytest.raises(ValueError, match=rf"timeout_s must be at least 0.1 s, got {value}"):
        jax_ub.configure(timeout_s=value)


def test_a_timeout_too_short_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("JAX_UB_TIMEOUT_S", "1e-9")
    config = jax_ub.Config()
    with pytest.raises(ValueError, match=r"at least 0.1 s.*JAX_UB_TIMEOUT_S='1e-9'"):
        config.check()


@pytest.mark.parametrize(
    "text,on",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("off", False),
        ("No", False),
        ("", False),
    ],
)
def test_trace_variable_reads_as_every_boolean_variable(monkeypatch, text, on):
    monkeypatch.setenv("JAX_UB_TRACE", text)
    assert config_module.trace_enabled() is on
    config_module.export_trace_setting()  # what the CUDA extension then reads
    assert os.environ["JAX_UB_TRACE"] == ("1" if on else "0")


def test_trace_variable_of_other_text_warns_and_stays_off(monkeypatch):
    monkeypatch.setenv("JAX_UB_TRACE", "verbose")
    with pytest.warns(UserWarning, match=r"JAX_UB_TRACE='verbose' is not one of .* stays off"):
        assert config_module.trace_enabled() is False


def test_trace_variable_is_exported_before_the_cuda_extension_loads():
    """In a fresh process, JAX_UB_TRACE=false reads as "0" once the CUDA extension has been
    looked for (it is absent on CPU-only builds; the variable is set either way)."""
    script = (
        "import os, jax_ub\n"
        "from jax_ub._src.runtime import extension\n"
        "extension.cuda_module()\n"
        "print(os.environ['JAX_UB_TRACE'])\n"
    )
    env = dict(os.environ, JAX_UB_TRACE="false")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"


@pytest.fixture
def compilation_cache():
    """Sets JAX's compilation cache folder for a test, and puts it back."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield lambda folder: jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_compilation_cache_dir", before)


def test_gemm_cache_auto_is_the_file_in_jax_compilation_cache(
    tmp_path, compilation_cache, monkeypatch
):
    """gemm_cache "auto" (the default unless JAX_UB_GEMM_CACHE says otherwise): the choice
    file in JAX's persistent compilation cache where that is on in a local folder (made, as
    JAX makes it), else none; "" is none and a path is itself, the cache on or off. Read
    when a communicator is created: the options' value."""
    from jax_ub._src.settings.options import current_options

    monkeypatch.delenv("JAX_UB_GEMM_CACHE", raising=False)
    assert config_module.Config().gemm_cache == "auto"
    folder = tmp_path / "xla_cache"
    compilation_cache(None)
    assert config_module.gemm_cache_path("auto") == ""
    compilation_cache(str(folder))
    assert config_module.gemm_cache_path("auto") == str(folder / "jax_ub_gemm_choices.txt")
    assert folder.is_dir()
    assert config_module.gemm_cache_path("") == ""
    assert config_module.gemm_cache_path(str(tmp_path / "mine.txt")) == str(tmp_path / "mine.txt")
    jax_ub.configure(gemm_cache="auto")
    assert current_options().gemm_cache == str(folder / "jax_ub_gemm_choices.txt")
    jax_ub.configure(gemm_cache="")
    assert current_options().gemm_cache == ""
    compilation_cache("gs://some-bucket/xla")  # not a local folder: none
    assert config_module.gemm_cache_path("auto") == ""
