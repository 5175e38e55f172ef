"""The process mesh: named axes pp × dp × ep × cp × tp over an MPI communicator.

Ranks are laid out by `Cart_create` with tp varying fastest, then cp (context parallel:
each rank holds a slice of every sequence), then ep (expert parallel: data parallel for
everything but the MoE experts, which it splits), as Megatron orders them: a
tensor-parallel group is a run of neighbouring ranks (on one node, when ranks are placed
in order), the cp ring, which moves K/V blocks every layer, is the next nearest, and the
ep group's all-to-all of tokens the next. Every axis and every combination of axes has
its own sub-communicator from `Cart_sub`.
"""

from __future__ import annotations

from collections import defaultdict
from numbers import Integral
from typing import Iterable

import attrs
from mpi4py import MPI

from numesh.base.errors import MeshError

AXES: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")
# the axes the global batch's rows split over, dp outer (`Mesh.index` merges them row-major):
# ep is data parallelism for every leaf but the experts
BATCH_AXES: tuple[str, ...] = ("dp", "ep")


@attrs.frozen
class Group:
    """Some ranks of one axis, by their index along it, as a collective group: e.g. the
    first and last pipeline stages, which share the tied embedding. Collectives take it
    where they take axis names (see `Mesh.group`); the byte counter books it under the axis."""

    axis: str
    members: tuple[int, ...]


AxisNames = str | tuple[str, ...] | Group


def parse_axis_sizes(spec: str) -> dict[str, int]:
    """The axes a mesh string names, with their sizes: "dp=2,tp=-1" -> {"dp": 2, "tp": -1}.
    Checks the syntax and the axis names; sizes are checked by the caller."""
    if not isinstance(spec, str):
        raise MeshError(f"a mesh is a string of comma-separated axis=size, e.g. 'dp=2,tp=2', got {spec!r}")
    sizes: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq or not name:
            raise MeshError(f"malformed mesh '{spec}': expected comma-separated axis=size, "
                            f"e.g. dp=2,ep=2,cp=2,tp=2,pp=2")
        if name in sizes:
            raise MeshError(f"axis '{name}' given twice in mesh '{spec}'")
        if name not in AXES:
            raise MeshError(f"unknown mesh axis '{name}': the axes are {', '.join(AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"malformed mesh '{spec}': size of '{name}' is '{value}', not an integer") from None
    return sizes


def parse_mesh(spec: str | dict[str, int] | None, n_ranks: int, origin: str = "") -> dict[str, int]:
    """Axis sizes from "dp=2,tp=2" (omitted axes are 1; one axis may be -1 = inferred).
    No spec (None or ""): every rank on dp, as `mpirun -n 4 numesh train` means. `origin`
    (" (in FILE)") names a --config file the spec came from, for a rank count that does not
    fit: the user passes --mesh over it, there is no --mesh of theirs to change."""
    if spec is None or spec == "":
        sizes: dict[str, int] = {"dp": n_ranks}
    elif isinstance(spec, dict):
        sizes = dict(spec)
    else:
        sizes = parse_axis_sizes(spec)
    for name, size in sizes.items():
        if name not in AXES:
            raise MeshError(f"unknown mesh axis '{name}': the axes are {', '.join(AXES)}")
        if isinstance(size, bool) or not isinstance(size, Integral):
            raise MeshError(f"mesh axis {name}={size!r}: sizes must be positive ints (or -1 to infer), "
                            f"not {type(size).__name__}")
        if size < 1 and size != -1:
            raise MeshError(f"mesh axis {name}={size}: sizes must be >= 1 (or -1 to infer from the number of ranks)")
    inferred = [n for n, s in sizes.items() if s == -1]
    if len(inferred) > 1:
        raise MeshError(f"only one mesh axis may be -1, got {', '.join(inferred)}")
    known = 1
    for name, size in sizes.items():
        if size != -1:
            known *= size
    if inferred:
        if n_ranks % known:
            raise MeshError(f"cannot infer {inferred[0]}: {n_ranks} ranks do not divide by {known}")
        sizes[inferred[0]] = n_ranks // known
    full = {a: int(sizes.get(a, 1)) for a in AXES}
    product = 1
    for a in AXES:
        product *= full[a]
    if product != n_ranks:
        shown = ",".join(f"{a}={full[a]}" for a in AXES)
        raise MeshError(
            f"mesh {shown}{origin} needs {product} ranks but the job has {n_ranks}: "
            f"run with mpirun -n {product} or {'pass' if origin else 'change'} --mesh"
        )
    return full


@attrs.define
class ByteCounter:
    """Bytes moved per (axes, op): `payload` is the local buffer size S, `bus` the
    NCCL-tests bus bytes (all-reduce 2(n-1)/n·S, all-gather/reduce-scatter (n-1)/n·S)."""

    payload: dict = attrs.field(factory=lambda: defaultdict(int))
    bus: dict = attrs.field(factory=lambda: defaultdict(float))
    calls: dict = attrs.field(factory=lambda: defaultdict(int))

    def add(self, axes: tuple[str, ...], op: str, nbytes: int, n: int) -> None:
        key = (axes, op)
        self.payload[key] += nbytes
        self.calls[key] += 1
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
        self.bus[key] += nbytes * factor.get(op, 1.0)

    def reset(self) -> None:
        self.payload.clear()
        self.bus.clear()
        self.calls.clear()

    def total(self, axes: AxisNames | None = None, op: str | None = None, kind: str = "bus") -> float:
        """Sum of counted bytes, optionally for one axis (group) and/or one op."""
        table = self.bus if kind == "bus" else self.payload if kind == "payload" else self.calls
        want = None if axes is None else _axes_key(axes)
        return sum(v for (a, o), v in table.items() if (want is None or a == want) and (op is None or o == op))


def _axes_key(axes: AxisNames) -> tuple[str, ...]:
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in AXES:
            raise MeshError(f"unknown mesh axis '{a}': the axes are {', '.join(AXES)}")
    return tuple(a for a in AXES if a in names)


class Mesh:
    """Named axes over a communicator; `comm(axis)` is that axis's sub-communicator.

    `sequence_parallel` says how the model uses the tp axis between its tensor-parallel
    matmuls: Megatron sequence parallelism, the activations split over the sequence
    (numesh/nn/parallel.py). It needs tp > 1; the axes and communicators are the same."""

    def __init__(self, sizes: dict[str, int], comm: MPI.Comm | None = None, sequence_parallel: bool = False):
        base = MPI.COMM_WORLD if comm is None else comm
        self.shape: dict[str, int] = parse_mesh(sizes, base.Get_size())
        if sequence_parallel and self.shape["tp"] == 1:
            raise MeshError("sequence parallelism splits the sequence over tp, which is 1 here: "
                            "add tp=N (N > 1) to the mesh or turn sequence parallelism off")
        self.sequence_parallel = sequence_parallel
        self.world = base
        self.cart = base.Create_cart([self.shape[a] for a in AXES], periods=[False] * len(AXES), reorder=False)
        self.rank = self.cart.Get_rank()
        self.coords: dict[str, int] = dict(zip(AXES, self.cart.Get_coords(self.rank)))
        self._comms: dict[tuple[str, ...], MPI.Comm] = {}
        self._groups: dict[Group, MPI.Comm | None] = {}
        self.counter = ByteCounter()
        self.observer = None  # a numesh.mesh.hook.Observer sees every call when set
        # Cart_sub is collective over the whole mesh, so make each axis's communicator now,
        # while every rank is here, not at its first use: that may be on some ranks only
        # (ZeRO-3 gathers a unit over dp on the first pipeline stage while the later stages
        # wait for its activations), which hung the job.
        for a in AXES:
            if self.shape[a] > 1:
                self.comm(a)

    @classmethod
    def create(cls, comm: MPI.Comm | None = None, sequence_parallel: bool = False, **sizes: int) -> "Mesh":
        return cls(sizes, comm, sequence_parallel)

    @classmethod
    def parse(cls, spec: str | None, comm: MPI.Comm | None = None, sequence_parallel: bool = False) -> "Mesh":
        base = MPI.COMM_WORLD if comm is None else comm
        return cls(parse_mesh(spec, base.Get_size()), base, sequence_parallel)

    def __repr__(self) -> str:
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return "Mesh(" + ", ".join(f"{a}={self.shape[a]}" for a in AXES) + sp + ")"

    def group(self, axis: str, members: Iterable[int]) -> Group:
        """Make the group of `members` (indices along `axis`). Collective over the axis:
        every rank of it calls this, members or not, so no rank waits for one that won't."""
        n = self.size(axis)
        g = Group(_axes_key(axis)[0], tuple(sorted({m % n for m in members})))
        if g not in self._groups:
            mine = self.index(axis) in g.members
            comm = self.comm(axis).Split(0 if mine else MPI.UNDEFINED, self.index(axis))
            self._groups[g] = comm if mine else None
        return g

    def size(self, axes: AxisNames) -> int:
        if isinstance(axes, Group):
            return len(axes.members)
        n = 1
        for a in _axes_key(axes):
            n *= self.shape[a]
        return n

    def index(self, axes: AxisNames) -> int:
        """This rank's position along the axis (row-major over merged axes)."""
        if isinstance(axes, Group):
            return axes.members.index(self.index(axes.axis))
        i = 0
        for a in _axes_key(axes):
            i = i * self.shape[a] + self.coords[a]
        return i

    def comm(self, axes: AxisNames) -> MPI.Comm:
        if isinstance(axes, Group):
            comm = self._groups.get(axes)
            if comm is None:
                raise MeshError(f"rank {self.rank} is not in {axes} (or it was not made with Mesh.group)")
            return comm
        key = _axes_key(axes)
        if key not in self._comms:
            self._comms[key] = self.cart.Sub([a in key for a in AXES])
        return self._comms[key]

    def neighbors(self, axis: str) -> tuple[int, int]:
        """(previous, next) ranks along `axis` in its sub-communicator; PROC_NULL at the ends."""
        size, i = self.size(axis), self.index(axis)
        prev = i - 1 if i > 0 else MPI.PROC_NULL
        nxt = i + 1 if i < size - 1 else MPI.PROC_NULL
        return prev, nxt

    def axes_of_size_gt1(self) -> tuple[str, ...]:
        return tuple(a for a in AXES if self.shape[a] > 1)

    def free(self) -> None:
        for c in [*self._comms.values(), *(g for g in self._groups.values() if g is not None)]:
            c.Free()
        self._comms.clear()
        self._groups.clear()
        self.cart.Free()


def axis_names(axes: Iterable[str] | str) -> tuple[str, ...]:
    """Canonical (pp, dp, ep, cp, tp) ordering of a set of axis names (a group's: its axis)."""
    if isinstance(axes, Group):
        return (axes.axis,)
    return _axes_key(tuple(axes) if not isinstance(axes, str) else axes)
