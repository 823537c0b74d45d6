"""Device mesh: named axes laid over the ranks of a job.

A mesh of shape ``(dp=2, tp=2)`` puts the *innermost* (last) axis on consecutive ranks, row-major:

    rank = coord[0] * stride[0] + ... + coord[-1] * 1

so ``tp`` groups are ``{0, 1}`` and ``{2, 3}`` and ``dp`` groups are ``{0, 2}`` and ``{1, 3}``. With one
node of consecutive local ranks this keeps tensor parallelism (chatty) inside the node and data
parallelism (one all-reduce per step) across nodes.

``MeshLayout`` is the pure part (shape arithmetic, no processes) and is unit-tested alone; ``Mesh`` adds one
process group per axis, created once and collectively at construction.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["Mesh", "MeshLayout"]


@dataclass(frozen=True)
class MeshLayout:
    """Named axes (outermost → innermost) over ``world_size`` ranks. Pure arithmetic, never communicates."""

    axes: tuple[str, ...]
    """Axis names, outermost first."""
    shape: tuple[int, ...]
    """Size of each axis; their product is the world size."""

    @staticmethod
    def infer(axis_sizes: Mapping[str, int], world_size: int) -> "MeshLayout":
        """Build a layout from ``{name: size}``; one size may be ``-1`` and is inferred from ``world_size``.

        Raises ``ValueError`` with the constraint, the values and the fix when the sizes cannot fit.
        """
        if not axis_sizes:
            raise ValueError("a Mesh needs at least one axis, e.g. Mesh(dp=-1)")
        names = tuple(axis_sizes)
        sizes = list(axis_sizes.values())
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"mesh axis name {name!r} is not a valid name; use a short identifier such as "
                                 f"'dp', 'tp' or 'pp', e.g. Mesh(dp=2, tp=2)")
        for name, size in zip(names, sizes):
            if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
                raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints, or -1 for one inferred axis")
        inferred = [n for n, s in zip(names, sizes) if s == -1]
        if len(inferred) > 1:
            raise ValueError(f"only one mesh axis may be -1 (inferred), got {inferred}; give the others explicit sizes")
        known = math.prod(s for s in sizes if s != -1)
        if inferred:
            if world_size % known != 0:
                raise ValueError(
                    f"cannot infer axis {inferred[0]!r}: world size {world_size} is not divisible by the product "
                    f"{known} of the other axes {dict(axis_sizes)}; choose sizes whose product divides {world_size}")
            sizes[names.index(inferred[0])] = world_size // known
        elif known != world_size:
            raise ValueError(
                f"mesh axes {dict(axis_sizes)} multiply to {known} but the world size is {world_size}; "
                f"make the product equal {world_size} (or set one axis to -1 to infer it)")
        return MeshLayout(axes=names, shape=tuple(sizes))

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Rank distance between neighbours along each axis (innermost stride is 1)."""
        strides, acc = [], 1
        for size in reversed(self.shape):
            strides.append(acc)
            acc *= size
        return tuple(reversed(strides))

    def index(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"unknown mesh axis {axis!r}; this mesh has axes {list(self.axes)}")
        return self.axes.index(axis)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        return tuple((rank // st) % sz for st, sz in zip(self.strides, self.shape))

    def rank_of(self, coords: Sequence[int]) -> int:
        return sum(c * st for c, st in zip(coords, self.strides))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: ranks that differ only in their ``axis`` coordinate, in axis order."""
        i = self.index(axis)
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            groups.setdefault(c[:i] + c[i + 1:], []).append(rank)
        return list(groups.values())

    def axis_ranks(self, rank: int, axis: str) -> list[int]:
        """The group along ``axis`` that contains ``rank``."""
        return next(g for g in self.group_ranks(axis) if rank in g)


class Mesh:
    """Named axes over the ranks of an initialised job, with one process group per axis.

    ``Mesh(dp=2, tp=2)`` — axes outermost → innermost; one axis may be ``-1`` (inferred from the world size).
    Collective: every rank must construct the same meshes in the same order, because each axis' process
    groups are created here (``torch.distributed.new_group`` is collective over the whole world).

    ``calibration``: fitted collective costs (``shardwise.comm.calibration.Calibration``, or several of them,
    one per group size) that ``algorithm="auto"`` consults; ``with_calibration`` attaches them later. Every
    rank must attach the same ones, or "auto" could pick different algorithms on different ranks.
    """

    def __init__(self, *, debug: bool = False, timeout_s: float | None = None, calibration: Any = None,
                 **axis_sizes: int) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("shardwise.Mesh needs an initialised job: call shardwise.init() first "
                               "(it reads torchrun's environment, or makes a world of size 1)")
        self._layout = MeshLayout.infer(axis_sizes, dist.get_world_size())
        self._rank = dist.get_rank()
        self.debug = debug
        """When true, collectives first check that every rank passed matching shapes/dtypes/ops."""
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"Mesh(timeout_s={timeout_s}): the collective timeout must be > 0 seconds, e.g. 60")
        self.timeout_s = timeout_s
        """The deadline of every collective on this mesh's groups; None: the job's (``sw.init(timeout_s=...)``)."""
        self.device = _device_for_backend()
        self._calibrations = _calibrations_by_size(calibration)
        self._groups: dict[str, dist.ProcessGroup] = {}
        # A second group per axis carries our own point-to-point algorithms (ring/tree), so their messages
        # never share tags or ordering with the backend's collectives issued on the first one.
        self._p2p_groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}
        self._sub_coords: dict[str, int] | None = None
        self._coords = dict(zip(self._layout.axes, self._layout.coords(self._rank)))
        for axis in self._layout.axes:
            for ranks in self._layout.group_ranks(axis):
                # new_group is collective over the world: every rank creates every group, keeps its own.
                group = _new_group(ranks, timeout_s)
                p2p_group = dist.new_group(ranks, timeout=_delta(timeout_s))
                if self._rank in ranks:
                    self._groups[axis], self._ranks[axis] = group, ranks
                    self._p2p_groups[axis] = p2p_group

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def layout(self) -> MeshLayout:
        return self._layout

    @property
    def axes(self) -> tuple[str, ...]:
        return self._layout.axes

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def rank(self) -> int:
        """This process' global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        return self._layout.world_size

    def size(self, axis: str) -> int:
        return self._layout.shape[self._layout.index(axis)]

    def coord(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (a sub-mesh keeps its parent's coordinates)."""
        coords = self._sub_coords if self._sub_coords is not None else self._coords
        if axis not in coords:
            self._layout.index(axis)  # raises the error naming the axes
        return coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        self._layout.index(axis)  # validates the name
        return self._groups[axis]

    def p2p_group(self, axis: str) -> dist.ProcessGroup:
        """The group reserved for point-to-point traffic along ``axis`` (ring/tree collectives, send/recv)."""
        self._layout.index(axis)
        return self._p2p_groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in coordinate order."""
        self._layout.index(axis)
        return list(self._ranks[axis])

    def global_rank(self, axis: str, coord: int) -> int:
        """Global rank of the member with ``coord`` along ``axis`` in this rank's group."""
        return self.ranks(axis)[coord]

    def sub(self, *axes: str) -> "Mesh":
        """The sub-mesh of this rank's slice over ``axes`` (sharing the same per-axis groups; no communication)."""
        for a in axes:
            self._layout.index(a)
        sub = object.__new__(Mesh)
        sub._layout = MeshLayout(axes=tuple(axes), shape=tuple(self.size(a) for a in axes))
        sub._rank = self._rank
        sub.debug, sub.device, sub.timeout_s = self.debug, self.device, self.timeout_s
        sub._calibrations = self._calibrations
        sub._groups = {a: self._groups[a] for a in axes}
        sub._p2p_groups = {a: self._p2p_groups[a] for a in axes}
        sub._ranks = {a: self._ranks[a] for a in axes}
        sub._sub_coords = {a: self.coord(a) for a in axes}
        sub._coords = sub._sub_coords
        return sub

    # -- calibration ---------------------------------------------------------------------------------
    def calibration_for(self, group_size: int) -> Any:
        """The attached calibration measured on groups of ``group_size`` ranks, or ``None``."""
        return self._calibrations.get(group_size)

    @property
    def calibrations(self) -> dict[int, Any]:
        """Every attached calibration by group size (empty: ``algorithm="auto"`` means ``native``)."""
        return dict(self._calibrations)

    def with_calibration(self, calibration: Any) -> "Mesh":
        """This mesh with ``calibration`` attached instead (a calibration, several, or ``None``): the same
        process groups and communication threads, no communication."""
        other = object.__new__(Mesh)
        # The comm worker threads and their queues are shared, so both views keep one order per axis.
        self.__dict__.setdefault("_comm_workers", {})
        self.__dict__.setdefault("_comm_last", {})
        other.__dict__.update(self.__dict__)
        other._calibrations = _calibrations_by_size(calibration)
        return other

    def __getitem__(self, axis: str) -> "Mesh":
        return self.sub(axis)

    def __iter__(self) -> Iterator[str]:
        return iter(self.axes)

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))
        return f"Mesh({dims})"


def _calibrations_by_size(calibration: Any) -> dict[int, Any]:
    """``None``, one calibration or an iterable of them → ``{group size: calibration}``; ``TypeError`` otherwise."""
    if calibration is None:
        return {}
    items = [calibration] if hasattr(calibration, "world_size") else calibration
    if not isinstance(items, Iterable) or isinstance(items, (str, bytes, Mapping)):
        raise TypeError(f"Mesh(calibration=...) takes a Calibration, a list of them or None, got "
                        f"{type(calibration).__name__}; load one with shardwise.comm.calibration.load_calibration")
    out: dict[int, Any] = {}
    for cal in items:
        size = getattr(cal, "world_size", None)
        if not isinstance(size, int) or not callable(getattr(cal, "best_algorithm", None)):
            raise TypeError(f"Mesh(calibration=...) got a {type(cal).__name__}, not a Calibration (with world_size "
                            f"and best_algorithm); load one with shardwise.comm.calibration.load_calibration")
        out[size] = cal
    return out


def _new_group(ranks: list[int], timeout_s: float | None) -> dist.ProcessGroup:
    if len(ranks) == dist.get_world_size() and timeout_s is None:
        # The whole world along one axis: reuse the default group rather than building a second one.
        return dist.group.WORLD  # type: ignore[return-value]
    return dist.new_group(ranks, timeout=_delta(timeout_s))


def _delta(timeout_s: float | None) -> datetime.timedelta | None:
    return None if timeout_s is None else datetime.timedelta(seconds=timeout_s)


def _device_for_backend() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
