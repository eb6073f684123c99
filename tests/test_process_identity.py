"""Whether a peer process on this machine has exited (jax_ub/_src/runtime/process_identity.py):
true for a process that is gone, a zombie, or a pid reused by a later process; never true
where it cannot know (another boot or PID namespace, an unreadable /proc, an identity that
lacks a field). And teardown's wait for its peers, which stops at a peer's exit."""

import os
import subprocess
import sys
import time
import warnings

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


class _Store:
    """A stand-in for jax.distributed's key-value client: `done` keys present, `fail`: every
    get fails at once (the store's host process gone), else a get waits out its timeout."""

    def __init__(self, done=(), fail=False):
        self.done, self.fail = set(done), fail

    def key_value_set(self, key, value):
        pass

    def blocking_key_value_get(self, key, timeout_ms):
        if self.fail:
            raise RuntimeError("UNAVAILABLE")
        if key in self.done:
            return "1"
        time.sleep(timeout_ms / 1000)
        raise RuntimeError("DEADLINE_EXCEEDED")


@pytest.mark.parametrize(
    "case, store, peer, most_s, warns",
    [
        ("finalized", _Store(done={"ns/done/p1"}), "live", 0.5, None),
        ("exited", _Store(), "dead", 0.5, None),
        ("never", _Store(), "live", 3.0, "not within 1.0 s"),
        ("store gone", _Store(fail=True), "live", 0.5, "key-value store failed"),
    ],
)
def test_teardown_waits_for_a_live_peer_only(monkeypatch, case, store, peer, most_s, warns):
    """bootstrap.teardown: a peer's done key ends the wait; so does the peer's exit (found
    while waiting); a live peer that never finalizes costs the deadline (1 s) and a warning;
    a failed store, a warning at once."""
    from jax_ub._src.runtime import bootstrap

    child = subprocess.Popen(SLEEPER)
    identity = _identity_of(child.pid)
    if peer == "dead":
        child.kill()
        child.wait()
    monkeypatch.setattr(bootstrap, "kv_client", lambda: store)
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bootstrap.teardown("ns", {1: identity}, timeout_s=1.0)
    finally:
        child.kill()
        child.wait()
    elapsed = time.monotonic() - t0
    messages = [str(w.message) for w in caught]
    assert elapsed < most_s, (case, elapsed)
    if warns is None:
        assert messages == [], messages
    else:
        assert len(messages) == 1 and warns in messages[0] and "process 1" in messages[0], messages
        if case == "never":
            assert elapsed >= 1.0, elapsed
