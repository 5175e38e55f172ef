"""Reading a checkpoint while the job that wrote it keeps saving and pruning.

A job run with `--keep N` moves `OUT/ckpt/latest` to each new step directory and then
deletes the oldest ones. A reader that followed `latest` to step_000010 could find files
of step_000010 gone half-way through its read (issue 31: `numesh sample --ckpt
RUN/ckpt/latest` failed 1 time in 25 with "...npy is not a readable .npy file"), and a
reader that followed the link twice (once for meta.json, once for the arrays, or once
per rank) could mix two steps without any error.

So a reader resolves the path once, to one step directory, and reads only that; in a
collective read rank 0 resolves it and every rank reads the same directory. If the read
fails and the path now leads to another directory, the one being read was pruned under
the reader: read again from the new one, up to TRIES times.

Why not make pruning spare a checkpoint being read? A lease (a file or lock the reader
holds) needs write access to the run directory, which a reader may not have (another
user, a read-only mount); flock is unreliable on the network file systems multi-node runs
keep checkpoints on; and a reader killed while holding a lease would pin a checkpoint
forever. Retrying needs nothing from the writer, and the checks stay as they are: every
file's sha256 is verified, so a read that succeeds is whole (a file deleted after it was
opened stays readable to the process that opened it), and a read that fails in a
directory nobody moved away from is reported as it always was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from numesh.base.errors import CheckpointError
from numesh.checkpoint.format import checkpoint_path

T = TypeVar("T")

# reads that may restart because `latest` moved on; a job saving faster than a whole read
# takes (a tiny model, --ckpt-interval 1, --keep 1) could otherwise keep a reader busy forever
TRIES = 5


def resolve(path: str | Path) -> Path:
    """The directory `path` leads to now (symlinks such as `latest` followed), or `path`
    itself when it leads nowhere, so that the reader's own "no checkpoint at ..." names it."""
    given = Path(path)
    return given.resolve() if given.exists() else given


# the directory a read follows: (its resolved path, device, inode). The inode tells a step
# saved again under the same name (a run resumed from an older step re-saves the later
# ones over their old copies) from the directory that was read.
Pin = tuple[Path, int, int]


def pin(path: str | Path) -> Pin:
    """The directory `path` leads to now (see `Pin`); device and inode 0 where there is none."""
    root = resolve(path)
    try:
        st = os.stat(root)
    except OSError:
        return root, 0, 0
    return root, st.st_dev, st.st_ino


def moved(path: str | Path, was: Pin) -> bool:
    """Whether `path` now leads to another existing directory than the one read (`was`):
    another step, or the same step's name holding a new copy."""
    now = pin(path)
    return now != was and now[0].is_dir()


def _gone(path: str | Path, root: Path, error: CheckpointError) -> CheckpointError:
    """The error to raise for a failed read of `root`: the original one, unless the
    directory itself was removed meanwhile (an explicit step directory that a running job's
    --keep pruned), which says so instead of naming one of its files."""
    if root.exists() or not root.name.startswith("step_"):
        return error
    return CheckpointError(f"{root} was removed while it was being read (a running job's --keep prunes its "
                           f"oldest checkpoints): read {root.parent / 'latest'}, or run with a larger --keep")


def _too_often(path: str | Path, tries: int) -> CheckpointError:
    return CheckpointError(f"{path} moved to a newer checkpoint {tries} times while it was being read (the job "
                           "saves faster than a read takes): read one of its step directories the job keeps "
                           "(raise --keep), or copy one first")


def read_pinned(path: str | Path, read: Callable[[Path], T], tries: int = TRIES) -> T:
    """`read(step_dir)` of the checkpoint directory `path` leads to (e.g. RUN/ckpt/latest),
    read again from the new one when a save moved `path` on and pruned the old one meanwhile
    (see the module docstring). One process."""
    checkpoint_path(path)  # None or '' (the current directory) is one line, not a TypeError
    for _ in range(tries):
        was = pin(path)
        try:
            return read(was[0])
        except CheckpointError as e:
            if not moved(path, was):
                raise _gone(path, was[0], e) from None
    raise _too_often(path, tries)


def _attempt(read: Callable[[Path], T], root: Path) -> tuple[tuple[str, str] | None, T | None]:
    """(error or None, result) of one read on this rank; every error is caught, because
    every rank must reach the collectives that follow, or the others would hang."""
    try:
        return None, read(root)
    except CheckpointError as e:
        return ("checkpoint", str(e)), None
    except Exception as e:  # noqa: BLE001 - see the docstring
        return ("other", f"{type(e).__name__}: {e}"), None


def agreed_error(errors: list[tuple[str, str] | None]) -> Exception:
    """The one error every rank raises, given every rank's (`allgather`ed; at least one):
    the first checkpoint error, else a RuntimeError naming the first rank that failed."""
    for kind, msg in (e for e in errors if e):
        if kind == "checkpoint":
            return CheckpointError(msg)
    rank, (_, msg) = next((i, e) for i, e in enumerate(errors) if e)
    return RuntimeError(f"rank {rank} failed reading the checkpoint: {msg}")


def _verdict(path: str | Path, was: Pin, errors: list[tuple[str, str] | None]) -> Exception | None:
    """On rank 0, after a failed collective read of the directory `was`: None to read again
    (`path` moved on), else the error every rank raises."""
    if moved(path, was):
        return None
    error = agreed_error(errors)
    return _gone(path, was[0], error) if isinstance(error, CheckpointError) else error


def read_pinned_on(comm: Any, path: str | Path, read: Callable[[Path], T], tries: int = TRIES) -> T:
    """`read_pinned` as a collective over `comm`: rank 0 resolves `path`, so that every rank
    reads the same step directory, and decides whether all read again or all raise the same
    error (rank 0's view of the directory, not each rank's at a slightly different moment)."""
    checkpoint_path(path)  # on every rank, before any collective: all raise, none waits
    rank0 = comm.Get_rank() == 0
    for _ in range(tries):
        was = pin(path) if rank0 else None
        root = comm.bcast(was[0] if rank0 else None, root=0)
        error, result = _attempt(read, root)
        errors = comm.allgather(error)
        if not any(errors):
            return result  # type: ignore[return-value]
        verdict = comm.bcast(_verdict(path, was, errors) if rank0 else None, root=0)
        if verdict is not None:
            raise verdict
    raise _too_often(path, tries)
