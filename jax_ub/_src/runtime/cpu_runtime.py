"""XLA's CPU runtime with many calls in flight: enough worker threads for collectives.

Why: XLA's CPU client (jaxlib 0.10) runs every program over several devices on one pool of
worker threads, ``max(NPROC or the CPUs this process may use, number of devices)`` of them.
Each call of such a program first runs one *launch* task per device on that pool; the
launch takes a slot of the device's in-flight semaphore (32 slots: calls dispatched and not
yet finished) and, when the device has 32 calls queued, waits for one to finish -- blocking
its pool thread. The calls themselves are gang-scheduled, one at a time, and a call with an
XLA collective in it (all-gather, psum, ...) needs one pool thread per device at once: each
device's part waits inside the collective until every other device's part has arrived. (A
jax_ub op's part returns at once; the op runs on a thread of its communicator's,
``src/host/communicator.h``.) With as many threads as devices, one launch waiting on the
semaphore leaves one device's part of the running call without a thread, and the others
wait for it forever. That is the deadlock behind "rank 0 timed out ... waiting for rank 1
to deliver its chunk" after a few dozen unsynchronized calls on CPU devices, and behind
XLA's own ``rendezvous.cc: Termination timeout for 'all gather'`` abort, which a loop of
``lax.all_gather`` alone reaches the same way (no jax_ub involved).

Nothing in jax_ub can avoid it: every device's part of a call must start for the call to
finish, and each part of an XLA collective holds its thread until it does. What bounds the
threads a call ever needs is the dispatch: one Python thread has one call launching at a
time, so at most one launch task per device waits on a semaphore while the parts of one
call run. A pool of ``2 * devices`` threads therefore always has a thread for every part,
and any number of calls can be in flight. XLA reads the pool size only from the ``NPROC``
environment variable, when JAX creates the CPU client; :func:`install` wraps JAX's CPU
backend factory so that, for the duration of that call only, ``NPROC`` asks for at least
``2 * devices`` threads. Where a machine has that many CPUs already, nothing changes. The
extra threads are idle unless launches back up; XLA's intra-op pool grows alike, which only
changes how finely it splits work across the same cores.

The CPU client is created once per process, the first time JAX needs a device, so this
only works if jax_ub is imported before that; :func:`check_worker_threads` warns, once,
when a communicator is made on a CPU client that was created earlier with too few
threads (more than 31 unsynchronized calls can then deadlock it, XLA's own collectives
included). The bound assumes one thread dispatching: programs over these devices
dispatched from several Python threads at once can block a launch per device each.

Seen with jaxlib 0.10.2 (XLA's PjRtCpuClient: CommonPjRtLoadedExecutable::Execute,
CpuPjRtRawLoadedExecutable::Execute, PjRtCpuClient::GetCollectiveLaunchEvent).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

import jax

from jax_ub._src.jax_compat import backend_registry
from jax_ub._src.settings.warn_registry import warn_once

_lock = threading.Lock()
# The CPU client's worker threads, once JAX has created it through install()'s factory.
_client_threads: int | None = None
_installed = False


def available_cpus() -> int:
    """What XLA's DefaultThreadPoolSize() would return now: NPROC, else the CPUs this
    process may run on."""
    nproc = os.environ.get("NPROC", "")
    if nproc.strip().isdigit():
        return int(nproc)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def requested_cpu_devices() -> int:
    """How many CPU devices JAX's CPU client will have: jax_num_cpu_devices, else XLA's
    --xla_force_host_platform_device_count, else 1."""
    value = getattr(jax.config, "jax_num_cpu_devices", -1)
    if value is not None and value >= 0:
        return int(value)
    found = re.findall(
        r"(?:^|\s)--?xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(found[-1]) if found else 1


def threads_needed(num_devices: int) -> int:
    """Worker threads with which any number of multi-device calls can be in flight (the
    module docstring says why)."""
    return 2 * num_devices if num_devices > 1 else 1


def _sized_factory(factory):
    def make_cpu_client(*args, **kwargs):
        global _client_threads
        have = available_cpus()
        need = threads_needed(requested_cpu_devices())
        if have >= need:
            client = factory(*args, **kwargs)
        else:
            # XLA reads NPROC only while it creates the client: set it for that call alone.
            # (Another thread reading the environment in between would see it too; backend
            # creation runs under JAX's backend lock, before any program runs.)
            previous = os.environ.get("NPROC")
            os.environ["NPROC"] = str(need)
            try:
                client = factory(*args, **kwargs)
            finally:
                if previous is None:
                    os.environ.pop("NPROC", None)
                else:
                    os.environ["NPROC"] = previous
            have = need
        with _lock:
            _client_threads = max(have, len(client.local_devices()))
        return client

    make_cpu_client.__wrapped__ = factory
    return make_cpu_client


def install() -> None:
    """Size the worker pool of JAX's CPU client when JAX creates it (idempotent; does
    nothing if the CPU backend exists already, or JAX has no CPU backend factory)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    backends, factories = backend_registry()
    registration = factories.get("cpu")
    if "cpu" in backends or registration is None:
        return
    factory = _sized_factory(registration.factory)
    if dataclasses.is_dataclass(registration):
        factories["cpu"] = dataclasses.replace(registration, factory=factory)
    elif hasattr(registration, "_replace"):  # a named tuple in some JAX versions
        factories["cpu"] = registration._replace(factory=factory)


def client_threads(num_devices: int) -> tuple[int, bool]:
    """(the CPU client's worker threads, whether it was created through install()'s
    factory); estimated from NPROC and the CPUs, as XLA counts them, for a client created
    before jax_ub was imported."""
    with _lock:
        if _client_threads is not None:
            return _client_threads, True
    return max(available_cpus(), num_devices), False


def check_worker_threads(num_devices: int) -> None:
    """Warn once if the CPU client, with `num_devices` local devices, has too few worker
    threads for any number of calls to be in flight (see the module docstring)."""
    threads, through_jax_ub = client_threads(num_devices)
    need = threads_needed(num_devices)
    if threads >= need:
        return
    if through_jax_ub:
        why = (
            f"jax_ub sized it for {requested_cpu_devices()} devices, read from "
            "jax_num_cpu_devices or XLA_FLAGS when JAX created it"
        )
    else:
        why = (
            "it was created before jax_ub was imported: import jax_ub before JAX first "
            "uses a device"
        )
    warn_once(
        "cpu_worker_threads",
        f"jax_ub: JAX's CPU client has {threads} worker threads for {num_devices} devices: "
        "with more than 31 calls in flight (no block_until_ready or host read in between), "
        "a program with collectives on these devices, jax_ub's or XLA's own, can deadlock "
        f"and time out. XLA's CPU pool needs 2 threads per device; {why}, or set NPROC={need} "
        "in the environment before that.",
    )
