"""Bad settings fail early with a clear message and change nothing: configure(), the
JAX_UB_* environment variables, the experimental tuning hook, initialize(), a buffer too
small without growth, and the extension's create_communicator."""

import dataclasses
import math

import pytest
from conftest import ag_fn as _ag
from conftest import comm_options, make_mesh, rel_err, to_f32
from conftest import rs_fn as _rs

import jax_ub
from jax_ub._src import _host, options

BAD_SETTINGS = [
    # (configure keyword arguments, exception type(s), regex)
    (dict(buffer_size=1), ValueError, r"unknown jax_ub setting 'buffer_size'"),
    (
        dict(timeout=5.0),
        ValueError,
        r"unknown jax_ub setting 'timeout'; known: \['buffer_bytes', 'timeout_s', "
        r"'allow_grow', 'allow_tf32', 'auto_min_bytes', 'gemm_cache'\]",
    ),
    (dict(buffers=1, grow=True), ValueError, r"unknown jax_ub setting 'buffers', 'grow'"),
    (dict(timeout_s=0), ValueError, r"timeout_s must be positive"),
    (dict(timeout_s=-0.5), ValueError, r"timeout_s must be positive and finite, got -0.5"),
    (dict(timeout_s=math.nan), ValueError, r"timeout_s"),
    (dict(timeout_s=math.inf), ValueError, r"timeout_s"),
    (dict(timeout_s="5"), (TypeError, ValueError), r"timeout_s"),
    (dict(buffer_bytes=-1), ValueError, r"buffer_bytes must be >= 0"),
    (dict(buffer_bytes=-4096), ValueError, r"buffer_bytes must be >= 0"),
    (dict(buffer_bytes=1.5), (TypeError, ValueError), r"buffer_bytes"),
    (
        dict(allow_grow=1),
        ValueError,
        r"allow_grow must be True or False, got 1 \(jax_ub.configure",
    ),
    (dict(gemm_cache=3), ValueError, r"gemm_cache must be a file path \(str\), got 3"),
    (dict(gemm_cache="/"), ValueError, r"gemm_cache must be a file, '/' is a directory"),
    (
        dict(gemm_cache="/no/such/folder/choices.txt"),
        ValueError,
        r"gemm_cache '/no/such/folder/choices.txt': its directory '/no/such/folder' does "
        r"not exist \(jax_ub.configure\(gemm_cache=...\)\)",
    ),
    # Tuning choices are internal, not user settings.
    (dict(gemm_order="row"), ValueError, r"unknown jax_ub setting 'gemm_order'"),
]


@pytest.mark.parametrize(
    "kwargs,error,match",
    BAD_SETTINGS,
    ids=[", ".join(f"{k}={v!r}" for k, v in c[0].items()) for c in BAD_SETTINGS],
)
def test_configure_rejects_bad_values(kwargs, error, match):
    before = _host.num_communicators()
    with pytest.raises(error, match=match):
        jax_ub.configure(**kwargs)
    assert _host.num_communicators() == before, "a communicator was left behind"


def test_gemm_cache_is_taken_and_ignored_on_cpu(tmp_path, mesh1d, rand):
    """A valid choice file path is accepted (env or configure) and reaches the communicator;
    the host protocol has no kernels to choose, so CPU runs leave the file untouched."""
    path = str(tmp_path / "choices.txt")
    jax_ub.finalize()
    jax_ub.configure(gemm_cache=path)
    assert options.current_options().gemm_cache == path
    x_s, w = rand(2 * 4, 16), rand(16, 2 * 8)
    assert rel_err(_ag(mesh1d(2))(x_s, w), to_f32(x_s) @ to_f32(w)) < 1e-5
    assert not (tmp_path / "choices.txt").exists()
    jax_ub.finalize()


def test_configure_error_leaves_config_unchanged():
    """A rejected configure() must not leave the rejected value (or part of it) behind.

    Otherwise the bad value sticks: every later configure() call fails on it, and the next
    communicator is created with it, failing far from the call that caused it.
    """
    before = dataclasses.asdict(jax_ub.config)
    with pytest.raises(ValueError):
        jax_ub.configure(timeout_s=-1.0)
    assert dataclasses.asdict(jax_ub.config) == before
    jax_ub.configure(buffer_bytes=1 << 20)  # a valid change still goes through
    with pytest.raises(ValueError):
        jax_ub.configure(buffer_bytes=1 << 21, no_such_setting=1)
    assert jax_ub.config.buffer_bytes == 1 << 20


@pytest.mark.parametrize(
    "var,value,match",
    [
        ("JAX_UB_TIMEOUT_S", "-3", r"timeout_s must be positive .*JAX_UB_TIMEOUT_S='-3'"),
        ("JAX_UB_TIMEOUT_S", "-1", r"JAX_UB_TIMEOUT_S"),
        ("JAX_UB_TIMEOUT_S", "abc", r"JAX_UB_TIMEOUT_S"),
        ("JAX_UB_TIMEOUT_S", "nan", r"JAX_UB_TIMEOUT_S"),
        (
            "JAX_UB_BUFFER_BYTES",
            "lots",
            r"buffer_bytes: environment variable "
            r"JAX_UB_BUFFER_BYTES='lots' is not a valid value",
        ),
        (
            "JAX_UB_GEMM_CACHE",
            "/no/such/folder/x",
            r"its directory '/no/such/folder' does not exist "
            r"\(environment variable JAX_UB_GEMM_CACHE='/no/such/folder/x'\)",
        ),
    ],
)
def test_env_var_errors_name_the_variable(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        jax_ub.Config()  # what `import jax_ub` builds from the environment


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduce_scatter_fold_rows=True), r"reduce_scatter_fold_rows must be an integer"),
        (dict(gemm_trials=-1), r"gemm_trials must be an integer >= 0, got -1"),
        (dict(gemm_trials=2.5), r"gemm_trials must be an integer >= 0, got 2.5"),
        (
            dict(gemm_order="rows"),
            r"gemm_order must be one of \('auto', 'column', 'row'\), got 'rows'",
        ),
        (dict(timeout_s=1.0), r"unknown tuning choice \['timeout_s'\]"),
    ],
)
def test_experimental_tuning_rejects_bad_values(kwargs, match):
    before = options.tuning()
    with pytest.raises(ValueError, match=match):
        with options.experimental_tuning(**kwargs):
            pass
    assert options.tuning() == before


@pytest.mark.parametrize(
    "mesh_shape,axis,kwargs,match",
    [
        (((2, "tp"),), "dp", {}, r"axis 'dp' is not in the mesh"),
        (
            ((2, "dp"), (2, "tp")),
            "pp",
            {},
            r"axis 'pp' is not in the mesh; mesh.axis_names=\('dp', 'tp'\)",
        ),
        (((2, "tp"),), "tp", dict(buffer_bytes=0), r"buffer_bytes must be positive"),
        (
            ((2, "tp"),),
            "tp",
            dict(buffer_bytes=-1),
            r"buffer_bytes must be positive, got buffer_bytes=-1",
        ),
    ],
    ids=["1-D mesh, axis dp", "2-D mesh, axis pp", "buffer_bytes=0", "buffer_bytes=-1"],
)
def test_initialize_rejects_bad_arguments(mesh_shape, axis, kwargs, match):
    before = _host.num_communicators()
    with pytest.raises(ValueError, match=match):
        jax_ub.initialize(make_mesh(*mesh_shape), axis, **kwargs)
    assert _host.num_communicators() == before, "a communicator was left behind"


def test_buffer_too_small_without_growth(mesh1d, rand):
    """An op needing more than the existing communicator holds fails at trace time."""
    mesh = mesh1d(2)
    jax_ub.finalize()
    jax_ub.configure(buffer_bytes=4096, allow_grow=False)
    try:
        # Fits: 2 ranks x (4 x 16 float32) = 512 bytes; creates the 4096-byte communicator.
        x_s, w = rand(2 * 4, 16), rand(16, 2 * 4)
        assert rel_err(_ag(mesh)(x_s, w), to_f32(x_s) @ to_f32(w)) < 1e-5
        (comm,) = jax_ub.live_communicators()
        assert comm.capacity_bytes == 4096
        # Needs 2 ranks x (64 x 16 float32) = 8192 bytes.
        with pytest.raises(
            ValueError,
            match=r"userbuffer too small for this op: it needs 8192 "
            r"bytes.*has 4096.*allow_grow=True",
        ):
            _ag(mesh)(rand(2 * 64, 16), w)
        with pytest.raises(ValueError, match=r"userbuffer too small"):
            _rs(mesh)(rand(2 * 64, 2 * 8), rand(2 * 8, 16))
        assert [c.id for c in jax_ub.live_communicators()] == [comm.id]
        assert comm.capacity_bytes == 4096
    finally:
        jax_ub.finalize()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=0, slot_devices=[0]), r"group size 0 is not in \[1, 64\]"),
        (dict(group_size=65, slot_devices=list(range(65))), r"group size 65 is not in"),
        (dict(group_size=2, slot_devices=[0, 1, 2]), r"number of slots 3 is not a positive"),
        (
            dict(group_size=3, slot_devices=[0, 1, 2, 3]),
            r"number of slots 4 is not a positive multiple of the group size 3",
        ),
        (dict(group_size=2, slot_devices=[]), r"number of slots 0"),
        (dict(group_size=2, slot_devices=[0, 0]), r"device 0 appears twice"),
        (
            dict(group_size=2, slot_devices=[0, 1], options=comm_options(timeout_s=0.0)),
            r"timeout must be positive",
        ),
        (
            dict(group_size=2, slot_devices=[0, 1], options=comm_options(timeout_s=-1.0)),
            r"timeout must be positive and finite, got -1 s",
        ),
        (
            dict(group_size=2, slot_devices=[0, 1], options=comm_options(timeout_s=math.nan)),
            r"timeout",
        ),
        (
            dict(group_size=1, slot_devices=[0], options={"timeout_s": 1.0}),
            r"missing communicator option allow_tf32",
        ),
        (
            dict(group_size=1, slot_devices=[0], options=comm_options(fold=1)),
            r"unknown communicator option fold",
        ),
        (
            dict(group_size=1, slot_devices=[0], options=comm_options(gemm_cache="a\nb")),
            r"gemm_cache must be a file path, without newlines",
        ),
    ],
)
def test_low_level_create_rejects(kwargs, match):
    before = _host.num_communicators()
    kw = dict(capacity_bytes=1024, options=comm_options(timeout_s=1.0))
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _host.create_communicator(**kw)
    assert _host.num_communicators() == before
