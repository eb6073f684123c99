"""Settings read at trace time take effect on functions jit traced before the change: the
Flax layers' ``defaults`` and ``configure``'s trace-time settings are part of the key of
JAX's trace caches, so a change retraces instead of being silently ignored."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from conftest import make_mesh, rel_err

import jax_ub
import jax_ub.flax as ubf

AG = "jax_ub_all_gather_matmul"


def _ub_calls(lowered) -> int:
    return len(re.findall(rf"custom_call @{AG}\b", lowered.as_text()))


def test_linen_defaults_impl_reaches_a_function_traced_before(rand):
    """One jitted ``apply``, called under ``defaults(impl="ub")`` then ``impl="xla"``: traced
    again, and only the first has jax_ub's custom calls; both give the same values."""
    mesh = make_mesh((2, "tp"))
    mlp = ubf.linen.ParallelMLP(32)
    x = rand(8, 2, 16)
    traces = []

    def apply(variables, x):
        traces.append(1)
        return mlp.apply(variables, x)

    step = jax.jit(apply)
    with jax.set_mesh(mesh):
        with ubf.defaults(impl="ub"):
            variables = mlp.init(jax.random.key(0), x)
            y_ub, lowered_ub = step(variables, x), step.lower(variables, x)
        with ubf.defaults(impl="xla"):
            y_xla, lowered_xla = step(variables, x), step.lower(variables, x)
        with ubf.defaults(impl="ub"):  # back: the first trace again, from the cache
            step(variables, x)
    assert len(traces) == 2
    assert _ub_calls(lowered_ub) == 1 and _ub_calls(lowered_xla) == 0
    assert rel_err(y_ub, y_xla) < 1e-5


def test_configure_retraces_on_every_change_only(rand):
    """Every setting keys the trace caches: changing one (read when a call is traced, as
    ``auto_min_bytes`` and ``keep_gathered``, or when a communicator is created, as
    ``timeout_s``, which a program's lowering picks) traces a jitted function again; setting
    a value it already has does not."""
    x = rand(8, 16)
    traces = []
    f = jax.jit(lambda x: traces.append(1) or jnp.sin(x))
    f(x)
    jax_ub.configure(timeout_s=jax_ub.config.timeout_s)
    f(x)
    assert len(traces) == 1
    changes = [
        ("timeout_s", jax_ub.config.timeout_s + 1),
        ("auto_min_bytes", jax_ub.config.auto_min_bytes + 1),
        ("keep_gathered", not jax_ub.config.keep_gathered),
    ]
    for i, (name, value) in enumerate(changes):
        jax_ub.configure(**{name: value})
        f(x)
        assert len(traces) == 2 + i, name


def test_setting_the_tuning_it_has_keeps_every_trace():
    """Setting the tuning to what it is (a test's restore, the defaults) traces nothing
    again, even the first time in a process: the trace key holds the tuning from import.
    (It once did not, and the first restore made JAX trace and compile every program of
    the process again.) In a fresh process: an earlier test may have set it already."""
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax_ub._src.settings import options\n"
        "traces = []\n"
        "f = jax.jit(lambda x: traces.append(1) or jnp.sin(x))\n"
        "f(jnp.ones(3))\n"
        "options.restore_tuning(options.tuning())\n"
        "options.set_experimental_tuning()\n"
        "f(jnp.ones(3))\n"
        "print(len(traces))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1", done.stdout
