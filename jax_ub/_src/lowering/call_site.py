"""The site of a CPU custom call: what lets a group's ranks agree on the order of calls
with no data path between them (src/host/ordered_runner.h)."""

from __future__ import annotations

import zlib

from jax.interpreters import mlir


class _SiteCounter:
    """How many CPU calls a module has lowered: kept in the module's keepalives, so it
    lives as long as the module being lowered."""

    def __init__(self) -> None:
        self.count = 0


def call_site(ctx: mlir.LoweringRuleContext, op: str) -> int:
    """A CPU call's site: its number among the module's jax_ub calls in lowering order,
    with a checksum of its op and name stack. The same in every process that lowers the
    same program, which is what lets a group's ranks agree on the order of calls with no
    data path between them (src/host/ordered_runner.h). Not its operand types: processes
    that call one site with different shapes then pair at once, and the call's descriptor
    check names both shapes, where different keys would wait out the timeout."""
    keepalives = ctx.module_context.keepalives
    counter = next((k for k in keepalives if isinstance(k, _SiteCounter)), None)
    if counter is None:
        counter = _SiteCounter()
        keepalives.append(counter)
    counter.count += 1
    tag = zlib.crc32(f"{op}|{ctx.name_stack}".encode())
    return (counter.count << 32) | tag
