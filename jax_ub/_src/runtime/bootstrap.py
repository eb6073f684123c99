"""Bootstrap of communicators whose groups span processes, through jax.distributed's
key-value store: no MPI, no launcher, no files.

Each process creates the regions of its own slots, publishes their handles under a key
namespace unique to the communicator, maps its peers' regions, and waits until every peer
process has mapped its own; then the names are removed (the mappings stay), so a process
that dies later leaves nothing behind. On CPU the handles are POSIX shared-memory names, on
CUDA GPUs the buffers' CUDA IPC handles (hex-encoded). Teardown waits, with a deadline, until
every peer process is done with the communicator before anything is freed.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import re
import socket
import time
from types import ModuleType

import jax

from jax_ub._src.jax_compat import distributed_client
from jax_ub._src.runtime import process_identity
from jax_ub._src.settings.options import Options

# This process's communicators, numbered: their shared-memory names (shm_prefix).
_sequence = itertools.count()
# Per communicator description, how many this process has bootstrapped: the key of each is its
# description and that count, the same in every process that shares it, whatever other
# communicators each made (pipeline stages running different programs), and successive ones
# (re-initializations after finalize) never pick up a stale key.
_bootstrapped: collections.Counter = collections.Counter()


_SHM_DIR = "/dev/shm"
# jax_ub_<pid>_<sequence>_n<PID namespace>_<slot> (before the namespace was in it, without).
_REGION_NAME = re.compile(r"jax_ub_(\d+)_\d+(?:_n(\d+))?_\d+")
# A region's name lives only while its bootstrap runs, and every wait of a bootstrap has a
# deadline; a name older than this outlived its bootstrap: its process died in between.
_STALE_AFTER_S = 600.0


def shm_prefix(sequence: int) -> str:
    """The shared-memory names of this process's regions for its `sequence`-th communicator
    (a slot's name adds _<slot>): they name the process, so that remove_stale_regions can
    tell when it is gone."""
    return f"/jax_ub_{os.getpid()}_{sequence}_n{process_identity.pid_namespace_id() or 0}"


def remove_stale_regions(
    timeout_s: float, now: float | None = None, sequence: int | None = None
) -> list[str]:
    """Unlink shared-memory names that crashed bootstraps left behind; returns them.

    A name is stale once the process that made it has exited, where that can be told: the
    name is of this process's PID namespace and its pid names no process or a zombie
    (process_identity; another namespace's pid, sharing /dev/shm, would look dead while its
    bootstrap runs). Any other name is stale once older than any bootstrap can run (the
    larger of 10 minutes and 4 timeouts). So are the names of this process's `sequence`-th
    communicator, which it is about to make: an exited process with this pid left them
    (pids are reused). Unlinking removes only the name; memory still mapped by a live
    process stays valid.
    """
    own = shm_prefix(sequence)[1:] + "_" if sequence is not None else None
    try:
        entries = list(os.scandir(_SHM_DIR))
    except OSError:  # no /dev/shm here: nothing to clean
        return []
    limit = max(_STALE_AFTER_S, 4 * timeout_s)
    now = time.time() if now is None else now
    namespace = process_identity.pid_namespace_id()
    removed = []
    for entry in entries:
        name = _REGION_NAME.fullmatch(entry.name)
        if not name:
            continue
        pid, pid_namespace = name.groups()
        try:
            if (
                (own is not None and entry.name.startswith(own))
                or (
                    namespace
                    and pid_namespace == namespace
                    and process_identity.pid_is_gone(int(pid))
                )
                or (now - entry.stat().st_mtime > limit)
            ):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


class PeersUnreachable(RuntimeError):
    """The devices of a group cannot share memory (different hosts, no peer access)."""


def host_identity() -> str:
    """Which machine this process runs on, for deciding which processes can share memory.

    The hostname and the kernel's boot id; ``JAX_UB_HOST_ID`` overrides both (for launchers
    whose containers share a hostname, and for tests).
    """
    override = os.environ.get("JAX_UB_HOST_ID")
    if override:
        return override
    return f"{socket.gethostname()}/{process_identity.boot_id()}"


def _check_hosts(group_size, device_ids, process_of_slot, host_of_process) -> None:
    """Raise PeersUnreachable naming every group whose processes are on different hosts."""
    problems = []
    for g in range(len(process_of_slot) // group_size):
        slots = range(g * group_size, (g + 1) * group_size)
        hosts: dict[str, list[int]] = {}
        for s in slots:
            hosts.setdefault(host_of_process[process_of_slot[s]], []).append(device_ids[s])
        if len(hosts) > 1:
            where = "; ".join(f"devices {ids} on host {h!r}" for h, ids in hosts.items())
            problems.append(f"group {g}: {where}")
    if problems:
        raise PeersUnreachable(
            "the devices of a tensor-parallel group must be on one host to share userbuffers, "
            "but " + " | ".join(problems) + ". Put the tensor-parallel axis inside a host "
            "(e.g. a (dp, tp) mesh with tp over one node's GPUs)"
        )


def _check_agreed(process: int, theirs: dict, ours: dict[str, object]) -> None:
    """Raise ValueError naming each setting that process `process` has set otherwise."""
    # Through JSON and back, so that both sides compare as the peer's values arrived.
    ours = json.loads(json.dumps(ours))
    differ = [
        f"{name}={theirs.get(name)!r} there, {value!r} here"
        for name, value in ours.items()
        if theirs.get(name) != value
    ]
    if differ:
        raise ValueError(
            f"jax_ub: process {process} configured jax_ub differently: {'; '.join(differ)}. "
            "Every process of a job must make the same jax_ub.configure(...) calls and set "
            "the same JAX_UB_* variables"
        )


def kv_client():
    client = distributed_client()
    if client is None:
        raise RuntimeError(
            "jax_ub: this mesh spans several processes; call jax.distributed.initialize() "
            "in every process before the first op"
        )
    return client


def create_across_processes(
    module: ModuleType,
    *,
    platform: str,
    describe: tuple,
    group_size: int,
    ordinals: list[int],
    process_of_slot: list[int],
    device_ids: list[int],
    capacity: int,
    options: Options,
) -> tuple[int, str, dict[int, object]]:
    """Create a communicator over slots held by several processes, with `options`.

    `options.agreed()` are the settings every process must share because the protocol
    depends on them (a process that splits its blocks differently from its peer would
    leave it waiting for a piece that never comes); each process publishes its own with
    its handles, and a difference is a ValueError naming the setting and both values, in
    every process.

    Returns (communicator id, key namespace, each peer process's index and identity
    (process_identity.identity(), as it published it)); the last two are what teardown()
    needs. Raises PeersUnreachable, in every process alike, where a group spans
    hosts: each process publishes its host with its handles and checks all of them before
    mapping any.
    """
    client = kv_client()
    seq = next(_sequence)
    digest = hashlib.sha1(repr(describe).encode()).hexdigest()[:12]
    ns = f"jax_ub/{digest}/{_bootstrapped[digest]}"
    _bootstrapped[digest] += 1
    me = jax.process_index()
    timeout_s, agreed = options.timeout_s, options.agreed()
    timeout_ms = max(1, int(timeout_s * 1000))
    create_kwargs: dict[str, object] = {}
    if platform == "cpu":
        remove_stale_regions(timeout_s, sequence=seq)
        create_kwargs["shm_prefix"] = shm_prefix(seq)
    else:
        create_kwargs["multiprocess"] = True
    peers = sorted(set(process_of_slot) - {me})
    try:
        comm_id = module.create_communicator(
            group_size, ordinals, capacity, options.to_dict(), **create_kwargs
        )
    except Exception as e:
        # The peers wait for this key: they fail at once with the reason, not at the timeout.
        _tell_peers(client, f"{ns}/p{me}", e)
        raise
    published = False
    try:
        names = list(module.region_names(comm_id))
        mine = {s: n for s, n in enumerate(names) if n}
        host = host_identity()
        info = {
            "names": mine,
            "capacity": capacity,
            "host": host,
            "agreed": agreed,
            "identity": process_identity.identity(),
        }
        client.key_value_set(f"{ns}/p{me}", json.dumps(info))
        published = True
        host_of_process = {me: host}
        identities: dict[int, object] = {}
        for p in peers:
            info = _peer_said(client, f"{ns}/p{p}", timeout_ms, p, "publish its userbuffers")
            if info["capacity"] != capacity:
                raise ValueError(
                    f"jax_ub: process {p} sized its userbuffer {info['capacity']} bytes, this "
                    f"process {capacity}: the processes run different shapes or settings"
                )
            _check_agreed(p, info["agreed"], agreed)
            host_of_process[p] = info["host"]
            identities[p] = info.get("identity")
            for slot, name in info["names"].items():
                names[int(slot)] = name
        _check_hosts(group_size, device_ids, process_of_slot, host_of_process)
        module.connect(comm_id, names)
        client.key_value_set(f"{ns}/mapped/p{me}", "{}")
        for p in peers:
            _peer_said(client, f"{ns}/mapped/p{p}", timeout_ms, p, "map this process's userbuffers")
        module.unlink(comm_id)
    except BaseException as e:
        module.destroy_communicator(comm_id)
        if isinstance(e, Exception):
            _tell_peers(client, f"{ns}/mapped/p{me}" if published else f"{ns}/p{me}", e)
        raise
    return comm_id, ns, identities


# How often teardown looks whether a peer it waits for has exited.
_EXIT_POLL_S = 0.2


def teardown(ns: str, peers: dict[int, object], timeout_s: float) -> None:
    """Wait until every peer process (index: identity, as create_across_processes returns
    them) is done with communicator `ns` before it is freed (a peer may still read or write
    our buffers). A peer on this machine that has exited is not waited for (it never will
    be done, and touches nothing any more: process_identity); one that never arrives costs
    the deadline and a warning, not a hang."""
    client = kv_client()
    client.key_value_set(f"{ns}/done/p{jax.process_index()}", "1")
    deadline = time.monotonic() + timeout_s
    for p, peer in peers.items():
        while not process_identity.has_exited(peer):
            begun = time.monotonic()
            wait_s = min(_EXIT_POLL_S, max(0.0, deadline - begun))
            try:
                client.blocking_key_value_get(f"{ns}/done/p{p}", max(1, int(wait_s * 1000)))
                break
            except Exception:  # noqa: BLE001  (the KV client raises its own error types)
                # Not by its timeout: the store itself failed (its host process is gone).
                store_failed = time.monotonic() - begun < wait_s / 2
            if store_failed or time.monotonic() >= deadline:
                import warnings  # noqa: PLC0415

                why = f"not within {timeout_s} s"
                if store_failed:
                    why = "jax.distributed's key-value store failed"
                warnings.warn(
                    f"jax_ub: process {p} did not finalize communicator {ns} ({why}); "
                    "freeing it anyway",
                    stacklevel=3,
                )
                return


def _tell_peers(client, key: str, error: Exception) -> None:
    """Publish at `key`, where the peers wait for this process's next step, why it failed."""
    try:
        client.key_value_set(key, json.dumps({"error": f"{type(error).__name__}: {error}"}))
    except Exception:  # noqa: BLE001, S110  (already set, or the service gone: they time out)
        pass


def _peer_said(client, key: str, timeout_ms: int, process: int, what: str) -> dict:
    """What process `process` published at `key`; its error, where it failed instead."""
    said = json.loads(_get(client, key, timeout_ms, process, what))
    if "error" in said:
        raise RuntimeError(
            f"jax_ub: process {process} failed to create its side of the communicator, so "
            f"this one cannot either: {said['error']}"
        )
    return said


def _get(client, key: str, timeout_ms: int, process: int, what: str) -> str:
    try:
        return client.blocking_key_value_get(key, timeout_ms)
    except Exception as e:  # noqa: BLE001  (the KV client raises its own error types)
        raise RuntimeError(
            f"jax_ub: process {process} did not {what} within {timeout_ms / 1000:.1f} s "
            f"(key {key!r}): it never arrived, died, or runs a different program ({e})"
        ) from None
