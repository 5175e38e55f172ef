"""The flight recorder's diagnosis: who the ranks stuck in a collective wait for, and why.

`diagnose` is a pure function of the ranks' states (`RankState`, what each rank's ring file
says: numesh/observe/flight.py reads them), so it is tested on synthetic rings. Sequence
numbers count a rank's calls per communicator: the members of a communicator issue the
same collectives in the same order, so their counts agree until one of them goes astray.
Times are wall-clock (`time.time()`), comparable between the ranks of one node.

A finding blames one rank for one call, in this order of priority: dead (or no record),
called something else or skipped the call, outside MPI (stuck in compute, hung, slow),
waiting in another call. The block's first line is the most likely cause, then the
others, then one line per rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import numpy as np

from numesh.mesh.mesh import AXES

COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})  # the others are p2p
SKIPPED, FAILED = 1, 2  # a call record's flags: skipped by an injected fault; the call the rank gave up in
# a rank waiting this long past the time-out without having given up has not run since (its own wait
# gives up at the time-out; the leader diagnoses flight.GRACE_S after its own)
STALE_S = 1.0


@attrs.define
class CallRec:
    """One call through the mesh as a rank's flight-recorder ring holds it: what the
    diagnosis compares between ranks to find the one that went astray.

    Attributes:
        seq: the call's number among this rank's calls on its communicator.
        comm: the communicator's axes, e.g. "dp" or "dp,tp".
        op: the operation, e.g. all_reduce or send.
        nbytes: the local buffer's bytes.
        step: the training step it was called in.
        start: when it began (wall-clock seconds).
        end: when it finished, or None if it had not.
        flags: SKIPPED (skipped by an injected fault) and FAILED (the call the rank gave up in).
    """

    seq: int
    comm: str
    op: str
    nbytes: int
    step: int
    start: float
    end: float | None
    flags: int = 0

    def label(self) -> str:
        return f"{self.op} over {self.comm} #{self.seq}"

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class RankState:
    """What one rank's ring file says (or, for a missing file, None in `diagnose`'s dict)."""

    rank: int
    coords: dict[str, int]
    shape: dict[str, int]
    calls: list[CallRec]  # oldest first
    counts: dict[str, int]  # calls issued per communicator
    beat: float  # when the rank last began a call (0: never)
    step: int = 0
    waiting: CallRec | None = None  # the call it is blocked in
    wait_since: float = 0.0
    failed: str | None = None  # why it gave up ('timeout', 'MPI error ...'), None if it did not
    alive: bool | None = None  # None: unknown (another host)
    note: str = ""  # an injected fault that fired
    pid: int = 0
    host: str = ""
    exited: float = 0.0  # when it exited through Python's exit, not killed (0: it did not)
    stopped: bool = False  # its process is stopped (kill -STOP, Ctrl-Z, a debugger): known on the reader's host only

    def where(self) -> str:
        """'dp=1,tp=1': its coordinates on the axes of size > 1."""
        return ",".join(f"{a}={self.coords.get(a, 0)}" for a in AXES if self.shape.get(a, 1) > 1) or "the only rank"

    def find(self, comm: str, seq: int) -> CallRec | None:
        for c in self.calls:
            if c.comm == comm and c.seq == seq and not c.flags & SKIPPED:
                return c
        return None

    def last_activity(self) -> float:
        ends = [c.end for c in self.calls if c.end]
        return max([self.beat, *ends]) if ends or self.beat else 0.0

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self, recurse=False)
        d["calls"] = [c.to_json() for c in self.calls]
        d["waiting"] = None if self.waiting is None else self.waiting.to_json()
        return d


def members(comm: str, of: RankState, states: dict[int, RankState | None], shape: dict[str, int],
            coords_of: dict[int, dict[str, int]]) -> list[int]:
    """The world ranks of `of`'s communicator named `comm`."""
    if "[" in comm:
        axis, rest = comm.split("[", 1)
        axes, allowed = (axis,), {int(x) for x in rest.rstrip("]").split(",") if x}
    else:
        axes, allowed = tuple(comm.split(",")), None
    out = []
    for r, c in coords_of.items():
        if all(c[a] == of.coords.get(a, 0) for a in AXES if a not in axes):  # a record without an axis: 0 on it
            if allowed is None or c[axes[0]] in allowed:
                out.append(r)
    return sorted(out)


def grid_coords(shape: dict[str, int]) -> dict[int, dict[str, int]]:
    """World rank -> coordinates, row-major over AXES (as Mesh's Cart_create with reorder=False)."""
    n = int(np.prod([shape.get(a, 1) for a in AXES]))
    out = {}
    for r in range(n):
        rem, c = r, {}
        for a in reversed(AXES):
            c[a] = rem % shape.get(a, 1)
            rem //= shape.get(a, 1)
        out[r] = c
    return out


def _ranks(rs: list[int]) -> str:
    rs = sorted(set(rs))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}" if j > i + 1 else f"{rs[i]},{rs[j]}")
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(parts)


STOPPED = "kill -STOP, Ctrl-Z or a debugger; SIGCONT resumes it"


def _doing(s: RankState, now: float, ended: bool = False) -> str:
    if s.alive is False:
        return "it is dead (its process is gone)"
    if s.stopped:
        return f"its process {s.pid} is stopped: {STOPPED}"
    if s.waiting is not None:
        return f"it waits in {s.waiting.label()} since {now - s.wait_since:.1f} s"
    last = next((c for c in reversed(s.calls) if not c.flags & SKIPPED), None)
    since = now - s.last_activity() if s.last_activity() else float("nan")
    what = f"last call {last.label()} at step {last.step}" if last else "no call yet"
    if ended:
        return f"it was outside MPI when the job ended, {what}: the rank that died, or stuck before it"
    return f"it is outside MPI since {since:.1f} s, {what}: stuck in compute, hung, or slow"


@attrs.define
class _Finding:
    priority: int  # 0 dead, 1 called something else / skipped, 2 outside MPI, 3 waits elsewhere
    age: float  # how long its waiters wait (older first)
    culprit: int
    text: str  # without the waiters
    waiters: set[int] = attrs.Factory(set)
    call: str = ""



def diagnose(states: dict[int, RankState | None], now: float, timeout: float, flight_dir: str = "",
             title: str = "", ended: bool = False) -> tuple[str, list[int]]:
    """The diagnosis block and the ranks it blames first (tests), from every rank's state
    (None: no ring file for that rank). `title` replaces the first line; `ended`: the job
    is over (a post-mortem), so "outside MPI" means "when it ended", not "now"."""
    d = _Diagnosis(states, now, ended)
    d.dead_and_skipped()
    d.collective_waits()
    d.p2p_waits()
    d.stuck_inside(timeout)
    ordered = d.ordered()
    lines = [title or f"numesh flight recorder: a collective did not finish within {timeout:g} s; "
                      f"every rank's last calls are in {flight_dir or 'OUT/flight'}"]
    lines += d.cause_lines(ordered)
    lines += d.rank_lines()
    return "\n".join(lines), [f.culprit for f in ordered]


class _Diagnosis:
    """The findings about one set of rank states, gathered by `diagnose` in a fixed order
    (which breaks ties between findings of the same priority and age)."""

    def __init__(self, states: dict[int, RankState | None], now: float, ended: bool):
        self.states, self.now, self.ended = states, now, ended
        self.known = [s for s in states.values() if s is not None]
        self.shape = self.known[0].shape if self.known else {}
        self.coords_of = grid_coords(self.shape) if self.known else {}
        self.waiting = [s for s in self.known if s.waiting is not None]
        self.findings: dict[tuple[int, str], _Finding] = {}

    def add(self, priority: int, culprit: int, call: str, text: str, waiters: list[int], age: float) -> None:
        f = self.findings.setdefault((culprit, call), _Finding(priority, age, culprit, text, call=call))
        f.priority, f.age = min(f.priority, priority), max(f.age, age)
        f.waiters.update(waiters)

    def who(self, r: int) -> str:
        s = self.states.get(r)
        return f"rank {r} ({s.where()})" if s is not None else f"rank {r}"

    def dead_and_skipped(self) -> None:
        """Ranks without a record, dead ranks, and every call an injected fault skipped."""
        for r in sorted(self.states):
            s = self.states[r]
            if s is None:
                self.add(0, r, "", f"rank {r} left no flight record (dead before training, or another file system)",
                         [], 0.0)
                continue
            if s.alive is False:
                self.add(0, r, "", f"{self.who(r)} is dead (its process {s.pid} is gone){_last(s)}", [], 0.0)
            for c in s.calls:
                if c.flags & SKIPPED:
                    self.add(1, r, c.label(),
                             f"{self.who(r)} skipped {c.label()} at step {c.step} (returned without calling MPI)", [],
                             0.0)

    def collective_waits(self) -> None:
        """Collectives: the waiters grouped by (communicator instance, sequence number); each
        member of a group that did not enter the call the others wait in is blamed."""
        groups: dict[tuple[str, int, tuple[int, ...]], list[RankState]] = {}
        for s in self.waiting:
            w = s.waiting
            if w.op in COLLECTIVES or "[" in w.comm:
                key = (w.comm, w.seq, tuple(members(w.comm, s, self.states, self.shape, self.coords_of)))
                groups.setdefault(key, []).append(s)
        for (comm, seq, group), ws in groups.items():
            op, nbytes = self.reference(comm, seq, ws)
            good = [s.rank for s in ws if (s.waiting.op, s.waiting.nbytes) == (op, nbytes)]
            age = max(self.now - s.wait_since for s in ws)
            for m in group:
                if m not in good:
                    self._blame_member(m, comm, seq, op, nbytes, good, age)

    def reference(self, comm: str, seq: int, ws: list[RankState]) -> tuple[str, int]:
        """What call #seq on `comm` should be: the most common (op, bytes) among every rank's
        entry for it, world-wide (every instance of a communicator runs the same program, so
        a two-rank group still has a majority), ties broken by the lowest rank."""
        votes: Counter = Counter()
        first: dict[tuple[str, int], int] = {}
        for s in self.known:
            e = s.find(comm, seq)
            if e is not None:
                votes[(e.op, e.nbytes)] += 1
                first.setdefault((e.op, e.nbytes), s.rank)
        if not votes:
            votes.update((s.waiting.op, s.waiting.nbytes) for s in ws)
            first = {(s.waiting.op, s.waiting.nbytes): s.rank for s in reversed(ws)}
        return max(votes, key=lambda k: (votes[k], -first.get(k, 0)))

    def _blame_member(self, m: int, comm: str, seq: int, op: str, nbytes: int, good: list[int], age: float) -> None:
        """Why member `m` of a group is not in call #seq on `comm` with the `good` waiters."""
        label = f"{op} over {comm} #{seq}"
        sm = self.states.get(m)
        if sm is None or sm.alive is False:
            self.add(0, m, label, f"{self.who(m)} is dead: it never entered {label}", good, age)
            return
        e = sm.find(comm, seq)
        if e is not None:
            if (e.op, e.nbytes) != (op, nbytes):
                self.add(1, m, label, f"{self.who(m)} called {e.op} of {e.nbytes} B as {comm} #{seq} (step {e.step}) "
                                      f"where the others called {op} of {nbytes} B", good, age)
            return  # it entered this one: it is not why the others wait
        if sm.counts.get(comm, 0) <= seq:
            prio = 3 if sm.waiting is not None and not sm.stopped else 2
            self.add(prio, m, label, f"{self.who(m)} never entered {label} ({_doing(sm, self.now, self.ended)})", good,
                     age)

    def p2p_waits(self) -> None:
        """Point-to-point: the waiter's neighbours along the axis are its possible peers."""
        for s in self.waiting:
            w = s.waiting
            if w.op in COLLECTIVES or "[" in w.comm:
                continue
            axis = w.comm.split(",")[0]
            for d in (-1, 1):
                c = {a: s.coords.get(a, 0) for a in AXES}  # a record without an axis: 0 on it
                c[axis] += d
                if 0 <= c[axis] < self.shape.get(axis, 1):
                    self._blame_neighbour(s, axis, next(r for r, rc in self.coords_of.items() if rc == c))

    def _blame_neighbour(self, s: RankState, axis: str, n: int) -> None:
        sn = self.states.get(n)
        label = f"the {axis} send/recv that {self.who(s.rank)} waits for"
        if sn is None or sn.alive is False:
            self.add(0, n, label, f"{self.who(n)} is dead: it never sent or received what {axis} neighbours wait for",
                     [s.rank], self.now - s.wait_since)
        elif sn.waiting is None:
            self.add(2, n, f"{axis} p2p", f"{self.who(n)} never entered the {axis} send/recv its neighbours wait for "
                                          f"({_doing(sn, self.now, self.ended)})", [s.rank], self.now - s.wait_since)

    def stuck_inside(self, timeout: float) -> None:
        """Ranks that entered the call their peers wait in, so no finding above names them,
        but cannot finish it: a stopped process (SIGSTOP and a debugger are seen on the
        reader's host), or one that waits past the time-out without having given up (it has
        not run its wait loop since: stopped, or starved of CPU; ranked with the waits
        elsewhere, behind any rank known to be outside MPI). MPI progresses a collective only
        while every member polls, so its peers wait for it."""
        blamed = {f.culprit for f in self.findings.values()}
        for s in self.waiting:
            w, age = s.waiting, self.now - s.wait_since
            if s.rank in blamed or s.alive is False:
                continue
            if s.stopped:
                prio, why = 2, f"its process {s.pid} is stopped: {STOPPED}"
            elif timeout > 0 and not self.ended and s.failed is None and age > timeout + STALE_S:
                prio, why = 3, (f"it has not given up though past the {timeout:g} s time-out: its process does "
                                f"not run (stopped, or starved of CPU)")
            else:
                continue
            self.add(prio, s.rank, w.label(), f"{self.who(s.rank)} entered {w.label()} but cannot finish it ({why})",
                     self.peers_waiting(s), age)

    def peers_waiting(self, s: RankState) -> list[int]:
        """The other waiting ranks whose call's communicator includes rank `s`."""
        return [o.rank for o in self.waiting
                if o.rank != s.rank and s.rank in members(o.waiting.comm, o, self.states, self.shape, self.coords_of)]

    def ordered(self) -> list[_Finding]:
        """The findings, most likely cause first, then an injected fault nobody waited on yet
        (e.g. a crash the launcher cut short)."""
        ordered = sorted(self.findings.values(), key=lambda f: (f.priority, -f.age, f.culprit))
        noted = [s for s in self.known if s.note and not any(f.culprit == s.rank for f in ordered)]
        for s in noted:
            ordered.append(_Finding(2, 0.0, s.rank, f"{self.who(s.rank)}: injected {s.note}"))
        return ordered

    def cause_lines(self, ordered: list[_Finding]) -> list[str]:
        lines = []
        for i, f in enumerate(ordered):
            text = f.text
            if f.waiters:
                ws = sorted(f.waiters)
                states = self.states
                wait_calls = {states[r].waiting.label() for r in ws if states.get(r) and states[r].waiting}
                what = "it" if f.call and wait_calls == {f.call} else " / ".join(sorted(wait_calls))
                text += (f"; {_ranks(ws)} {'was' if len(ws) == 1 else 'were'} waiting in {what} when the job ended"
                         if self.ended
                         else f"; {_ranks(ws)} wait{'s' if len(ws) == 1 else ''} in {what} since {f.age:.1f} s")
            lines.append(("cause: " if i == 0 else "also:  ") + text)
        if not ordered:
            lines.append("cause: unknown: every rank waits in a call its peers also entered "
                         "(a peer on another node, or MPI itself, may be stuck)")
        return lines

    def rank_lines(self) -> list[str]:
        lines = ["ranks:"]
        for r in sorted(self.states):
            s = self.states[r]
            if s is None:
                lines.append(f"  rank {r}: no flight record")
                continue
            now = self.now
            state = ("dead" if s.alive is False else
                     f"waits in {s.waiting.label()} ({s.waiting.op} of {s.waiting.nbytes} B) "
                     f"since {now - s.wait_since:.1f} s"
                     if s.waiting is not None else f"outside MPI since {now - s.last_activity():.1f} s")
            extra = f"; gave up: {s.failed}" if s.failed else ""
            note = f"; injected: {s.note}" if s.note else ""
            halted = f"; process {s.pid} stopped" if s.stopped and s.alive is not False else ""
            lines.append(f"  rank {r} ({s.where()}) step {s.step}: {state}{extra}{halted}{note}")
        return lines


def _last(s: RankState) -> str:
    last = next((c for c in reversed(s.calls) if not c.flags & SKIPPED), None)
    return f"; its last call was {last.label()} at step {last.step}" if last else ""

