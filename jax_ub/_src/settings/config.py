"""The user's settings: userbuffer size, peer-wait deadline, growth policy, TF32, the
smallest call that ``impl="auto"`` runs as the userbuffer op on GPUs, and a file that keeps
GPU kernel choices across processes.

Each value is validated where it enters: from :func:`configure` (an error names the
argument) or from the environment, read at import. An invalid environment variable does not
break ``import jax_ub`` (nor ``python -m jax_ub.info``, which shows it): its error, naming
the variable and its value, is raised at first use, by any op, layer or
:func:`jax_ub.explain_impl` call, and by reading the setting; ``configure()`` of that
setting replaces it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings

from jax_ub._src.settings import trace_key

# The shortest wait on a peer that timeout_s may set: a shorter one fails calls whose peer
# is merely a moment behind (scheduling, a first call's compile), blaming the peer.
MIN_TIMEOUT_S = 0.1


def _is_int(value: object) -> bool:
    """An integer, Python's or NumPy's (``np.int64(1 << 20)``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_timeout(value: object, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"timeout_s must be a number of seconds, got {value!r} ({source})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"timeout_s must be positive and finite, got {value} ({source})")
    if value < MIN_TIMEOUT_S:
        raise ValueError(
            f"timeout_s must be at least {MIN_TIMEOUT_S} s, got {value} ({source}): a shorter "
            "wait fails calls whose peer is merely a moment behind, as if it never arrived"
        )


def _check_buffer_bytes(value: object, source: str) -> None:
    if not _is_int(value):
        raise ValueError(f"buffer_bytes must be an integer, got {value!r} ({source})")
    if value < 0:
        raise ValueError(f"buffer_bytes must be >= 0, got {value} ({source})")
    if value >= 1 << 62:
        raise ValueError(f"buffer_bytes must be below 2**62, got {value} ({source})")


def _check_auto_min_bytes(value: object, source: str) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(
            f"auto_min_bytes must be an integer number of bytes >= 0, got {value!r} ({source})"
        )
    if value >= 1 << 62:
        raise ValueError(f"auto_min_bytes must be below 2**62, got {value} ({source})")


def _check_bool(name: str):
    def check(value: object, source: str) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r} ({source})")

    return check


# gemm_cache's default: the file below in JAX's persistent compilation cache, where that is on.
GEMM_CACHE_AUTO = "auto"
GEMM_CACHE_FILE = "jax_ub_gemm_choices.txt"


def _check_gemm_cache(value: object, source: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"gemm_cache must be a file path (str), got {value!r} ({source})")
    if value in ("", GEMM_CACHE_AUTO):
        return
    if "\n" in value:
        raise ValueError(f"gemm_cache must be a path without newlines, got {value!r} ({source})")
    if os.path.isdir(value):
        raise ValueError(f"gemm_cache must be a file, {value!r} is a directory ({source})")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise ValueError(
            f"gemm_cache {value!r}: its directory {folder!r} does not exist ({source})"
        )


BOUND_GEMMS = ("xla", "ub")


def _check_bound_gemms(value: object, source: str) -> None:
    if value not in BOUND_GEMMS:
        raise ValueError(f"bound_gemms must be one of {BOUND_GEMMS}, got {value!r} ({source})")


# The smallest size measured at which neither op was slower than XLA's (at 4 MiB the
# reduce-scatter was): the calibration is in jax_ub._src.settings.auto_rule's docstring.
DEFAULT_AUTO_MIN_BYTES = 8 << 20


def _parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(text)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# name -> (env variable or None, parse the variable's text, what the text must be, check,
# default)
_SETTINGS = {
    "buffer_bytes": (
        "JAX_UB_BUFFER_BYTES",
        int,
        "an integer number of bytes",
        _check_buffer_bytes,
        0,
    ),
    "timeout_s": ("JAX_UB_TIMEOUT_S", float, "a number of seconds", _check_timeout, 30.0),
    "allow_grow": (
        "JAX_UB_ALLOW_GROW",
        _parse_bool,
        f"one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}",
        _check_bool("allow_grow"),
        True,
    ),
    "allow_tf32": (None, None, "", _check_bool("allow_tf32"), False),
    "auto_min_bytes": (
        "JAX_UB_AUTO_MIN_BYTES",
        int,
        "an integer number of bytes",
        _check_auto_min_bytes,
        DEFAULT_AUTO_MIN_BYTES,
    ),
    "gemm_cache": ("JAX_UB_GEMM_CACHE", str, "a file path", _check_gemm_cache, GEMM_CACHE_AUTO),
    "keep_gathered": (
        "JAX_UB_KEEP_GATHERED",
        _parse_bool,
        f"one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}",
        _check_bool("keep_gathered"),
        False,
    ),
    "bound_gemms": (None, None, "", _check_bound_gemms, "xla"),
}

# The environment variable behind each setting that has one.
ENV_VARS = {name: spec[0] for name, spec in _SETTINGS.items() if spec[0]}


class InvalidSetting:
    """What a setting holds while its environment variable's text is invalid: the error,
    raised when the setting is read (see :class:`Config`), so that importing jax_ub and
    ``python -m jax_ub.info`` still work."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return f"<invalid: {self.message}>"

    def error(self) -> ValueError:
        return ValueError(self.message)


def _from_env(name: str) -> object:
    """The setting's value from its environment variable (its default where unset or
    empty), or an InvalidSetting holding the error that names the variable and its text."""
    env, parse, expected, check, default = _SETTINGS[name]
    text = os.environ.get(env) if env else None
    if not text:
        return default
    source = f"environment variable {env}={text!r}"
    try:
        value = parse(text)
    except ValueError:
        return InvalidSetting(
            f"jax_ub: {name}: {source} is not a valid value (expected {expected}); fix or "
            f"unset {env}, or call jax_ub.configure({name}=...)"
        )
    try:
        check(value, source)
    except ValueError as e:
        return InvalidSetting(
            f"jax_ub: {e}; fix or unset {env}, or call jax_ub.configure({name}=...)"
        )
    return value


TRACE_VAR = "JAX_UB_TRACE"


def trace_enabled() -> bool:
    """Whether ``JAX_UB_TRACE`` turns on the CUDA path's trace on stderr, read as every
    boolean ``JAX_UB_*`` variable is: one of ``1/true/yes/on`` (on) or ``0/false/no/off``
    (off), any case; unset or empty: off. Other text warns, naming the variable, and leaves
    the trace off."""
    text = os.environ.get(TRACE_VAR, "")
    if not text.strip():
        return False
    try:
        return _parse_bool(text)
    except ValueError:
        warnings.warn(
            f"jax_ub: environment variable {TRACE_VAR}={text!r} is not one of "
            f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}: the trace stays off",
            stacklevel=2,
        )
        return False


def export_trace_setting() -> None:
    """Set ``JAX_UB_TRACE`` to ``"1"`` or ``"0"`` as :func:`trace_enabled` reads it, for the
    CUDA extension, which reads the variable when it first traces; unset stays unset."""
    if TRACE_VAR in os.environ:
        os.environ[TRACE_VAR] = "1" if trace_enabled() else "0"


# The settings read when a call is traced, not when a communicator is created
# (options.traced_settings).
TRACE_TIME = ("auto_min_bytes", "keep_gathered", "bound_gemms")


def _plain(value: object) -> object:
    """A NumPy number as Python's own (``np.int64(1 << 20)`` -> ``1048576``): the settings
    go to the communicators' C++ options as Python numbers."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


@dataclasses.dataclass
class Config:
    """Settings read when a communicator is created (``auto_min_bytes``, ``keep_gathered``
    and ``bound_gemms``: when a call is traced).

    A setting whose environment variable holds invalid text raises its ValueError (naming
    the variable and the text) when read, and :meth:`check`, which every op, layer and
    :func:`jax_ub.explain_impl` call runs first, raises it too; ``configure()`` of the
    setting replaces it.

    Attributes:
      buffer_bytes: the symmetric buffer per device, in bytes. ``0`` (default) sizes it
        from the first op that needs one (at least 1 MiB on CPU, 256 MiB on GPUs, so a
        model's first ops do not each grow it). An op that needs more than the buffer
        holds grows it when ``allow_grow``, else raises naming both sizes (env
        ``JAX_UB_BUFFER_BYTES``).
      timeout_s: how long any rank waits for a peer before the op fails with an error
        naming the missing rank (env ``JAX_UB_TIMEOUT_S``, default 30; at least 0.1).
      allow_grow: when an op needs more than the buffer holds, create a larger buffer at
        trace time (at least twice the old one) instead of raising (env
        ``JAX_UB_ALLOW_GROW``, default on).
      allow_tf32: let float32 GEMMs on GPUs use TF32 tensor cores (default off).
      auto_min_bytes: on GPUs, ``impl="auto"`` runs the userbuffer op only for calls whose
        collective moves at least this many bytes per rank (6x for ``matmul_all_reduce``),
        XLA's unfused op below (env
        ``JAX_UB_AUTO_MIN_BYTES``, default 8 MiB, calibrated on 2x H200; the rule and its
        calibration: ``jax_ub._src.settings.auto_rule``, :func:`jax_ub.explain_impl`). CPU devices
        and ``impl="ub"`` ignore it. Every process of a group needs the same value.
      gemm_cache: a file that keeps the GPU kernel each GEMM shape's tuning and trials
        chose (env ``JAX_UB_GEMM_CACHE``; ``""``: none). A shape the file holds runs its
        kernel from the first call, with no tuning and no trials, so processes that share
        the file run the same kernels: the same speed and the same bits from run to run.
        Lines are keyed by GPU model, cuBLASLt version and shape, and new choices are
        appended; processes may share it on a local file system. Delete it to choose
        again (after a driver, library or clock change). CPU devices ignore it. Default
        ``"auto"``: where JAX's persistent compilation cache is on in a local folder
        (``jax_compilation_cache_dir``), the file ``jax_ub_gemm_choices.txt`` there, so
        a restart skips jax_ub's tuning as it skips XLA's compiles (and the autotuning
        in them); else none.
      keep_gathered: whether an all-gathered op (``all_gather_matmul`` and the MLPs and
        layers built on it) keeps ``all_gather(x)`` from its forward for its weight
        gradient: ``tp`` times ``x``'s shard of memory per call until the backward. Off
        (default), it keeps ``x``'s shard and the backward gathers it again inside the
        input gradient's GEMM+RS call, on the copy engines beside its GEMMs: the memory of
        XLA's unfused ops, where a ``jax.checkpoint`` policy recomputes ``x``, and no
        slower (``benchmarks/RESULTS.md``). On may help where a step's backward cannot
        hide the second gather (env ``JAX_UB_KEEP_GATHERED``). fp8 calls keep their
        gathered fp8 ``x`` either way.
      bound_gemms: whose GEMMs ``impl="none"`` (the no-communication bound) runs: XLA's
        dots (``"xla"``, default) or jax_ub's own (``"ub"``: each call on a group of one
        device, at the shapes of the group's, the gathers and reduce-scatters still local
        copies and sums), so that a faster GEMM is not taken for overlap.
        ``matmul_all_reduce`` keeps XLA's dot.
    """

    # A value set is checked as configure() checks it (an environment variable's invalid
    # text is kept as an InvalidSetting, raised when the setting is read, not when the
    # Config is made, at import). Every setting of jax_ub.config is part of the key of
    # JAX's trace caches: a function traced before a change is traced again at its next
    # call, and lowered on a communicator of the new settings.
    def __setattr__(self, name: str, value: object) -> None:
        if name in _SETTINGS and type(value) is not InvalidSetting:
            check_setting(name, value, f"jax_ub.config.{name}")
            value = _plain(value)
        object.__setattr__(self, name, value)
        if self is globals().get("config"):
            _key_changed(self)

    def __getattribute__(self, name: str) -> object:
        value = object.__getattribute__(self, name)
        if type(value) is InvalidSetting:
            raise value.error()
        return value

    def problems(self) -> dict[str, str]:
        """The settings whose environment variable is invalid: name -> the error's text."""
        found = {}
        for field in dataclasses.fields(self):
            value = object.__getattribute__(self, field.name)
            if type(value) is InvalidSetting:
                found[field.name] = value.message
        return found

    def check(self) -> None:
        """Raise the error of the first setting whose environment variable is invalid."""
        for message in self.problems().values():
            raise ValueError(message)

    def __repr__(self) -> str:
        values = ", ".join(
            f"{f.name}={object.__getattribute__(self, f.name)!r}" for f in dataclasses.fields(self)
        )
        return f"Config({values})"

    buffer_bytes: int = dataclasses.field(default_factory=lambda: _from_env("buffer_bytes"))
    timeout_s: float = dataclasses.field(default_factory=lambda: _from_env("timeout_s"))
    allow_grow: bool = dataclasses.field(default_factory=lambda: _from_env("allow_grow"))
    allow_tf32: bool = dataclasses.field(default_factory=lambda: _from_env("allow_tf32"))
    auto_min_bytes: int = dataclasses.field(default_factory=lambda: _from_env("auto_min_bytes"))
    gemm_cache: str = dataclasses.field(default_factory=lambda: _from_env("gemm_cache"))
    keep_gathered: bool = dataclasses.field(default_factory=lambda: _from_env("keep_gathered"))
    bound_gemms: str = dataclasses.field(default_factory=lambda: _from_env("bound_gemms"))


def check_setting(name: str, value: object, source: str) -> None:
    """``value`` for setting ``name`` as ``configure`` checks it; the error names ``source``."""
    _SETTINGS[name][3](value, source)


def _key_changed(settings: Config) -> None:
    trace_key.set_global("config", tuple(object.__getattribute__(settings, n) for n in _SETTINGS))


config = Config()
_key_changed(config)


def gemm_cache_path(value: str) -> str:
    """The kernel choice file a communicator created now uses for gemm_cache ``value``:
    ``"auto"`` resolved (see Config), read when the communicator is created, so a
    compilation cache folder set after ``import jax_ub`` counts."""
    if value != GEMM_CACHE_AUTO:
        return value
    import jax  # noqa: PLC0415  (this module stays free of jax at import)

    folder = getattr(jax.config, "jax_compilation_cache_dir", None)
    on = getattr(jax.config, "jax_enable_compilation_cache", True)
    if not folder or not on or "://" in str(folder):
        return ""  # off, or not a local folder (a bucket): appends there need not be whole
    try:
        os.makedirs(folder, exist_ok=True)  # as JAX makes it at its first entry
    except OSError:
        return ""
    return os.path.join(os.path.abspath(folder), GEMM_CACHE_FILE)


def configure(**changes: object) -> Config:
    """Change settings for communicators created from now on; returns the new config.

    Every setting is part of the key of JAX's caches of traced functions: a function ``jit``
    traced before the change is traced again at its next call, and gets a communicator made
    with the new values (a new one where a setting it is created with changed,
    ``timeout_s``, ``allow_tf32`` or ``gemm_cache``, or a larger ``buffer_bytes``); a
    program compiled ahead of time (``.lower(...).compile()``) keeps its communicator until
    :func:`jax_ub.finalize`. ``auto_min_bytes``, ``keep_gathered`` and ``bound_gemms`` are
    read when a call is traced.

    Example::

        jax_ub.configure(timeout_s=5.0, buffer_bytes=512 << 20)
    """
    unknown = [name for name in changes if name not in _SETTINGS]
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        raise ValueError(f"unknown jax_ub setting {names}; known: {list(_SETTINGS)}")
    # Validate the whole change before applying any of it.
    for name, value in changes.items():
        check_setting(name, value, f"jax_ub.configure({name}=...)")
    for name, value in changes.items():
        setattr(config, name, value)  # as plain Python numbers (Config.__setattr__)
    return config
