"""The docstring examples of the public modules run, and print what they show."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_ub
import jax_ub.flax
import jax_ub.flax.linen.blocks
import jax_ub.flax.linen.dense_general
import jax_ub.flax.linen.layers
import jax_ub.flax.nnx.blocks
import jax_ub.flax.nnx.dense_general
import jax_ub.flax.nnx.gated
import jax_ub.flax.nnx.layers

MODULES = [
    jax_ub.flax.nnx.layers,
    jax_ub.flax.nnx.blocks,
    jax_ub.flax.nnx.gated,
    jax_ub.flax.linen.layers,
    jax_ub.flax.linen.blocks,
    jax_ub.flax.nnx.dense_general,
    jax_ub.flax.linen.dense_general,
    jax_ub.flax._settings,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_examples_run(module):
    # What an example may take from the one before it in the module's docs.
    globs = dict(
        jax=jax, jnp=jnp, np=np, nn=nn, nnx=nnx, P=P, Mesh=Mesh, jax_ub=jax_ub,
        mesh=Mesh(np.array(jax.devices()[:4]), ("tp",)), x=jnp.ones((32, 2, 16)),
    )  # fmt: skip
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, globs=globs) if t.examples]
    assert tests, f"{module.__name__} has no examples"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


def test_readme_examples_run(capsys):
    """The README's Python blocks run as printed, and print what they say they print."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    claimed = re.findall(r"print\(.*?\)\s+# (.*)", readme)
    assert printed[-len(claimed) :] == claimed


def test_info_reports_what_a_bug_report_needs():
    """`python -m jax_ub.info` runs and names versions, extensions, devices and settings."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "jax_ub.info"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for needle in (
        "jax ",
        "jaxlib ",
        "jax_ub ",
        "extensions built against jaxlib ",
        "extensions: host (CPU) loaded",
        "devices (",
        "settings: buffer_bytes=",
        "tuning (internal): autotune_gemm=",
    ):
        assert needle in text, (needle, text)


def test_all_gather_matmul_states_auto_size_rule():
    """``help(all_gather_matmul)``'s ``"auto"`` says what the module docs say: on GPUs, ub
    only from ``auto_min_bytes`` (8 MiB by default) per rank."""
    doc = " ".join(jax_ub.all_gather_matmul.__doc__.split())
    assert "auto_min_bytes" in doc and "8 MiB" in doc, doc
    from jax_ub._src.settings.config import DEFAULT_AUTO_MIN_BYTES

    assert DEFAULT_AUTO_MIN_BYTES == 8 << 20


# Every public name of jax_ub's top level (jax_ub has no __all__: help(jax_ub) would print
# each name of one in full).
PUBLIC = {
    "Communicator", "Config", "Fp8Scales", "ImplChoice", "all_gather_matmul",
    "all_gather_matmul_reference", "check_health", "config", "configure",
    "dots_and_ops_saveable", "explain_impl", "finalize", "gated_mlp", "gated_mlp_reference",
    "gelu_mlp", "initialize", "live_communicators", "share_gpu", "matmul_all_reduce",
    "matmul_all_reduce_reference", "matmul_reduce_scatter", "matmul_reduce_scatter_reference",
}  # fmt: skip


def test_help_is_short_and_names_every_public_name():
    """``help(jax_ub)`` reads in a few minutes (under 150 lines), names every public name,
    and each public function's and class's own help still has its whole docstring."""
    import inspect
    import pydoc
    import re

    text = pydoc.render_doc(jax_ub, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 150, len(text.splitlines())
    public = {n for n, v in vars(jax_ub).items() if not n.startswith("_")}
    public = {n for n in public if not inspect.ismodule(getattr(jax_ub, n))}
    assert public == PUBLIC, public ^ PUBLIC
    for name in PUBLIC:
        assert re.search(rf"\b{name}\b", text), f"help(jax_ub) does not name {name}"
        value = getattr(jax_ub, name)
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__doc__:
            # Words only: pydoc prefixes a class's lines with "|".
            own = pydoc.render_doc(value, renderer=pydoc.plaintext).replace("|", " ").split()
            doc = inspect.getdoc(value).replace("|", " ").split()
            assert " ".join(doc) in " ".join(own), name


def test_star_import_takes_every_public_name():
    namespace = {}
    exec("from jax_ub import *", namespace)
    assert PUBLIC <= set(namespace), PUBLIC - set(namespace)
