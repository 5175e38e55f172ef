"""`numesh report OUT`: theory beside measurement, from a traced run's OUT/trace.json.

Pure functions over the trace (a dict as `json.load` gives it); `numesh train --trace`
prints the same report at the end. For a job that died before writing trace.json,
`recover` first rebuilds it from the events its ranks had flushed (a partial trace: the
report covers the whole steps it holds and says so). What it measures, per rank and optimiser step (the
"step" spans; the first step is left out as warm-up when there are more):

* **Time per category**, a partition of each step's span, so the categories sum to the
  step time. Each instant goes to the first of: exposed communication (a blocking
  collective, not a pipeline message), bubble (waiting for a pipeline message), compute
  (an F/B/W span), bubble (anything else inside the schedule's span: the stage idles),
  exposed communication (a nonblocking collective still in flight while nothing else
  runs: the rank is waiting for it), optimiser, other (data loading, the loss all-reduce's
  bookkeeping, Python between the pieces).
* **Pipeline bubble**: per step and pipeline (the pp ranks of one dp×tp coordinate), the
  makespan from the first stage's start to the last one's end of the schedule (clocks
  aligned), each stage's idle fraction `1 - busy/makespan` and the bubble `1 - Σbusy /
  (p·makespan)`, beside `simulate` of the same schedule, with unit costs, with the
  mean measured F, B and W times, with each stage's own means, and with each step's own
  measured action times (the schedule's bubble for exactly the work that ran: what the
  measurement has beyond it is overhead, pipeline messages and code between actions).
* **Bytes per axis per step**: every call's payload (sends, not receives) by axes and op,
  beside `numesh.perf.formulas.step_bytes` for this rank's units (with ep, the experts' token
  all-to-alls from the routing counts each step span records).
* **MFU**: achieved FLOP/s (FLOPs per token × tokens per step / mean step time) over the
  job's peak (`--peak-flops`, or the cores the job uses times one core's matmul peak,
  the best reading kept per machine: `numesh.host.runtime.job_peak_flops`), not clamped
  (`numesh.perf.formulas.mfu`).
* **Slowest rank**: the one the others wait for. A rank's waiting is the time it was
  blocked in communication while a collective's last member had not begun it yet
  (`wait_ms`, from aligned begin times; several nonblocking calls waiting at once count
  once, and only while the rank is blocked), plus its time in pipeline receives; the
  slowest rank waits least, and it is slower by the median of the other ranks' waiting
  minus its own, per step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from numesh.base.errors import TraceError
from numesh.base.files import write_atomic
from numesh.observe.spool import PARTS_DIR
from numesh.observe.trace import recover as recover_trace
from numesh.perf import formulas
from numesh.pipeline.schedules import make_schedule

CATEGORIES = ("compute", "comm", "bubble", "optimizer", "other")
P2P = ("send", "recv", "sendrecv")
# priorities of what an instant of a step is spent on (higher wins); see the module docstring
_PRIO = {"other": 0, "optimizer": 1, "async_comm": 2, "idle_in_pipeline": 3, "compute": 4, "p2p": 5, "comm": 6}
_CAT_OF = {"other": "other", "optimizer": "optimizer", "async_comm": "comm", "idle_in_pipeline": "bubble",
           "compute": "compute", "p2p": "bubble", "comm": "comm"}


_REWRITE = "write a new one with `numesh train --trace --out OUT`"


def recover(out: Path) -> dict | None:
    """The trace of a `--trace` job in OUT that has no whole OUT/trace.json of its own,
    rebuilt from the events its ranks flushed to OUT/trace.parts (numesh/observe/spool.py),
    marked partial; written to OUT/trace.json (for Perfetto) once none of its ranks runs.
    None when trace.json is that run's whole trace, or there are no parts."""
    trace = recover_trace(out / PARTS_DIR)
    if trace is None or _whole_trace_of(out / "trace.json", meta(trace)["run"]):
        return None
    if not meta(trace)["partial"]["running"]:  # a job still going writes its own at the end
        try:
            write_atomic(out / "trace.json", json.dumps(trace, allow_nan=False))
        except OSError:  # a read-only OUT: the report is still made, from the parts
            pass
    return trace


def _whole_trace_of(path: Path, run: int) -> bool:
    """Whether `path` is the whole trace (not a rebuilt partial one) of run `run`."""
    try:
        m = meta(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError):
        return False
    return "partial" not in m and m.get("run") == run


def load(path: str | Path) -> dict:
    """A trace from OUT (a run directory) or the trace file itself; one that cannot be read,
    is cut off or is not numesh's (no events, no numesh metadata) is a TraceError naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / "trace.json"
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise TraceError(f"{path} cannot be read as a trace ({why}): {_REWRITE}") from None
    if not (isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)
            and isinstance(trace.get("otherData"), dict) and isinstance(meta(trace), dict) and meta(trace)):
        raise TraceError(f"{path} is not a numesh trace (no traceEvents or no otherData.numesh): {_REWRITE}")
    return trace


def report_of(path: str | Path, trace: dict | None = None) -> dict[str, Any]:
    """`build(load(path))`, or `build(trace)` for a trace already in hand (one `recover`
    rebuilt); a trace whose events or metadata lack what the report needs (a hand-edited or
    foreign file) is a TraceError naming the file and what was missing."""
    trace = load(path) if trace is None else trace
    try:
        return build(trace)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, StopIteration, ZeroDivisionError) as e:
        raise TraceError(f"{path} is not a complete numesh trace ({type(e).__name__}: {e}): {_REWRITE}") from None


def meta(trace: dict) -> dict:
    return trace.get("otherData", {}).get("numesh", {})


def rank_events(trace: dict) -> dict[int, list[dict]]:
    """Each rank's "X" events, by start time."""
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(e["pid"], []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: e["ts"])
    return out


def step_windows(events: list[dict], skip_first: bool = True) -> list[tuple[int, float, float]]:
    """(step, start, end) in µs of each step span, the first left out when there are more."""
    steps = [(e["args"]["step"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "step"]
    steps.sort(key=lambda s: s[1])
    return steps[1:] if skip_first and len(steps) > 1 else steps


def _within(events: list[dict], start: float, end: float) -> list[dict]:
    return [e for e in events if e["ts"] >= start and e["ts"] < end]


def _kind(e: dict) -> str | None:
    cat = e.get("cat")
    if cat == "comm":
        blocking = e.get("tid", 0) == 0
        if e["args"]["op"] in P2P:
            return "p2p" if blocking else None  # sends in flight: the stage is computing or idle anyway
        return "comm" if blocking else "async_comm"
    if cat == "compute":
        return "compute"
    if cat == "pipeline":
        return "idle_in_pipeline"
    if cat == "optimizer":
        return "optimizer"
    return None


def _segments(events: list[dict], start: float, end: float, extra: list[float] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Cut [start, end) at every event boundary (and `extra`): (cuts, priority of what each
    piece is spent on, `_PRIO`)."""
    spans = []
    for e in events:
        k = _kind(e)
        a, b = max(e["ts"], start), min(e["ts"] + e["dur"], end)
        if k is not None and b > a:
            spans.append((a, b, _PRIO[k]))
    points = [start, end] + [s[0] for s in spans] + [s[1] for s in spans] + [x for x in extra if start < x < end]
    cuts = np.unique(np.array(points, dtype=np.float64))
    prio = np.zeros(len(cuts) - 1, dtype=np.int64)
    for a, b, p in spans:
        i, j = np.searchsorted(cuts, a), np.searchsorted(cuts, b)
        np.maximum(prio[i:j], p, out=prio[i:j])
    return cuts, prio


def categorize(events: list[dict], start: float, end: float) -> dict[str, float]:
    """µs of [start, end) spent per category (CATEGORIES), a partition of the window."""
    cuts, prio = _segments(events, start, end)
    widths = np.diff(cuts)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, p in _PRIO.items():
        out[_CAT_OF[name]] += float(widths[prio == p].sum())
    return out


def time_breakdown(trace: dict) -> dict[int, dict[str, float]]:
    """Per rank, the mean ms per step of each category, and `step_ms`."""
    out = {}
    for rank, evs in rank_events(trace).items():
        wins = step_windows(evs)
        total = dict.fromkeys(CATEGORIES, 0.0)
        step = 0.0
        for _, a, b in wins:
            for k, v in categorize(_within(evs, a, b), a, b).items():
                total[k] += v
            step += b - a
        n = max(len(wins), 1)
        out[rank] = {**{k: v / n / 1e3 for k, v in total.items()}, "step_ms": step / n / 1e3,
                     "data_ms": sum(e["dur"] for _, a, b in wins for e in _within(evs, a, b)
                                    if e.get("cat") == "data") / n / 1e3}
    return out


def _ranks(trace: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in meta(trace).get("ranks", [])}


def pipeline_bubble(trace: dict) -> dict[str, Any]:
    """Measured bubble and per-stage idle (means over steps and pipelines) beside the schedule's theory."""
    m = meta(trace)
    p, evs = m["mesh"]["pp"], rank_events(trace)
    sched = make_schedule(m["schedule"], p, m["micro_batches"], m["virtual_stages"])
    durations: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    per_stage: dict[tuple[str, int], list[float]] = {}  # (kind, global stage) -> durations
    bubbles = _Bubbles(p)
    for members in _pipelines(_ranks(trace)).values():
        bubbles.add(sched, {s: _step_spans(evs.get(r, []), durations, per_stage) for s, r in members.items()})
    mean = {k: (statistics.fmean(v) / 1e3 if v else 0.0) for k, v in durations.items()}
    if sched.split_backward:
        measured_costs = (mean["F"], mean["B"], mean["W"])
    else:
        measured_costs = (mean["F"], mean["B"], 0.0)  # B is the whole backward
    unit = formulas.bubble(sched)
    with_costs = formulas.bubble(sched, *measured_costs) if mean["F"] > 0 else unit
    # each stage's own costs: the first stage also embeds, the last runs the head and loss
    stage_costs = {k: statistics.fmean(v) / 1e3 for k, v in per_stage.items()}
    with_stage_costs = formulas.bubble(sched, *measured_costs, stage_costs=stage_costs) if mean["F"] > 0 else unit
    return {
        "schedule": sched.name, "p": p, "m": sched.m, "v": sched.v,
        "measured": statistics.fmean(bubbles.fractions) if bubbles.fractions else 0.0,
        "measured_idle_per_stage": [statistics.fmean(x) if x else 0.0 for x in bubbles.idle],
        "theory_unit_costs": unit["fraction"],
        "theory_unit_costs_per_stage": unit["per_rank"],
        "theory_measured_costs": with_costs["fraction"],
        "theory_measured_costs_per_stage": with_costs["per_rank"],
        "theory_stage_costs": with_stage_costs["fraction"],
        "theory_stage_costs_per_stage": with_stage_costs["per_rank"],
        "theory_action_costs": statistics.fmean(bubbles.replay) if bubbles.replay else None,
        "theory_action_costs_per_stage": [statistics.fmean(x) if x else None for x in bubbles.replay_idle],
        "mean_action_ms": mean,
    }


def _pipelines(ranks: dict[int, dict]) -> dict[tuple, dict[int, int]]:
    """Every pipeline of the mesh: (dp, ep, cp, tp) -> pp index -> rank."""
    pipes: dict[tuple, dict[int, int]] = {}
    for r, info in ranks.items():
        c = info["coords"]
        pipes.setdefault((c["dp"], c.get("ep", 0), c.get("cp", 0), c["tp"]), {})[c["pp"]] = r
    return pipes


def _step_spans(evs: list[dict], durations: dict[str, list[float]],
                per_stage: dict[tuple[str, int], list[float]]) -> list[tuple[float, float, float, dict]]:
    """Each traced step of one rank: (its pipeline run's start, end, the time busy computing,
    {(kind, micro-batch, stage): ms of that action}); every action's duration also goes into
    `durations` (by kind) and `per_stage` (by kind and global stage)."""
    spans = []
    for _, a, b in step_windows(evs):
        inside = _within(evs, a, b)
        pipe = next(e for e in inside if e.get("cat") == "pipeline")
        acts = [e for e in inside if e.get("cat") == "compute"]
        costs = {}
        for e in acts:
            kind, stage = e["args"]["kind"], e["args"]["stage"]
            durations[kind].append(e["dur"])
            per_stage.setdefault((kind, stage), []).append(e["dur"])
            costs[(kind, e["args"]["mb"], stage)] = e["dur"] / 1e3
        spans.append((pipe["ts"], pipe["ts"] + pipe["dur"], sum(e["dur"] for e in acts), costs))
    return spans


class _Bubbles:
    """Each step's measured bubble of each pipeline, and the schedule replayed with that
    step's own action costs (when every action of the step was traced)."""

    def __init__(self, p: int):
        self.p = p
        self.fractions: list[float] = []
        self.idle: list[list[float]] = [[] for _ in range(p)]
        self.replay: list[float] = []
        self.replay_idle: list[list[float]] = [[] for _ in range(p)]

    def add(self, sched: Any, per_rank: dict[int, list[tuple[float, float, float, dict]]]) -> None:
        """The steps of one pipeline (`per_rank`: pp index -> `_step_spans`)."""
        p = self.p
        for k in range(min(len(v) for v in per_rank.values())):
            start = min(per_rank[s][k][0] for s in per_rank)
            end = max(per_rank[s][k][1] for s in per_rank)
            span = end - start
            busy = [per_rank[s][k][2] for s in range(p)]
            self.fractions.append(1 - sum(busy) / (p * span))
            for s in range(p):
                self.idle[s].append(1 - busy[s] / span)
            costs = {key: c for s in per_rank for key, c in per_rank[s][k][3].items()}
            if len(costs) == sum(len(a) for a in sched.actions):
                own = formulas.bubble(sched, action_costs=costs)
                self.replay.append(own["fraction"])
                for s in range(p):
                    self.replay_idle[s].append(own["per_rank"][s])


def _bytes_key(axes: str, op: str) -> str:
    return f"{axes}/{op}"


def step_shape(m: dict) -> formulas.StepShape:
    """The step's layout, from a trace's metadata (`Trainer.trace_meta`)."""
    sched = make_schedule(m["schedule"], m["mesh"]["pp"], m["micro_batches"], m["virtual_stages"])
    return formulas.StepShape(
        m["mesh"], m["zero"], m["micro_batches"], m["rows_per_micro_batch"], m["block_size"], m["n_embd"],
        m["itemsize"], sched.split_backward,
        m.get("sequence_parallel", False),  # absent in traces before sp
        m.get("recompute", "none"),  # traces written before --recompute ran without it
        formulas.Parts(**m.get("parts", {})),  # traces written before the model kinds: GPT-2's
        None if not m.get("moe") else formulas.ExpertShape(**m["moe"]),  # absent before the formulas took it
    )


def rank_units(info: dict) -> formulas.RankUnits:
    """What a rank holds, from its entry in a trace's metadata (`Trainer.rank_units`)."""
    return formulas.RankUnits(
        [formulas.Chunk(**c) for c in info["chunks"]], info["padded_blocks"], info["padded_outer"], info["tied_bytes"],
        info.get("tp_partial_values", 0),  # absent in traces before sp
        info.get("ep_replicated_values", 0),  # absent in traces before ep
        info.get("matrix_all_to_all", 0), info.get("matrix_all_gather", 0),  # absent before Muon
        info.get("matrix_dp_gather", 0),  # absent before ZeRO 0 dealt Muon's matrices over dp
        info.get("matrix_replica_all_to_all", 0),  # absent before they were dealt over ep x cp x tp
    )


def bytes_per_step(trace: dict) -> dict[int, dict[str, dict[str, float]]]:
    """Per rank, {"measured": {axes/op: payload bytes per step}, "formula": {...}}."""
    m = meta(trace)
    ranks = _ranks(trace)
    step = step_shape(m)
    out = {}
    for r, evs in rank_events(trace).items():
        wins = step_windows(evs)
        got: dict[str, float] = {}
        for _, a, b in wins:
            for e in _within(evs, a, b):
                if e.get("cat") == "comm" and e["args"]["op"] != "recv":
                    key = _bytes_key(e["args"]["axes"], e["args"]["op"])
                    got[key] = got.get(key, 0) + e["args"]["bytes"]
        n = max(len(wins), 1)
        info = ranks[r]
        # the experts' all-to-all depends on the routing: each step span carries its own bytes
        a2a = {e["args"]["step"]: e["args"].get("all_to_all_bytes", 0) for e in evs if e.get("cat") == "step"}
        want = formulas.step_bytes(step, rank_units(info), all_to_all_bytes=sum(a2a.get(s, 0) for s, _, _ in wins) / n)
        out[r] = {"measured": {k: v / n for k, v in sorted(got.items())},
                  "formula": {_bytes_key(*k): v for k, v in sorted(want.items())}}
    return out


def waiting(events: list[dict], start: float, end: float) -> float:
    """µs of [start, end) this rank spent waiting for peers: blocked in communication
    (exposed comm) while some collective's last member had not yet begun it (`wait_ms`,
    counted once however many calls waited at once), or in a pipeline receive."""
    waits = [(e["ts"], e["ts"] + e["args"].get("wait_ms", 0.0) * 1e3) for e in events
             if e.get("cat") == "comm" and e["args"]["op"] not in P2P]
    cuts, prio = _segments(events, start, end, [x for w in waits for x in w])
    covered = np.zeros(len(prio), dtype=bool)
    for a, b in waits:
        covered[np.searchsorted(cuts, a):np.searchsorted(cuts, b)] = True
    widths = np.diff(cuts)
    blocked = (prio == _PRIO["comm"]) | (prio == _PRIO["async_comm"])
    return float(widths[blocked & covered].sum() + widths[prio == _PRIO["p2p"]].sum())


def slowest_rank(trace: dict) -> dict[str, Any]:
    """The rank the others wait for, and by how much per step (module docstring)."""
    waited = {}
    for r, evs in rank_events(trace).items():
        wins = step_windows(evs)
        total = sum(waiting(_within(evs, a, b), a, b) for _, a, b in wins)
        waited[r] = total / max(len(wins), 1) / 1e3
    rank = min(waited, key=lambda r: (waited[r], r))
    others = [v for r, v in waited.items() if r != rank]
    return {"rank": rank, "slower_by_ms": (statistics.median(others) - waited[rank]) if others else 0.0,
            "waited_ms_per_step": waited}


def build(trace: dict) -> dict[str, Any]:
    """Everything the report says, as plain data (`--json` prints it)."""
    m = meta(trace)
    times = time_breakdown(trace)
    step_ms = max(t["step_ms"] for t in times.values())
    achieved = m["flops_per_token"] * m["tokens_per_step"] / (step_ms / 1e3) if step_ms > 0 else 0.0
    by = bytes_per_step(trace)
    evs = rank_events(trace)
    return {
        "run": {k: m[k] for k in ("mesh", "schedule", "micro_batches", "virtual_stages", "zero", "dtype", "batch_size",
                                  "block_size", "n_params")},
        "clock": m["clock"],
        "steps": len(step_windows(evs[min(evs)])),  # rank 0's, unless a partial trace has none of it
        "step_ms": step_ms,
        "time_ms": {str(r): t for r, t in sorted(times.items())},
        "bubble": pipeline_bubble(trace),
        "bytes": {str(r): b for r, b in sorted(by.items())},
        "bytes_match": all(b["measured"] == b["formula"] for b in by.values()),
        "flops": {"achieved_per_s": achieved, "peak_per_s": m["peak_flops"],
                  "mfu": formulas.mfu(achieved, m["peak_flops"])},
        "slowest": slowest_rank(trace),
        **({"partial": m["partial"]} if "partial" in m else {}),
    }


def _partial_lines(partial: dict | None) -> list[str]:
    """What a trace rebuilt from a dead job's spool parts holds (`recover`), for `render`."""
    if not partial:
        return []
    steps = "; ".join(f"rank {r}: " + ("no whole step" if s is None else f"up to step {s}")
                      for r, s in sorted(partial["last_step"].items(), key=lambda kv: int(kv[0])))
    missing, running = partial["ranks_missing"], partial.get("running")
    why = ("the run is still going; rebuilt from what each rank has flushed so far" if running
           else "the job ended before writing it; rebuilt from what each rank had flushed")
    return [f"partial trace: {why} to {partial['parts']} ({steps}"
            + (f"; {'rank' if len(missing) == 1 else 'ranks'} {','.join(map(str, missing))} left nothing" if missing
               else "") + "); the numbers below are over those steps"]


def _mb(x: float) -> str:
    return f"{x / 2**20:.3f} MiB" if x >= 2**14 else f"{x:.0f} B"


def render(rep: dict[str, Any]) -> str:
    """The report as plain text."""
    run, b = rep["run"], rep["bubble"]
    mesh = ",".join(f"{k}={v}" for k, v in run["mesh"].items())
    lines = [
        f"numesh report: mesh {mesh}, schedule {run['schedule']} "
        f"(m={run['micro_batches']}, v={run['virtual_stages']}), "
        f"ZeRO {run['zero']}, {run['dtype']}; {rep['steps']} steps measured (the first left out)",
        f"clocks aligned to rank 0 within {rep['clock']['max_uncertainty_us']:.1f} us "
        f"(residual after alignment {rep['clock']['max_residual_us']:.1f} us)",
        *_partial_lines(rep.get("partial")),
        "",
        "time per step (ms)      " + "".join(f"{c:>10}" for c in (*CATEGORIES, "sum", "step")),
    ]
    for r, t in rep["time_ms"].items():
        total = sum(t[c] for c in CATEGORIES)
        lines.append(f"  rank {r:<18}" + "".join(f"{t[c]:10.2f}" for c in CATEGORIES)
                     + f"{total:10.2f}{t['step_ms']:10.2f}")
    lines += [
        "  (comm = exposed communication: blocking collectives and waits on nonblocking ones; bubble = waiting for",
        "   pipeline messages or idle inside the schedule; other includes data loading)",
        "",
        f"pipeline bubble ({b['schedule']}, p={b['p']}, m={b['m']}, v={b['v']}): measured {100 * b['measured']:.1f} %, "
        f"theory {100 * b['theory_unit_costs']:.1f} % (unit costs), {100 * b['theory_measured_costs']:.1f} % "
        f"(measured mean F/B/W {b['mean_action_ms']['F']:.2f}/{b['mean_action_ms']['B']:.2f}/"
        f"{b['mean_action_ms']['W']:.2f} ms), "
        f"{100 * b['theory_stage_costs']:.1f} % (each stage's measured costs)",
        "  idle per stage: measured " + ", ".join(f"{100 * x:.1f} %" for x in b["measured_idle_per_stage"])
        + "; theory " + ", ".join(f"{100 * x:.1f} %" for x in b["theory_stage_costs_per_stage"]),
        *([f"  each step's own action times through the schedule: {100 * b['theory_action_costs']:.1f} % (per stage "
           + ", ".join(f"{100 * x:.1f} %" for x in b["theory_action_costs_per_stage"])
           + "); measured minus this is the run's overhead: pipeline messages and the code between actions"]
          if b.get("theory_action_costs") is not None else []),
        "",
        "bytes per step (payload; rank: measured = formula)",
    ]
    for r, by in rep["bytes"].items():
        keys = sorted(set(by["measured"]) | set(by["formula"]))
        parts = []
        for k in keys:
            got, want = by["measured"].get(k, 0), by["formula"].get(k, 0)
            parts.append(f"{k} {_mb(got)}" + ("" if got == want else f" (formula {_mb(want)})"))
        lines.append(f"  rank {r}: " + ("; ".join(parts) if parts else "nothing"))
    lines.append("  every rank matches the formulas" if rep["bytes_match"] else "  MISMATCH with numesh.perf.formulas")
    f, s = rep["flops"], rep["slowest"]
    lines += [
        "",
        f"achieved {f['achieved_per_s'] / 1e9:.2f} GFLOP/s of {f['peak_per_s'] / 1e9:.1f} GFLOP/s peak: "
        f"MFU {100 * f['mfu']:.1f} % (step {rep['step_ms']:.2f} ms, the longest of any rank)",
        f"slowest rank: {s['rank']}, {s['slower_by_ms']:.1f} ms per step slower than the median rank "
        "(the others wait for it: " + ", ".join(f"rank {r} {v:.1f}" for r, v in sorted(s["waited_ms_per_step"].items()))
        + " ms waited per step)",
    ]
    return "\n".join(lines)
