"""A timeline of a run in the Chrome trace-event format (Perfetto, chrome://tracing).

One `Tracer` per rank is both an `Observer` of the mesh (every collective and point-to-point
call becomes a complete "X" event with its op, axes and bytes) and the recorder through which
the pipeline executor and the training loop add their spans (forward/backward/weight of each
stage chunk and micro-batch, optimiser step, data loading, evaluation, checkpoint I/O) and the
flow arrows of pipeline messages. The executor and the loop hold it as `trace`, None when
tracing is off, so off costs one `is None` test per action.

Events are buffered per rank as tuples and turned into JSON once, at the end: every rank
encodes its events as UTF-8 JSON and rank 0 gathers the bytes (`Gatherv`, buffer-based, no
pickle), merges them and writes one file. A job that dies never gets there (a killed rank
makes mpiexec SIGKILL the others), so each rank also appends its events to a part file as it
goes, at step boundaries (numesh/observe/spool.py); `recover` merges what the parts hold
into the same trace, marked partial, and a clean end removes them.

Clocks. Each rank times with `time.perf_counter`. At start-up the ranks are aligned to rank
0: a few ping-pong rounds per rank, keeping the round with the smallest round-trip time; the
offset is rank 0's clock at the middle of that round minus ours, and its uncertainty is half
that round-trip. A second exchange after correction measures the residual skew, which goes
into the trace's metadata (`otherData.clock`) and the report.

Waiting for peers. A collective's "X" event spans the whole call (for a nonblocking one, from
issue to completion, on a thread of its own, "async comm", because it overlaps other spans).
Its `wait_ms` argument is the part spent waiting for the last peer to arrive: computed on rank
0 when the events are merged, as `max(begin of every member of the communicator) - my
begin`, clipped to the call, from the aligned begin timestamps (the k-th collective on a
communicator is the same call on all its members). Nothing is exchanged at run time for it;
its error is the residual clock skew. `transfer_ms` is the rest of the call.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from numesh.base.files import write_atomic
from numesh.base.process import alive
from numesh.mesh.hook import Observer
from numesh.mesh.mesh import AXES, Group, Mesh
from numesh.observe.spool import SpoolWriter, clear, part_path, read_parts

P2P_OPS = ("send", "recv", "sendrecv")
MAIN_TID, ASYNC_TID = 0, 1
MAX_EVENTS = 2_000_000  # per rank; later events are counted as dropped (a long run's trace stays bounded)
# the spool is flushed at the end of a step (or evaluation, or checkpoint) this long after
# the last flush: a kill loses at most this much of the run, and short steps pay for one
# write every FLUSH_S, not one a step. Inside a step it is flushed only after LONG_FLUSH_S,
# so that a long step's events survive a kill too while a short step's timing is untouched.
FLUSH_S, LONG_FLUSH_S = 0.5, 2.0
BOUNDARIES = frozenset({"step", "eval", "checkpoint"})


def axes_label(axes: Any) -> str:
    """"dp", "pp+dp", or "pp[0,3]" for a group of some ranks of one axis."""
    if isinstance(axes, Group):
        return f"{axes.axis}[{','.join(map(str, axes.members))}]"
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return "+".join(a for a in AXES if a in names)


def label_axes(label: str) -> tuple[str, ...]:
    """The axis names of a label from `axes_label`."""
    return tuple(label.split("[")[0].split("+"))


def align_clocks(comm: MPI.Comm, rounds: int = 8) -> tuple[float, float, float]:
    """(offset to add to this rank's perf_counter to get rank 0's, its uncertainty (half the
    best round-trip), the residual offset measured after correction), all in seconds.
    Collective over `comm`; rank 0 answers every other rank in turn."""
    rank, size = comm.Get_rank(), comm.Get_size()
    comm.Barrier()
    buf = np.zeros(1, np.float64)

    def exchange(offset: float) -> tuple[float, float]:
        best = (math.inf, 0.0)  # (rtt, offset estimate)
        for peer in range(1, size):
            for _ in range(rounds):
                if rank == 0:
                    comm.Recv(buf, source=peer, tag=77)
                    buf[0] = time.perf_counter()
                    comm.Send(buf, dest=peer, tag=78)
                elif rank == peer:
                    t1 = time.perf_counter()
                    comm.Send(buf, dest=0, tag=77)
                    comm.Recv(buf, source=0, tag=78)
                    t2 = time.perf_counter()
                    rtt = t2 - t1
                    if rtt < best[0]:
                        best = (rtt, float(buf[0]) - (t1 + t2) / 2 - offset)
        return best

    if size == 1:
        return 0.0, 0.0, 0.0
    rtt, offset = exchange(0.0)
    _, residual = exchange(offset)
    return (offset, rtt / 2, residual) if rank else (0.0, 0.0, 0.0)


class Tracer(Observer):
    """This rank's trace: an observer of the mesh's calls plus the spans and flows the
    executor and the loop record (see the module docstring)."""

    def __init__(self, mesh: Mesh, align_rounds: int = 8):
        self.mesh, self.rank = mesh, mesh.rank
        self.coords = dict(mesh.coords)
        self.offset, self.uncertainty, self.residual = align_clocks(mesh.world, align_rounds)
        self.origin = time.perf_counter() + self.offset  # rank 0's clock, the same instant on every rank
        self.run = time.time_ns()  # names this run's spool parts (an OUT may hold an older run's)
        if mesh.world.Get_size() > 1:
            self.origin, self.run = mesh.world.bcast((self.origin, self.run) if self.rank == 0 else None, root=0)
        # (ph, name, cat, tid, t0, t1, args) in this rank's perf_counter seconds
        self.events: list[tuple] = []
        self.dropped = 0
        self.meta: dict[str, Any] = {}  # per-rank facts the report needs (the loop fills it)
        self.step = -1  # the optimiser step being run (set by the loop)
        self.spool: SpoolWriter | None = None  # set by `start_spool`
        self._spooled, self._flushed_at = 0, 0.0  # events already in the spool; when it was last flushed

    now = staticmethod(time.perf_counter)

    def _add(self, ev: tuple) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append(ev)
        else:
            self.dropped += 1

    # ------------------------------------------------------------------ Observer

    def begin(self, op: str, axes: Any, nbytes: int) -> list:
        return [op, axes, nbytes, time.perf_counter(), len(self.events)]

    def end(self, token: list) -> None:
        op, axes, nbytes, t0, n0 = token
        # nothing recorded since it began: a blocking call (or issued and waited at once),
        # which nests in the main thread's spans; otherwise it overlapped them
        tid = MAIN_TID if len(self.events) == n0 else ASYNC_TID
        self._add(("X", op, "comm", tid, t0, time.perf_counter(),
                   {"op": op, "axes": axes_label(axes), "bytes": nbytes}))

    # ------------------------------------------------------------------ spans and flows

    def span(self, name: str, cat: str, t0: float, t1: float | None = None, args: dict | None = None) -> None:
        """A complete event from `t0` to `t1` (now when None), on the main thread."""
        now = time.perf_counter()
        self._add(("X", name, cat, MAIN_TID, t0, now if t1 is None else t1, args))
        if self.spool is not None and now - self._flushed_at >= (FLUSH_S if cat in BOUNDARIES else LONG_FLUSH_S):
            self.flush()

    def flow_start(self, fid: int, name: str = "p2p") -> None:
        self._add(("s", name, "flow", MAIN_TID, time.perf_counter(), None, {"id": fid}))

    def flow_end(self, fid: int, t: float, name: str = "p2p") -> None:
        self._add(("f", name, "flow", MAIN_TID, t, None, {"id": fid}))

    # ------------------------------------------------------------------ the spool

    def start_spool(self, parts_dir: Path, meta: dict) -> None:
        """From now on, append this rank's events to its part in `parts_dir` as the run goes
        (numesh/observe/spool.py), headed by the report's `meta`. Collective: rank 0 first
        clears the parts an earlier run in the same OUT left."""
        if self.rank == 0:
            clear(parts_dir)
        self.mesh.world.Barrier()
        header = {"run": self.run, "origin": self.origin, "pid": os.getpid(), "host": socket.gethostname(),
                  "rank": self.rank_info(), "meta": meta}
        self.spool = SpoolWriter(part_path(parts_dir, self.rank), header)
        self._flushed_at = -math.inf  # the first step is flushed as soon as it ends

    def flush(self) -> None:
        """Append the events recorded since the last flush to the spool. The flush is itself
        a span ("trace flush"), so the time it takes is in the trace, not hidden in another."""
        t0 = time.perf_counter()
        try:
            self.spool.append(self.events[self._spooled:], self.dropped)
        except OSError as e:  # a full disk costs the run its spool, not its training
            print(f"[rank {self.rank}] trace: cannot write {self.spool.path} ({e.strerror or e}); "
                  "a job that dies from now on leaves no trace", file=sys.stderr, flush=True)
            self.spool = None
            return
        self._spooled = len(self.events)
        self._add(("X", "trace flush", "trace", MAIN_TID, t0, time.perf_counter(), None))
        self._flushed_at = time.perf_counter()

    def _drop_spool(self) -> None:
        """After trace.json is written (collective): every rank removes its part, rank 0 the folder."""
        if self.spool is None:
            return
        comm = self.mesh.world
        comm.Barrier()  # rank 0 has written trace.json
        self.spool.remove()
        comm.Barrier()
        if self.rank == 0:
            try:
                self.spool.path.parent.rmdir()
            except OSError:
                pass
        self.spool = None

    # ------------------------------------------------------------------ output

    def process_label(self) -> str:
        return f"rank {self.rank} (" + ",".join(f"{a}={self.coords[a]}" for a in AXES) + ")"

    def chrome_events(self) -> list[dict]:
        """This rank's events as Chrome trace-event dicts, in µs since the common origin."""
        return chrome_events(self.rank, self.process_label(), self.offset - self.origin, self.events)

    def rank_info(self) -> dict[str, Any]:
        return {"rank": self.rank, "coords": self.coords, "label": self.process_label(),
                "clock_offset_s": self.offset, "clock_uncertainty_s": self.uncertainty,
                "clock_residual_s": self.residual, "dropped_events": self.dropped, **self.meta}

    def write(self, path: str | Path, meta: dict | None = None) -> Path | None:
        """Gather every rank's events on rank 0 and write one trace file there (collective
        over the world). Returns the path on rank 0, None elsewhere."""
        comm = self.mesh.world
        mine = json.dumps({"events": self.chrome_events(), "rank": self.rank_info()}, allow_nan=False).encode()
        sizes = comm.gather(len(mine), root=0)
        data = np.frombuffer(mine, np.uint8)
        recv = None
        if self.rank == 0:
            recv = np.empty(sum(sizes), np.uint8)
            comm.Gatherv(data, [recv, sizes], root=0)
        else:
            comm.Gatherv(data, None, root=0)
        out = None
        if self.rank == 0:
            parts, at = [], 0
            for n in sizes:
                parts.append(json.loads(recv[at:at + n].tobytes()))
                at += n
            out = Path(path)
            write_atomic(out, json.dumps(merge(parts, {**(meta or {}), "run": self.run}), allow_nan=False))
        self._drop_spool()
        return out


def chrome_events(pid: int, label: str, shift: float, events: list[tuple]) -> list[dict]:
    """One rank's raw events (the tracer's tuples, in its perf_counter seconds) as Chrome
    trace-event dicts in µs since the common origin (`shift`: its clock offset minus the
    origin), in process `pid` named `label`."""
    out: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": MAIN_TID, "args": {"name": "main"}},
    ]
    lanes: list[float] = []  # end of the last call on each async lane: overlapping calls get lanes of their own
    for ph, name, cat, tid, t0, t1, args in sorted(events, key=lambda e: e[4]):
        if tid == ASYNC_TID:
            lane = next((i for i, end in enumerate(lanes) if end <= t0), len(lanes))
            lanes[lane:lane + 1] = [t1]
            tid = ASYNC_TID + lane
        ev: dict[str, Any] = {"ph": ph, "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": (t0 + shift) * 1e6}
        if ph == "X":
            ev["dur"] = (t1 - t0) * 1e6
            if args:
                ev["args"] = args
        else:
            ev["id"] = args["id"]
            if ph == "f":
                ev["bp"] = "e"  # bind to the slice enclosing ts (the receive)
        out.append(ev)
    out += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": ASYNC_TID + i, "args": {"name": f"async comm {i}"}}
            for i in range(len(lanes))]
    return out


def recover(parts_dir: Path) -> dict | None:
    """The trace a run's spool parts hold (numesh/observe/spool.py), merged as `Tracer.write`
    merges the gathered events, for a job that died before writing trace.json (or one still
    going); None when no part holds an event. `otherData.numesh.partial` says which ranks
    left a part, the last step each recorded whole, and which still run (on this host)."""
    parts = read_parts(parts_dir)
    if not any(p.events for p in parts):
        return None  # the job died before any rank ended a step: nothing to show
    merged, last = [], {}
    for p in parts:
        info = {**p.header["rank"], "dropped_events": p.dropped}
        merged.append({"events": chrome_events(info["rank"], info["label"], info["clock_offset_s"] - p.header["origin"],
                                               [tuple(e) for e in p.events]),
                       "rank": info})
        steps = [e[6]["step"] for e in p.events if e[2] == "step"]
        last[str(info["rank"])] = max(steps) if steps else None
    meta = parts[0].header.get("meta") or {}
    size = int(np.prod(list(meta.get("mesh", {}).values()) or [len(parts)]))
    recorded = [p.header["rank"]["rank"] for p in parts]
    here = socket.gethostname()
    running = [p.header["rank"]["rank"] for p in parts
               if p.header.get("host") == here and p.header.get("pid", 0) > 0 and alive(p.header["pid"])]
    partial = {"parts": str(parts_dir), "ranks_recorded": recorded, "running": running,
               "ranks_missing": [r for r in range(size) if r not in recorded], "last_step": last}
    return merge(merged, {**meta, "run": parts[0].header["run"], "partial": partial})


def merge(parts: list[dict], meta: dict) -> dict:
    """One Chrome trace from every rank's {"events", "rank"}: events sorted by time, each
    collective given its `wait_ms`/`transfer_ms`, clock facts in `otherData`."""
    ranks = sorted((p["rank"] for p in parts), key=lambda r: r["rank"])
    events = [e for p in parts for e in p["events"]]
    if not any(r["dropped_events"] for r in ranks):
        add_peer_waits(events, {r["rank"]: r["coords"] for r in ranks})
    events.sort(key=lambda e: (e.get("ts", -1.0), e["pid"]))
    clock = {
        "method": "ping-pong with rank 0, min round-trip of several rounds",
        "max_uncertainty_us": max(r["clock_uncertainty_s"] for r in ranks) * 1e6,
        "max_residual_us": max(abs(r["clock_residual_s"]) for r in ranks) * 1e6,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"numesh": {**meta, "clock": clock, "ranks": ranks}}}


def comm_key(label: str, coords: dict[str, int]) -> tuple:
    """Which communicator a call on `label` from a rank at `coords` used: the members share
    their coordinates on every other axis."""
    axes = label_axes(label)
    return (label, tuple(coords.get(a, 0) for a in AXES if a not in axes))  # a trace without an axis: 0 on it


def add_peer_waits(events: list[dict], coords: dict[int, dict[str, int]]) -> None:
    """Give every collective "X" event `wait_ms` (from its begin until the last member of
    its communicator began the same call) and `transfer_ms` (the rest), in place."""
    calls: dict[tuple, dict[int, list[dict]]] = {}
    for e in events:
        a = e.get("args")
        if e["ph"] != "X" or e.get("cat") != "comm" or a["op"] in P2P_OPS:
            continue
        calls.setdefault(comm_key(a["axes"], coords[e["pid"]]), {}).setdefault(e["pid"], []).append(e)
    for per_rank in calls.values():
        lists = [sorted(v, key=lambda e: e["ts"]) for v in per_rank.values()]
        for same in zip(*lists):  # the k-th call on a communicator is one call on all members
            last = max(e["ts"] for e in same)
            for e in same:
                wait = min(max(last - e["ts"], 0.0), e["dur"])
                e["args"]["wait_ms"] = wait / 1e3
                e["args"]["transfer_ms"] = (e["dur"] - wait) / 1e3
