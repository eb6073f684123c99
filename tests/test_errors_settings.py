"""Bad settings fail early with a clear message and change nothing: configure(), the
JAX_UB_* environment variables (at first use, not at import: jax_ub and jax_ub.info still
load), the experimental tuning hook, initialize(), a buffer too small without growth, and
the extension's create_communicator."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import ag_fn as _ag
from conftest import comm_options, make_mesh, rel_err, to_f32
from conftest import rs_fn as _rs

import jax_ub
from jax_ub._src import _host
from jax_ub._src.settings import config as config_module
from jax_ub._src.settings import options

BAD_SETTINGS = [
    # (configure keyword arguments, exception type(s), regex)
    (dict(buffer_size=1), ValueError, r"unknown jax_ub setting 'buffer_size'"),
    (
        dict(timeout=5.0),
        ValueError,
        r"unknown jax_ub setting 'timeout'; known: \['buffer_bytes', 'timeout_s', "
        r"'allow_grow', 'allow_tf32', 'auto_min_bytes', 'gemm_cache', 'keep_gathered', "
        r"'bound_gemms'\]",
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
    (dict(keep_gathered="no"), ValueError, r"keep_gathered must be True or False, got 'no'"),
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
    config = jax_ub.Config()  # what `import jax_ub` builds from the environment: no error
    with pytest.raises(ValueError, match=match):
        config.check()  # what every op runs first


# One invalid text per setting that has an environment variable, and its error.
BAD_ENV = {
    "timeout_s": (
        "JAX_UB_TIMEOUT_S",
        "abc",
        r"jax_ub: timeout_s: environment variable JAX_UB_TIMEOUT_S='abc' is not a valid "
        r"value \(expected a number of seconds\); fix or unset JAX_UB_TIMEOUT_S, or call "
        r"jax_ub.configure\(timeout_s=...\)",
    ),
    "buffer_bytes": (
        "JAX_UB_BUFFER_BYTES",
        "1.5GB",
        r"JAX_UB_BUFFER_BYTES='1.5GB' is not a valid value \(expected an integer number of "
        r"bytes\)",
    ),
    "allow_grow": (
        "JAX_UB_ALLOW_GROW",
        "maybe",
        r"JAX_UB_ALLOW_GROW='maybe' is not a valid value \(expected one of "
        r"1/true/yes/on or 0/false/no/off\)",
    ),
    "auto_min_bytes": (
        "JAX_UB_AUTO_MIN_BYTES",
        "-5",
        r"auto_min_bytes must be an integer number of bytes >= 0, got -5 \(environment "
        r"variable JAX_UB_AUTO_MIN_BYTES='-5'\)",
    ),
    "keep_gathered": (
        "JAX_UB_KEEP_GATHERED",
        "sometimes",
        r"JAX_UB_KEEP_GATHERED='sometimes' is not a valid value \(expected one of "
        r"1/true/yes/on or 0/false/no/off\)",
    ),
    "gemm_cache": (
        "JAX_UB_GEMM_CACHE",
        "/no/such/folder/x",
        r"its directory '/no/such/folder' does not exist \(environment variable "
        r"JAX_UB_GEMM_CACHE='/no/such/folder/x'\)",
    ),
}
VALID = {
    "timeout_s": 30.0,
    "buffer_bytes": 0,
    "allow_grow": True,
    "auto_min_bytes": 8 << 20,
    "gemm_cache": "",
    "keep_gathered": False,
}


def test_every_env_backed_setting_is_covered():
    assert set(BAD_ENV) == set(config_module.ENV_VARS)
    assert {name: spec[0] for name, spec in BAD_ENV.items()} == config_module.ENV_VARS


@pytest.mark.parametrize(
    "text,value",
    [("0", False), ("false", False), ("OFF", False), ("no", False), ("1", True), ("on", True)],
)
def test_allow_grow_from_the_environment(monkeypatch, text, value):
    """JAX_UB_ALLOW_GROW=false turns growth off (it once meant on: any text but "0" did)."""
    monkeypatch.setenv("JAX_UB_ALLOW_GROW", text)
    assert jax_ub.Config().allow_grow is value


@pytest.mark.parametrize("name", list(BAD_ENV))
def test_invalid_env_var_fails_first_use_not_import(monkeypatch, mesh1d, rand, name):
    """An invalid JAX_UB_* variable: building the config (at import) succeeds; every first
    use (reading the setting, each op under every impl, explain_impl, initialize) raises
    the same ValueError naming the variable and its text; configure() of the setting
    replaces it."""
    var, text, match = BAD_ENV[name]
    monkeypatch.setenv(var, text)
    fresh = jax_ub.Config()
    (message,) = fresh.problems().values()
    assert list(fresh.problems()) == [name]
    assert re.search(match, message), message
    assert message in repr(fresh)  # repr shows the problem instead of raising it
    with pytest.raises(ValueError) as e:
        getattr(fresh, name)
    assert str(e.value) == message

    # The live config as `import jax_ub` leaves it (restored after the test by conftest).
    setattr(jax_ub.config, name, config_module._from_env(name))
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 16), rand(16, 2 * 8)
    uses = [
        (f"all_gather_matmul impl={impl!r}", lambda impl=impl: _ag(mesh, impl)(x, w))
        for impl in ("ub", "xla", "auto")
    ]
    uses += [
        ("matmul_reduce_scatter", lambda: _rs(mesh, "xla")(rand(8, 2 * 16), rand(2 * 16, 8))),
        (
            "explain_impl",
            lambda: jax_ub.explain_impl("all_gather_matmul", (4, 16), (16, 8), "float32", 2),
        ),
        ("initialize", lambda: jax_ub.initialize(mesh, "tp")),
    ]
    for what, use in uses:
        with pytest.raises(ValueError) as e:
            use()
        assert str(e.value) == message, what

    jax_ub.configure(**{name: VALID[name]})
    assert jax_ub.config.problems() == {}
    assert rel_err(_ag(mesh, "ub")(x, w), to_f32(x) @ to_f32(w)) < 1e-5


def test_invalid_env_vars_let_jax_ub_import_and_info_report_them():
    """With every JAX_UB_* variable invalid, `import jax_ub` succeeds, the first op raises
    the first one's error, and `python -m jax_ub.info` exits 0, printing the whole report
    with each variable's error (the same text the ops raise)."""
    env = dict(os.environ, **{var: text for var, text, _ in BAD_ENV.values()})
    script = (
        "import jax, jax.numpy as jnp, jax_ub\n"
        "try:\n"
        "    jax_ub.matmul_reduce_scatter(jnp.ones((4, 4)), jnp.ones((4, 4)), 'tp')\n"
        "except ValueError as e:\n"
        "    print('FIRST USE:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("Traceback") == 0, out.stderr[-3000:]
    (first,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FIRST USE: ")]
    assert re.search(BAD_ENV["buffer_bytes"][2], first), first  # the first setting's

    info = subprocess.run(
        [sys.executable, "-m", "jax_ub.info"], env=env, capture_output=True, text=True, timeout=300
    )
    assert info.returncode == 0, info.stderr[-3000:]
    text = info.stdout
    for needle in ("jax_ub ", "devices (", "tuning (internal): ", "allow_tf32=False"):
        assert needle in text, (needle, text)
    settings = [ln for ln in text.splitlines() if ln.startswith("settings: ")][0]
    for name, (var, value, match) in BAD_ENV.items():
        assert f"{name}=INVALID" in settings, settings
        assert f"{var}={value!r}" in text, text
        assert re.search(
            r"ERROR \(raised by the first op\): jax_ub: .*" + match.removeprefix("jax_ub: "), text
        ), (
            name,
            text,
        )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(reduce_scatter_fold_rows=True), r"reduce_scatter_fold_rows must be an integer"),
        (dict(gemm_trials=-1), r"gemm_trials must be an integer >= 0 \(below 2\*\*31\), got -1"),
        (dict(gemm_trials=2.5), r"gemm_trials must be an integer >= 0 \(below 2\*\*31\), got 2.5"),
        (dict(gemm_trials=1 << 31), r"gemm_trials must be .*, got 2147483648"),
        (dict(reduce_scatter_fold_rows=1 << 63), r"reduce_scatter_fold_rows must be an integer"),
        (
            dict(gemm_order="rows"),
            r"gemm_order must be one of \('auto', 'column', 'row'\), got 'rows'",
        ),
        (dict(timeout_s=1.0), r"unknown tuning choice \['timeout_s'\]"),
        (dict(all_gather_in_turn=1), r"all_gather_in_turn must be True, False or None, got 1"),
        (dict(two_gemm_lanes="on"), r"two_gemm_lanes must be True, False or None, got 'on'"),
        (
            dict(all_gather_flag_gemm=0),
            r"all_gather_flag_gemm must be True, False or None, got 0",
        ),
        (
            dict(reduce_scatter_early_sum="yes"),
            r"reduce_scatter_early_sum must be True, False or None, got 'yes'",
        ),
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
            r"buffer_bytes must be >= 0, got -1",
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


@pytest.mark.parametrize(
    "name,theirs", [("reduce_scatter_ring", True), ("reduce_scatter_fold_rows", 0)]
)
def test_a_process_configured_otherwise_is_named_with_both_values(name, theirs):
    # bootstrap's check of the settings every process must share (Options.agreed()), as
    # each process runs it on what its peers sent, without starting processes: the peer's
    # settings arrive through JSON.
    from jax_ub._src.runtime.bootstrap import _check_agreed  # noqa: PLC0415

    ours = options.current_options().agreed()
    assert ours[name] != theirs, "the test needs this process's own value to differ"
    with options.experimental_tuning(**{name: theirs}):
        sent = json.loads(json.dumps(options.current_options().agreed()))
    _check_agreed(1, json.loads(json.dumps(ours)), ours)  # the same: no error
    named = f"{name}={theirs!r} there, {ours[name]!r} here"
    with pytest.raises(
        ValueError, match=re.escape(f"process 1 configured jax_ub differently: {named}")
    ):
        _check_agreed(1, sent, ours)
