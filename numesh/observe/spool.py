"""A traced run's events on disk as the run goes, so that a job that dies still leaves them.

`Tracer.write` gathers every rank's events on rank 0 when the run ends. A rank that is
killed (kill -9, the OOM killer) makes mpiexec SIGKILL the others at once, so nothing at
the end runs: such a run used to leave no trace at all (issue 31). So each rank also
appends its events to `OUT/trace.parts/rank-RANK.jsonl` as it goes: a header line (the
run's id, the rank's facts and clock alignment, the report's metadata), then one line per
flush with the events recorded since the last, as the tracer holds them (this rank's
`perf_counter` seconds). Each line is one `write` call on an unbuffered file, so a SIGKILL
loses what the rank had not flushed yet, never what it had (written bytes are in the
kernel's page cache), and at most the line being written, which the reader skips.

This module is the file format only: `numesh.observe.trace.recover` turns the parts of a
run into one trace as `Tracer.write` would have.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import attrs

PARTS_DIR = "trace.parts"


def part_path(parts_dir: Path, rank: int) -> Path:
    return parts_dir / f"rank-{rank}.jsonl"


def clear(parts_dir: Path) -> None:
    """An empty `parts_dir` (the parts of an earlier run in the same OUT removed)."""
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True, exist_ok=True)


class SpoolWriter:
    """Appends one rank's events to its part file (see the module docstring)."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        self._f = open(path, "wb", buffering=0)  # unbuffered: every line is one write() call
        self._line({"header": header})

    def _line(self, doc: dict[str, Any]) -> None:
        self._f.write(json.dumps(doc, allow_nan=False).encode() + b"\n")

    def append(self, events: list[tuple], dropped: int) -> None:
        """The tracer's raw event tuples recorded since the last call, and how many it has dropped."""
        self._line({"events": events, "dropped": dropped})

    def remove(self) -> None:
        """The run ended and its trace.json is written: the part is no longer needed."""
        self._f.close()
        self.path.unlink(missing_ok=True)


@attrs.frozen
class Part:
    """What one rank's part file holds: its header and every event it flushed."""

    header: dict[str, Any]
    events: list[list]
    dropped: int
    torn: bool  # the last line was cut off (the rank died writing it)


def read_part(path: Path) -> Part | None:
    """One part file, None when it has no readable header. Lines after a torn one are not trusted."""
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError:
        return None
    header, events, dropped, torn = None, [], 0, False
    for raw in lines:
        if not raw:
            continue
        try:
            doc = json.loads(raw)
        except ValueError:
            torn = True
            break
        if header is None:
            header = doc.get("header") if isinstance(doc, dict) else None
            if not isinstance(header, dict):
                return None
            continue
        events += doc.get("events", [])
        dropped = doc.get("dropped", dropped)
    return None if header is None else Part(header, events, dropped, torn)


def read_parts(parts_dir: Path) -> list[Part]:
    """The parts of the newest run in `parts_dir` (each header names its run), by rank."""
    parts = [p for p in map(read_part, sorted(parts_dir.glob("rank-*.jsonl"))) if p is not None]
    if not parts:
        return []
    run = max(p.header.get("run", 0) for p in parts)
    return sorted((p for p in parts if p.header.get("run", 0) == run), key=lambda p: p.header["rank"]["rank"])
