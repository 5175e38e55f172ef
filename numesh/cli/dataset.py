"""The dataset a command needs, prepared once per job: a download bar and the MPI hand-off.

Under mpirun every rank runs `numesh train`; only rank 0 may download or write the dataset,
the others wait for it. Rank 0's outcome (ok, or the one-line error) is broadcast, so a
failure there is the same error on every rank and never a hang, and every rank then checks
it can see the files (a node without the shared filesystem is an error on all ranks too).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Callable, Iterator


@contextlib.contextmanager
def download_bar(what: str = "download") -> Iterator[Callable[[int, int], None]]:
    """A `progress(done_bytes, total_bytes)` callback drawing a rich bar on stderr.

    The bar appears on the first call only, so a cached or local source draws nothing."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=Console(stderr=True), transient=False,
    )
    task = None

    def progress(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            bar.start()
            task = bar.add_task(what, total=total or None)
        bar.update(task, completed=done, total=total or None)

    try:
        yield progress
    finally:
        if task is not None:
            bar.stop()


def ensure_run_dataset(data_dir: str | Path) -> Path:
    """`numesh.data.char.ensure_dataset` on rank 0 of COMM_WORLD, its result shared with every rank.

    Prints rank 0's note (a download, the offline fallback) as one line on stderr. Raises
    the same DataError on every rank when rank 0 failed or a rank cannot see the dataset."""
    from mpi4py import MPI

    from numesh.base.errors import DataError
    from numesh.data.char import ensure_dataset
    from numesh.data.dataset import META_FILE

    comm = MPI.COMM_WORLD
    status: tuple[str, str | None] | None = None
    if comm.Get_rank() == 0:
        try:
            with download_bar("tiny Shakespeare") as progress:
                _, note = ensure_dataset(data_dir, progress=progress)
            status = ("ok", note)
        except DataError as e:  # the others wait in bcast: tell them instead of raising alone
            status = ("error", str(e))
    status = comm.bcast(status, root=0) if comm.Get_size() > 1 else status
    kind, text = status
    if kind == "error":
        raise DataError(text)
    if text and comm.Get_rank() == 0:
        print(text, file=sys.stderr, flush=True)
    path = Path(data_dir)
    if comm.Get_size() > 1:
        seen = comm.allreduce(int((path / META_FILE).is_file()), op=MPI.MIN)
        if not seen:
            raise DataError(
                f"rank 0 prepared {path} but some ranks cannot see it: put it on a filesystem "
                "every node shares, or prepare it on each node with `numesh data`"
            )
    return path
