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


# A site's bits: its number among the module's calls (15), a checksum of its operand types
# (16), and of its op and name stack (32). The operand types tell its copies' counts apart
# (src/bindings/ffi_cpu.cc) but are not part of the key ranks pair calls by.
SHAPE_SHIFT = 32


def call_site(ctx: mlir.LoweringRuleContext, op: str) -> int:
    """A CPU call's site: its number among the module's jax_ub calls in lowering order,
    with checksums of its op and name stack and of its operand types. The same in every
    process that lowers the same program, which is what lets a group's ranks agree on the
    order of calls with no data path between them (src/host/ordered_runner.h). The key
    ranks pair by leaves the operand types out: processes that call one site with different
    shapes then pair at once, and the call's descriptor check names both shapes, where
    different keys would wait out the timeout. Copies are counted per operand types, so
    programs that differ only in shapes do not shift each other's copy numbers."""
    keepalives = ctx.module_context.keepalives
    counter = next((k for k in keepalives if isinstance(k, _SiteCounter)), None)
    if counter is None:
        counter = _SiteCounter()
        keepalives.append(counter)
    counter.count += 1
    place = zlib.crc32(f"{op}|{ctx.name_stack}".encode())
    types = zlib.crc32(str(ctx.avals_in).encode()) & 0xFFFF
    return (counter.count & 0x7FFF) << 48 | types << SHAPE_SHIFT | place
