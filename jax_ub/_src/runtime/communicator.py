"""Userbuffer communicators: one per (mesh devices, axis, platform), created on first use.

A communicator covers every tensor-parallel group of one mesh axis: slot
``group * axis_size + rank`` belongs to the mesh device at that position once the axis is
moved last. Each slot owns a symmetric buffer that the other ranks of its group write
into. The compiled op carries the communicator's id; the handler finds its own slot from
the device it runs on.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
from jax.sharding import Mesh

from jax_ub._src.runtime import bootstrap, cpu_runtime, extension
from jax_ub._src.settings import checks
from jax_ub._src.settings.config import check_setting, config
from jax_ub._src.settings.options import Options, current_options
from jax_ub._src.settings.warn_registry import clear_warnings, warn_once

_MIB = 1 << 20
# Default userbuffer when the config leaves it to us: what the op needs, but at least this,
# so that a model's first few ops do not each grow it.
_MIN_BYTES = {"cpu": 1 * _MIB, "cuda": 256 * _MIB}


@dataclasses.dataclass(frozen=True)
class _Key:
    platform: str
    axis_name: str
    device_ids: tuple[int, ...]  # global device ids, slot order
    group_size: int
    # What the communicator is created with: after jax_ub.configure changes one of them,
    # new traces get a communicator made with it.
    options: Options


@dataclasses.dataclass
class Communicator:
    """A live userbuffer communicator (returned by :func:`jax_ub.initialize`)."""

    id: int
    platform: str
    axis_name: str
    group_size: int
    num_groups: int
    capacity_bytes: int
    timeout_s: float
    devices: tuple[jax.Device, ...]
    bootstrap_namespace: str | None = None  # set when the groups span processes
    # Each peer process's index: its identity (bootstrap), for teardown.
    peer_processes: dict[int, object] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"Communicator(id={self.id}, platform={self.platform!r}, axis={self.axis_name!r}, "
            f"groups={self.num_groups}x{self.group_size}, buffer={self.capacity_bytes} bytes)"
        )


_lock = threading.RLock()
_live: dict[_Key, Communicator] = {}
_retired: list[tuple[_Key, Communicator]] = []  # outgrown, still referenced by programs
# The config's buffer_bytes when each live communicator was made: a later change asks again.
_made_under: dict[_Key, int] = {}
# Groups found unable to share memory, with the reason: asked again, every process answers
# alike without another bootstrap round. Cleared by finalize().
_unreachable: dict[_Key, str] = {}

PeersUnreachable = bootstrap.PeersUnreachable


def slot_devices(mesh: Mesh, axis_name: str) -> list[jax.Device]:
    """Mesh devices in slot order: the axis last, the other axes flattened into groups."""
    checks.check_axis_in_mesh("", axis_name, mesh)
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(np.asarray(mesh.devices), axis, -1)
    return list(devs.reshape(-1))


def _device_ordinal(device: jax.Device) -> int:
    """The ordinal XLA hands an FFI handler running on `device`, or -1 if not ours.

    XLA's CPU client passes the global device id; the GPU client the local CUDA ordinal.
    """
    if device.process_index != jax.process_index():
        return -1
    if device.platform == "cpu":
        return int(device.id)
    hw = getattr(device, "local_hardware_id", None)
    return int(hw) if hw is not None else int(device.id)


def _create(key: _Key, devices: list[jax.Device], capacity: int) -> Communicator:
    module = extension.module_for(key.platform)
    if module is None:
        raise RuntimeError(
            f"jax_ub has no userbuffer implementation for platform {key.platform!r} in this "
            "build (CUDA needs the extension built with a CUDA toolkit); use impl='xla'"
        )
    if key.platform == "cpu":
        cpu_runtime.check_worker_threads(len(jax.local_devices(backend="cpu")))
    ordinals = [_device_ordinal(d) for d in devices]
    options = key.options.to_dict()
    timeout_s = key.options.timeout_s
    ns, peers = None, {}
    if all(o >= 0 for o in ordinals):
        _check_peer_access(module, key, devices, ordinals)
        comm_id = module.create_communicator(key.group_size, ordinals, capacity, options)
    else:
        comm_id, ns, peers = bootstrap.create_across_processes(
            module,
            platform=key.platform,
            # Not the settings: processes that differ must meet, to say so (bootstrap).
            describe=(key.platform, key.axis_name, key.device_ids, key.group_size),
            group_size=key.group_size,
            ordinals=ordinals,
            process_of_slot=[d.process_index for d in devices],
            device_ids=[d.id for d in devices],
            capacity=capacity,
            options=key.options,
        )
    return Communicator(
        id=comm_id,
        platform=key.platform,
        axis_name=key.axis_name,
        group_size=key.group_size,
        num_groups=len(devices) // key.group_size,
        capacity_bytes=capacity,
        timeout_s=timeout_s,
        devices=tuple(devices),
        bootstrap_namespace=ns,
        peer_processes=peers,
    )


def _check_peer_access(module, key: _Key, devices, ordinals) -> None:
    """GPUs of one process: raise PeersUnreachable for a group with a pair of GPUs that
    cannot map each other's memory (no NVLink or PCIe peer access)."""
    can_access = getattr(module, "can_access_peer", None)  # CUDA only
    if can_access is None:
        return
    g = key.group_size
    for start in range(0, len(ordinals), g):
        group = ordinals[start : start + g]
        for a in group:
            for b in group:
                if a != b and not can_access(a, b):
                    raise PeersUnreachable(
                        f"GPU {a} cannot access the memory of GPU {b} (no NVLink or PCIe peer "
                        f"access), so devices {[d.id for d in devices[start : start + g]]} "
                        "cannot share userbuffers; put the tensor-parallel axis on "
                        "peer-connected GPUs"
                    )


def warn_fallback(axis_name: str, reason: Exception) -> None:
    """Warn once per group layout (the reason names its devices) that impl="auto" uses
    XLA's collectives instead."""
    message = f"jax_ub: impl='auto' uses XLA's collectives on axis {axis_name!r}: {reason}"
    warn_once(str(reason), message)


def get_communicator(
    mesh: Mesh,
    axis_name: str,
    platform: str,
    needed_bytes: int = 0,
    requested_bytes: int | None = None,
) -> Communicator:
    """The communicator for (mesh, axis) on `platform` with the options in force now
    (options.current_options), created or grown as needed.

    The buffer is `requested_bytes` (from initialize) or the config's `buffer_bytes` when
    either is set, exactly, or the live communicator's where that is larger. A live one
    with less is replaced where initialize asks for more, or where the config's
    `buffer_bytes` changed since it was made (programs compiled on it keep it); an op
    needing more grows it only with `allow_grow`. Otherwise it is what the op needs, with a
    floor that spares a model's first few ops from each growing it.
    """
    devices = slot_devices(mesh, axis_name)
    group_size = mesh.shape[axis_name]
    key = _Key(platform, axis_name, tuple(d.id for d in devices), group_size, current_options())
    with _lock:
        if key in _unreachable:
            raise PeersUnreachable(_unreachable[key])
        comm = _live.get(key)
        explicit = requested_bytes or config.buffer_bytes
        # The size asked for now: initialize's; else the config's, unless it is what the live
        # communicator was made under (initialize may have asked for another size then).
        asked = explicit
        if not requested_bytes and comm is not None and _made_under.get(key) == explicit:
            asked = 0
        if comm is not None and comm.capacity_bytes >= max(needed_bytes, asked):
            return comm
        live = comm.capacity_bytes if comm is not None else 0
        has = max(asked, live)
        if has and needed_bytes > has and not config.allow_grow:
            where = (
                f"buffer_bytes is {asked}"
                if asked > live
                else f"the communicator for axis {axis_name!r} has {live}"
            )
            raise ValueError(
                f"jax_ub: userbuffer too small for this op: it needs {needed_bytes} bytes per "
                f"device, {where}; pass a larger buffer_bytes to jax_ub.initialize/configure "
                "or allow_grow=True"
            )
        if explicit:
            capacity = max(needed_bytes, explicit)  # larger only by allow_grow
        else:
            capacity = max(needed_bytes, _MIN_BYTES.get(platform, _MIB))
        if comm is not None:
            # Programs compiled against the old buffer keep it until finalize().
            _retired.append((key, comm))
            if needed_bytes > comm.capacity_bytes:  # grown: at least doubled
                capacity = max(capacity, 2 * comm.capacity_bytes)
        try:
            _live[key] = _create(key, devices, capacity)
            _made_under[key] = config.buffer_bytes
        except PeersUnreachable as e:
            _unreachable[key] = str(e)
            raise
        return _live[key]


def initialize(
    mesh: Mesh,
    axis_name: str,
    *,
    buffer_bytes: int | None = None,
    platform: str | None = None,
) -> Communicator:
    """Create the communicator for `axis_name` of `mesh` now rather than on first use.

    Args:
      mesh: the mesh the ops will run under (``jax.shard_map(..., mesh=mesh)``).
      axis_name: the tensor-parallel axis.
      buffer_bytes: symmetric buffer per device; defaults to ``jax_ub.config.buffer_bytes``.
      platform: "cpu" or "cuda"; defaults to the platform of the mesh's devices.

    Example::

        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
        jax_ub.initialize(mesh, "tp", buffer_bytes=512 << 20)
    """
    platform = extension.normalize_platform(platform or np.asarray(mesh.devices).flat[0].platform)
    if buffer_bytes is not None:
        check_setting("buffer_bytes", buffer_bytes, "jax_ub.initialize(buffer_bytes=...)")
        if buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes=}")
        buffer_bytes = int(buffer_bytes)
    return get_communicator(mesh, axis_name, platform, requested_bytes=buffer_bytes)


def live_communicators(options: Options | None = None) -> list[Communicator]:
    """The live communicators; those created with `options` where given."""
    with _lock:
        return _made_with(_live.items(), options)


def all_communicators(options: Options | None = None) -> list[Communicator]:
    """Live and retired (outgrown, still referenced by compiled programs) communicators;
    those created with `options` where given."""
    with _lock:
        return _made_with([*_live.items(), *_retired], options)


def _made_with(keyed, options: Options | None) -> list[Communicator]:
    """The communicators of (key, communicator) pairs created with `options` (all: None)."""
    return [c for k, c in keyed if options is None or k.options == options]


def take_all() -> list[Communicator]:
    """Empty the cache (and what it remembers of unreachable groups, and the warnings given);
    return
    every communicator it held, for teardown to destroy."""
    with _lock:
        comms = list(_live.values()) + [c for _, c in _retired]
        _live.clear()
        _made_under.clear()
        _retired.clear()
        _unreachable.clear()
    clear_warnings()
    return comms


def required_bytes(
    platform: str,
    op: str,
    chunk_bytes: int,
    group_size: int,
    also_gathers: bool,
    rows: int,
    k: int,
) -> int:
    """Symmetric buffer bytes one call of ``op`` needs per device, as the C++ side sizes it:
    ``chunk_bytes`` one rank's chunk (AG: x; RS: the output block of ``rows`` rows),
    ``also_gathers`` a reduce-scatter that all-gathers a second input beside it, ``k`` the
    contraction; the schedule is the one a communicator created now takes."""
    module = extension.module_for(platform)
    return int(
        module.required_bytes(
            op, chunk_bytes, group_size, also_gathers, rows, k, current_options().to_dict()
        )
    )


def for_lowering(
    op: str, mesh: Mesh, axis_name: str, platform: str, needed: int, fallback: bool
) -> Communicator | None:
    """The communicator, or None where impl="auto" may use XLA's collectives instead: the
    group's devices cannot share memory (different hosts, no peer access)."""
    try:
        return get_communicator(mesh, axis_name, platform, needed)
    except PeersUnreachable as e:
        if not fallback:
            raise ValueError(f"{op}: impl='ub' cannot run on this mesh: {e}") from None
        warn_fallback(axis_name, e)
        return None
