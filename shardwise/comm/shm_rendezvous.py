"""Setting up an axis group's shared memory: who is on which host, one segment, everyone attached, unlinked.

``shm_group_for(mesh, axis)`` (and ``shm_p2p.shm_link_for`` for point-to-point segments, through
``attach_group_segment``) is collective over the axis group the first time it is called for a
(mesh, axis) and cached on the mesh afterwards (like the per-axis comm worker). The backend's process group
carries only this rendezvous, in three small object collectives on ``mesh.group(axis)``:

1. all-gather every member's host identity (host name + kernel boot id: two containers with the same host
   name but separate kernels do not share ``/dev/shm``), pid and process start time (for liveness checks);
2. coordinate 0 creates the segment under a random name and broadcasts the name (or its error);
3. the others map it and all-gather success; then coordinate 0 unlinks the file — from here on it exists
   only as the members' mappings, so nothing is left in ``/dev/shm`` however the job ends.

It always runs on the calling thread, in program order, so it never interleaves with other backend
collectives of the group issued from another thread.
"""

from __future__ import annotations

import os
import platform
import socket

import torch
import torch.distributed as dist

from ..mesh import Mesh
from .shm import DEFAULT_REGION_BYTES, DEFAULT_SLOTS, ShmGroup
from .shm_segment import Segment, SegmentLayout, attach_segment, create_segment, unlink_segment
from .shm_sync import Peer, policy_for, process_start_time

__all__ = ["shm_group_for", "attach_group_segment", "host_identity", "cores", "DEFAULT_TIMEOUT_S", "group_timeout_s",
           "ORDERED_MACHINES"]

DEFAULT_TIMEOUT_S = 300.0
"""Timeout of shared-memory waits when neither the mesh nor the axis' process group states one."""
ORDERED_MACHINES = ("x86_64", "AMD64", "amd64")
"""Where plain stores are seen by other cores in program order (x86's total store order): the protocol
publishes a piece with a plain counter store after the data stores, with no fence in between."""


def host_identity() -> str:
    """This process' host: ``hostname/boot-id`` (equal strings: the processes share ``/dev/shm``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def group_timeout_s(mesh: Mesh, axis: str) -> float:
    """The deadline of a wait: ``Mesh(timeout_s=...)``, else the axis group's own timeout, else the default."""
    if mesh.timeout_s is not None:
        return float(mesh.timeout_s)
    try:
        backend = mesh.group(axis)._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # private API: absent in another torch version
        return DEFAULT_TIMEOUT_S


def shm_group_for(mesh: Mesh, axis: str, *, required: bool = True) -> ShmGroup | None:
    """This rank's ``ShmGroup`` for ``axis`` (``None`` for a group of one). When the group's ranks are not all
    on one host: ``ValueError`` if ``required``, else ``None``. Collective over the axis on the first call."""
    cache: dict[str, ShmGroup | str | None] = mesh.__dict__.setdefault("_shm_groups", {})
    if axis not in cache:
        cache[axis] = None if mesh.size(axis) == 1 else _rendezvous(mesh, axis)
    entry = cache[axis]
    if isinstance(entry, str):
        if required:
            raise ValueError(entry)
        return None
    return entry


def _rendezvous(mesh: Mesh, axis: str) -> ShmGroup | str:
    """A new attached group, or the reason the axis cannot use shared memory (not on one host)."""
    n = mesh.size(axis)
    made = attach_group_segment(mesh, axis, SegmentLayout(n, DEFAULT_SLOTS, DEFAULT_REGION_BYTES))
    if isinstance(made, str):
        return made
    seg, peers = made
    return ShmGroup(seg, peers, mesh.coord(axis), axis, group_timeout_s(mesh, axis), policy_for(n, cores()))


def attach_group_segment(mesh: Mesh, axis: str, layout: object, *,
                         fix: str = "use algorithm='native', 'ring' or 'tree' for this axis",
                         what: str = "algorithm 'shm'") -> tuple[Segment, list[Peer]] | str:
    """Steps 1-3 of the module doc for any segment ``layout`` (an object with ``n`` and ``total_bytes``, as
    ``create_segment`` takes): this member's mapping and every member's ``Peer``, or the reason the axis cannot
    use shared memory (``what`` cannot run; ``fix`` is the advice). Collective over the axis group."""
    group, ranks, me = mesh.group(axis), mesh.ranks(axis), mesh.coord(axis)
    n = len(ranks)
    infos: list[object] = [None] * n
    dist.all_gather_object(infos, (host_identity(), os.getpid(), process_start_time(os.getpid())), group=group)
    hosts = [str(info[0]) for info in infos]  # type: ignore[index]
    if len(set(hosts)) > 1:
        return _not_one_host(axis, ranks, hosts, fix, what)
    if platform.machine() not in ORDERED_MACHINES:  # the same answer on every rank of one host
        return f"{what} relies on x86-64's store ordering and this machine is {platform.machine()}; {fix}"
    seg, made = None, [None]
    if me == 0:
        try:
            seg = create_segment(layout)  # type: ignore[arg-type]
            made = [("ok", seg.name)]
        except OSError as exc:
            size = layout.total_bytes  # type: ignore[attr-defined]
            made = [("error", f"rank {mesh.rank} could not create a {size} B segment in /dev/shm "
                              f"({exc}); free space there (or enlarge it) or {fix}")]
    dist.broadcast_object_list(made, src=ranks[0], group=group)
    status, text = made[0]  # type: ignore[misc]
    if status != "ok":
        raise RuntimeError(f"shm setup on axis {axis!r}: {text}")
    problem = ""
    if me != 0:
        try:
            seg = attach_segment(text, layout)  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:
            problem = f"rank {mesh.rank}: {exc}"
    problems: list[object] = [None] * n
    dist.all_gather_object(problems, problem, group=group)
    if me == 0:
        unlink_segment(text)  # every member has mapped it (or failed): the name is no longer needed
    bad = [str(p) for p in problems if p]
    if bad:
        raise RuntimeError(f"shm setup on axis {axis!r}: could not map the shared-memory segment ({'; '.join(bad)})")
    assert seg is not None
    return seg, [Peer(ranks[c], c, int(infos[c][1]), int(infos[c][2])) for c in range(n)]  # type: ignore[index]


def cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _not_one_host(axis: str, ranks: list[int], hosts: list[str], fix: str, what: str) -> str:
    where = "; ".join(f"ranks {[r for r, h2 in zip(ranks, hosts) if h2 == h]} on {h.split('/')[0]!r}"
                      for h in dict.fromkeys(hosts))
    return (f"{what} needs every rank of axis {axis!r} on one host, but they are on "
            f"{len(set(hosts))} hosts ({where}); {fix}")
