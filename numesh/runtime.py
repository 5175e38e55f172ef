"""Per-process set-up shared by every command: BLAS threads per rank and clean failure.

Ranks × BLAS threads should equal the cores of a node, and an MPI job must never hang:
a user error (the same on every rank) exits every rank with one message, while an
unexpected exception on one rank prints a rank-tagged traceback and aborts the job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Callable, TypeVar

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from numesh.errors import Interrupted
from numesh.threads import set_threads

T = TypeVar("T")

_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_LIMITER = None


def ranks_per_node(comm: MPI.Comm | None = None) -> int:
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    n = node.Get_size()
    node.Free()
    return n


def set_blas_threads(threads: int | None = None, comm: MPI.Comm | None = None) -> int:
    """Limit BLAS threads (and numesh's intra-op threads) so that ranks on this node ×
    threads = its cores.

    An explicit `threads`, or OMP/OPENBLAS_NUM_THREADS in the environment, wins."""
    global _LIMITER
    if threads is None:
        for var in _THREAD_ENV:
            if os.environ.get(var, "").isdigit():
                threads = int(os.environ[var])
                break
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // ranks_per_node(comm))
    _LIMITER = threadpool_limits(limits=threads, user_api="blas")
    return set_threads(threads)  # the same cores serve numpy's non-BLAS work


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks for reuse instead of returning them to the kernel.

    A training step allocates and frees the same activation-sized arrays every time;
    with glibc's defaults each one is a fresh mmap, so every step pays thousands of page
    faults and zero-fills (measured: ~11,000 faults per step on the default model). Same
    effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ in the environment."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


def configure_process(threads: int | None = None, comm: MPI.Comm | None = None) -> int:
    """Per-rank set-up before heavy work: BLAS threads and allocator reuse. Returns the threads."""
    keep_freed_memory()
    return set_blas_threads(threads, comm)


def matmul_peak_flops(dtype=np.float32, n: int = 512, repeats: int = 5) -> float:
    """This rank's measured matrix-multiply throughput (FLOP/s), the denominator of MFU."""
    a = np.ones((n, n), dtype=dtype)
    out = np.empty_like(a)
    np.matmul(a, a, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, a, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def is_root() -> bool:
    return MPI.COMM_WORLD.Get_rank() == 0


def log(msg: str) -> None:
    """A log line on rank 0's stderr."""
    if is_root():
        print(msg, file=sys.stderr, flush=True)


def guarded(fn: Callable[[], T], user_errors: tuple[type[BaseException], ...] = (ValueError,)) -> T:
    """Run `fn`; a user error exits with status 2 and one line, anything else aborts every rank.

    An `Interrupted` run (every rank stopped at the same step, see numesh/interrupt.py)
    exits 130 on every rank with its one line on rank 0. A bare KeyboardInterrupt (a Ctrl-C
    outside the training loop, where no rank agreed to stop) exits 130 too, aborting the job
    when it has several ranks, since a peer may be blocked waiting for this one."""
    comm = MPI.COMM_WORLD
    try:
        return fn()
    except user_errors as e:
        if comm.Get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Interrupted as e:
        if comm.Get_rank() == 0:
            print(e, file=sys.stderr, flush=True)
        raise SystemExit(Interrupted.EXIT_CODE) from None
    except KeyboardInterrupt:
        if comm.Get_size() > 1:
            print(f"[rank {comm.Get_rank()}] interrupted", file=sys.stderr, flush=True)
            comm.Abort(Interrupted.EXIT_CODE)
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(Interrupted.EXIT_CODE) from None
    except SystemExit:
        raise
    except BaseException:
        rank = comm.Get_rank()
        lines = traceback.format_exc().rstrip().splitlines()
        print("\n".join(f"[rank {rank}] {line}" for line in lines), file=sys.stderr, flush=True)
        if comm.Get_size() > 1:
            comm.Abort(1)
        raise SystemExit(1) from None
