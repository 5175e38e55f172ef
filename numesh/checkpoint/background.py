"""Checkpoints written while training goes on (`numesh train --ckpt-async`).

A synchronous save stops every rank while its files are written. Here the main thread only
takes the snapshot at the step boundary: the state's trees, which `train_state` already
copies out of the optimiser's buffers (so training may change those from the next step
on), and the list of blocks this rank writes. Everything slow runs on threads:

1. each rank's writer checks its blocks are finite and writes them, with their sha256, to
   the `.tmp-` directory (`save.write_blocks`, as a synchronous save does);
2. once every rank's writer is done, the file records are gathered on rank 0, whose
   finisher thread writes meta.json, renames the directory into place and only then moves
   `latest` (`save.finish_on_root`, as a synchronous save does);
3. once that is done, every rank learns the outcome (a CheckpointError on every rank if any
   rank failed).

The gather and the outcome are collective, so they run on the main thread, at the first
step boundary where every rank is ready for them (`AsyncCheckpoints.poll`: one small
all-reduce a step while a save is in flight), or when the next save or the end of the run
waits for the save in flight. The threads make no MPI call. A rank killed in step 1 or 2
leaves a `.tmp-` directory that no `latest` points to: the previous checkpoint stays `latest`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
from mpi4py import MPI

from numesh.base.errors import CheckpointError
from numesh.checkpoint.model import gpt_leaves
from numesh.checkpoint.save import Block, Written, finish_on_root, prepare_save, rank_blocks, write_blocks
from numesh.checkpoint.state import TrainState


def _thread(target: Callable[[], None]) -> threading.Thread:
    """`target` on a daemon thread. Not a lower CPU priority: a thread holding the GIL while
    descheduled would stall the training thread that waits for it."""
    t = threading.Thread(target=target, name="numesh-ckpt-writer", daemon=True)
    t.start()
    return t


class BackgroundSave:
    """One checkpoint of `state` on its way to disk, this rank's part of it (collective to
    make: rank 0 prepares the temporary directory). `ready()` says whether this rank can
    take the next collective step, `advance()` takes it (every rank together)."""

    def __init__(self, state: TrainState, out_dir: str | Path, keep: int | None):
        self.comm, self.rank, self.step, self.keep = state.mesh.world, state.mesh.rank, state.step, keep
        self.tmp, self.final = prepare_save(state, out_dir)
        self.written: list[Written] = []
        self.error: str | None = None
        self.gathered = False  # step 2 of the module docstring under way (every rank)
        self.outcome: tuple[str, str] | None = None  # rank 0's, once its finisher is done
        self._finisher: threading.Thread | None = None
        blocks: list[Block] = []
        try:  # views of the state's trees, which are copies of the live buffers already
            blocks = rank_blocks(state, gpt_leaves(state.model))
        except ValueError as e:  # reported on every rank by the outcome
            self.error = f"rank {self.rank}: cannot write checkpoint {self.tmp}: {e}"
        # meta.json needs only the state's description, not its trees
        self.state = attrs.evolve(state, trees={g: None for g in state.trees})
        self._writer = _thread(lambda: self._write(blocks))

    def _write(self, blocks: list[Block]) -> None:
        if self.error:
            return
        try:
            if not all(np.isfinite(b.data).all() for b in blocks):  # never becomes latest
                self.error = f"not saving step {self.step}: its parameters or optimiser state are not finite"
                return
            self.written = write_blocks(blocks, self.tmp)
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank
            self.error = f"rank {self.rank}: cannot write checkpoint {self.tmp}: {e}"

    def _finish(self, gathered: list[tuple[list[Written], str | None]]) -> None:
        try:
            self.outcome = finish_on_root(self.state, gpt_leaves(self.state.model), gathered, self.tmp, self.final,
                                          self.keep)
        except Exception as e:  # noqa: BLE001
            self.outcome = ("error", f"cannot finish checkpoint {self.final}: {e}")

    def ready(self) -> bool:
        """This rank is ready for the next collective step: its writer is done, or (once the
        records are gathered) rank 0's finisher is."""
        if not self.gathered:
            return not self._writer.is_alive()
        return self._finisher is None or not self._finisher.is_alive()

    def advance(self) -> Path | None:
        """The next collective step, once every rank is `ready()`: gather the records and
        start rank 0's finisher (None), or announce the outcome (the step directory)."""
        if not self.gathered:
            gathered = self.comm.gather((self.written, self.error), root=0)
            if self.rank == 0:
                self._finisher = _thread(lambda: self._finish(gathered))
            self.gathered = True
            return None
        status, msg = self.comm.bcast(self.outcome if self.rank == 0 else None, root=0)
        if status != "ok":
            raise CheckpointError(msg)
        return self.final

    def finish(self) -> Path:
        """Wait for every step, then the outcome (collective)."""
        while True:
            self._writer.join()
            if self._finisher is not None:
                self._finisher.join()
            if (done := self.advance()) is not None:
                return done

    def join(self) -> None:
        """Wait for this rank's threads, without any collective."""
        self._writer.join()
        if self._finisher is not None:
            self._finisher.join()


class AsyncCheckpoints:
    """At most one `BackgroundSave` in flight, the same one on every rank of `comm`."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.pending: BackgroundSave | None = None

    def start(self, state: TrainState, out_dir: str | Path, keep: int | None = None) -> Path:
        """Wait for the save in flight, then start saving `state`; returns its step directory
        (complete only once finished). Collective."""
        self.wait()
        self.pending = BackgroundSave(state, out_dir, keep)
        return self.pending.final

    def poll(self) -> Path | None:
        """At a step boundary, on every rank: take the save in flight one step further if
        every rank is ready for it; its step directory once installed, else None."""
        if self.pending is None or not self.comm.allreduce(int(self.pending.ready()), op=MPI.MIN):
            return None
        try:
            done = self.pending.advance()
        except CheckpointError:
            self.pending = None
            raise
        if done is not None:
            self.pending = None
        return done

    def wait(self) -> Path | None:
        """Finish the save in flight, if any (collective): its step directory, or None."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.finish()

    def abandon(self) -> None:
        """Let this rank's threads end without any collective (an error is unwinding):
        `latest` moves only if rank 0's finisher was already under way."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None
