"""Ending communicators: finalize (also at exit), and check_health for failures found on
the device after an op returned."""

from __future__ import annotations

import atexit
import warnings

import jax

from jax_ub._src.runtime import bootstrap, communicator, extension, process_identity
from jax_ub._src.runtime.communicator import Communicator


def finalize() -> None:
    """Destroy every communicator and free its buffers.

    Compiled programs that used them are dropped from JAX's caches, so the next call
    traces again and creates fresh communicators.
    """
    comms = communicator.take_all()
    try:
        _destroy(comms)
    finally:
        if comms:
            jax.clear_caches()
        # Programs compiled from here on number the copies of their CPU calls afresh
        # (src/bindings/ffi_cpu.h), in every process alike.
        extension.module_for("cpu").reset_call_copies()


def _destroy(comms: list[Communicator]) -> None:
    # Calls already dispatched may still run on these communicators: let them finish. A
    # result that failed (say, a timeout) re-raises its error here; it is already known.
    for array in jax.live_arrays() if comms else ():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001
            continue
    for comm in comms:
        module = extension.module_for(comm.platform)
        # A call dispatched to some devices but not started on others must not find its
        # communicator gone while its peers wait inside the op for it.
        if module is not None and not module.quiesce(comm.id):
            warnings.warn(
                f"jax_ub: {comm} still had calls in flight after {comm.timeout_s} s; "
                "destroying it anyway",
                stacklevel=2,
            )
        try:
            if comm.bootstrap_namespace is not None:
                bootstrap.teardown(comm.bootstrap_namespace, comm.peer_processes, comm.timeout_s)
        finally:
            if module is not None:
                module.destroy_communicator(comm.id)


def check_health() -> None:
    """Raise ``RuntimeError`` if a live communicator has failed, with the reason.

    On CPU a failed call raises by itself. On GPUs an op has returned to XLA before the
    device finds that a peer timed out or ran a different call: the watchdog then prints
    the reason, fills that call's outputs with NaN and marks the communicator broken, so the
    *next* jax_ub call raises. This function raises it without another call: it waits (up
    to the timeout) until the calls already dispatched have been checked. Call it after
    ``jax.block_until_ready`` where a NaN would otherwise go unexplained, e.g. once per
    training step or when a loss turns NaN.

    Example::

        loss = jax.block_until_ready(train_step(state, batch))
        jax_ub.check_health()  # RuntimeError: ... ranks disagree on the call ...
    """
    comms = communicator.all_communicators()
    problems = []
    for comm in comms:
        module = extension.module_for(comm.platform)
        if module is None:
            continue
        module.quiesce(comm.id)  # returns early once broken
        reason = module.broken_reason(comm.id)
        if reason:
            problems.append(f"{comm}: {reason}{_exited_peers(comm)}")
    if problems:
        raise RuntimeError("jax_ub: " + "\n".join(problems))


def _exited_peers(comm: Communicator) -> str:
    """The peer processes of `comm` on this machine that have exited, as a note for a
    failure's reason (most likely its cause); "" for none."""
    gone = [p for p, peer in comm.peer_processes.items() if process_identity.has_exited(peer)]
    if not gone:
        return ""
    names = ", ".join(f"process {p}" for p in gone)
    return f" ({names} of this job, on this machine, exited)"


def _finalize_at_exit() -> None:
    try:
        finalize()
    except Exception as e:  # noqa: BLE001  (interpreter is going away; report, don't raise)
        warnings.warn(f"jax_ub: finalize at exit failed: {e}", stacklevel=1)


atexit.register(_finalize_at_exit)
