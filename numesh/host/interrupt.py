"""Ctrl-C for an MPI job: every rank stops at the same step, or the whole job is aborted.

Python turns SIGINT into a KeyboardInterrupt only when the main thread next runs
bytecode. In a multi-rank job that is fatal: mpiexec forwards the signal to every rank
(and a scheduler may signal one rank alone); the rank that happens to be in Python code
raises and leaves mid-step, while its peer sits in C inside an MPI wait for a message
that never comes, and the job hangs (6 of 6 tries with pp=2, issue #18).

`InterruptWatch` replaces that for the span of a training loop:

- SIGINT and SIGTERM (and the signals `numesh train --save-on-signal` names) only record
  the signal; nothing is raised mid-step.
- `requested()`, called by the loop once per step at the step boundary, is a one-value
  MAX all-reduce over the run's communicator: every rank learns that *some* rank was
  signalled at the same step, so every rank stops there together (and can save a
  checkpoint together, since that is collective too).
- A watchdog thread learns of the signal at once through `signal.set_wakeup_fd` (the C
  signal handler writes the signal number to a pipe even while the main thread is blocked
  in MPI), and aborts the whole job with exit code 130 if the main thread does not reach
  the agreement in time: `grace_s`, or twice the longest step seen so far if that is
  longer, and `save_grace_s` while a checkpoint is being written. So a rank stuck in a
  receive whose peer has died can never hang the job. A second signal (more than
  `repeat_s` after the first, so that one Ctrl-C delivered twice counts once) aborts at once.

It knows nothing of models: the caller decides what to save and what to raise
(`numesh.base.errors.Interrupted`, which `numesh.host.runtime.guarded` turns into exit code 130).
The flag all-reduce goes straight to the communicator, not through the mesh's byte
counter, so the per-step traffic that tests and formulas count is unchanged. The watchdog
calls MPI_Abort from its own thread, which MPI allows under MPI_THREAD_MULTIPLE, the level
mpi4py asks for by default.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Iterator

import numpy as np
from mpi4py import MPI

from numesh.base.errors import Interrupted, abort_job
from numesh.host import startup_signals
from numesh.host.startup_signals import signal_name

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 5.0  # to finish the step in progress and agree (at least: twice the longest step if that is longer)
SAVE_GRACE_S = 120.0  # to write the interrupted step's checkpoint
REPEAT_S = 0.5  # signals this close to the first one are the same Ctrl-C


class InterruptWatch:
    """SIGINT/SIGTERM handling for one training loop on `comm` (every rank makes one), and
    that of any other `signals` given (those --save-on-signal names).

    `start()` installs the handlers and the watchdog (in the main thread only; elsewhere it
    installs nothing but `requested()` still takes part in the all-reduce), `stop()`
    restores the previous handlers and wakeup fd. Also a context manager."""

    def __init__(
        self,
        comm: MPI.Comm,
        grace_s: float = GRACE_S,
        save_grace_s: float = SAVE_GRACE_S,
        repeat_s: float = REPEAT_S,
        signals: tuple[int, ...] = SIGNALS,
        agree: Callable[[np.ndarray], None] | None = None,
    ):
        self.comm, self.grace_s, self.save_grace_s, self.repeat_s = comm, grace_s, save_grace_s, repeat_s
        self.signals = tuple(dict.fromkeys((*SIGNALS, *signals)))
        self.signum = 0  # the first signal this rank received (0: none)
        self.agreed = 0  # the signal every rank stopped for (0: none yet)
        self._lock = threading.Lock()
        self._first_at: float | None = None
        self._deadline: float | None = None  # the watchdog aborts the job after this (monotonic)
        self._step_s = 0.0  # the longest interval between two requested() calls
        self._last_check: float | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._old: dict[int, object] = {}
        self._old_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._flag = np.zeros(1, dtype=np.int32)
        self._agree = agree  # the per-step agreement's all-reduce (MAX, in place) where the caller runs it

    # ------------------------------------------------------------------ install / restore

    def start(self) -> "InterruptWatch":
        if threading.current_thread() is not threading.main_thread() or self._thread is not None:
            return self  # signal handlers can only be set from the main thread
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handler)
        if (early := startup_signals.take()) in self.signals:
            self._got(early)  # it came during start-up (numesh/host/startup_signals.py): as if it came now
        self._thread = threading.Thread(target=self._watch, name="numesh-interrupt-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Restore the handlers and wakeup fd that were there before `start()`; end the watchdog."""
        if self._thread is None:
            return
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        self._closing = True
        r, w = self._pipe  # type: ignore[misc]
        with contextlib.suppress(OSError):
            os.write(w, b"\0")  # wake the watchdog (0 is no signal number)
        self._thread.join(timeout=5.0)
        self._thread = None
        os.close(r)
        os.close(w)
        self._pipe, self._old = None, {}

    def __enter__(self) -> "InterruptWatch":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the training loop's side

    def requested(self) -> int:
        """Collective over `comm`, once per step at the step boundary on every rank: the
        signal some rank received (the largest number if several did), or 0 to go on."""
        now = time.monotonic()
        if self._last_check is not None:
            self._step_s = max(self._step_s, now - self._last_check)
        self._last_check = now
        self._flag[0] = self.signum
        if self._agree is not None:
            self._agree(self._flag)
        elif self.comm.Get_size() > 1:
            self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
        got = int(self._flag[0])
        if got:  # from here on the main thread needs only a little more time, signalled or not
            self.agreed = got
            self._set_deadline(self.grace_s)
        return got

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Give the watchdog's deadline `save_grace_s` while the block writes a checkpoint
        (collective: every rank enters it at the same step boundary).

        A barrier first, under the step's grace: a rank frozen inside the agreement
        all-reduce after sending its flag lets its peers agree without it, and they would
        otherwise wait for it with the save's long deadline instead of the step's."""
        self.comm.Barrier()
        self._set_deadline(self.save_grace_s)
        try:
            yield
        finally:
            self._set_deadline(self.grace_s)

    def _set_deadline(self, seconds: float) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            os.write(self._pipe[1], b"\0")  # type: ignore[index]  # the watchdog re-reads the deadline

    # ------------------------------------------------------------------ the watchdog thread

    def _handler(self, signum: int, frame: object) -> None:
        """The Python-level handler, run by the main thread whenever it next runs bytecode
        (maybe only after a long MPI wait): it records the signal, so that a signal raised
        in the main thread itself is seen at the very next step boundary; the watchdog
        reads the same delivery from the wakeup fd and does the counting and the timing.
        It takes no lock: it may run while the main thread holds one."""
        if not self.signum:
            self.signum = signum

    def _got(self, signum: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._first_at is None:
                self._first_at = now
                if not self.signum:
                    self.signum = signum
                late = now + max(self.grace_s, 2.0 * self._step_s)  # never shorten a save's deadline
                self._deadline = late if self._deadline is None else max(self._deadline, late)
                return
            if now - self._first_at < self.repeat_s:  # type: ignore[operator]
                return
        self._abort(f"second {signal_name(signum)}: aborting the job")

    def _watch(self) -> None:
        r = self._pipe[0]  # type: ignore[index]
        while not self._closing:
            with self._lock:
                deadline = self._deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([r], [], [], timeout)
            except InterruptedError:
                continue
            if self._closing:
                return
            if ready:
                try:
                    data = os.read(r, 512)
                except BlockingIOError:
                    continue
                for signum in data:
                    if signum in self.signals:
                        self._got(signum)
            elif deadline is not None:
                with self._lock:
                    late = self._deadline is not None and time.monotonic() >= self._deadline
                if late:
                    self._abort(
                        f"{signal_name(self.signum or self.agreed)}: the ranks did not stop together in time "
                        "(one may be stuck waiting for a peer); aborting the job"
                    )

    def _abort(self, why: str) -> None:
        if self._closing:
            return
        print(f"[rank {MPI.COMM_WORLD.Get_rank()}] interrupted: {why}", file=sys.stderr, flush=True)
        abort_job(self.comm, Interrupted.EXIT_CODE)

