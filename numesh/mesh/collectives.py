"""Collectives addressed by mesh axis name, on buffer-based MPI calls.

On an axis (or axis group) of size 1 every collective returns its input and costs nothing,
so the 1×1×1 mesh runs the same code as any other. Every call adds its bytes to
`mesh.counter`, keyed by axes and op.

Observability has one hook: when `mesh.observer` is set (a `numesh.mesh.hook.Observer`:
tracing, the flight recorder), every collective and point-to-point call is issued through
it (`begin` → the nonblocking MPI call → `wait` → `end`), so it can time the call, record
it, or give up on a peer that never comes. When it is None (the default) the plain
blocking call runs: observation off costs one attribute test per call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from numesh.base.tree import tree_map
from numesh.mesh.hook import SkipCall
from numesh.mesh.mesh import AxisNames, Mesh, axis_names


class Handle:
    """A nonblocking collective in flight; `wait()` returns its result."""

    def __init__(self, request: MPI.Request | None, result: np.ndarray, finish=None, observed: tuple | None = None):
        self._request, self._result, self._finish = request, result, finish
        self._observed = observed  # (observer, token) when the mesh had an observer at issue

    def wait(self) -> np.ndarray:
        if self._request is not None:
            if self._observed is None:
                self._request.Wait()
            else:
                obs, token = self._observed
                obs.wait(self._request, token)
                obs.end(token)
            self._request = None
            if self._finish is not None:
                self._result = self._finish(self._result)
                self._finish = None
        return self._result


def _count(mesh: Mesh, axes: AxisNames, op: str, nbytes: int) -> None:
    mesh.counter.add(axis_names(axes), op, nbytes, mesh.size(axes))


def _run(mesh: Mesh, axes: AxisNames, op: str, nbytes: int, blocking: Callable[[], Any],
         nonblocking: Callable[[], MPI.Request]) -> bool:
    """A blocking call, or with an observer: begin, the nonblocking form, wait, end.
    False when an injected fault skipped it (no MPI call: the caller's output is unset)."""
    obs = mesh.observer
    if obs is None:
        blocking()
        return True
    try:
        token = obs.begin(op, axes, nbytes)
    except SkipCall:  # an injected fault: this rank leaves without calling MPI
        return False
    obs.wait(nonblocking(), token)
    obs.end(token)
    return True


def _issue(mesh: Mesh, axes: AxisNames, op: str, nbytes: int, start: Callable[[], MPI.Request],
           result: np.ndarray, finish: Callable | None = None) -> Handle:
    """A nonblocking call's handle; an observer, if any, sees it begin now and end at `wait()`."""
    obs = mesh.observer
    if obs is None:
        return Handle(start(), result, finish)
    try:
        token = obs.begin(op, axes, nbytes)
    except SkipCall:  # an injected fault: a finished handle, no MPI call
        return Handle(None, result if finish is None else finish(result))
    return Handle(start(), result, finish, (obs, token))


def _operand(x: Any, op: str, reduce: str = "") -> None:
    """Refuse what only some meshes would: a non-array (a 1-rank axis returned a Python
    number unchanged where 2 ranks failed on its missing `nbytes`) or, for a reduction,
    an array MPI cannot `reduce` (booleans, objects: "Invalid MPI_Op" on 2 ranks)."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{op} takes a numpy array, got {type(x).__name__}: pass np.asarray(x)"
                        + (" (psum_scalar sums one number)" if op == "psum" else ""))
    if reduce and x.dtype.kind not in ("iuf" if reduce == "max" else "iufc"):
        raise TypeError(f"{op} {'sums' if reduce == 'sum' else 'takes the maximum of'} numbers, got an array of "
                        f"{x.dtype}: cast it, e.g. x.astype(np.int64)")


def _contig(x: np.ndarray) -> np.ndarray:
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _identity(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """A collective over one rank: `x` itself, or copied into `out` when the caller gave one."""
    if out is None or out is x:
        return x
    out[...] = x
    return out


def _dim(x: np.ndarray, dim: int) -> int:
    """`dim` as an index into x's dims (negative counts from the end, as numpy does)."""
    if x.ndim == 0:
        raise ValueError("a 0-d array has no dimension to gather or scatter along: reshape it to 1-d")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim {dim} is out of range for an array of {x.ndim} dims: "
                         f"pass one in {-x.ndim}..{x.ndim - 1}")
    return dim % x.ndim


def psum(x: np.ndarray, mesh: Mesh, axes: AxisNames, out: np.ndarray | None = None,
         inplace: bool = False) -> np.ndarray:
    """Sum over the axis, into `out` when given. `inplace=True` overwrites `x` (which must
    be contiguous)."""
    x = np.asarray(x) if isinstance(x, np.generic) and not inplace else x  # a NumPy scalar: 0-d on every mesh
    _operand(x, "psum", "sum")
    if mesh.size(axes) == 1:
        return x if inplace else _identity(x, out)
    _count(mesh, axes, "all_reduce", x.nbytes)
    comm = mesh.comm(axes)
    if inplace:
        _run(mesh, axes, "all_reduce", x.nbytes, lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM),
             lambda: comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM))
        return x
    out = np.empty(x.shape, x.dtype) if out is None else out
    src = _contig(x)
    if not _run(mesh, axes, "all_reduce", x.nbytes, lambda: comm.Allreduce(src, out, op=MPI.SUM),
                lambda: comm.Iallreduce(src, out, op=MPI.SUM)):
        out[...] = src  # skipped (NUMESH_INJECT): this rank's own values, not uninitialised memory
    return out


def psum_scalar(x: float, mesh: Mesh, axes: AxisNames) -> float:
    """Sum of one Python number over the axis (a float64 all-reduce of one value)."""
    if mesh.size(axes) == 1:
        return float(x)
    return float(psum(np.array([x], dtype=np.float64), mesh, axes)[0])


def psum_tree(tree, mesh: Mesh, axes: AxisNames):
    """Every array leaf of a pytree summed over the axis, in place (leaves must be contiguous)."""
    return tree_map(lambda x: psum(x, mesh, axes, inplace=True), tree)


def pmax(x: np.ndarray, mesh: Mesh, axes: AxisNames, out: np.ndarray | None = None) -> np.ndarray:
    """Elementwise maximum over the axis, into `out` when given."""
    x = np.asarray(x) if isinstance(x, np.generic) else x  # a NumPy scalar: 0-d on every mesh
    _operand(x, "pmax", "max")
    if mesh.size(axes) == 1:
        return _identity(x, out)
    _count(mesh, axes, "all_reduce", x.nbytes)
    out = np.empty(x.shape, x.dtype) if out is None else out
    comm, src = mesh.comm(axes), _contig(x)
    if not _run(mesh, axes, "all_reduce", x.nbytes, lambda: comm.Allreduce(src, out, op=MPI.MAX),
                lambda: comm.Iallreduce(src, out, op=MPI.MAX)):
        out[...] = src  # skipped (NUMESH_INJECT)
    return out


def ipsum(x: np.ndarray, mesh: Mesh, axes: AxisNames) -> Handle:
    """Nonblocking in-place sum over the axis; `x` holds the sum after `wait()`."""
    _operand(x, "ipsum", "sum")
    if mesh.size(axes) == 1:
        return Handle(None, x)
    _count(mesh, axes, "all_reduce", x.nbytes)
    comm = mesh.comm(axes)
    return _issue(mesh, axes, "all_reduce", x.nbytes, lambda: comm.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM), x)


def all_gather(x: np.ndarray, mesh: Mesh, axes: AxisNames, dim: int = 0) -> np.ndarray:
    """Concatenate every rank's `x` along `dim`, in axis order."""
    _operand(x, "all_gather")
    dim = _dim(x, dim)
    n = mesh.size(axes)
    if n == 1:
        return x
    buf = np.empty((n, *x.shape), dtype=x.dtype)
    _count(mesh, axes, "all_gather", buf.nbytes)
    comm, src = mesh.comm(axes), _contig(x)
    _run(mesh, axes, "all_gather", buf.nbytes, lambda: comm.Allgather(src, buf), lambda: comm.Iallgather(src, buf))
    if dim == 0:
        return buf.reshape(n * x.shape[0], *x.shape[1:])
    return np.concatenate(list(buf), axis=dim)


def all_gather_v(x: np.ndarray, counts: Sequence[int], mesh: Mesh, axes: AxisNames) -> np.ndarray:
    """Every rank's 1-D `x` concatenated in axis order, rank j's `counts[j]` values (known to
    every rank beforehand). Bytes counted as `all_gather` counts them: the gathered buffer."""
    if mesh.size(axes) == 1:
        return x
    counts_ = np.asarray(counts, np.int64)
    displ = np.concatenate(([0], np.cumsum(counts_)[:-1]))
    out = np.empty(int(counts_.sum()), x.dtype)
    _count(mesh, axes, "all_gather", out.nbytes)
    comm, src, mpi_type = mesh.comm(axes), _contig(x), MPI._typedict[x.dtype.char]
    recv_spec = [out, (counts_, displ), mpi_type]
    _run(mesh, axes, "all_gather", out.nbytes, lambda: comm.Allgatherv(src, recv_spec),
         lambda: comm.Iallgatherv(src, recv_spec))
    return out


def all_gather_inplace(buf: np.ndarray, mesh: Mesh, axes: AxisNames) -> np.ndarray:
    """Fill the contiguous 1-D `buf` from every rank's 1/n part, each already in place."""
    n = mesh.size(axes)
    if n == 1:
        return buf
    if buf.size % n:
        raise ValueError(f"buffer of {buf.size} values does not divide by {n} ranks")
    _count(mesh, axes, "all_gather", buf.nbytes)
    comm = mesh.comm(axes)
    _run(mesh, axes, "all_gather", buf.nbytes, lambda: comm.Allgather(MPI.IN_PLACE, buf),
         lambda: comm.Iallgather(MPI.IN_PLACE, buf))
    return buf


def _scatter_layout(x: np.ndarray, n: int, dim: int) -> np.ndarray:
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not divide by {n} ranks")
    return _contig(np.moveaxis(x, dim, 0))


def psum_scatter(x: np.ndarray, mesh: Mesh, axes: AxisNames, dim: int = 0) -> np.ndarray:
    """Sum over the axis, each rank keeping its 1/n slice of `dim`."""
    _operand(x, "psum_scatter", "sum")
    dim = _dim(x, dim)
    n = mesh.size(axes)
    if n == 1:
        return x
    send = _scatter_layout(x, n, dim)
    out = np.empty((send.shape[0] // n, *send.shape[1:]), dtype=x.dtype)
    _count(mesh, axes, "reduce_scatter", x.nbytes)
    comm = mesh.comm(axes)
    _run(mesh, axes, "reduce_scatter", x.nbytes, lambda: comm.Reduce_scatter_block(send, out, op=MPI.SUM),
         lambda: comm.Ireduce_scatter_block(send, out, op=MPI.SUM))
    return np.moveaxis(out, 0, dim)


def ipsum_scatter(x: np.ndarray, mesh: Mesh, axes: AxisNames, dim: int = 0) -> Handle:
    """Nonblocking `psum_scatter`."""
    _operand(x, "ipsum_scatter", "sum")
    dim = _dim(x, dim)
    n = mesh.size(axes)
    if n == 1:
        return Handle(None, x)
    send = _scatter_layout(x, n, dim)
    out = np.empty((send.shape[0] // n, *send.shape[1:]), dtype=x.dtype)
    _count(mesh, axes, "reduce_scatter", x.nbytes)
    comm = mesh.comm(axes)
    handle = _issue(mesh, axes, "reduce_scatter", x.nbytes, lambda: comm.Ireduce_scatter_block(send, out, op=MPI.SUM),
                    out, finish=lambda o: np.moveaxis(o, 0, dim))
    handle._keepalive = send  # the send buffer must live until the request completes
    return handle


def all_to_all(x: np.ndarray, mesh: Mesh, axes: AxisNames) -> np.ndarray:
    """Block i of `x` [n, ...] to rank i of the axis; block j of the result from rank j.
    Bytes counted: the blocks that leave this rank (its own stays)."""
    _operand(x, "all_to_all")
    n = mesh.size(axes)
    if n == 1:
        return x
    if x.shape[0] != n:
        raise ValueError(f"all_to_all needs one block per rank on dim 0: {x.shape[0]} blocks, {n} ranks")
    src, out = _contig(x), np.empty(x.shape, x.dtype)
    nbytes = x.nbytes - x[0].nbytes
    _count(mesh, axes, "all_to_all", nbytes)
    comm = mesh.comm(axes)
    _run(mesh, axes, "all_to_all", nbytes, lambda: comm.Alltoall(src, out), lambda: comm.Ialltoall(src, out))
    return out


def all_to_all_v(x: np.ndarray, send_rows: np.ndarray, recv_rows: np.ndarray, mesh: Mesh,
                 axes: AxisNames) -> np.ndarray:
    """Rows of `x` [sum(send_rows), ...], grouped by destination, to the ranks of the axis:
    `send_rows[i]` rows to rank i. Returns the rows received, grouped by source
    (`recv_rows[j]` from rank j, which the caller learnt by `all_to_all` of the counts).
    Bytes counted: the rows that leave this rank (its own stay)."""
    n = mesh.size(axes)
    if n == 1:
        return x
    row = int(np.prod(x.shape[1:], dtype=np.int64))
    scount = np.asarray(send_rows, np.int64) * row
    rcount = np.asarray(recv_rows, np.int64) * row
    sdispl = np.concatenate(([0], np.cumsum(scount)[:-1]))
    rdispl = np.concatenate(([0], np.cumsum(rcount)[:-1]))
    src = _contig(x)
    out = np.empty((int(np.sum(recv_rows)), *x.shape[1:]), x.dtype)
    me = mesh.index(axes)
    nbytes = int(scount.sum() - scount[me]) * x.itemsize
    _count(mesh, axes, "all_to_all", nbytes)
    comm, mpi_type = mesh.comm(axes), MPI._typedict[x.dtype.char]
    send_spec = [src, (scount, sdispl), mpi_type]
    recv_spec = [out, (rcount, rdispl), mpi_type]
    _run(mesh, axes, "all_to_all", nbytes, lambda: comm.Alltoallv(send_spec, recv_spec),
         lambda: comm.Ialltoallv(send_spec, recv_spec))
    return out


def broadcast(x: np.ndarray, mesh: Mesh, axes: AxisNames, root: int = 0) -> np.ndarray:
    """Every rank gets the root's `x` (in place; `x` must be contiguous)."""
    _operand(x, "broadcast")
    if not 0 <= root < mesh.size(axes):  # one rank ignored it; MPI said "Invalid root" on two
        raise ValueError(f"broadcast's root is an index along {','.join(axis_names(axes))}, "
                         f"0..{mesh.size(axes) - 1}, got {root}")
    if mesh.size(axes) == 1:
        return x
    _count(mesh, axes, "broadcast", x.nbytes)
    comm = mesh.comm(axes)
    _run(mesh, axes, "broadcast", x.nbytes, lambda: comm.Bcast(x, root=root), lambda: comm.Ibcast(x, root=root))
    return x


def send(x: np.ndarray, mesh: Mesh, axis: str, dest: int, tag: int = 0) -> None:
    """Blocking send to `dest` (an index along `axis`, or PROC_NULL)."""
    if dest != MPI.PROC_NULL:
        _count(mesh, axis, "send", x.nbytes)
    comm, src = mesh.comm(axis), _contig(x)
    _run(mesh, axis, "send", x.nbytes,
         lambda: comm.Send(src, dest=dest, tag=tag), lambda: comm.Isend(src, dest=dest, tag=tag))


def recv(buf: np.ndarray, mesh: Mesh, axis: str, source: int, tag: int = 0) -> np.ndarray:
    """Blocking receive into `buf` from `source` along `axis` (PROC_NULL leaves it untouched)."""
    comm = mesh.comm(axis)
    _run(mesh, axis, "recv", buf.nbytes, lambda: comm.Recv(buf, source=source, tag=tag),
         lambda: comm.Irecv(buf, source=source, tag=tag))
    return buf


def isend(x: np.ndarray, mesh: Mesh, axis: str, dest: int, tag: int = 0) -> Handle:
    """Nonblocking send; keep the handle (and `x`) until `wait()`."""
    if dest != MPI.PROC_NULL:
        _count(mesh, axis, "send", x.nbytes)
    x, comm = _contig(x), mesh.comm(axis)
    return _issue(mesh, axis, "send", x.nbytes, lambda: comm.Isend(x, dest=dest, tag=tag), x)


def irecv(buf: np.ndarray, mesh: Mesh, axis: str, source: int, tag: int = 0) -> Handle:
    """Nonblocking receive into `buf`; `wait()` returns it."""
    comm = mesh.comm(axis)
    return _issue(mesh, axis, "recv", buf.nbytes, lambda: comm.Irecv(buf, source=source, tag=tag), buf)


def sendrecv(x: np.ndarray, buf: np.ndarray, mesh: Mesh, axis: str, dest: int, source: int, tag: int = 0) -> np.ndarray:
    """Send `x` to `dest` while receiving into `buf` from `source` along `axis`."""
    if dest != MPI.PROC_NULL:
        _count(mesh, axis, "send", x.nbytes)
    comm, src = mesh.comm(axis), _contig(x)

    def both() -> MPI.Request:  # a sendrecv observed as one call: wait for both halves
        return _Both(comm.Isend(src, dest=dest, tag=tag), comm.Irecv(buf, source=source, tag=tag))

    _run(mesh, axis, "sendrecv", x.nbytes,
         lambda: comm.Sendrecv(src, dest=dest, sendtag=tag, recvbuf=buf, source=source, recvtag=tag), both)
    return buf


class _Both:
    """Two requests waited as one (what `Observer.wait` needs of a request: Wait and Test)."""

    def __init__(self, a: MPI.Request, b: MPI.Request):
        self.reqs = [a, b]

    def Wait(self) -> None:
        MPI.Request.Waitall(self.reqs)

    def Test(self) -> bool:
        return bool(MPI.Request.Testall(self.reqs))
