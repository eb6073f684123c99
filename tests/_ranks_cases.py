"""Cases for test_ranks_mode.py, run under ``pytest --ranks 2``: the N-ranks mode's own
machinery on CPU devices (one per rank): a group across the ranks, XLA's collectives as the
reference, global arrays fetched whole, meshes of fewer ranks skipped, a failing rank
reported. Not collected by the suite (its name does not start with ``test_``)."""

import os
import time

import jax
import numpy as np
import pytest
from conftest import RANKS, gpu_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ub

pytestmark = pytest.mark.gpu  # the mode runs GPU tests only


def _one_device_per_rank() -> list:
    return [jax.local_devices(process_index=p, backend="cpu")[0] for p in range(RANKS)]


def test_op_across_the_ranks_equals_xla_and_numpy():
    mesh = gpu_mesh(_one_device_per_rank(), (RANKS,), ("tp",))
    x = jax.random.normal(jax.random.key(0), (8 * RANKS, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4 * RANKS))

    def ag(impl):
        return jax.jit(
            jax.shard_map(
                lambda x, w: jax_ub.all_gather_matmul(x, w, "tp", impl=impl),
                mesh=mesh,
                in_specs=(P("tp"), P(None, "tp")),
                out_specs=P(None, "tp"),
            )
        )

    got, want = ag("ub")(x, w), ag("xla")(x, w)
    assert not got.is_fully_addressable  # each rank holds its columns only ...
    whole = np.asarray(got)  # ... and fetches them all
    np.testing.assert_allclose(whole, np.asarray(x) @ np.asarray(w), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(whole, np.asarray(want), rtol=1e-4, atol=1e-4)
    rows = jax.device_put(x.astype(jax.numpy.bfloat16), NamedSharding(mesh, P("tp")))
    assert not rows.is_fully_addressable
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(x).astype(rows.dtype))
    assert os.environ["NCCL_HOSTID"] == f"jax_ub_rank_{jax.process_index()}"


def test_a_mesh_of_fewer_ranks_is_skipped():
    gpu_mesh(_one_device_per_rank(), (1,), ("tp",))
    raise AssertionError("not skipped")


def test_the_last_rank_fails_when_asked():
    if os.environ.get("JAX_UB_TEST_RANKS_FAIL") and jax.process_index() == RANKS - 1:
        raise AssertionError(f"rank {jax.process_index()} fails on purpose")


def test_a_rank_gone_does_not_hang_the_others():
    """The last rank's process ends in the middle of a test while rank 0 waits on (here: for
    good): the launcher ends rank 0 a grace period after, instead of waiting with it."""
    if os.environ.get("JAX_UB_TEST_RANKS_GONE"):
        if jax.process_index() == RANKS - 1:
            os._exit(3)
        time.sleep(3600)


def test_a_fetch_the_others_skip_names_itself():
    """Rank 0 fetches an array the others never fetch: a clear error, not a hang."""
    if not os.environ.get("JAX_UB_TEST_RANKS_SKIP_FETCH"):
        return
    rows = jax.device_put(
        np.arange(4 * RANKS, dtype=np.float32).reshape(RANKS, 4),
        NamedSharding(gpu_mesh(_one_device_per_rank(), (RANKS,), ("tp",)), P("tp")),
    )
    if jax.process_index() == 0:
        with pytest.raises(RuntimeError, match=rf"float32\[{RANKS}, 4\]: not every rank"):
            np.asarray(rows)
