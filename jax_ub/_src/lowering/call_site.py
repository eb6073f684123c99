"""The site of a CPU custom call: what lets a group's ranks agree on the order of calls
with no data path between them (src/host/ordered_runner.h)."""

from __future__ import annotations

import itertools
import zlib

from jax.interpreters import mlir

_lowerings = itertools.count(1)


class _SiteCounter:
    """How many CPU calls a module has lowered, and which lowering of this process it is:
    kept in the module's keepalives, so it lives as long as the module being lowered."""

    def __init__(self) -> None:
        self.count = 0
        self.lowering = next(_lowerings)


def call_site(ctx: mlir.LoweringRuleContext, op: str) -> tuple[int, int]:
    """A CPU call's site, and the lowering it belongs to.

    The site: its number among the module's jax_ub calls in lowering order (bits 48-62),
    with a checksum of its op and name stack (bits 0-31). The same in every process that
    lowers the same program, which is what lets a group's ranks agree on the order of calls
    with no data path between them (src/host/ordered_runner.h). It leaves the operand
    shapes out: processes that call one site with different shapes then pair at once, and
    the call's descriptor check names both shapes, where different keys would wait out the
    timeout.

    The lowering: this process's own number for the module being lowered (not part of any
    key). XLA's copies of a site are counted per lowering (src/bindings/ffi_cpu.cc), so
    programs that differ only in shapes do not shift each other's copy numbers, and a
    process that lowers and compiles a program again (after a ``jax.clear_caches()`` of its
    own) numbers the new executable's calls as its peers number those of their first."""
    keepalives = ctx.module_context.keepalives
    counter = next((k for k in keepalives if isinstance(k, _SiteCounter)), None)
    if counter is None:
        counter = _SiteCounter()
        keepalives.append(counter)
    counter.count += 1
    place = zlib.crc32(f"{op}|{ctx.name_stack}".encode())
    return (counter.count & 0x7FFF) << 48 | place, counter.lowering
