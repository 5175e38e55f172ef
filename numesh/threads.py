"""Intra-op threads: run row-independent NumPy work on all of a rank's cores.

BLAS uses every thread a rank has, but NumPy's elementwise ops, reductions and the small
per-head matmuls of attention run on one core, so outside the big matmuls the other cores
idle. `over_rows(fn, n)` splits `range(n)` into contiguous chunks and runs `fn(rows)` for
each on its own thread (NumPy releases the GIL inside its loops). The ops it is used for
are independent per row, so the result is bit-identical to one call on all rows.

`over_batch(fn, n)` is the coarse form: each thread runs a whole piece of work (a
transformer block on some of the sequences) with BLAS and `over_rows` single-threaded
inside, so the cores meet once per piece instead of once per op. That matters on small
models: a BLAS or pool thread that has gone idle takes ~0.1 ms to wake, paid by each of
the ~50 matmuls of a step.

One thread model: numesh owns a rank's threads and BLAS runs on one thread
(`numesh.runtime.set_blas_threads`). Matrix multiplies outside a split block (the LM head,
tensor-parallel blocks) are split over rows by `matmul` like any other row-independent op.
Two pools (OpenBLAS's and numesh's) on the same cores fought: each BLAS call on several
threads must wake the others, and when the cores are busy (other ranks, or numesh's own
workers) a wake-up waits for a scheduler slice. Measured on the shared 2-core machine under
load: one transformer block (16 tokens, 128 wide) on BLAS's 2 threads 490 ms, split over
numesh's 2 threads with BLAS on one 31 ms (benchmarks/bench_node.py measures the sweep).

Nothing is split so small that the hand-off (~20 µs) outweighs the work: `over_rows`
takes a minimum rows per chunk, `matmul` one of `MIN_CHUNK_FLOPS`, and `block_chunks` weighs a
block's work against the Python glue each chunk pays under the GIL.

The thread count follows `numesh.runtime.set_blas_threads` (ranks × threads = cores);
with one thread, as in an oversubscribed MPI job, everything is a plain call.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import numpy as np

from numesh.tree import tree_map

T = TypeVar("T")

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []
_threads = 1
_blas = None  # threadpoolctl controller of the loaded BLAS libraries, made on first use


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
        fn, done, errors, err_state = _jobs.get()
        try:
            with np.errstate(**err_state):  # float warnings as the caller has them
                fn()
        except BaseException as e:  # re-raised by the caller
            errors.append(e)
        finally:
            done.release()


def _run_all(calls: list[Callable[[], None]]) -> None:
    """Run calls[0] here and the others on the workers; wait for all, re-raise the first error."""
    dones, errors = [], []
    err_state = np.geterr()
    for call in calls[1:]:
        done = threading.Lock()
        done.acquire()
        _jobs.put((call, done, errors, err_state))
        dones.append(done)
    try:
        calls[0]()
    finally:
        for done in dones:
            done.acquire()
    if errors:
        raise errors[0]


def _bounds(n: int, k: int) -> list[slice]:
    edges = [n * i // k for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def over_rows(fn: Callable[[slice], None], n: int, min_rows: int = 1) -> None:
    """Call `fn(slice)` over contiguous chunks covering range(n), one per thread, and wait.

    Chunks have at least `min_rows` rows, so small inputs run as one call (a hand-off costs
    ~20 µs). `fn` must only write to its own rows of preallocated outputs."""
    k = min(_threads, n // max(1, min_rows))
    if k <= 1:
        fn(slice(0, n))
        return
    _run_all([lambda r=r: fn(r) for r in _bounds(n, k)])


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """BLAS and `over_rows` on one thread (per caller) inside the block."""
    global _blas, _threads
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas")
    saved = _threads
    _threads = 1
    try:
        with _blas.limit(limits=1):
            yield
    finally:
        _threads = saved


def over_batch(fn: Callable[[slice], T], n: int, k: int | None = None) -> list[T]:
    """`fn(rows)` for `k` (default: one per thread) contiguous chunks of range(n); the results
    in row order.

    Each call runs single-threaded (BLAS included), so `fn` may do a whole sub-computation
    on its rows, but it must not communicate (MPI calls stay on the main thread)."""
    k = min(_threads, n) if k is None else max(1, min(k, _threads, n))
    if k <= 1:
        return [fn(slice(0, n))]
    chunks = _bounds(n, k)
    out: list = [None] * k

    def call(i: int) -> None:
        out[i] = fn(chunks[i])

    with _single_threaded():
        _run_all([lambda i=i: call(i) for i in range(k)])
    return out


# A single-threaded sgemm does ~1 MFLOP in 20 µs (50 GFLOP/s, one AVX2 core), the cost of a
# hand-off: chunks of at least 4 MFLOP keep the hand-off under ~20 % of each.
MIN_CHUNK_FLOPS = 4e6


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [M, K] @ b [K, N], rows split over the threads when each chunk has enough work.

    Each row of the result is computed by one single-threaded BLAS call on a block of rows,
    so the split changes no bit of a row beyond what BLAS's own blocking would."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.result_type(a, b))
    min_rows = max(1, int(MIN_CHUNK_FLOPS // max(1, 2 * k * n)))

    def rows(r: slice) -> None:
        np.matmul(a[r], b, out=out[r])

    over_rows(rows, m, min_rows)
    return out


# A transformer block's Python glue (~60 NumPy calls forward and backward, ~5 µs each: ~0.3
# ms) runs under the GIL, so the chunks pay it one after another, while their matmuls run
# side by side: k chunks of a block of W FLOPs take about max(W / (k·R), k·G) with R a
# core's rate and G the glue. The best k is sqrt(W / (R·G)); at R ≈ 50 GFLOP/s a core does
# R·G ≈ 15 MFLOP in one chunk's glue. (Estimates, not fitted: on 2 cores k ≤ 2 never binds
# for the default model, W ≈ 0.9 GFLOP gives k = 7; the baby model's W ≈ 30 GFLOP, k = 44.)
GLUE_FLOPS = 15e6


def block_chunks(n_threads: int, rows: int, block_flops: float) -> int:
    """How many chunks to split a block of `block_flops` FLOPs on `rows` sequences into: at
    most one per thread and per row, and no more than sqrt(W / GLUE_FLOPS) (1 = not split)."""
    best = int(math.sqrt(max(block_flops, 0.0) / GLUE_FLOPS))
    return max(1, min(n_threads, rows, best))


# ---------------------------------------------------------------------------------------
# A forward/backward pair run as row chunks, one per thread


class RowChunks(NamedTuple):
    """Context of a computation run as row chunks: each chunk's rows and its own context."""

    rows: tuple[slice, ...]
    parts: tuple


def _over_chunks(fn: Callable[[int], T], n: int) -> list[T]:
    """`fn(i)` for each of n chunks, spread over the threads like the chunks they came from."""
    return [y for ys in over_batch(lambda r: [fn(i) for i in range(r.start, r.stop)], n) for y in ys]


def chunked_fwd(fn: Callable[[slice], tuple[np.ndarray, Any]], n: int, k: int | None = None) -> tuple[np.ndarray, RowChunks]:
    """`fn(rows) -> (y, ctx)` over `k` row chunks of range(n) (`over_batch`): y concatenated by rows."""
    parts = over_batch(lambda r: (r, *fn(r)), n, k)
    y = np.concatenate([y for _, y, _ in parts])
    return y, RowChunks(tuple(r for r, _, _ in parts), tuple(c for _, _, c in parts))


def chunked_bwd(fn: Callable[[Any, slice], tuple[np.ndarray, Any]], ctx: RowChunks) -> tuple[np.ndarray, RowChunks]:
    """`fn(chunk ctx, rows) -> (dx, next ctx)` for each chunk of `ctx`: dx concatenated by rows."""
    parts = _over_chunks(lambda i: fn(ctx.parts[i], ctx.rows[i]), len(ctx.rows))
    return np.concatenate([d for d, _ in parts]), RowChunks(ctx.rows, tuple(w for _, w in parts))


def chunked_sum(fn: Callable[[Any], Any], ctx: RowChunks) -> Any:
    """`fn(chunk ctx) -> tree` for each chunk, the trees summed in chunk order (into the first's
    fresh arrays): weight gradients differ from one thread's only by float rounding."""
    trees = _over_chunks(lambda i: fn(ctx.parts[i]), len(ctx.rows))
    total = trees[0]
    for t in trees[1:]:
        tree_map(lambda a, b: a.__iadd__(b), total, t)
    return total
