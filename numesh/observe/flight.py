"""The flight recorder: every rank's recent collectives, and a diagnosis when one never ends.

`FlightRecorder` is an `Observer` (numesh/mesh/hook.py) on the training mesh. For
each call through the mesh it writes one record (sequence number on its communicator,
op, communicator, bytes, step, start, end) into a small ring held in a memory-mapped file,
OUT/flight/ring-RANK.bin, whose header also holds a heartbeat, the per-communicator call
counts, the call the rank is waiting in (and since when) and any injected fault that
fired. Because the ring lives in a shared file mapping, it stays readable by the other
ranks when its own rank is stuck in compute, hangs, or is dead: no rank has to answer.

With a timeout, `wait` polls the request (Test, yielding the core between tests) instead
of blocking. A call that is still not done after `timeout` seconds, or whose
Test raises an MPI error (a peer that called a collective of another size), makes the
rank give up on MPI, which cannot be trusted any more:

1. it writes OUT/flight/rank-RANK.json (its ring, decoded; atomically);
2. it waits GRACE_S for the other ranks that time out too, then the lowest-numbered rank
   with a dump of this run is the leader; the others wait for it (and take over if it
   has not aborted the job LEADER_WAIT_S later);
3. the leader reads every rank's ring file, writes the dumps of the ranks that could not,
   works out who never entered the collective the others wait in, or called a different
   one (other op, axes or size), or is dead, prints that as one block on stderr and in
   OUT/flight/diagnosis.txt, and calls MPI_Abort(COMM_WORLD, EXIT_CODE).

A rank whose training raises after such a fault shows in the rings (a call skipped, a rank
that gave up or died) takes the same path (`after_error`): the error is most likely the
fault's consequence, data from calls that no longer pair, so the job ends with the diagnosis
and EXIT_CODE rather than with whichever error tripped first.

The diagnosis itself (`diagnose`, numesh/observe/diagnosis.py) is a pure function of the
ranks' states, which `read_state` decodes from their ring files. A clean end of training
removes the ring files (`close`). A job that the launcher killed (a rank died) leaves them
behind: `postmortem` (`numesh report OUT`) diagnoses them afterwards, with what the
witness (numesh/observe/witness.py, one process per host outside the job) saw end first,
and each ring's `exited` time, set when its process left through Python's own exit (which
a SIGKILL never runs).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from numesh.base.errors import abort_job
from numesh.base.files import write_atomic
from numesh.base.process import alive, stopped
from numesh.mesh.hook import Observer, SkipCall
from numesh.mesh.mesh import AxisNames, Group, axis_names
from numesh.observe import witness
from numesh.observe.diagnosis import FAILED, SKIPPED, CallRec, RankState, diagnose

EXIT_CODE = 3
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))  # no sched_yield on Windows: sleep(0) yields there
GRACE_S = 2.0  # for the other ranks' time-outs and dumps before the leader diagnoses
LEADER_WAIT_S = 5.0  # a non-leader takes over if the job is still alive this long after the grace
RING = 256  # calls kept per rank (a step of the default model issues ~100 on a 2x2x2 mesh)
MAX_COMMS = 32
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "sendrecv",
       "all_to_all")  # a ring entry's op codes (append only: recorded rings keep their meaning)
_OP_CODE = {op: i for i, op in enumerate(OPS)}
MAGIC = 0x6E756D6573680002  # 2: the header has `exited`

HEAD = np.dtype([
    ("magic", "<i8"), ("pid", "<i8"), ("ncalls", "<i8"), ("step", "<i8"), ("beat", "<f8"),
    ("waiting", "<i8"), ("wait_since", "<f8"), ("failed", "<i8"), ("counts", "<i8", (MAX_COMMS,)), ("note", "S160"),
    ("exited", "<f8"),  # when the process exited through Python's own exit (0: it did not, or not yet)
])
ENTRY = np.dtype([
    ("seq", "<i8"), ("comm", "<i8"), ("op", "<i8"), ("nbytes", "<i8"), ("step", "<i8"),
    ("start", "<f8"), ("end", "<f8"), ("flags", "<i8"),
])


def comm_name(axes: AxisNames) -> str:
    """'tp', 'dp,tp', or a group of one axis as 'pp[0,3]'."""
    if isinstance(axes, Group):
        return f"{axes.axis}[{','.join(map(str, axes.members))}]"
    return ",".join(axis_names(axes))


# ---------------------------------------------------------------------------------------
# reading ring files


def read_state(flight_dir: Path, rank: int, run: int) -> RankState | None:
    """Rank `rank`'s state from its ring and meta files (None if missing or of another run)."""
    try:
        meta = json.loads((flight_dir / f"meta-{rank}.json").read_text())
        raw = np.fromfile(flight_dir / f"ring-{rank}.bin", dtype=np.uint8)
    except (OSError, ValueError):
        return None
    if meta.get("run") != run or raw.size < HEAD.itemsize:
        return None
    head = raw[:HEAD.itemsize].view(HEAD)[0]
    ring = raw[HEAD.itemsize:HEAD.itemsize + RING * ENTRY.itemsize].view(ENTRY)
    if int(head["magic"]) != MAGIC:
        return None
    names = meta["comms"]
    ncalls = int(head["ncalls"])
    calls, waiting = [], None
    for k in range(max(0, ncalls - RING), ncalls):
        e = ring[k % RING]
        comm = int(e["comm"])
        rec = CallRec(int(e["seq"]), names[comm] if comm < len(names) else f"comm{comm}", OPS[int(e["op"])],
                      int(e["nbytes"]), int(e["step"]), float(e["start"]), float(e["end"]) or None, int(e["flags"]))
        calls.append(rec)
        if k % RING == int(head["waiting"]) and int(head["waiting"]) >= 0 and rec.end is None:
            waiting = rec
    counts = {names[i]: int(head["counts"][i]) for i in range(len(names))}
    failed = {0: None, 1: "timeout", 2: "MPI error", 3: "error"}.get(int(head["failed"]), "?")
    running, halted = None, False
    if meta.get("host") == socket.gethostname():
        running, halted = alive(int(meta["pid"])), stopped(int(meta["pid"]))
    return RankState(rank, meta["coords"], meta["shape"], calls, counts, float(head["beat"]), int(head["step"]),
                     waiting, float(head["wait_since"]), failed, running, head["note"].decode(errors="replace"),
                     int(meta["pid"]), meta.get("host", ""), float(head["exited"]), halted)


def postmortem(flight_dir: str | Path) -> str | None:
    """The diagnosis of a job that ended without one, from the ring files it left behind.

    A rank that dies makes the launcher kill the others at once (MPICH's and Open MPI's
    mpiexec both do, with SIGKILL), before any time-out, so no rank is left to diagnose;
    the rings live in file mappings and survive. This reads the latest run's rings and
    diagnoses them as of the job's last recorded moment (writing OUT/flight/diagnosis.txt).
    Returns the run's diagnosis (the one it wrote itself, if it did), or None when there is
    no flight record or a rank of that run still runs."""
    flight_dir = Path(flight_dir)
    metas = []
    for path in flight_dir.glob("meta-*.json"):
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict) and isinstance(m.get("run"), int) and isinstance(m.get("shape"), dict):
            metas.append(m)  # anything else is not a flight recorder's (a hand-edited or foreign file)
    if not metas:
        return None
    diag = flight_dir / "diagnosis.txt"
    if diag.is_file():
        return diag.read_text()
    run = max(m["run"] for m in metas)
    shape = next(m["shape"] for m in metas if m["run"] == run)
    states = {r: read_state(flight_dir, r, run) for r in range(int(np.prod(list(shape.values()))))}
    if any(s is not None and s.alive for s in states.values()):
        return None
    for s in states.values():
        if s is not None:
            s.alive = None  # every process is gone now; which died first is what we infer
    first = witness.first_to_end(witness.read(flight_dir, run))
    began = _began_first(first, states)
    for r in began or (first["gone"] if first else ()):
        if states.get(r) is not None:
            states[r].alive = False  # the witness saw it end while the others still ran, or it ended itself first
    known = [s for s in states.values() if s is not None]
    if not known:  # the metadata without a ring: nothing recorded to diagnose
        return None
    end = max(max(s.last_activity(), s.wait_since) for s in known)
    title = (f"numesh flight recorder (post-mortem): the job ended at {time.strftime('%H:%M:%S', time.localtime(end))} "
             f"without a diagnosis (a rank that dies makes mpiexec kill the others at once; its exit code is in "
             f"mpiexec's message); every rank's last calls are in {flight_dir}")
    text, _ = diagnose(states, end, 0.0, str(flight_dir), title=title, ended=True)
    text += "\n" + witness_line(first, states, began)
    try:
        write_atomic(diag, text + "\n")
    except OSError:  # a read-only OUT (another user's run): the diagnosis is still printed
        pass
    return text + "\n"


def _began_first(first: dict[str, Any] | None, states: dict[int, RankState | None]) -> list[int]:
    """Ranks on the witness's host that recorded ending themselves (Python's exit, an injected
    crash) by the time the witness saw the first ranks gone, where those differ from the
    ranks it saw gone. The witness sees when the kernel finished each exit; under CPU
    contention the kernel can finish a rank that mpiexec SIGKILLed before, or together with,
    the rank whose end made mpiexec send that kill (seen on a loaded 2-core machine: the
    killed rank "ended first" by 6 ms). The rank's own record, made before its exit began,
    says which came first. Empty when they are the ranks the witness saw, or it saw none."""
    if first is None:
        return []
    began = sorted(r for r, s in states.items()
                   if s is not None and s.exited and s.exited <= first["at"] and s.host == first.get("host"))
    return [] if set(began) in (set(), set(first["gone"])) else began


def witness_line(first: dict[str, Any] | None, states: dict[int, RankState | None],
                 began: list[int] | None = None) -> str:
    """What the witness (numesh/observe/witness.py) saw end first, in words; and which ranks
    had recorded ending themselves before that (`_began_first`)."""
    if first is None:
        return ("witness: none saw one rank end before the others (no pidfds here, the ranks ended together, "
                "or --collective-timeout 0)")
    gone = first["gone"]
    who = ", ".join(f"rank {r}" + (f" (pid {states[r].pid})" if states.get(r) else "") for r in gone)
    how = ("exited on its own (an error it printed ends the job too)"
           if all(states.get(r) is not None and states[r].exited for r in gone)
           else "never exited on its own: killed (kill -9, the OOM killer), crashed, or aborted the job")
    ahead = "" if first["ms_before"] is None else f", {first['ms_before']:.1f} ms before the next"
    line = f"witness: {who} ended first{ahead}, while {len(first['alive'])} other rank(s) still ran; it {how}"
    if began:
        line += (f"; but {', '.join(f'rank {r}' for r in began)} had recorded ending itself by then (its exit began "
                 f"first, whenever the kernel finished it): the cause above")
    return line


# ---------------------------------------------------------------------------------------
# the observer


class FlightRecorder(Observer):
    """Records every call of `mesh` in OUT/flight/ring-RANK.bin and, with `timeout` > 0,
    turns a call that never ends into a diagnosis and MPI_Abort (see the module docstring).

    `inject` (a `numesh.observe.inject.FaultInjector`) runs first in `begin`, so that a call it
    skips is recorded as skipped and a hang leaves the heartbeat stale. Made collectively
    (every rank of `mesh.world`: the run id is broadcast)."""

    def __init__(self, mesh: Any, flight_dir: str | Path, timeout: float, inject: Any = None,
                 grace_s: float = GRACE_S, leader_wait_s: float = LEADER_WAIT_S):
        self.mesh, self.dir, self.timeout, self.inject = mesh, Path(flight_dir), float(timeout), inject
        self.grace_s, self.leader_wait_s = grace_s, leader_wait_s
        world = mesh.world
        self.rank, self.size = world.Get_rank(), world.Get_size()
        run = np.array([time.time_ns() if self.rank == 0 else 0], dtype=np.int64)
        world.Bcast(run, root=0)  # one id per run: stale dumps in a reused OUT are not ours
        self.run = int(run[0])
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in (f"rank-{self.rank}.json", "diagnosis.txt" if self.rank == 0 else ""):
            if name:
                (self.dir / name).unlink(missing_ok=True)
        if self.rank == 0:  # an earlier job's witness record would keep the folder after a clean end
            for old in self.dir.glob("witness-*.json"):
                old.unlink(missing_ok=True)
        self._ring_path = self.dir / f"ring-{self.rank}.bin"
        self._mm = np.memmap(self._ring_path, dtype=np.uint8, mode="w+", shape=(HEAD.itemsize + RING * ENTRY.itemsize,))
        self._head = self._mm[:HEAD.itemsize].view(HEAD)
        self.ring = self._mm[HEAD.itemsize:].view(ENTRY)
        self._end = self.ring["end"]
        self._waiting, self._wait_since, self._beat = (self._head["waiting"], self._head["wait_since"],
                                                       self._head["beat"])
        self._counts, self._ncalls = self._head["counts"][0], self._head["ncalls"]
        self._head["pid"], self._head["waiting"] = os.getpid(), -1
        self._comms: dict[Any, int] = {}
        self._names: list[str] = []
        self.step = 0
        self._write_meta()
        self._head["magic"] = MAGIC  # last: a reader sees a whole header or none
        if inject is not None:
            inject.on_fire, inject.on_exit = self._note, self._mark_exit  # os._exit runs no atexit
        self._failing = False
        atexit.register(self._mark_exit)  # an exit of its own, unlike SIGKILL, which runs nothing
        self._witness = self._start_witness(world)

    def _start_witness(self, world: Any) -> Any:
        """The witness of this host's ranks (numesh/observe/witness.py), started by the
        host's first rank (collective); None on the others."""
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            pids = node.gather((self.rank, os.getpid()), root=0)
            leader = node.Get_rank() == 0
        finally:
            node.Free()
        return witness.spawn(self.dir, self.run, dict(pids)) if leader else None

    def _mark_exit(self) -> None:
        if hasattr(self, "_head"):
            self._head["exited"] = time.time()

    def _write_meta(self) -> None:
        meta = {"run": self.run, "rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "coords": dict(self.mesh.coords), "shape": dict(self.mesh.shape), "comms": self._names}
        write_atomic(self.dir / f"meta-{self.rank}.json", json.dumps(meta))

    def _comm_id(self, axes: AxisNames) -> int:
        key = axes if isinstance(axes, (str, Group)) else tuple(axes)
        cid = self._comms.get(key)
        if cid is None:
            name = comm_name(axes)
            cid = self._names.index(name) if name in self._names else len(self._names)
            if cid >= MAX_COMMS:
                raise RuntimeError(f"flight recorder: more than {MAX_COMMS} communicators")
            if cid == len(self._names):
                self._names.append(name)
                self._write_meta()
            self._comms[key] = cid
        return cid

    def _note(self, text: str) -> None:
        self._head["note"] = text.encode()[:160]
        self._mm.flush()

    # ------------------------------------------------------------------ Observer

    def on_step(self, step: int) -> None:
        self.step = step
        self._head["step"] = step
        if self.inject is not None:
            self.inject.on_step(step)

    def begin(self, op: str, axes: AxisNames, nbytes: int) -> int:
        cid = self._comm_id(axes)
        if self.inject is not None:
            try:
                self.inject.begin(op, axes, nbytes)
            except SkipCall:
                now = time.time()
                self._put(int(self._counts[cid]), cid, op, nbytes, now, now, SKIPPED)
                raise
        seq = int(self._counts[cid])
        self._counts[cid] = seq + 1
        return self._put(seq, cid, op, nbytes, time.time(), 0.0, 0)

    def _put(self, seq: int, cid: int, op: str, nbytes: int, start: float, end: float, flags: int) -> int:
        n = int(self._ncalls[0])
        i = n % RING
        self.ring[i] = (seq, cid, _OP_CODE[op], nbytes, self.step, start, end, flags)
        self._ncalls[0] = n + 1
        self._beat[0] = start
        return i

    def end(self, token: int) -> None:
        self._end[token] = time.time()

    def wait(self, request: Any, token: int) -> None:
        try:
            if request.Test():
                return
            if self.timeout <= 0:
                request.Wait()
                return
            self._poll(request, token)
        except MPI.Exception as e:
            self._fail(token, f"MPI error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", 2)

    def _poll(self, request: Any, token: int) -> None:
        """Test until done, yielding the core between tests (`sched_yield`: back at once when no
        other process wants the core, so the wait ends as soon as a blocking call's would; an
        oversubscribed peer runs meanwhile). Sleeping between tests stalled the collective
        itself: MPICH progresses a non-blocking collective only inside Test, so every round
        waited for the sleeper, and a call took up to twice a blocking one where Test and
        yield takes what a blocking call does. `mpirun -n 2 python benchmarks/bench_trace.py
        overhead --mesh tp=2` measures what the recorder costs a step."""
        t0 = time.monotonic()
        self._wait_since[0], self._waiting[0] = time.time(), token
        deadline = t0 + self.timeout
        while not request.Test():
            if time.monotonic() > deadline:
                self._fail(token, f"timeout after {time.monotonic() - t0:.1f} s", 1)
            _yield()
        self._waiting[0] = -1

    def close(self) -> None:
        """The run ended cleanly: remove this rank's files (and the folder once empty)."""
        atexit.unregister(self._mark_exit)
        witness.stop(self._witness)
        del self._head, self.ring, self._end, self._waiting, self._wait_since, self._beat, self._counts, self._ncalls
        self._mm._mmap.close()  # type: ignore[attr-defined]
        del self._mm
        for name in (f"ring-{self.rank}.bin", f"meta-{self.rank}.json"):
            (self.dir / name).unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass

    # ------------------------------------------------------------------ giving up

    def after_error(self, error: BaseException) -> None:
        """An exception escaped this rank's training: if the rings show a collective fault
        (a call skipped, a rank that gave up or is dead), the error is most likely its
        consequence (a rank whose calls no longer pair with its peers' reduces the wrong
        buffers, and whichever rank first trips over the data raises), so end as a time-out
        does: the diagnosis, and EXIT_CODE on every rank. Returns when the rings show no
        fault: the error is the rank's own and unwinds as any other."""
        if self._failing:
            return
        states = [read_state(self.dir, r, self.run) for r in range(self.size)]
        if not any(s is not None and (s.alive is False or s.failed is not None
                                      or any(c.flags & (SKIPPED | FAILED) for c in s.calls)) for s in states):
            return
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        self._fail(None, reason, 3, title=f"numesh flight recorder: rank {self.rank} raised {reason} after a "
                                        f"collective fault; every rank's last calls are in {self.dir}")

    def _fail(self, token: int | None, reason: str, code: int, title: str = "") -> None:
        """Never returns: dump, wait for the others, diagnose (leader) and abort the job.
        `token`: the call this rank gives up in (None: an error outside any call)."""
        self._failing = True
        if token is not None:
            self._waiting[0] = token
            if not self._wait_since[0]:
                self._wait_since[0] = time.time()
            self.ring[token]["flags"] |= FAILED
        self._head["failed"] = code
        self._mm.flush()
        state = read_state(self.dir, self.rank, self.run)
        dump = {"run": self.run, "written_by": self.rank, "reason": reason, "time": time.time(),
                **(state.to_json() if state is not None else {})}
        write_atomic(self.dir / f"rank-{self.rank}.json", json.dumps(dump, indent=1))
        failed_at = time.monotonic()
        time.sleep(self.grace_s)
        while True:
            dumps = self._dumps()
            if not dumps or min(dumps) >= self.rank:
                break  # the lowest-numbered rank that gave up: the leader
            if time.monotonic() - failed_at > self.grace_s + self.leader_wait_s:
                break  # the leader did not abort the job: take over
            time.sleep(0.1)
        self._lead(reason, title)

    def _dumps(self) -> dict[int, dict]:
        out = {}
        for r in range(self.size):
            try:
                d = json.loads((self.dir / f"rank-{r}.json").read_text())
            except (OSError, ValueError):
                continue
            if d.get("run") == self.run:
                out[r] = d
        return out

    def _lead(self, reason: str, title: str = "") -> None:
        try:
            states = {r: read_state(self.dir, r, self.run) for r in range(self.size)}
            dumps = self._dumps()
            for r, s in states.items():
                if s is not None and r not in dumps:
                    dump = {"run": self.run, "written_by": self.rank, "reason": "read from its ring by the leader",
                            "time": time.time(), **s.to_json()}
                    write_atomic(self.dir / f"rank-{r}.json", json.dumps(dump, indent=1))
            text, _ = diagnose(states, time.time(), self.timeout, str(self.dir), title=title)
            text += f"\n(rank {self.rank} gave up: {reason}; exiting with code {EXIT_CODE} on every rank)"
            write_atomic(self.dir / "diagnosis.txt", text + "\n")
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except BaseException as e:  # the abort below must happen whatever went wrong here
            print(f"[rank {self.rank}] flight recorder: diagnosis failed: {e!r}; aborting", file=sys.stderr, flush=True)
        abort_job(MPI.COMM_WORLD, EXIT_CODE)

