"""Intra-op threads: run NumPy work on all of a rank's cores, the same bits on any count.

BLAS uses every thread a rank has, but NumPy's elementwise ops, reductions and the small
per-head matmuls of attention run on one core, so outside the big matmuls the other cores
idle. `over_rows(fn, n)` splits `range(n)` into contiguous chunks and runs `fn(rows)` for
each on its own thread (NumPy releases the GIL inside its loops); it is used only for work
whose rows are independent, so the result is the same bits as one call on all rows.

Anything that is not row-independent (a matmul's rows depend on the BLAS call they are in;
a block's weight gradients sum over its sequences) is cut into fixed tiles, chosen from the
shape alone, and the threads only decide who computes which tile: see "Fixed tiles" below.
`matmul` makes one BLAS call per tile of rows; a block on enough tokens is cut into fixed
pieces of its sequences (numesh.nn.walk), and each thread runs the whole block on a run
of pieces (`chunked_*`) with BLAS and `over_rows` single-threaded inside (`over_batch`),
so the cores meet once per block instead of once per op. That matters on small models: a
BLAS or pool thread that has gone idle takes ~0.1 ms to wake, paid by each of the ~50
matmuls of a step.

One thread model: numesh owns a rank's threads and BLAS runs on one thread
(`numesh.host.runtime.set_blas_threads`). Two pools (OpenBLAS's and numesh's) on the same
cores fought: each BLAS call on several threads must wake the others, and when the cores
are busy (other ranks, or numesh's own workers) a wake-up waits for a scheduler slice
(benchmarks/bench_node.py measures the thread sweep).

A thread waiting for another (a worker for its next job, the caller for the workers to
finish) spins awake a while before it sleeps, when every thread has a core of its own
(`set_threads(spin=True)`, as numesh.host.runtime sets it): waking a sleeping thread goes
through the hypervisor on a VM that halts idle vCPUs (its cost is measured below), at each
of a step's dozens of hand-offs (numesh.host.spin says why and how).

Nothing is handed to another thread when the hand-off would outweigh the work: `over_rows`
takes a minimum rows per chunk and `matmul` one of `MIN_CHUNK_FLOPS` per thread. The
minimums assume a hand-off of ~20 µs; on the 2-vCPU VMs it measured 0.08-0.35 ms
(`python benchmarks/bench_threads.py`), and there larger minimums still gained nothing
measurable (docs/benchmarks.md, "Fast on every CPU").
The thread count follows `numesh.host.runtime.set_blas_threads` (ranks × threads = cores);
with one thread, as in an oversubscribed MPI job, the same tiles run one after another.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import numpy as np

from numesh.base.tree import tree_leaves, tree_map
from numesh.host import aligned
from numesh.host.blas import matmul_into
from numesh.host.spin import Counter, warm

T = TypeVar("T")

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_workers: list[threading.Thread] = []
_threads = 1
_spin = False  # whether waiting threads spin awake before they sleep (`set_threads`)
_posted, _finished = Counter(), Counter()  # bumped when jobs are queued, when one is done
_blas = None  # threadpoolctl controller of the loaded BLAS libraries, made on first use


def set_threads(n: int, spin: bool = False) -> int:
    """Use `n` threads (this one and n-1 workers, started once and kept); returns n.
    `spin`: each has a core of its own, so a thread waiting for another spins awake for a
    while before it sleeps (`numesh.host.spin`), as OpenMP's threads do; never on shared
    cores, where the spin would take the core the other thread needs."""
    global _threads, _spin
    _threads = max(1, int(n))
    _spin = bool(spin) and _threads > 1
    if _spin:
        warm()
    while len(_workers) < _threads - 1:
        t = threading.Thread(target=_work, name=f"numesh-intra-{len(_workers)}", daemon=True)
        t.start()
        _workers.append(t)
    return _threads


def threads() -> int:
    return _threads


def _work() -> None:
    while True:
        fn, done, errors, err_state = _next_job()
        try:
            with np.errstate(**err_state):  # float warnings as the caller has them
                fn()
        except BaseException as e:  # re-raised by the caller
            errors.append(e)
        finally:
            # let go of the job before saying it is done: kept while this thread waits for
            # the next one, its closure kept what it reads alive (a block's weight gradients)
            fn = errors = None  # (an error's traceback holds the job's frames too)
            done.release()
            _finished.bump()


def _next_job() -> tuple:
    """The next job off the queue; with `_spin`, spinning awake (no GIL) for a while for
    one to be posted before sleeping on the queue (`numesh.host.spin`)."""
    seen = _posted.value()  # before the queue is looked at: a job posted after it bumps it
    try:
        return _jobs.get_nowait()
    except queue.Empty:
        pass
    if _spin and _posted.wait_change(seen):
        try:
            return _jobs.get_nowait()
        except queue.Empty:  # another worker took it
            pass
    return _jobs.get()


def _wait(done: threading.Lock) -> None:
    """Until a worker releases `done`; with `_spin`, spinning awake while workers go on
    finishing jobs, then sleeping on the lock."""
    while not done.acquire(blocking=False):
        seen = _finished.value()
        if done.acquire(blocking=False):
            return
        if not (_spin and _finished.wait_change(seen)):
            done.acquire()
            return


def _run_all(calls: list[Callable[[], None]]) -> None:
    """Run calls[0] here and the others on the workers; wait for all, re-raise the first error."""
    dones, errors = [], []
    err_state = np.geterr()
    for call in calls[1:]:
        done = threading.Lock()
        done.acquire()
        _jobs.put((call, done, errors, err_state))
        dones.append(done)
    _posted.bump()
    try:
        calls[0]()
    finally:
        for done in dones:
            _wait(done)
    if errors:
        raise errors[0]


def _bounds(n: int, k: int) -> list[slice]:
    edges = [n * i // k for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def chunk_rows(row_len: int, elements: int = 1 << 15) -> int:
    """The fewest rows a chunk of rows `row_len` long takes (`over_rows`' min_rows, `tiles`'
    tile) so that it holds at least `elements` elements: a hand-off (~20 µs) is then small
    beside the work."""
    return max(1, elements // max(1, row_len))


def over_rows(fn: Callable[[slice], None], n: int, min_rows: int = 1) -> None:
    """Call `fn(slice)` over contiguous chunks covering range(n), one per thread, and wait.

    Only for row-independent work: `fn` must compute each row with the same operations
    whatever chunk it is in, and only write to its own rows of preallocated outputs; the
    chunks follow the thread count. Chunks have at least `min_rows` rows, so small inputs
    run as one call (a hand-off costs ~20 µs where idle cores wake fast, more on a VM: see the module
    docstring)."""
    k = min(_threads, n // max(1, min_rows))
    if k <= 1:
        fn(slice(0, n))
        return
    if _held is not None and threading.get_ident() == _held[0]:
        _held[1].append((fn, _bounds(n, k)))
        return
    _run_all([lambda r=r: fn(r) for r in _bounds(n, k)])


_held: tuple[int, list] | None = None  # (the thread inside `one_hand_off`, its calls held back)


@contextlib.contextmanager
def one_hand_off() -> Iterator[None]:
    """The `over_rows` calls this thread makes inside the block (each cut into more than one
    chunk) held back and run at its end, all of them in one hand-off: thread i takes chunk i
    of each, so every row gets what it would have got at once. For calls none of which
    reads what another writes (an optimiser's update of each unit): each hand-off costs the
    main thread's Python time and the other threads' wake-up (~0.1 ms on a VM, see the
    module docstring), and a step's units otherwise hand off one by one."""
    global _held
    if _held is not None or _threads <= 1:
        yield
        return
    _held = (threading.get_ident(), [])
    try:
        yield
        calls = _held[1]
    finally:
        _held = None
    if calls:
        _run_all([lambda i=i: _chunks(calls, i) for i in range(max(len(chunks) for _, chunks in calls))])


def _chunks(calls: list[tuple[Callable[[slice], None], list[slice]]], i: int) -> None:
    for fn, chunks in calls:
        if i < len(chunks):
            fn(chunks[i])


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """BLAS and `over_rows` on one thread (per caller) inside the block. BLAS is left alone
    where it already runs on one thread, as numesh.host.runtime sets it: asking each library
    its count costs ~1 µs, a threadpoolctl limit and its restore tens of µs on the main
    thread while the others wait, at every block call."""
    global _blas, _threads
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas")
    saved = _threads
    _threads = 1
    try:
        if all(lib.num_threads == 1 for lib in _blas.lib_controllers):
            yield
        else:
            with _blas.limit(limits=1):
                yield
    finally:
        _threads = saved


def over_batch(fn: Callable[[slice], T], n: int, k: int | None = None) -> list[T]:
    """`fn(rows)` for `k` (default: one per thread) contiguous chunks of range(n); the results
    in row order.

    Each call runs single-threaded (BLAS included), so `fn` may do a whole sub-computation
    on its rows, but it must not communicate (MPI calls stay on the main thread). The chunks
    follow the thread count: a caller whose numbers must not depend on it hands in fixed
    tiles (`runs_for`, `tree_sum`) rather than rows."""
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
# the same row can round differently in a call of 64 rows and in one of 1000. So what numesh
# splits is cut into tiles chosen from the shape and the cores this rank may use on its
# machine (`cores`: the machine's cores over the ranks on it, a fact of the machine and the
# launch), never from the thread count (`tiles`); the thread count only decides which
# thread computes which tile. Never more tiles than cores: more could not run at once, and
# each tile costs a few % of a large matmul's speed on one thread (it packs the right-hand
# side again: benchmarks/bench_tiles.py). So:
#
# - `matmul` makes one BLAS call per fixed tile of rows;
# - a block's tokens are cut into fixed pieces of whole sequences (numesh.nn.walk); inside
#   a block call, every matmul over token rows makes its calls piece by piece, and every sum
#   over tokens (weight, bias and LayerNorm gradients: `token_sum`) adds the pieces' sums in
#   one fixed pairwise tree. One thread runs the block on all pieces at once, several
#   threads on runs of them (`runs_for`, each an aligned subtree), and the runs' results are
#   added by the same tree (`tree_sum`): the same calls and the same additions either way.
#
# Element-wise and per-row work (`over_rows`) needs no tiles: its rows never meet, and each
# row gets the same operations in any chunk. Together: the same bits for any thread count,
# on any BLAS kernel (tests/test_threads.py, rerun under four kernel families by
# tests/test_blas_kernels.py).

_cores = max(1, os.cpu_count() or 1)


def set_cores(n: int) -> int:
    """The cores this rank may use (numesh.host.runtime.set_blas_threads: the machine's cores over
    the ranks on it), which bound how finely work is tiled; returns n."""
    global _cores
    _cores = max(1, int(n))
    return _cores


def cores() -> int:
    return _cores


@functools.lru_cache(maxsize=1024)
def tiles(n: int, min_rows: int, most: int) -> tuple[slice, ...]:
    """The fixed tiles of range(n): the most contiguous, near-equal tiles of at least
    `min_rows` rows each, as a power of two (balanced over 2, 4, 8, ... threads) and at
    most `most`. A function of its arguments only."""
    count = 1
    while 2 * count <= most and n // (2 * count) >= max(1, min_rows):
        count *= 2
    return tuple(_bounds(n, count))


def over_tiles(fn: Callable[[int], T], count: int, k: int | None = None) -> list[T]:
    """`fn(i)` for each of `count` tiles, dealt to at most `k` threads (default: all) in
    contiguous runs; the results in tile order. BLAS stays as it is (single-threaded under
    numesh.host.runtime)."""
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
# rows (each call packs the right-hand side again), at 64 rows 10-15 %
# (benchmarks/bench_tiles.py measures it).
TILE_ROWS = 256
# Columns of a matmul tile, when too few rows make one row tile: each call packs the
# left-hand side again, a [M, K] with M small, so narrower tiles cost little.
TILE_COLS = 128
# A single-threaded sgemm does ~1 MFLOP in 20 µs (50 GFLOP/s, one AVX2 core), the cost of a
# hand-off: each thread gets at least 4 MFLOP, else the tiles run on the caller's thread.
MIN_CHUNK_FLOPS = 4e6

_local = threading.local()  # .pieces: the token rows of each piece of the block call on this thread,
# () inside `token_sum` (still in a run, but not over those rows), None outside a run


@contextlib.contextmanager
def token_pieces(rows: tuple[slice, ...] | None) -> Iterator[None]:
    """Inside, matmuls over `rows[-1].stop` token rows make their calls piece by piece, every
    matmul one call per piece (no tiles: see `matmul`), and `token_sum` adds piece by piece
    (this thread only; None: no pieces)."""
    saved = getattr(_local, "pieces", None)  # None on a thread that never set it
    _local.pieces = rows
    try:
        yield
    finally:
        _local.pieces = saved


def in_pieces() -> bool:
    """Whether this thread is inside a block run as pieces (`token_pieces`): its calls then
    see a run of the pieces, whose size follows the thread count."""
    return bool(getattr(_local, "pieces", None))


def _pieces(n: int) -> tuple[slice, ...]:
    """The pieces of n token rows inside `token_pieces`, else the one piece range(n)."""
    rows = getattr(_local, "pieces", None)
    return rows if rows and rows[-1].stop == n else (slice(0, n),)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a [M, K] @ b [K, N], into `out` where given (a weight gradient's place in the
    optimiser's buffer); one single-threaded BLAS call per fixed tile of rows (`tiles` of
    TILE_ROWS, at most `cores`), the tiles spread over the threads when each thread gets
    enough work: the same bits for any thread count. Too few rows for two tiles (a weight
    gradient x.T @ dy of a narrow layer: M is its input width) cuts the columns instead, by
    the same rule. Inside a block run as pieces (`token_pieces`) one call per piece over
    token rows, else one call: the runs of pieces are already the threads' split, and more
    calls on one thread only cost (each packs an operand again: 5-10 % at a step's shapes,
    benchmarks/bench_tiles.py)."""
    m = a.shape[0]
    n = b.shape[1]
    if out is None:
        out = aligned.empty((m, n), np.result_type(a, b))  # the attention reads q, k, v where the QKV product left them
    if getattr(_local, "pieces", None) is not None:  # in a run ((): inside `token_sum`)
        for p in _pieces(m):
            matmul_into(a[p], b, out[p])
        return out
    rows = tiles(m, TILE_ROWS, _cores)
    parts = ([(r, slice(None)) for r in rows] if len(rows) > 1
             else [(slice(None), c) for c in tiles(n, TILE_COLS, _cores)])
    if len(parts) == 1:
        matmul_into(a, b, out)
        return out

    def tile(i: int) -> None:
        r, c = parts[i]
        matmul_into(a[r], b[:, c], out[r, c])

    over_tiles(tile, len(parts), _flops([(a, b)]))
    return out


def _shared_row_tiles(products: list[tuple[np.ndarray, np.ndarray]]) -> tuple[slice, ...]:
    """The row tiles `matmul` cuts each of these products into, where it cuts all of them
    into the same two or more (their A's have one row count, outside a block's pieces); else ()."""
    m = products[0][0].shape[0]
    if getattr(_local, "pieces", None) is not None or any(a.shape[0] != m for a, _ in products):
        return ()
    rows = tiles(m, TILE_ROWS, _cores)
    return rows if len(rows) > 1 else ()


def _flops(products: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """The most threads these products' FLOPs are worth: MIN_CHUNK_FLOPS each."""
    return int(sum(2.0 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in products) // MIN_CHUNK_FLOPS)


def matmuls(products: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """[`matmul`(a, b) for each (a, b)] in one hand-off to the threads: each thread takes its
    row tile of every product, so the tiles (and the bits) are `matmul`'s and the threads
    wait for each other once, not once a product (q, k and v's projections, SwiGLU's gate
    and up: each hand-off costs a start-up lag and the threads' imbalance)."""
    rows = _shared_row_tiles(products)
    if not rows:
        return [matmul(a, b) for a, b in products]
    outs = [aligned.empty((a.shape[0], b.shape[1]), np.result_type(a, b)) for a, b in products]

    def tile(i: int) -> None:
        for (a, b), out in zip(products, outs):
            matmul_into(a[rows[i]], b, out[rows[i]])

    over_tiles(tile, len(rows), _flops(products))
    return outs


def matmul_sum(products: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Σ a @ b over the products, added in order (`matmul` of the first, then `add_into` of
    each other's `matmul`: the same bits), in one hand-off: each thread makes its row tile
    of every product and adds it while the tile is in cache."""
    rows = _shared_row_tiles(products)
    if not rows:
        out = matmul(*products[0])
        for a, b in products[1:]:
            add_into(out, matmul(a, b))
        return out
    (a0, b0), n = products[0], products[0][1].shape[1]
    out = aligned.empty((a0.shape[0], n), np.result_type(*(x for pair in products for x in pair)))

    def tile(i: int) -> None:
        r = rows[i]
        matmul_into(a0[r], b0, out[r])
        part = aligned.empty((r.stop - r.start, n), out.dtype)
        for a, b in products[1:]:
            matmul_into(a[r], b, part)
            out[r] += part

    over_tiles(tile, len(rows), _flops(products))
    return out


def whole(n: int) -> bool:
    """Whether `token_sum` over n token rows is one call over all of them (no pieces here)."""
    return len(_pieces(n)) == 1


def token_sum(fn: Callable[[slice], Any], n: int) -> Any:
    """`fn(rows) -> array or tuple of arrays` (a sum over those token rows) for each of
    `token_pieces`' pieces of the n token rows, added in the fixed pairwise tree ((0+1) +
    (2+3), ... (`_pairwise`); `fn(range(n))` outside pieces."""
    pieces = _pieces(n)
    if len(pieces) == 1:
        return fn(pieces[0])
    assert len(pieces) & (len(pieces) - 1) == 0, "token pieces must be a power of two"
    # fn's own matmuls are not over these token rows, but still in the run: () says both
    saved, _local.pieces = _local.pieces, ()
    try:
        sums = [fn(r) for r in pieces]
    finally:
        _local.pieces = saved
    return _pairwise(sums)


# ---------------------------------------------------------------------------------------
# A block run as runs of fixed pieces, one run per thread


class RowChunks(NamedTuple):
    """Context of a computation run as runs of pieces of rows (`runs_for`): each run's rows, its
    pieces (rows relative to the run) and its own context."""

    rows: tuple[slice, ...]
    pieces: tuple[tuple[slice, ...], ...]
    parts: tuple


def runs_for(n_threads: int, pieces: tuple[slice, ...]) -> tuple[tuple[slice, tuple[slice, ...]], ...]:
    """The pieces (a power of two of them) dealt to `n_threads` threads: a power of two of
    runs of equally many pieces, at most one per thread, so each run is a whole subtree of
    the pieces' tree. Each run's rows and its pieces relative to the run."""
    count = len(pieces)
    assert count & (count - 1) == 0, "pieces must be a power of two"
    k = 1
    while 2 * k <= min(n_threads, count):
        k *= 2
    per = count // k
    out = []
    for r in range(k):
        ps = pieces[r * per:(r + 1) * per]
        s0 = ps[0].start
        out.append((slice(s0, ps[-1].stop), tuple(slice(p.start - s0, p.stop - s0) for p in ps)))
    return tuple(out)


def _over_runs(fn: Callable[[int], T], n: int) -> list[T]:
    """`fn(i)` for each of n runs (or leaves), dealt to the threads in contiguous runs,
    single-threaded inside (`over_batch`); the results in order."""
    return [y for ys in over_batch(lambda r: [fn(i) for i in range(r.start, r.stop)], n) for y in ys]


class _Rows:
    """The runs' outputs gathered by rows into one array, each run copying its own rows on
    its own thread as it finishes (a concatenation after the threads met ran on one thread
    while the others waited: a block's [B, T, C] output, twice a layer). Made by the first
    run to finish, shaped from its output."""

    def __init__(self, rows: tuple[slice, ...]) -> None:
        self.rows, self.array, self._lock = rows, None, threading.Lock()

    def put(self, i: int, y: np.ndarray) -> None:
        with self._lock:
            if self.array is None:
                self.array = np.empty((self.rows[-1].stop, *y.shape[1:]), y.dtype)
        self.array[self.rows[i]] = y


def _gathered(rows: tuple[slice, ...], fn: Callable[[int], tuple[np.ndarray, Any]]) -> tuple[np.ndarray, list]:
    """(the runs' first outputs gathered by rows, their second outputs in order) of `fn(i)`
    for each run i (rows[i] its rows)."""
    if len(rows) == 1:
        y, other = fn(0)
        return y, [other]
    out = _Rows(rows)

    def run(i: int) -> Any:
        y, other = fn(i)
        out.put(i, y)
        return other

    others = _over_runs(run, len(rows))
    return out.array, others


def chunked_fwd(fn: Callable[[slice, tuple[slice, ...]], tuple[np.ndarray, Any]],
                pieces: tuple[slice, ...]) -> tuple[np.ndarray, RowChunks]:
    """`fn(rows, pieces) -> (y, ctx)` for each run of `pieces`: y gathered by rows."""
    rs = runs_for(_threads, pieces)
    y, ctxs = _gathered(tuple(r for r, _ in rs), lambda i: fn(*rs[i]))
    return y, RowChunks(tuple(r for r, _ in rs), tuple(p for _, p in rs), tuple(ctxs))


def chunked_bwd(fn: Callable[[Any, slice, tuple[slice, ...]], tuple[np.ndarray, Any]],
                ctx: RowChunks) -> tuple[np.ndarray, RowChunks]:
    """`fn(run ctx, rows, pieces) -> (dx, next ctx)` for each run of `ctx`: dx gathered by rows."""
    dx, nxt = _gathered(ctx.rows, lambda i: fn(ctx.parts[i], ctx.rows[i], ctx.pieces[i]))
    return dx, RowChunks(ctx.rows, ctx.pieces, tuple(nxt))


def chunked_sum(fn: Callable[[Any, tuple[slice, ...]], Any], ctx: RowChunks, out: Any = None) -> Any:
    """`fn(run ctx, pieces) -> tree` for each run, the runs' trees added as the top of the
    pieces' pairwise tree (`tree_sum`): the same bits whichever thread ran which run; the
    last addition into `out` where given (`_pairwise`)."""
    return tree_sum(lambda i: (None, fn(ctx.parts[i], ctx.pieces[i])), len(ctx.rows), out)[1]


def chunked_bwd_sum(fn: Callable[[Any, slice, tuple[slice, ...]], tuple[np.ndarray, Any]],
                    ctx: RowChunks, out: Any = None) -> tuple[np.ndarray, Any]:
    """`fn(run ctx, rows, pieces) -> (dx, tree)` for each run: dx gathered by rows, the
    trees added as `chunked_sum` adds them (into `out` where given)."""
    dx, trees = _gathered(ctx.rows, lambda i: fn(ctx.parts[i], ctx.rows[i], ctx.pieces[i]))
    return dx, _pairwise(trees, out)


def _add(a: Any, b: Any) -> Any:
    """a += b over two trees, into a's arrays (fresh arrays of one leaf's result)."""
    if isinstance(a, np.ndarray):
        return add_into(a, b)
    if isinstance(a, tuple):
        return tuple(_add(x, y) for x, y in zip(a, b, strict=True))
    tree_map(add_into, a, b)
    return a


def _add_to(out: Any, a: Any, b: Any) -> Any:
    """out = a + b over trees with the same leaves in the same order (`tree_leaves`), into
    out's arrays; returns `out` itself. The leaves' sums are `_add`'s, so the same bits."""
    la, lb, lo = tree_leaves(a), tree_leaves(b), tree_leaves(out)
    if not len(la) == len(lb) == len(lo) or any(o.shape != x.shape or o.shape != y.shape
                                                 for x, y, o in zip(la, lb, lo)):
        raise ValueError("the sum's destination is not shaped like the trees it adds")
    flat = [_flat(o, x, y) for x, y, o in zip(la, lb, lo)]
    total = sum(o.size for o in lo)
    if _threads == 1 or not worth_splitting(total) or any(f is None for f in flat):
        for x, y, o in zip(la, lb, lo):
            add_into(x, y, out=o)
        return out
    starts = np.cumsum([0] + [o.size for o in lo])

    def part(r: slice) -> None:  # the leaves' values r.start..r.stop, counted through them in order
        for i in range(int(np.searchsorted(starts, r.start, "right")) - 1, len(lo)):
            if starts[i] >= r.stop:
                break
            lo_i, hi_i = max(r.start, starts[i]) - starts[i], min(r.stop, starts[i + 1]) - starts[i]
            fo, fa, fb = flat[i]
            np.add(fa[lo_i:hi_i], fb[lo_i:hi_i], out=fo[lo_i:hi_i])

    over_rows(part, total, ELEMENTWISE_CHUNK)  # one hand-off for every leaf, small ones included
    return out


def _flat(a: np.ndarray, *rest: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """1-D views of a and the rest where all are C-contiguous and of one shape, else None."""
    if any(x.shape != a.shape or not x.flags.c_contiguous for x in rest) or not a.flags.c_contiguous:
        return None
    return a.reshape(-1), *(x.reshape(-1) for x in rest)


# Elements a thread takes at least in `add_into`, `copy_into` and `scale_into`: on the
# 2-vCPU VMs a hand-off (0.08-0.35 ms, the module's text) costs what one pass over a few
# hundred thousand floats does, so the default model's units (~200K values) stay on one
# thread and SmolLM2's (3.5M) are split.
ELEMENTWISE_CHUNK = 1 << 18


def worth_splitting(n: int) -> bool:
    """Whether n values of element-wise work are enough to split over the threads: at least
    two ELEMENTWISE_CHUNKs, else one thread does it (a hand-off would cost more)."""
    return n >= 2 * ELEMENTWISE_CHUNK


def _flat_pair(a: np.ndarray, *rest: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """1-D views of a and the rest where all are C-contiguous, of one shape and large enough
    to split over the threads (`worth_splitting`); else None."""
    return _flat(a, *rest) if worth_splitting(a.size) else None


def add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a += b, returning a, or out = a + b, returning out; a large one's elements split over
    the threads (`over_rows`: element-wise, so the same bits on any thread count). The sums
    of a step's weight gradients over the threads' runs (`tree_sum`) ran on one thread
    while the others waited: ~1 % of a SmolLM2 step at 512 × 4."""
    out = a if out is None else out
    flat = _flat_pair(out, a, b)
    if flat is None or _threads == 1:
        np.add(a, b, out=out)
        return out
    fo, fa, fb = flat
    over_rows(lambda r: np.add(fa[r], fb[r], out=fo[r]), fo.size, ELEMENTWISE_CHUNK)
    return out


def scale_into(x: np.ndarray, factor: float) -> None:
    """x *= factor, a large one's elements split over the threads as in `add_into` (the
    optimiser's gradient clipping: a pass over every gradient on one thread before)."""
    flat = _flat_pair(x, x)
    if flat is None or _threads == 1:
        x *= factor
        return
    fx = flat[0]
    f = fx.dtype.type(factor)  # x's precision, as x *= factor computes it
    over_rows(lambda r: np.multiply(fx[r], f, out=fx[r]), fx.size, ELEMENTWISE_CHUNK)


def zero_into(x: np.ndarray) -> np.ndarray:
    """x[...] = 0, returning x; a large one's elements split over the threads as in
    `add_into` (buffers that kernels add into, zeroed on the main thread alone before, at
    batch 1: `benchmarks/profile_train.py --preset smollm2-4 --block-size 2048 --batch-size 1`)."""
    flat = _flat_pair(x, x)
    if flat is None or _threads == 1:
        x.fill(0)
        return x
    fx = flat[0]
    over_rows(lambda r: fx[r].fill(0), fx.size, ELEMENTWISE_CHUNK)
    return x


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, a large one's elements split over the threads as in `add_into`."""
    flat = _flat_pair(dst, src)
    if flat is None or _threads == 1:
        dst[...] = src
        return
    fd, fs = flat
    over_rows(lambda r: np.copyto(fd[r], fs[r]), fd.size, ELEMENTWISE_CHUNK)


def _pairwise(sums: list, out: Any = None) -> Any:
    """The trees of `sums` added in the fixed pairwise tree: (0+1) + (2+3), ..., level by
    level, an odd last one carried up as it is; None for none. With `out` (a tree with the
    sums' leaves, e.g. views of the optimiser's gradient buffer: `ParamUnits.grad_slot`)
    the last addition writes into it and `out` itself is returned, the same bits; with one
    tree there is no addition and that tree is returned."""
    while len(sums) > 2 or (len(sums) == 2 and out is None):
        sums = [_add(sums[i], sums[i + 1]) if i + 1 < len(sums) else sums[i] for i in range(0, len(sums), 2)]
    if len(sums) == 2:
        return _add_to(out, sums[0], sums[1])
    return sums[0] if sums else None


def tree_sum(fn: Callable[[int], tuple[Any, Any]], n: int, out: Any = None) -> tuple[list, Any]:
    """`fn(i) -> (side, tree)` for i in range(n), dealt to the threads in contiguous runs
    (`over_batch`): ([side for each i], the trees added by `_pairwise`, into `out` where
    given), the same bits whichever thread computed which."""
    parts = _over_runs(fn, n)
    return [side for side, _ in parts], _pairwise([t for _, t in parts], out)
