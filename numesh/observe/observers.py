"""Small observers of the mesh's hook (numesh/mesh/hook.py): `Recorder` keeps every call
(tests, and the base of richer observers), `Chain` runs several at once, and `attach` adds
one to a mesh."""

from __future__ import annotations

import time
from typing import Any

import attrs

from numesh.mesh.hook import Observer
from numesh.mesh.mesh import AxisNames, axis_names


@attrs.define
class Call:
    """One observed call: what, over which axes, how many bytes, when (perf_counter seconds)."""

    seq: int
    op: str
    axes: tuple[str, ...]
    nbytes: int
    start: float
    end: float | None = None


class Recorder(Observer):
    """Keeps every observed call in order (tests, and the base of richer observers)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def begin(self, op: str, axes: AxisNames, nbytes: int) -> Call:
        call = Call(len(self.calls), op, axis_names(axes), nbytes, time.perf_counter())
        self.calls.append(call)
        return call

    def end(self, token: Call) -> None:
        token.end = time.perf_counter()


class Chain(Observer):
    """Several observers at once (e.g. the tracer and the flight recorder): each sees every
    begin and end; the first one's `wait` completes the call (give the one that polls with a
    deadline first)."""

    def __init__(self, *observers: Observer):
        if not observers:
            raise ValueError("Chain needs at least one observer")
        self.observers = observers

    def begin(self, op: str, axes: AxisNames, nbytes: int) -> list:
        return [o.begin(op, axes, nbytes) for o in self.observers]

    def wait(self, request: Any, token: list) -> None:
        self.observers[0].wait(request, token[0])

    def end(self, token: list) -> None:
        for o, t in zip(self.observers, token):
            o.end(t)


def attach(mesh: Any, observer: Observer) -> None:
    """Add `observer` to `mesh` (chained after any observer it already has)."""
    mesh.observer = observer if mesh.observer is None else Chain(mesh.observer, observer)
