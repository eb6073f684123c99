"""Teardown's test of whether a peer process on this machine has exited
(jax_ub/_src/runtime/process_identity.py): true for a process that is gone, a zombie, or a
pid reused by a later process; never true where it cannot know (another boot or PID
namespace, an unreadable /proc, an identity that lacks a field)."""

import os
import subprocess
import sys

import pytest

from jax_ub._src.runtime import process_identity as pi

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _identity_of(pid: int) -> dict:
    state_start = pi._state_and_start(pid)
    assert state_start is not None
    return dict(pi.identity(), pid=pid, start=state_start[1])


def test_this_process_and_a_live_child_have_not_exited():
    assert not pi.has_exited(pi.identity())
    child = subprocess.Popen(SLEEPER)
    try:
        assert not pi.has_exited(_identity_of(child.pid))
    finally:
        child.kill()
        child.wait()


def test_a_reaped_child_and_a_zombie_have_exited():
    child = subprocess.Popen(SLEEPER)
    peer = _identity_of(child.pid)
    child.kill()
    child.wait()  # reaped: its pid names nothing (or, reused, a later process)
    assert pi.has_exited(peer)

    zombie = subprocess.Popen(SLEEPER)
    peer = _identity_of(zombie.pid)
    zombie.kill()
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        assert pi._state_and_start(zombie.pid)[0] == "Z"
        assert pi.has_exited(peer)
    finally:
        zombie.wait()


def test_a_reused_pid_counts_as_exited():
    """The pid names a process that started at another time than the one that published it."""
    peer = pi.identity()
    peer["start"] = str(int(peer["start"]) + 1)
    assert pi.has_exited(peer)


@pytest.mark.parametrize(
    "change",
    [
        {"boot": "another-boot"},
        {"pid_namespace": "pid:[1]"},
        {"start": ""},
        {"pid": None},
        {"pid": 0},
        {"pid": "12"},
    ],
)
def test_what_cannot_be_known_is_not_an_exit(change):
    """Another machine's boot or another PID namespace's pid says nothing here; nor does an
    identity without its fields. (Made from a reaped child's, which would count as exited.)"""
    child = subprocess.Popen(SLEEPER)
    peer = _identity_of(child.pid)
    child.kill()
    child.wait()
    assert pi.has_exited(peer)
    assert not pi.has_exited(dict(peer, **change))
    assert not pi.has_exited(None)
    assert not pi.has_exited("not an identity")


def test_an_unreadable_proc_is_not_an_exit(monkeypatch):
    child = subprocess.Popen(SLEEPER)
    peer = _identity_of(child.pid)
    child.kill()
    child.wait()

    def unreadable(pid: int):
        raise PermissionError(f"/proc/{pid}/stat")

    monkeypatch.setattr(pi, "_state_and_start", unreadable)
    assert not pi.has_exited(peer)
