"""Partition specs: which mesh axes split which dimension of an array.

`P(None, "tp")` says dim 1 is split over tp and dim 0 is whole on every rank; axes a spec
does not name are axes the array is replicated over. Global arrays map to local shards
by `shard`, and back by `unshard`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from numesh.base.errors import MeshError
from numesh.mesh.collectives import all_gather
from numesh.mesh.mesh import AXES, Mesh, axis_names


class P(tuple):
    """A partition spec: one entry per array dim, each None, an axis name or a tuple of names."""

    def __new__(cls, *dims: str | tuple[str, ...] | None) -> "P":
        seen: list[str] = []
        for d in dims:
            if not (d is None or isinstance(d, str)
                    or isinstance(d, (tuple, list)) and all(isinstance(a, str) for a in d)):
                raise MeshError(f"partition spec entry {d!r} must be None, an axis name ({', '.join(AXES)}) or a "
                                f"tuple of them, one entry per array dim")
            if d is not None:
                axis_names(d)  # validates the names
                seen.extend((d,) if isinstance(d, str) else d)
        twice = sorted({a for a in seen if seen.count(a) > 1})
        if twice:
            raise MeshError(f"partition spec {dims!r} names axis {', '.join(twice)} more than once: "
                            f"an axis can split only one dimension, once")
        return super().__new__(cls, dims)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(d) for d in self) + ")"

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec splits over."""
        names: list[str] = []
        for d in self:
            if d is not None:
                names.extend(axis_names(d))
        return axis_names(names) if names else ()


def replicated_axes(spec: P, mesh: Mesh | None = None) -> tuple[str, ...]:
    """Axes the array is replicated over (of size > 1 when a mesh is given)."""
    used = set(spec.axes())
    return tuple(a for a in AXES if a not in used and (mesh is None or mesh.shape[a] > 1))


def _dims(shape: Sequence[int], spec: P) -> list:
    if len(spec) > len(shape):
        raise ValueError(f"spec {spec!r} has {len(spec)} entries but the array has {len(shape)} dims")
    return list(spec) + [None] * (len(shape) - len(spec))


def local_shape(global_shape: Sequence[int], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """The shape of this rank's shard of an array of `global_shape`."""
    out = []
    for i, (n, d) in enumerate(zip(global_shape, _dims(global_shape, spec))):
        k = 1 if d is None else mesh.size(d)
        if n % k:
            raise ValueError(f"dim {i} of size {n} does not divide by {d}={k} (spec {spec!r})")
        out.append(n // k)
    return tuple(out)


def local_slices(global_shape: Sequence[int], spec: P, mesh: Mesh) -> tuple[slice, ...]:
    """Where this rank's shard sits in the global array."""
    loc = local_shape(global_shape, spec, mesh)
    out = []
    for n, d in zip(loc, _dims(global_shape, spec)):
        i = 0 if d is None else mesh.index(d)
        out.append(slice(i * n, (i + 1) * n))
    return tuple(out)


def shard(x: np.ndarray, spec: P, mesh: Mesh) -> np.ndarray:
    """This rank's (contiguous, owned) slice of the global array `x`."""
    return np.array(x[local_slices(x.shape, spec, mesh)], order="C", copy=True)


def unshard(x: np.ndarray, spec: P, mesh: Mesh) -> np.ndarray:
    """The global array, gathered from every rank's shard `x` (a collective)."""
    for dim, d in enumerate(_dims(x.shape, spec)):
        if d is not None:
            x = all_gather(x, mesh, d, dim)
    return x
