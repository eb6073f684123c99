"""Where a machine's CPU time goes, thread by thread: every ``--every`` seconds, the threads
that used the most CPU since the last sample (user and system time apart), each with its
name, the system call it is in or last entered, its kernel wait channel, its process's jax_ub rank
(``JAX_UB_TEST_RANK``) and command line; then the interval's CPU time summed by system call.
Linux only (``/proc``); reading other users' threads' environments and syscalls needs root.

For the N-ranks mode (``device_run.sh ranks`` with ``RANKS_THREADS=1``), where N processes
a lane on one GPU keep the host's cores busy: it says whether that is compiling, tracing,
or threads waiting in a poll or spin loop.

    python3 benchmarks/tools/hot_threads.py --seconds 60 --every 10 --top 15
"""

from __future__ import annotations

import argparse
import collections
import os
import time

# x86_64 numbers of the calls a waiting thread sits in (others are shown by number).
SYSCALLS = {
    0: "read", 1: "write", 7: "poll", 16: "ioctl", 23: "select", 24: "sched_yield",
    35: "nanosleep", 44: "sendto", 45: "recvfrom", 46: "sendmsg", 47: "recvmsg",
    202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 270: "pselect6", 271: "ppoll",
    281: "epoll_pwait", 441: "epoll_pwait2",
}  # fmt: skip
TICK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _threads() -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (user, system) clock ticks so far."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat = _read(f"/proc/{pid}/task/{tid}/stat")
            if not stat:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
            out[int(pid), int(tid)] = (int(fields[11]), int(fields[12]))
    return out


def _where(pid: int, tid: int) -> tuple[str, str]:
    """The thread's system call (name or number; "running" when in user code) and wchan."""
    call = _read(f"/proc/{pid}/task/{tid}/syscall").split()
    if not call:
        name = "?"
    elif call[0] == "running":
        name = "running"
    else:
        number = int(call[0]) if call[0].lstrip("-").isdigit() else -1
        name = SYSCALLS.get(number, str(number))
    return name, _read(f"/proc/{pid}/task/{tid}/wchan").strip() or "-"


def _process(pid: int, cache: dict[int, str]) -> str:
    if pid not in cache:
        env = dict(
            kv.split("=", 1) for kv in _read(f"/proc/{pid}/environ").split("\0") if "=" in kv
        )
        rank = env.get("JAX_UB_TEST_RANK")
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
        cache[pid] = (f"rank {rank} " if rank else "") + cmd[-70:]
    return cache[pid]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60, help="how long to sample")
    p.add_argument("--every", type=float, default=10, help="seconds between samples")
    p.add_argument("--top", type=int, default=12, help="threads shown a sample")
    args = p.parse_args()
    names: dict[int, str] = {}
    before, start = _threads(), time.monotonic()
    while time.monotonic() - start < args.seconds:
        time.sleep(args.every)
        now = _threads()
        used = {
            key: (u - before[key][0], s - before[key][1])
            for key, (u, s) in now.items()
            if key in before
        }
        before = now
        hot = sorted(used.items(), key=lambda kv: -sum(kv[1]))
        by_call: collections.Counter = collections.Counter()
        for (pid, tid), (u, s) in hot:
            if u + s:
                by_call[_where(pid, tid)[0]] += u + s
        total = sum(u + s for u, s in used.values()) / TICK
        system = sum(s for _, s in used.values()) / TICK
        print(
            f"-- {time.strftime('%H:%M:%S')}: {total / args.every:.1f} cores busy "
            f"({system / args.every:.1f} in the kernel), {len(now)} threads",
            flush=True,
        )
        for (pid, tid), (u, s) in hot[: args.top]:
            call, wchan = _where(pid, tid)
            thread = _read(f"/proc/{pid}/task/{tid}/comm").strip()[:16]
            cpu, sys_share = 100 * (u + s) / TICK / args.every, 100 * s / max(u + s, 1)
            print(
                f"  {cpu:5.1f}% cpu ({sys_share:3.0f}% sys)  tid {tid:<7} {call:<14} "
                f"{wchan:<22} {thread:<16} {_process(pid, names)}"
            )
        shares = ", ".join(f"{c} {t / TICK / args.every:.1f}" for c, t in by_call.most_common(8))
        print(f"  cores by the call each thread is in now: {shares}", flush=True)


if __name__ == "__main__":
    main()
