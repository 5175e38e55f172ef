"""Waiting a while for another thread awake, without the GIL, before going to sleep.

numesh's threads hand each other work (numesh.host.threads) and wait for it to finish, dozens
of times a step. A thread that blocks on a lock or a queue goes to sleep, and waking it
takes the kernel, and on a virtual machine whose guest does not poll when idle
(`/sys/module/haltpoll/parameters/guest_halt_poll_ns` 0) the hypervisor too: an empty job's
round trip took 70-220 µs on this project's 2-vCPU VMs. So a waiting thread first spins on
a counter the other thread bumps, for up to SPIN_SECONDS, in compiled code that holds no GIL
(a Python loop would hold it and stall the very thread it waits for), and sleeps only after.
OpenMP runtimes do the same (libgomp's GOMP_SPINCOUNT, Intel's KMP_BLOCKTIME); torch's
threads spin. It is worth it only where each thread has a core of its own, so
numesh.host.threads spins only when told the threads fit the cores.

`Counter` is one int64 that threads bump (`bump`, under the GIL) and others wait to see
change (`wait_change`): an atomic load each try, which the compiler may not hoist out of the
loop. Without numba, `wait_change` returns at once and the callers sleep as before.
"""

from __future__ import annotations

import functools
import platform
import time

import numpy as np

from numesh.host.kernels import HAVE_NUMBA, njit

# The longest a waiter spins before it sleeps. The gaps between a step's hand-offs are
# milliseconds (the glue between ops): spins of 5-20 ms made the default model at T = 2048,
# batch 1, 5-10 % faster on 2 threads, one of 0.5 ms nothing measurable
# (`python benchmarks/bench_threads.py --spin-seconds S`).
SPIN_SECONDS = 0.01

_PAUSE = "llvm.x86.sse2.pause" if platform.machine().lower() in ("x86_64", "amd64") else ""  # x86's spin-wait hint

if HAVE_NUMBA:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _load(typingctx, addr):
        """The int64 at address `addr`, read atomically (acquire): a fresh read every call."""
        sig = types.int64(addr)

        def codegen(context, builder, signature, args):
            if _PAUSE:  # tell the core it spins: it then yields to its SMT sibling and saves power
                pause = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), _PAUSE)
                builder.call(pause, [])
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            return builder.load_atomic(ptr, "acquire", 8)

        return sig, codegen

    @njit(cache=True, nogil=True)
    def _spin(addr, seen, tries):
        """Whether the int64 at `addr` differs from `seen` within `tries` reads."""
        for _ in range(tries):
            if _load(addr) != seen:
                return True
        return False


def warm() -> None:
    """Compile (or load) and time the spin loop now, not inside the first wait."""
    if HAVE_NUMBA:
        _seconds_per_try()


@functools.cache
def _seconds_per_try() -> float:
    """One read of `_spin`'s loop on this core, timed once per process."""
    cell = np.zeros(1, np.int64)
    n = 1 << 16
    _spin(cell.ctypes.data, np.int64(0), n)  # compile, or load from the cache
    t0 = time.perf_counter()
    _spin(cell.ctypes.data, np.int64(0), n)
    return max(time.perf_counter() - t0, 1e-9) / n


class Counter:
    """One int64 that a thread bumps when it has posted or finished work, and that others
    spin on (`wait_change`) for up to `seconds` before they sleep."""

    def __init__(self) -> None:
        self._cell = np.zeros(1, np.int64)
        self._addr = self._cell.ctypes.data

    def value(self) -> int:
        return int(self._cell[0])

    def bump(self) -> None:
        """Under the GIL. Two bumps racing may count once: that only ends a spin early or
        not at all, and every waiter then checks its real condition and sleeps when in doubt."""
        self._cell[0] += 1

    def wait_change(self, seen: int, seconds: float | None = None) -> bool:
        """Spin, without the GIL, until the value is no longer `seen` (True) or about
        `seconds` (default SPIN_SECONDS) pass (False; at once without numba)."""
        seconds = SPIN_SECONDS if seconds is None else seconds
        if not HAVE_NUMBA or seconds <= 0:
            return False
        tries = max(1, int(seconds / _seconds_per_try()))
        return bool(_spin(self._addr, np.int64(seen), tries))
