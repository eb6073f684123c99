"""Telling that a process on this machine has exited: for teardown (a peer that died will
never say it is done with a communicator, and it no longer touches its peers' memory, so
waiting out the deadline for it only delays the survivors' finalize()), and for removing
the shared-memory names a bootstrap that died left behind.

Each process publishes its identity with its userbuffers (bootstrap). A peer's pid alone
proves nothing: another machine's, another PID namespace's, or a reused one would mislead.
So a peer counts as exited only where it shares this process's kernel boot and PID namespace
and its pid now names no process, a zombie, or a process started at another time. Where
anything is unknown (an unreadable /proc, a field missing), it does not count as exited:
the caller waits as before.
"""

from __future__ import annotations

import os


def boot_id() -> str:
    """The running kernel's boot id (different on every machine and boot), "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def pid_namespace_id() -> str:
    """This process's PID namespace as a number (its inode), "" where unknown."""
    try:
        return "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit())
    except OSError:
        return ""


def _state_and_start(pid: int) -> tuple[str, str] | None:
    """pid's state letter and start time (clock ticks after boot, /proc/PID/stat's 3rd and
    22nd fields); None where no process has that pid. Raises OSError where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': the fields
    # after its last ')' start at the state.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def pid_is_gone(pid: int, start: str = "") -> bool:
    """Whether `pid` (of this PID namespace) names no process, a zombie, or, given the
    `start` of the process it named, one started at another time; False where /proc cannot
    tell."""
    try:
        found = _state_and_start(pid)
    except (OSError, IndexError):
        return False
    return found is None or found[0] in ("Z", "X") or (bool(start) and found[1] != start)


def identity() -> dict[str, object]:
    """This process's identity, as JSON-ready values: kernel boot id, PID namespace, pid and
    its start time ("" where unknown)."""
    try:
        found = _state_and_start(os.getpid())
    except (OSError, IndexError):
        found = None
    return {
        "boot": boot_id(),
        "pid_namespace": pid_namespace_id(),
        "pid": os.getpid(),
        "start": found[1] if found else "",
    }


def has_exited(peer: object) -> bool:
    """Whether the process that published `peer` (an identity()) has certainly exited."""
    if not isinstance(peer, dict):
        return False
    pid, start = peer.get("pid"), peer.get("start")
    if not isinstance(pid, int) or pid <= 0 or not isinstance(start, str) or not start:
        return False
    boot, namespace = boot_id(), pid_namespace_id()
    if not boot or not namespace:
        return False
    if peer.get("boot") != boot or peer.get("pid_namespace") != namespace:
        return False
    return pid_is_gone(pid, start)
