"""The one hook through which collectives are observed: what the mesh knows of observability.

Set `mesh.observer` to an `Observer` and every collective and point-to-point call on that
mesh is issued as `token = begin(op, axes, nbytes)`, the nonblocking MPI call,
`wait(request, token)`, `end(token)` (nonblocking calls end when their handle is waited).
`wait` owns the completion, so an observer may poll with a deadline instead of blocking
forever. With no observer (the default) the plain blocking calls run.

`begin` may raise `SkipCall`: the call then returns at once without calling MPI (fault
injection's `skip`, see numesh/observe/inject.py); a nonblocking call returns a finished handle.

The observers themselves (the tracer, the flight recorder, fault injection, `Recorder`,
`Chain` and `attach`) live in `numesh.observe`, above the mesh.
"""

from __future__ import annotations

from typing import Any

from numesh.mesh.mesh import AxisNames


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
