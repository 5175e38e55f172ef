"""Per-process set-up shared by every command: BLAS threads per rank and clean failure.

Ranks × BLAS threads should equal the cores of a node, and an MPI job must never hang:
a user error (the same on every rank) exits every rank with one message, while an
unexpected exception on one rank prints a rank-tagged traceback and aborts the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from numesh.base.errors import ConfigError, Interrupted, abort_job
from numesh.base.files import os_reason, write_atomic
from numesh.host import blas
from numesh.host.threads import over_batch, set_cores, set_threads

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
    """Give this rank `threads` threads so that ranks on this node × threads = its cores:
    numesh's intra-op threads, with BLAS on one thread (numesh splits matmuls itself, see
    numesh/threads.py: two thread pools on the same cores fought). Returns the threads.

    An explicit `threads`, or OMP/OPENBLAS_NUM_THREADS in the environment, wins; one of those
    set to anything but a whole number >= 1 is a ConfigError naming it."""
    global _LIMITER
    cores = set_cores(max(1, (os.cpu_count() or 1) // ranks_per_node(comm)))  # tiles follow cores, not threads
    if threads is None:
        threads = env_threads()
    if threads is None:
        threads = cores
    _LIMITER = threadpool_limits(limits=1, user_api="blas")
    return set_threads(threads, spin=threads <= cores)  # spinning on shared cores would slow the other thread


def env_threads() -> int | None:
    """The thread count the environment asks for: the first of OMP_NUM_THREADS,
    OPENBLAS_NUM_THREADS, MKL_NUM_THREADS that is set and not empty, else None. A value that is
    not a whole number >= 1 is a ConfigError naming the variable (it was once silently ignored),
    in any of them: the BLAS libraries read the later ones too."""
    counts = []
    for var in _THREAD_ENV:
        value = os.environ.get(var, "").strip()
        if not value:
            continue
        if not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ConfigError(f"{var}={os.environ[var]!r} must be a whole number >= 1 (threads per rank): "
                              f"set it to one or unset it")
        counts.append(int(value))
    return counts[0] if counts else None


# One process stops scaling early (issue #14, a 16-core Xeon, default model: 83/51/47/70/102
# ms at 1/2/4/8/16 threads) while dp ranks at one thread each scale almost linearly: the
# GIL-bound glue of a step does not split over threads, it does over ranks. Already at 2
# (the 2-core VM, quiet, bench_node.py): baby model, batch 64, dp=2 7.0 s a step against 9.1 s
# for one process on 2 threads; default model 22.7k tokens/s (dp=2) against 15.5k.
HINT_MIN_THREADS = 2


def dp_hint(world_size: int, threads: int, batch_size: int, micro_batches: int = 1) -> str | None:
    """The one-line hint `numesh train` prints when one process runs on many threads and a dp
    mesh of ranks would be faster: the largest dp ≤ threads that divides the batch. None when
    it does not apply (several ranks already, few threads, or no dp divides the batch)."""
    if world_size != 1 or threads < HINT_MIN_THREADS:
        return None
    dps = [d for d in range(2, threads + 1) if batch_size % (d * micro_batches) == 0]
    if not dps:
        return None
    dp = max(dps)
    per = threads // dp
    return (f"hint: one process on {threads} threads; `mpirun -n {dp} numesh train --mesh dp={dp} ...` "
            f"({dp} ranks x {per} thread{'s' if per > 1 else ''}) is usually faster "
            "(python benchmarks/bench_node.py measures both on this machine)")


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed blocks for reuse instead of returning them to the kernel.

    A training step allocates and frees the same activation-sized arrays every time;
    with glibc's defaults each one is a fresh mmap, so every step pays thousands of page
    faults and zero-fills (`python benchmarks/bench_train.py --malloc glibc` against the
    default `--malloc` shows the page faults per step on this machine). Same
    effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_/MALLOC_TOP_PAD_ in the environment.

    The top pad is for numesh's worker threads: each allocates in an arena of its own, made
    of heaps of at most 64 MiB, and glibc unmaps a heap other than an arena's first as soon
    as it is empty, whatever the trim threshold, unless the arena's top pad would not fit
    beside it. A block run in pieces frees its worker's activations at the end of each
    backward, so without the pad a step could map, fault in and unmap the same memory again,
    in some runs and not others, as the heaps happened to lie (tests/test_malloc.py shows
    the mechanism; `benchmarks/bench_llama.py` prints the page faults per step)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return (bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, (1 << 31) - 1))
                and bool(libc.mallopt(m_top_pad, 64 << 20)))
    except (OSError, AttributeError):
        return False


def configure_process(threads: int | None = None, comm: MPI.Comm | None = None) -> int:
    """Per-rank set-up before heavy work: BLAS threads and allocator reuse. Returns the threads.
    A bad NUMESH_KERNELS, NUMESH_BLAS or thread variable in the environment is a ConfigError here."""
    from numesh.host.kernels import check_mode

    check_mode()
    blas.check_mode()
    blas.name()  # MKL, where it is the choice, loads now, before the threads ask for it
    keep_freed_memory()
    return set_blas_threads(threads, comm)


def gemm_flops(m: int, k: int, n: int, dtype=np.float32, repeats: int = 5, split: bool = False) -> float:
    """Best throughput (FLOP/s) of an [m, k] @ [k, n] multiply over `repeats` tries, after a
    warm-up. With `split`, the rows are spread over numesh's threads with BLAS on one thread
    in each (`over_batch`), as a block runs when split over threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    out = np.empty((m, n), dtype)

    def rows(r: slice) -> None:
        blas.matmul_into(a[r], b, out[r])  # the BLAS numesh's own GEMMs run on

    def once() -> None:
        if split:
            over_batch(rows, m)
        else:
            rows(slice(0, m))

    once()
    best = float("inf")
    # at least `repeats` tries and ~20 ms, so a small GEMM's timer noise averages out
    for _ in range(repeats):
        t0 = time.perf_counter()
        count = 0
        while True:
            once()
            count += 1
            dt = time.perf_counter() - t0
            if dt > 0.02 / repeats:
                break
        best = min(best, dt / count)
    return 2.0 * m * k * n / best


# ---------------------------------------------------------------------------------------
# MFU's peak: one core's matmul rate, the best reading kept per machine, times the cores the job uses


def peak_cache_path() -> Path:
    """Where one core's peak is cached: $NUMESH_CACHE_DIR, else $XDG_CACHE_HOME/numesh, else
    ~/.cache/numesh; the file `peak_flops.json`. Delete it to measure again."""
    base = os.environ.get("NUMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "numesh")
    return Path(base) / "peak_flops.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def machine_key(dtype) -> str:
    """What a cached peak belongs to: the CPU, the BLAS library and the kernels it runs
    (OPENBLAS_CORETYPE changes them), and the dtype."""
    libs = blas.loaded_libraries()
    lib = f"{libs[0]['internal_api']} {libs[0]['version']} {libs[0].get('architecture')}" if libs else "no BLAS"
    if blas.name() == "mkl":  # the peak is numesh's GEMM's (gemm_flops)
        lib = blas.describe()
    return f"{_cpu_model()} | {platform.machine()} | {lib} | {np.dtype(dtype).name}"


def core_peak_flops(dtype=np.float32) -> tuple[float, str]:
    """One core's matmul peak: a 768³ GEMM on one BLAS thread, the best of several tries,
    kept in `peak_cache_path()` as the best ever read on this machine. Other work on the
    cores only ever makes a reading lower, so a peak first measured under load (which made
    MFU read above 1) is raised by a later, quieter reading: each start checks with a few
    tries and keeps the higher. (FLOP/s, where it came from)."""
    path, key = peak_cache_path(), machine_key(dtype)
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    old = cache.get(key) if isinstance(cache.get(key), dict) and cache[key].get("flops", 0) > 0 else None
    with threadpool_limits(limits=1, user_api="blas"):
        now = gemm_flops(768, 768, 768, dtype, repeats=3 if old else 10)
    if old is not None and old["flops"] >= now:
        return float(old["flops"]), f"cached in {path} on {old.get('date', '?')}"
    cache[key] = {"flops": now, "date": time.strftime("%Y-%m-%d")}
    what = "measured now" if old is None else f"measured now, above the {old['flops'] / 1e9:.1f} GFLOP/s cached"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(cache, indent=1))
        return now, f"{what}, cached in {path}"
    except OSError as e:
        return now, f"{what}; not cached ({os_reason(e)})"


def host_cores_used(cores: int, rank_threads: list[int]) -> int:
    """Cores the job's ranks on one host can keep busy: their threads, but never more than
    the host has (ranks that share cores share their peak)."""
    return max(1, min(cores, sum(rank_threads)))


def job_peak_flops(comm: MPI.Comm, n_threads: int, dtype=np.float32) -> tuple[float, str]:
    """MFU's denominator: over the job's hosts, the cores its ranks use there times one core's
    peak on that host (`core_peak_flops`, measured by one rank per host). Collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.Get_rank() == 0
        per_core, source = node.bcast(core_peak_flops(dtype) if leader else None, root=0)
        used = host_cores_used(os.cpu_count() or 1, node.allgather(n_threads))
    finally:
        node.Free()
    total = comm.allreduce(used * per_core if leader else 0.0)
    cores, hosts = comm.allreduce(used if leader else 0), comm.allreduce(int(leader))
    return total, (f"{cores} core(s) on {hosts} host(s) x one core's {np.dtype(dtype).name} matmul peak "
                   f"{per_core / 1e9:.1f} GFLOP/s on {blas.describe()}, {source}")


def rank_ranges(ranks: list[int]) -> str:
    """"0-3,8,10-11": sorted rank numbers, consecutive ones as ranges."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def describe_hosts(hostnames: list[str]) -> str:
    """One line: each host (in the order of its first rank) with its ranks, from each rank's hostname."""
    hosts: dict[str, list[int]] = {}
    for rank, name in enumerate(hostnames):
        hosts.setdefault(name, []).append(rank)
    n, h = len(hostnames), len(hosts)
    listed = ", ".join(f"{name} ({rank_ranges(ranks)})" for name, ranks in hosts.items())
    return f"{n} rank{'s' if n > 1 else ''} on {h} host{'s' if h > 1 else ''}: {listed}"


def host_map(comm: MPI.Comm) -> str:
    """`describe_hosts` of the job's ranks (collective)."""
    return describe_hosts(comm.allgather(socket.gethostname()))


def is_root() -> bool:
    return MPI.COMM_WORLD.Get_rank() == 0


def log(msg: str) -> None:
    """A log line on rank 0's stderr."""
    if is_root():
        print(msg, file=sys.stderr, flush=True)


def guarded(fn: Callable[[], T], user_errors: tuple[type[BaseException], ...] = (ValueError,)) -> T:
    """Run `fn`; a user error exits with status 2 and one line, anything else aborts every rank.

    An `Interrupted` run (every rank stopped at the same step, see numesh/interrupt.py)
    exits 128 + its signal on every rank (130 for SIGINT, 143 for SIGTERM) with its one line
    on rank 0, a `Preempted` one 75. A bare KeyboardInterrupt (a Ctrl-C
    outside the training loop, where no rank agreed to stop) exits 130 too, aborting the job
    when it has several ranks, since a peer may be blocked waiting for this one. Output
    piped into a reader that stops early (`| head`) exits 141 quietly, as a shell reports it."""
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
        raise SystemExit(e.exit_code) from None  # 75 when preempted (errors.Preempted)
    except BrokenPipeError:  # `numesh sample ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError):  # stdout's buffered rest would fail again at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None  # 128 + SIGPIPE, what a shell reports for a process cut off so
    except KeyboardInterrupt:
        if comm.Get_size() > 1:
            print(f"[rank {comm.Get_rank()}] interrupted", file=sys.stderr, flush=True)
            abort_job(comm, Interrupted.EXIT_CODE)
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(Interrupted.EXIT_CODE) from None
    except SystemExit:
        raise
    except BaseException:
        rank = comm.Get_rank()
        lines = traceback.format_exc().rstrip().splitlines()
        print("\n".join(f"[rank {rank}] {line}" for line in lines), file=sys.stderr, flush=True)
        if comm.Get_size() > 1:
            abort_job(comm, 1)
        raise SystemExit(1) from None
