"""Intra-op threads: run row-independent NumPy work on all of a rank's cores.

BLAS uses every thread a rank has, but NumPy's elementwise ops, reductions and the small
per-head matmuls of attention run on one core, so outside the big matmuls the other cores
idle. `over_rows(fn, n)` splits `range(n)` into contiguous chunks and runs `fn(rows)` for
each on its own thread (NumPy releases the GIL inside its loops). The ops it is used for
are independent per row, so the result is bit-identical to one call on all rows.

The thread count follows `numesh.runtime.set_blas_threads` (ranks × threads = cores);
with one thread, as in an oversubscribed MPI job, `over_rows` is a plain call.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []
_threads = 1


def set_threads(n: int) -> int:
    """Use `n` threads (this one and n-1 workers, started once and kept); returns n."""
    global _threads
    _threads = max(1, int(n))
    while len(_workers) < _threads - 1:
        t = threading.Thread(target=_work, name=f"numesh-intra-{len(_workers)}", daemon=True)
        t.start()
        _workers.append(t)
    return _threads


def threads() -> int:
    return _threads


def _work() -> None:
    while True:
        fn, rows, done, errors = _jobs.get()
        try:
            fn(rows)
        except BaseException as e:  # re-raised by the caller
            errors.append(e)
        finally:
            done.release()


def over_rows(fn: Callable[[slice], None], n: int, min_rows: int = 1) -> None:
    """Call `fn(slice)` over contiguous chunks covering range(n), one per thread, and wait.

    Chunks have at least `min_rows` rows, so small inputs run as one call (a hand-off costs
    ~20 µs). `fn` must only write to its own rows of preallocated outputs."""
    k = min(_threads, n // max(1, min_rows))
    if k <= 1:
        fn(slice(0, n))
        return
    bounds = [n * i // k for i in range(k + 1)]
    dones, errors = [], []
    for i in range(1, k):
        done = threading.Lock()
        done.acquire()
        _jobs.put((fn, slice(bounds[i], bounds[i + 1]), done, errors))
        dones.append(done)
    try:
        fn(slice(bounds[0], bounds[1]))
    finally:
        for done in dones:
            done.acquire()
    if errors:
        raise errors[0]
