"""Which rank of a job ended first: a watcher process outside the job.

A rank that dies makes mpiexec SIGKILL the others a few milliseconds later, before any of
them can write a word, and the flight rings only say where each rank was. When the killed
rank was computing like the others, or inside the collective they were in, the post-mortem
could only say "cause: unknown" (issue 31). Nothing inside a rank can reliably see which
process ended first: a watching thread needs the GIL, which the main thread may hold for
the switch interval (5 ms), as long as mpiexec takes to kill the rest; inferring it from
heartbeats fails when a rank was descheduled (2 shared cores: the survivor's last beat came
before the victim's death in 1 of 5 tries).

So the flight recorder starts one small process per host (its node's first rank starts it,
in a session of its own, so the launcher's kill does not reach it). It blocks in poll() on
a pidfd of every rank of that host; the kernel wakes it when the first one exits, and it
looks at once which ranks are already gone: the first, while mpiexec is still on its way
to kill the others. It writes what it saw to OUT/flight/witness-HOST.json, then waits for
the rest to end (writing when each went) and exits. A clean end of the run sends it "bye"
and it leaves without writing anything.

This file is also the witness's program: run by path (`python -I -S witness.py ...`) it
imports only the standard library, so it starts in milliseconds and never touches MPI.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

AFTER_FIRST_S = 10.0  # how long the witness waits for the other ranks once one has ended
BYE = b"bye\n"
# variables a launcher sets for its own ranks: the witness is not one of them
_LAUNCHER_ENV = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPI_LOCAL", "PRTE_", "OPAL_")


def out_file(flight_dir: Path, host: str) -> Path:
    return flight_dir / f"witness-{host}.json"


def available() -> bool:
    """Whether this system has pidfds (Linux 5.3 or later)."""
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except OSError:
        return False


def spawn(flight_dir: Path, run: int, pids: dict[int, int]) -> subprocess.Popen | None:
    """Start the witness of the ranks `pids` (world rank -> pid, this host's); None where
    pidfds are missing or the process cannot start (the post-mortem then infers as before)."""
    if not available():
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", __file__, str(out_file(flight_dir, socket.gethostname())), str(run)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True,  # the launcher's kill of the job's processes does not reach it
        )
        proc.stdin.write(json.dumps({str(r): p for r, p in pids.items()}).encode() + b"\n")
        proc.stdin.flush()
    except OSError:
        return None
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """The run ended cleanly: the witness leaves without writing."""
    if proc is None:
        return
    try:
        proc.stdin.write(BYE)
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def read(flight_dir: Path, run: int) -> list[dict[str, Any]]:
    """What the witnesses of run `run` saw (one document per host, see `watch`)."""
    out = []
    for path in sorted(flight_dir.glob("witness-*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("run") == run and doc.get("first"):
            out.append(doc)
    return out


def first_to_end(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first look that saw some ranks gone while others still ran (the earliest, over
    hosts): {"at", "gone": ranks, "alive": ranks, "host", "ms_before": until the next rank ended}.
    None when no witness saw one rank end before the rest."""
    looks = [{**d["first"], "host": d.get("host")} for d in docs if d["first"]["alive"]]
    if not looks:
        return None
    first = min(looks, key=lambda f: f["at"])
    later = [t for d in docs for r, t in d["ended"].items() if int(r) not in first["gone"]]
    return {**first, "ms_before": (min(later) - first["at"]) * 1e3 if later else None}


# ---------------------------------------------------------------------------------------
# the witness's program


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _gone(live: dict[int, int]) -> list[int]:
    """The pidfds in `live` (pidfd -> rank) whose process has ended, looked at at once."""
    look = select.poll()
    for fd in live:
        look.register(fd, select.POLLIN)
    return sorted(fd for fd, _ in look.poll(0))


def watch(path: Path, run: int, pids: dict[int, int]) -> None:
    """Wait for the ranks `pids` (rank -> pid) to end; write, to `path`, which were gone at
    the first look after the first one ended ("first": {"at", "gone", "alive"}) and when
    each was seen gone ("ended": rank -> time). Returns at once, writing nothing, on "bye"
    on stdin."""
    live = {}
    for r, pid in pids.items():
        try:
            live[os.pidfd_open(pid)] = r
        except OSError:  # gone before the witness started: no order to tell
            continue
    waiting = select.poll()
    for fd in live:
        waiting.register(fd, select.POLLIN)
    waiting.register(0, select.POLLIN)
    doc: dict[str, Any] = {"run": run, "host": socket.gethostname(), "pids": pids, "first": None, "ended": {}}
    deadline = None
    while live:
        left = None if deadline is None else max(0, int((deadline - time.time()) * 1e3))
        ready = {fd for fd, _ in waiting.poll(left)}
        gone = _gone(live)  # first, before anything else: mpiexec is on its way to kill the rest
        now = time.time()
        for fd in gone:
            doc["ended"][str(live.pop(fd))] = now
            waiting.unregister(fd)
            os.close(fd)
        if gone and doc["first"] is None:
            ended = sorted(int(r) for r in doc["ended"])
            doc["first"] = {"at": now, "gone": ended, "alive": sorted(live.values())}
            deadline = now + AFTER_FIRST_S
            _write(path, doc)
        if 0 in ready and not gone:
            said = os.read(0, 16)
            if said.startswith(BYE):
                return
            if not said:
                waiting.unregister(0)  # the pipe closed: the rank that held it ended (its pidfd says when)
        if deadline is not None and time.time() >= deadline:
            break
    _write(path, doc)


def _first_line() -> tuple[bytes, bytes]:
    """The first line on stdin and what came after it (unbuffered: poll() watches fd 0 next)."""
    got = b""
    while b"\n" not in got:
        chunk = os.read(0, 4096)
        if not chunk:
            break
        got += chunk
    line, _, rest = got.partition(b"\n")
    return line, rest


def _ahead_of_the_job() -> str:
    """Ask the kernel to run the witness before the job's processes when it wakes: it must
    look at the pidfds before mpiexec has killed the other ranks (milliseconds), which a
    loaded machine's scheduler can delay past (a fresh-clone CI saw every rank gone at the
    first look). The lowest real-time priority, else a higher nice; either needs the right
    (root, CAP_SYS_NICE), and without it the witness runs as before. It blocks in poll()
    between events, so it takes no CPU from the job. Returns what it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO 1"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(-10)
        return "nice -10"
    except OSError:
        return "as started"


def main(argv: list[str]) -> int:
    line, rest = _first_line()
    if not line or rest.startswith(BYE):
        return 0  # the run ended (or its first rank did) before the witness started
    _ahead_of_the_job()
    watch(Path(argv[1]), int(argv[2]), {int(r): int(p) for r, p in json.loads(line).items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
