"""The one hook through which collectives are observed (tracing, the flight recorder).

Set `mesh.observer` to an `Observer` and every collective and point-to-point call on that
mesh is issued as `token = begin(op, axes, nbytes)`, the nonblocking MPI call,
`wait(request, token)`, `end(token)` (nonblocking calls end when their handle is waited).
`wait` owns the completion, so an observer may poll with a deadline instead of blocking
forever. With no observer (the default) the plain blocking calls run.

`begin` may raise `SkipCall`: the call then returns at once without calling MPI (fault
injection's `skip`, see numesh/mesh/inject.py); a nonblocking call returns a finished handle.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from numesh.mesh.mesh import AxisNames, axis_names


class SkipCall(Exception):
    """Raised by `Observer.begin` to make the collective return without calling MPI."""


class Observer:
    """The do-nothing observer: subclasses override what they need."""

    def begin(self, op: str, axes: AxisNames, nbytes: int) -> Any:
        return None

    def wait(self, request: Any, token: Any) -> None:
        request.Wait()

    def end(self, token: Any) -> None:
        pass


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
