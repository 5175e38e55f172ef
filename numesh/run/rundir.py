"""A run's output directory: held by one run at a time, never silently reused, with room
for a checkpoint, and its metrics written as strict JSON lines.

Rank 0 does the file work; every rank learns the outcome through one broadcast, so a
problem is the same one-line error on every rank, before the first training step.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mpi4py import MPI

from numesh.base.errors import ConfigError, abort_job
from numesh.base.files import os_reason, write_atomic
from numesh.checkpoint.format import LATEST, RUN_CKPT
from numesh.host.runtime import rank_ranges

LOCK_FILE = ".lock"
RUN_FILES = ("config.json", "metrics.jsonl")  # what makes a directory a run's


def latest_checkpoint(out: Path, comm: MPI.Comm) -> Path | None:
    """OUT/ckpt/latest if rank 0 sees it (a dangling link too: resuming from it then fails
    with one line instead of silently starting over), else None; the same answer on every
    rank. What `--resume auto` continues from."""
    latest = out / RUN_CKPT / LATEST
    found = (latest.is_symlink() or latest.exists()) if comm.Get_rank() == 0 else None
    return latest if comm.bcast(found, root=0) else None


PROBE_PREFIX = ".probe-"  # the file the start-up check writes under --out, gone once read


def check_shared(out: Path, comm: MPI.Comm, private: bool = False) -> None:
    """Every rank must see the files rank 0 writes under `out` (checkpoints are written by
    every rank and read back by any): rank 0 writes a file there, every rank reads it. With
    `private` this rank looks in a directory of its own instead (a test's node-local disk,
    NUMESH_INJECT's `unshared`). A ConfigError naming the ranks and hosts that cannot see
    it, on every rank, before any training. Collective; nothing to check on one rank."""
    if comm.Get_size() == 1:
        return
    name, error = None, None
    if comm.Get_rank() == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
            name = f"{PROBE_PREFIX}{secrets.token_hex(8)}"
            write_atomic(out / name, name)
        except OSError as e:
            error = f"cannot use --out {out}: {os_reason(e)}"
    name, error = comm.bcast((name, error), root=0)
    if error:
        raise ConfigError(error)
    seen = _sees(out, name, private)
    views = comm.allgather((seen, socket.gethostname()))
    if comm.Get_rank() == 0:
        (out / name).unlink(missing_ok=True)
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    if blind:
        hosts = sorted({views[r][1] for r in blind})
        raise ConfigError(
            f"--out {out} is not one directory for every rank: rank{'s' if len(blind) > 1 else ''} "
            f"{rank_ranges(blind)} (on {', '.join(hosts)}) cannot see the file rank 0 (on {views[0][1]}) wrote there, "
            "as with a disk local to each node: put --out on a file system every host mounts")


def _sees(out: Path, name: str, private: bool, tries: int = 5, pause_s: float = 0.2) -> bool:
    """Whether this rank reads `name` under `out` (under a fresh directory of its own if
    `private`), trying a few times: a network file system may show a new file a moment late."""
    if private:
        with tempfile.TemporaryDirectory(prefix="numesh-unshared-") as own:
            return _sees(Path(own), name, False, tries, pause_s)
    for i in range(tries):
        try:
            if (out / name).read_text() == name:
                return True
        except (OSError, UnicodeDecodeError):
            pass
        if i + 1 < tries:
            time.sleep(pause_s)
    return False


# what --resume auto redoing an attempt that saved nothing checks: the settings that differ
# from those of its config.json, as options ([] when it may be redone)
Differences = Callable[[dict[str, Any]], list[str]]


def _empty_dir(path: Path) -> bool:
    """Whether `path` is an empty directory (or a link to one): OUT/ckpt made ready for a
    run, say on another disk, holds no run yet."""
    try:
        return path.is_dir() and not any(p for p in path.iterdir() if not p.name.startswith(PROBE_PREFIX))
    except OSError:
        return False


def _remove(path: Path) -> None:
    """--overwrite's removal of one of a run's files or directories. OUT/ckpt linked to
    another disk keeps its link, and loses what a run writes there: step directories,
    `latest` and unfinished saves (nothing else, in case the link names a shared place)."""
    if path.is_symlink() and path.is_dir():
        for entry in path.iterdir():
            if entry.name == LATEST or entry.name.startswith(("step_", ".tmp-", PROBE_PREFIX)):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _probe_checkpoints(ckpt: Path) -> Path:
    """OUT/ckpt (or where it links to) written to once, a file created and removed (and
    the directory too, if it made it), before the first step: a run whose checkpoints
    cannot be written found out at its first save, after all its steps. A ConfigError
    naming why, a dangling link apart (it said "File exists")."""
    if ckpt.is_symlink() and not ckpt.exists():
        raise ConfigError(f"{ckpt} links to {os.readlink(ckpt)}, which does not exist: mount or make it, or remove "
                          "the link, before training")
    try:
        made = not ckpt.exists()
        ckpt.mkdir(exist_ok=True)
        probe = ckpt / f"{PROBE_PREFIX}{secrets.token_hex(8)}"
        probe.write_bytes(b"")
        probe.unlink()
        if made:  # a run that saves nothing leaves no OUT/ckpt
            ckpt.rmdir()
    except OSError as e:
        raise ConfigError(f"cannot write checkpoints under {ckpt}: {os_reason(e)}: make it writable or choose "
                          "another --out") from None
    return ckpt


class RunDir:
    """OUT of one run: locked for the run's life (an flock, so a killed run leaves no stale
    lock), refused if it already holds a run unless resuming or told to overwrite, checked
    for space for a checkpoint; `write` appends a metrics line. With `redo` (--resume auto
    without a checkpoint), an attempt that saved nothing is overwritten only when that loses
    nothing: it logged no step, or ran with the same settings (`redo` returns none)."""

    def __init__(self, out: Path, comm: MPI.Comm, resume: str | Path | None, overwrite: bool, ckpt_bytes: int,
                 config: dict[str, Any], resume_step: int = 0, redo: Differences | None = None):
        self.out, self.comm, self.resume_step, self.redo = out, comm, resume_step, redo
        self._lock = self.metrics = None
        error = None
        if comm.Get_rank() == 0:
            try:
                self._open(resume, overwrite, ckpt_bytes, config)
            except (ConfigError, OSError) as e:
                error = str(e) if isinstance(e, ConfigError) else f"cannot use --out {out}: {os_reason(e)}"
                self.close()
        error = comm.bcast(error, root=0)
        if error:
            raise ConfigError(error)

    def _open(self, resume: str | Path | None, overwrite: bool, ckpt_bytes: int, config: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        existing = [n for n in (*RUN_FILES, RUN_CKPT) if (self.out / n).exists() and not _empty_dir(self.out / n)]
        own = bool(resume) and _is_within(Path(resume), self.out / RUN_CKPT)  # continuing this run
        if existing and resume and not own and not overwrite:
            raise ConfigError(
                f"--out {self.out} already holds another run ({', '.join(existing)}) and --resume {resume} is not "
                "one of its checkpoints: its metrics would mix with this run's; pass --overwrite to replace it, "
                "or another --out")
        if existing and not (resume or overwrite):
            raise ConfigError(f"--out {self.out} already holds a run ({', '.join(existing)}): {_reuse_hint(self.out)}")
        if existing and self.redo is not None:
            self._check_redo()
        if overwrite and not own:  # never the checkpoint being resumed from
            for name in existing:
                _remove(self.out / name)
        ckpt = _probe_checkpoints(self.out / RUN_CKPT)
        where = ckpt if ckpt.exists() else self.out  # OUT/ckpt may link to another disk
        free = shutil.disk_usage(where).free
        if free < ckpt_bytes:
            raise ConfigError(
                f"{where} has {free / 2**20:.1f} MiB free but a checkpoint of this model needs "
                f"~{ckpt_bytes / 2**20:.1f} MiB: free some space or choose another --out"
            )
        write_atomic(self.out / "config.json", json.dumps(config, indent=2))  # never half a config to a reader
        if resume:
            self._drop_steps_from(self.resume_step)
        self.metrics = open(self.out / "metrics.jsonl", "a" if resume else "w")

    def _check_redo(self) -> None:
        """Refuse to start over an attempt that saved no checkpoint but logged steps under
        other settings: --resume auto redoes the same command (the same steps again), never
        silently replaces another experiment's metrics."""
        metrics = self.out / "metrics.jsonl"
        if not metrics.is_file() or not metrics.read_text(encoding="utf-8", errors="replace").strip():
            return  # nothing logged: nothing to lose
        try:
            recorded = json.loads((self.out / "config.json").read_text(encoding="utf-8"))
            changed = self.redo(recorded) if isinstance(recorded, dict) else ["its config.json is not a config"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            changed = ["its config.json cannot be read"]
        if changed:
            raise ConfigError(
                f"--out {self.out} holds an attempt that saved no checkpoint, and --resume auto would replace its "
                f"metrics with a run of other settings: {', '.join(changed)}; rerun it as it was, pass --overwrite "
                "to replace it, or choose another --out")

    def _drop_steps_from(self, step: int) -> None:
        """Keep only the metrics lines before `step` (the checkpoint resumed from): a run that
        died after it logged steps the resumed run logs again, and each step appears once."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut off by the crash
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] < step:
                kept.append(line + "\n")
        write_atomic(path, "".join(kept))

    def _take_lock(self) -> None:
        path = self.out / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for any file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"--out {self.out} is in use by {holder}: wait for it or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self._lock = fd

    def write(self, record: dict[str, Any]) -> None:
        """Append one metrics line (rank 0; strict JSON: non-finite numbers become null)."""
        if self.metrics is None:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        try:
            self.metrics.write(json.dumps(clean, allow_nan=False) + "\n")
            self.metrics.flush()
        except OSError as e:
            msg = f"cannot write {self.out / 'metrics.jsonl'}: {e.strerror or e}"
            if self.comm.Get_size() > 1:  # only rank 0 writes: the others would wait for it forever
                print(f"error: {msg}", file=sys.stderr, flush=True)
                abort_job(self.comm, 2)
            raise MetricsWriteError(msg) from None

    def close_metrics(self) -> None:
        """No more metrics lines (the directory stays locked until `close`)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def close(self) -> None:
        """The run is over: metrics closed, the lock released (another run may take OUT)."""
        self.close_metrics()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None


def _is_within(path: Path, folder: Path) -> bool:
    """Whether `path` (links such as `latest` followed) lies inside `folder`."""
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _reuse_hint(out: Path) -> str:
    """What to do about a run already in `out`: --resume only where its `latest` checkpoint
    exists (a run that crashed before its first save has none, and suggesting it led to a
    second error)."""
    latest = out / RUN_CKPT / LATEST
    if latest.exists():
        return f"pass --resume {shlex.quote(str(latest))} to continue it, --overwrite to replace it, or another --out"
    return "it has no checkpoint to resume from: pass --overwrite to replace it, or another --out"


class MetricsWriteError(ConfigError):
    """The metrics file could not be written (a full disk, a removed directory)."""
