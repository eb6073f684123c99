"""impl="auto" picks the userbuffer path where it can run (float32 on CPU devices) and XLA's
collectives where it cannot (int32, mixed dtypes, devices that cannot share memory), where
impl="ub" raises instead."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _op_cases import OPS, op_fn, op_operands
from conftest import ag_fn as _ag
from conftest import rel_err, smap, to_f32
from conftest import rs_fn as _rs
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_ub

TARGET = {"ag": "jax_ub_all_gather_matmul", "rs": "jax_ub_matmul_reduce_scatter"}


@pytest.mark.parametrize("op", OPS)
def test_auto_is_ub_on_cpu(mesh1d, rand, op):
    """impl="auto" takes the userbuffer path for float32 on CPU (custom call in the HLO)."""
    mesh = mesh1d(2)
    x, w = op_operands(rand, op, 2, 8, 16 if op == "ag" else 8, 8)
    f = op_fn(op, mesh, "auto")
    assert TARGET[op] in f.lower(x, w).as_text()
    assert rel_err(f(x, w), op_fn(op, mesh, "xla")(x, w)) < 1e-5


def test_auto_falls_back_to_xla_for_int32(mesh1d):
    mesh = mesh1d(4)
    x = jnp.asarray((np.arange(4 * 2 * 8, dtype=np.int32).reshape(4 * 2, 8) % 7) - 3)
    w = jnp.asarray((np.arange(8 * 4 * 4, dtype=np.int32).reshape(8, 4 * 4) % 5) - 2)
    f = _ag(mesh, "auto")
    text = f.lower(x, w).as_text()
    assert "jax_ub_all_gather_matmul" not in text
    out = f(x, w)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) @ np.asarray(w))

    xr = jnp.asarray((np.arange(4 * 4 * 4 * 2, dtype=np.int32).reshape(4 * 4, 4 * 2) % 5) - 2)
    wr = jnp.asarray((np.arange(4 * 2 * 4, dtype=np.int32).reshape(4 * 2, 4) % 3) - 1)
    g = _rs(mesh, "auto")
    assert "jax_ub_matmul_reduce_scatter" not in g.lower(xr, wr).as_text()
    np.testing.assert_array_equal(np.asarray(g(xr, wr)), np.asarray(xr) @ np.asarray(wr))


def test_auto_falls_back_to_xla_for_mixed_dtypes(mesh1d, rand):
    mesh = mesh1d(2)
    x, w = rand(2 * 4, 8), rand(8, 2 * 4, dtype=jnp.bfloat16)
    f = _ag(mesh, "auto")
    assert "jax_ub_all_gather_matmul" not in f.lower(x, w).as_text()
    assert rel_err(f(x, w), to_f32(x) @ to_f32(w)) < 1e-5


def _no_peer_access(monkeypatch):
    """Every group of this process looks like GPUs without peer access."""
    from jax_ub._src.runtime import communicator
    from jax_ub._src.settings import warn_registry

    def refuse(module, key, devices, ordinals):
        raise communicator.PeersUnreachable(
            f"devices {[d.id for d in devices[: key.group_size]]} cannot share memory (test)"
        )

    jax_ub.finalize()
    monkeypatch.setattr(communicator, "_check_peer_access", refuse)
    # What this test learns about unreachable groups goes with it, even if it fails.
    monkeypatch.setattr(communicator, "_unreachable", {})
    monkeypatch.setattr(warn_registry, "_warned", set())


def test_auto_falls_back_to_xla_where_peers_cannot_share_memory(mesh1d, rand, monkeypatch):
    """Forward and gradient of both ops under impl="auto" lower to XLA's collectives, with
    one warning, and equal the reference."""
    _no_peer_access(monkeypatch)
    mesh = mesh1d(4)
    x, w1, w2 = rand(4 * 8, 16), rand(16, 4 * 8), rand(4 * 8, 16)

    def loss(impl):
        def body(x, w1, w2):
            h = jax_ub.all_gather_matmul(x, w1, "tp", impl=impl)
            y = jax_ub.matmul_reduce_scatter(jnp.tanh(h), w2, "tp", impl=impl)
            return lax.psum(jnp.sum(jnp.sin(y)), "tp")

        f = smap(body, mesh, in_specs=(P("tp"), P(None, "tp"), P("tp")), out_specs=P())
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    with pytest.warns(UserWarning, match=r"impl='auto' uses XLA's collectives on axis 'tp'"):
        text = loss("auto").lower(x, w1, w2).as_text()
    assert "jax_ub_" not in text
    (l_auto, g_auto), (l_ref, g_ref) = loss("auto")(x, w1, w2), loss("xla")(x, w1, w2)
    assert rel_err(l_auto, l_ref) < 1e-6
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(g_auto, g_ref))
    jax_ub.finalize()


def test_ub_raises_where_peers_cannot_share_memory(mesh1d, rand, monkeypatch):
    _no_peer_access(monkeypatch)
    with pytest.raises(ValueError, match=r"impl='ub' cannot run on this mesh: devices \["):
        _ag(mesh1d(4), "ub")(rand(4 * 2, 8), rand(8, 4 * 4))
    jax_ub.finalize()


def test_gpu_without_cuda_extension_says_why(monkeypatch, rand):
    """On GPUs with only the CPU extension loaded: impl="ub" says what is missing and how to
    see it, impl="auto" warns once and takes XLA's path."""
    from jax_ub._src.ops import impl_choice
    from jax_ub._src.ops.path import Path
    from jax_ub._src.runtime import extension
    from jax_ub._src.settings import warn_registry

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(extension, "cuda_module", lambda: None)
    monkeypatch.setattr(extension, "cuda_import_error", lambda: "not built (no CUDA toolkit)")
    monkeypatch.setattr(warn_registry, "_warned", set())
    x, w = rand(8, 4), rand(4, 8)
    with pytest.raises(
        ValueError,
        match=r"impl='ub' cannot run this call: no userbuffer "
        r"implementation for platform 'gpu': the CUDA extension is not built "
        r"\(no CUDA toolkit\).*python -m jax_ub.info",
    ):
        impl_choice.choose_path("all_gather_matmul", "ub", x, w)
    with pytest.warns(UserWarning, match=r"impl='auto' uses XLA's collectives on GPUs"):
        assert impl_choice.choose_path("all_gather_matmul", "auto", x, w) is Path.XLA
