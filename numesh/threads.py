"""Intra-op threads: run NumPy work on all of a rank's cores, the same bits on any count.

BLAS uses every thread a rank has, but NumPy's elementwise ops, reductions and the small
per-head matmuls of attention run on one core, so outside the big matmuls the other cores
idle. `over_rows(fn, n)` splits `range(n)` into contiguous chunks and runs `fn(rows)` for
each on its own thread (NumPy releases the GIL inside its loops); it is used only for work
whose rows are independent, so the result is the same bits as one call on all rows.

Anything that is not row-independent (a matmul's rows depend on the BLAS call they are in;
a block's weight gradients sum over its sequences) is cut into fixed tiles, chosen from the
shape alone, and the threads only decide who computes which tile: see "Fixed tiles" below.
`matmul` makes one BLAS call per tile of rows; a block runs as fixed pieces of its
sequences (`chunked_*`, numesh.nn.stage), each thread running whole blocks on its pieces
with BLAS and `over_rows` single-threaded inside (`over_batch`), so the cores meet once
per block instead of once per op. That matters on small models: a BLAS or pool thread
that has gone idle takes ~0.1 ms to wake, paid by each of the ~50 matmuls of a step.

One thread model: numesh owns a rank's threads and BLAS runs on one thread
(`numesh.runtime.set_blas_threads`). Two pools (OpenBLAS's and numesh's) on the same
cores fought: each BLAS call on several threads must wake the others, and when the cores
are busy (other ranks, or numesh's own workers) a wake-up waits for a scheduler slice
(benchmarks/bench_node.py measures the thread sweep).

Nothing is handed to another thread when the hand-off (~20 µs) would outweigh the work:
`over_rows` takes a minimum rows per chunk and `matmul` one of `MIN_CHUNK_FLOPS` per thread.
The thread count follows `numesh.runtime.set_blas_threads` (ranks × threads = cores);
with one thread, as in an oversubscribed MPI job, the same tiles run one after another.
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

    Only for row-independent work: `fn` must compute each row with the same operations
    whatever chunk it is in, and only write to its own rows of preallocated outputs; the
    chunks follow the thread count. Chunks have at least `min_rows` rows, so small inputs
    run as one call (a hand-off costs ~20 µs)."""
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


# ---------------------------------------------------------------------------------------
# Fixed tiles: why no split changes a bit
#
# BLAS computes a row of a product along different code paths (micro-kernel tails,
# small-matrix kernels) depending on the shape of the call the row is part of, and which
# paths exist depends on the kernel family OpenBLAS picked for the CPU (OPENBLAS_CORETYPE):
# the same row can round differently in a call of 64 rows and in one of 1000. So work that
# numesh splits is cut into tiles chosen from the problem's shape alone, never from the
# thread count (`tiles`): every tile is the same BLAS call, or the same block on the same
# sequences, on 1 thread or 16, and the thread count only decides which thread makes each
# call. Sums over tiles (a block's weight gradients, taken per piece of sequences) are added
# in one fixed pairwise tree over the tiles, whichever thread computed which (`tree_sum`).
# Element-wise and per-row work (`over_rows`) needs no tiles: its rows never meet, and each
# row makes the same calls in any chunk. Together: the same bits for any thread count, on
# any BLAS kernel (tests/test_threads.py runs the check under four kernel families).

MAX_TILES = 64


def tiles(n: int, min_rows: int, max_tiles: int = MAX_TILES) -> tuple[slice, ...]:
    """The fixed tiles of range(n): the most contiguous, near-equal tiles of at least
    `min_rows` rows each, as a power of two up to `max_tiles` (balanced over 2, 4, 8, ...
    threads). A function of its arguments only."""
    count = 1
    while 2 * count <= max_tiles and n // (2 * count) >= max(1, min_rows):
        count *= 2
    return tuple(_bounds(n, count))


def over_tiles(fn: Callable[[int], T], count: int, k: int | None = None) -> list[T]:
    """`fn(i)` for each of `count` tiles, dealt to at most `k` threads (default: all) in
    contiguous runs; the results in tile order. Unlike `over_batch` the callers keep BLAS as
    it is (single-threaded under numesh.runtime)."""
    k = min(_threads, count) if k is None else max(1, min(k, _threads, count))
    out: list = [None] * count

    def run(r: slice) -> None:
        for i in range(r.start, r.stop):
            out[i] = fn(i)

    if k <= 1:
        run(slice(0, count))
    else:
        _run_all([lambda r=r: run(r) for r in _bounds(count, k)])
    return out


# Rows of a matmul tile: at 256 rows one BLAS call per tile costs 0-5 % over one call on all
# rows (the packed right-hand side is re-packed per call), at 64 rows 10-15 %
# (benchmarks/bench_tiles.py measures it).
TILE_ROWS = 256
# A single-threaded sgemm does ~1 MFLOP in 20 µs (50 GFLOP/s, one AVX2 core), the cost of a
# hand-off: each thread gets at least 4 MFLOP, else the tiles run on the caller's thread.
MIN_CHUNK_FLOPS = 4e6


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [M, K] @ b [K, N]: one single-threaded BLAS call per fixed row tile of a (`tiles`
    of TILE_ROWS), the tiles spread over the threads when each thread gets enough work, so
    the result is the same bits for any thread count."""
    m, k = a.shape
    n = b.shape[1]
    out = np.empty((m, n), np.result_type(a, b))
    rows = tiles(m, TILE_ROWS)

    def tile(i: int) -> None:
        np.matmul(a[rows[i]], b, out=out[rows[i]])

    over_tiles(tile, len(rows), int(2.0 * m * k * n // MIN_CHUNK_FLOPS))
    return out


# ---------------------------------------------------------------------------------------
# A forward/backward pair run as fixed pieces of sequences, spread over the threads


class RowChunks(NamedTuple):
    """Context of a computation run as pieces of rows (`tiles`): each piece's rows and its
    own context."""

    rows: tuple[slice, ...]
    parts: tuple


def _over_pieces(fn: Callable[[int], T], n: int) -> list[T]:
    """`fn(i)` for each of n pieces, dealt to the threads in contiguous runs, each thread
    single-threaded inside (`over_batch`); the results in piece order."""
    return [y for ys in over_batch(lambda r: [fn(i) for i in range(r.start, r.stop)], n) for y in ys]


def chunked_fwd(fn: Callable[[slice], tuple[np.ndarray, Any]], pieces: tuple[slice, ...]) -> tuple[np.ndarray, RowChunks]:
    """`fn(rows) -> (y, ctx)` for each piece of rows: y concatenated by rows."""
    parts = _over_pieces(lambda i: fn(pieces[i]), len(pieces))
    y = np.concatenate([y for y, _ in parts])
    return y, RowChunks(pieces, tuple(c for _, c in parts))


def chunked_bwd(fn: Callable[[Any, slice], tuple[np.ndarray, Any]], ctx: RowChunks) -> tuple[np.ndarray, RowChunks]:
    """`fn(piece ctx, rows) -> (dx, next ctx)` for each piece of `ctx`: dx concatenated by rows."""
    parts = _over_pieces(lambda i: fn(ctx.parts[i], ctx.rows[i]), len(ctx.rows))
    return np.concatenate([d for d, _ in parts]), RowChunks(ctx.rows, tuple(w for _, w in parts))


def chunked_sum(fn: Callable[[Any], Any], ctx: RowChunks) -> Any:
    """`fn(piece ctx) -> tree` for each piece, summed in the fixed pairwise tree over the
    pieces (`tree_sum`): the same bits whichever thread computed which piece."""
    return tree_sum(lambda i: (None, fn(ctx.parts[i])), len(ctx.rows))[1]


def chunked_bwd_sum(fn: Callable[[Any, slice], tuple[np.ndarray, Any]], ctx: RowChunks) -> tuple[np.ndarray, Any]:
    """`fn(piece ctx, rows) -> (dx, tree)` for each piece: dx concatenated by rows, the trees
    summed as `chunked_sum` sums them (each thread adds up its own pieces as it goes)."""
    dxs, total = tree_sum(lambda i: fn(ctx.parts[i], ctx.rows[i]), len(ctx.rows))
    return np.concatenate(dxs), total


# The tree over n pieces: node (lo, size) covers pieces [lo, lo + size), size a power of two
# and lo a multiple of it; its value is its left half's plus its right half's (or the left
# half's alone past the last piece), the leaves are the pieces' own trees.


def _add(a: Any, b: Any) -> Any:
    """a += b over two trees, into a's arrays (fresh arrays of one piece's result)."""
    tree_map(lambda x, y: x.__iadd__(y), a, b)
    return a


def _own_nodes(fn: Callable[[int], tuple[Any, Any]], r: slice) -> tuple[list, dict]:
    """`fn(i) -> (side, tree)` for the pieces of run `r` in order: the sides, and the run's
    trees added up into the largest whole nodes of the tree (a binary counter)."""
    sides, stack = [], []  # stack of (lo, size, tree)
    for i in range(r.start, r.stop):
        side, t = fn(i)
        sides.append(side)
        stack.append((i, 1, t))
        while len(stack) > 1:
            (lo, size, left), (lo2, size2, right) = stack[-2], stack[-1]
            if size != size2 or lo % (2 * size) or lo2 != lo + size:
                break
            stack[-2:] = [(lo, 2 * size, _add(left, right))]
    return sides, {(lo, size): t for lo, size, t in stack}


def tree_sum(fn: Callable[[int], tuple[Any, Any]], n: int) -> tuple[list, Any]:
    """`fn(i) -> (side, tree)` for i in range(n), spread over the threads like
    `chunked_fwd`: ([side for each i], the trees summed in the fixed pairwise tree)."""
    runs = over_batch(lambda r: _own_nodes(fn, r), n)
    nodes = {key: t for _, part in runs for key, t in part.items()}

    def node(lo: int, size: int) -> Any:
        if lo >= n:
            return None
        if (lo, size) in nodes:
            return nodes[(lo, size)]
        left, right = node(lo, size // 2), node(lo + size // 2, size // 2)
        return left if right is None else _add(left, right)

    top = 1 << max(0, n - 1).bit_length()
    return [s for sides, _ in runs for s in sides], node(0, top)
