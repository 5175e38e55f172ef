"""`numesh train --trace` and `numesh report` (issue #16, points 1 and 2).

The report's pure functions are checked on synthetic traces (a schedule's ideal timeline
from `simulate` must give back its own bubble); then one real 8-rank dp=2 × tp=2 × pp=2
zero-bubble job is launched as a subprocess (like tests/test_interrupt.py) and its trace
and report are checked: every rank a process labelled with its coordinates, every action
kind and op, every flow closed, categories summing to the step time, bytes per axis equal
to numesh.perf.formulas.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_dataset
from numesh.observe.trace import add_peer_waits, axes_label, comm_key
from numesh.perf import formulas, report
from numesh.pipeline.schedules import make_schedule, simulate
from test_mpi_suites import clean_env, launcher

# ---------------------------------------------------------------------------------------
# pure functions on synthetic traces


def X(pid: int, name: str, cat: str, ts: float, dur: float, tid: int = 0, **args: object) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": dict(args)}


def test_categories_partition_a_step_by_priority() -> None:
    evs = [
        X(0, "step 1", "step", 0, 100, step=1),
        X(0, "data", "data", 0, 5),
        X(0, "pipeline", "pipeline", 5, 60),
        X(0, "recv", "comm", 5, 10, op="recv", axes="pp", bytes=8),  # waiting for a message: bubble
        X(0, "F0", "compute", 15, 20, kind="F"),
        X(0, "all_reduce", "comm", 20, 5, op="all_reduce", axes="tp", bytes=8),  # blocking tp inside F: comm
        X(0, "all_reduce", "comm", 30, 50, tid=1, op="all_reduce", axes="dp", bytes=8),  # nonblocking, 30..80
        X(0, "B0", "compute", 40, 20, kind="B"),
        X(0, "optimizer", "optimizer", 70, 25),  # 65..80 waits for the dp call: comm; then optimiser
    ]
    got = report.categorize(evs[1:], 0, 100)
    # bubble: the receive, and 35..40, 60..65 idle in the schedule (the dp call in flight does not count there)
    assert got == {"compute": 15.0 + 20.0, "comm": 5.0 + 15.0, "bubble": 10.0 + 5.0 + 5.0, "optimizer": 15.0,
                   "other": 5.0 + 5.0}
    assert sum(got.values()) == 100


def synthetic_trace(name: str, p: int, m: int, v: int = 1, steps: int = 3, stage_costs: dict | None = None,
                    action_costs: dict | None = None) -> dict:
    """A trace whose pipeline runs exactly as `simulate` says (F 1 ms, B 2 ms, W 1 ms, or
    `stage_costs` / `action_costs` in µs where given)."""
    sched = make_schedule(name, p, m, v)
    tl = simulate(sched, t_f=1e3, t_b=1e3 if sched.split_backward else 2e3, t_w=1e3, stage_costs=stage_costs,
                  action_costs=action_costs)
    events, t = [], 0.0
    for s in range(steps):
        for r in range(p):
            events.append(X(r, f"step {s}", "step", t, tl.makespan + 10, step=s))
            events.append(X(r, "pipeline", "pipeline", t + 5, tl.makespan))
            for a, (b, e) in zip(sched.actions[r], tl.intervals[r]):
                events.append(X(r, str(a), "compute", t + 5 + b, e - b, kind=a.kind, mb=a.mb, chunk=a.chunk,
                                stage=sched.stage(r, a.chunk)))
        t += tl.makespan + 20
    ranks = [{"rank": r, "coords": {"pp": r, "dp": 0, "tp": 0}} for r in range(p)]
    meta = {"mesh": {"pp": p, "dp": 1, "tp": 1}, "schedule": name, "micro_batches": m, "virtual_stages": v,
            "ranks": ranks}
    return {"traceEvents": events, "otherData": {"numesh": meta}}


@pytest.mark.parametrize("name, p, m, v",
                         [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 4, 1)])
def test_measured_bubble_of_an_ideal_run_is_the_theory(name: str, p: int, m: int, v: int) -> None:
    b = report.pipeline_bubble(synthetic_trace(name, p, m, v))
    sched = make_schedule(name, p, m, v)
    split = sched.split_backward
    want = formulas.bubble(sched, 1.0, 1.0 if split else 2.0, 1.0 if split else 0.0)
    assert b["measured"] == pytest.approx(want["fraction"], abs=1e-12)
    assert b["theory_measured_costs"] == pytest.approx(want["fraction"], abs=1e-12)
    assert b["measured_idle_per_stage"] == pytest.approx(want["per_rank"], abs=1e-12)
    assert b["mean_action_ms"]["F"] == pytest.approx(1.0)


@pytest.mark.parametrize("name, p, m, v", [("1f1b", 2, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 8, 1)])
def test_the_theory_with_each_stages_costs_matches_unequal_stages(name: str, p: int, m: int, v: int) -> None:
    """The last stage also runs the head and loss, the first the embedding: with each
    stage's own measured costs the simulation reproduces such a run; with mean costs it cannot."""
    last = p * v - 1
    costs = {("F", 0): 1.3e3, ("F", last): 1.8e3, ("B", last): 2.6e3 if name == "zb-h1" else 3.5e3}
    b = report.pipeline_bubble(synthetic_trace(name, p, m, v, stage_costs=costs))
    assert b["theory_stage_costs"] == pytest.approx(b["measured"], abs=1e-12)
    assert b["theory_stage_costs_per_stage"] == pytest.approx(b["measured_idle_per_stage"], abs=1e-12)
    assert abs(b["theory_measured_costs"] - b["measured"]) > 1e-3


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                           ("zb-h1", 4, 8, 1)])
def test_the_theory_with_each_actions_costs_matches_uneven_actions(name: str, p: int, m: int, v: int) -> None:
    """Actions of one kind and stage that take different times (a loaded machine, cache
    effects) make a bubble that mean costs need not show; each action's own measured time
    through the schedule reproduces it, stage by stage, and a message delay between the
    stages (`comm`) shows up as the difference."""
    sched = make_schedule(name, p, m, v)
    rng = np.random.default_rng(3)
    costs = {(a.kind, a.mb, sched.stage(r, a.chunk)): float(rng.uniform(0.5e3, 3e3))
             for r in range(p) for a in sched.actions[r]}
    b = report.pipeline_bubble(synthetic_trace(name, p, m, v, action_costs=costs))
    assert b["theory_action_costs"] == pytest.approx(b["measured"], abs=1e-12)
    assert b["theory_action_costs_per_stage"] == pytest.approx(b["measured_idle_per_stage"], abs=1e-12)
    delayed = simulate(sched, action_costs=costs, comm=200.0)
    assert delayed.bubble_fraction > b["theory_action_costs"] + 1e-3


def test_peer_wait_is_the_time_until_the_last_member_began() -> None:
    coords = {r: {"pp": 0, "dp": r // 2, "tp": r % 2} for r in range(4)}
    # two tp all-reduces (ranks 0,1 and ranks 2,3) and one dp all-reduce (ranks 0,2)
    evs = [
        X(0, "ar", "comm", 0, 10, op="all_reduce", axes="tp", bytes=8),
        X(1, "ar", "comm", 4, 6, op="all_reduce", axes="tp", bytes=8),
        X(2, "ar", "comm", 1, 3, op="all_reduce", axes="tp", bytes=8),
        X(3, "ar", "comm", 2, 2, op="all_reduce", axes="tp", bytes=8),
        X(0, "ar", "comm", 20, 5, op="all_reduce", axes="dp", bytes=8),
        X(2, "ar", "comm", 23, 2, op="all_reduce", axes="dp", bytes=8),
    ]
    add_peer_waits(evs, coords)
    assert [e["args"]["wait_ms"] * 1e3 for e in evs] == pytest.approx([4, 0, 1, 0, 3, 0])
    assert [e["args"]["transfer_ms"] * 1e3 for e in evs] == pytest.approx([6, 6, 2, 2, 2, 2])
    assert comm_key("tp", coords[1]) == comm_key("tp", coords[0]) != comm_key("tp", coords[2])


def test_slowest_rank_is_the_one_the_others_wait_for() -> None:
    evs = []
    for s in range(3):
        t = s * 1000
        for r in range(3):
            evs.append(X(r, f"step {s}", "step", t, 500, step=s))
            begin = t + (300 if r == 1 else 100)  # rank 1 arrives 200 µs late at every step's collective
            evs.append(X(r, "ar", "comm", begin, t + 310 - begin, op="all_reduce", axes="dp", bytes=8))
    add_peer_waits(evs, {r: {"pp": 0, "dp": r, "tp": 0} for r in range(3)})
    got = report.slowest_rank({"traceEvents": evs})
    assert got["rank"] == 1
    assert got["slower_by_ms"] == pytest.approx(0.2)


def test_axes_labels() -> None:
    from numesh.mesh.mesh import Group

    assert axes_label(("dp", "pp")) == "pp+dp" and axes_label("tp") == "tp"
    assert axes_label(Group("pp", (0, 3))) == "pp[0,3]"


# ---------------------------------------------------------------------------------------
# a real 8-rank job

TINY = ["--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
        "--micro-batches", "2", "--max-iters", "4", "--eval-interval", "100", "--eval-iters", "1", "--dtype", "float32"]


def launch(n: int, out: Path, data: Path, *args: str, env: dict | None = None, timeout: float = 300) -> str:
    found = launcher()
    if found is None:
        pytest.skip("no mpiexec")
    cmd = [found[0], "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "numesh.cli.app", "train", "--data", str(data),
           "--out", str(out), *TINY, "--trace", *args]
    res = subprocess.run(cmd, env={**clean_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stderr


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("trace8")
    data = make_dataset(root / "data")
    out = root / "run"
    log = launch(8, out, data, "--mesh", "dp=2,tp=2,pp=2", "--zero", "1", "--schedule", "zb-h1")
    return out, log


def test_trace_has_every_rank_action_op_and_flow(traced_run: tuple[Path, str]) -> None:
    out, _ = traced_run
    trace = json.loads((out / "trace.json").read_text())  # valid (strict) JSON
    evs = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(8))
    for r, label in names.items():  # tp varies fastest, then (cp, ep,) dp, then pp
        assert label == f"rank {r} (pp={r // 4},dp={r // 2 % 2},ep=0,cp=0,tp={r % 2})"
    for r in range(8):
        mine = [e for e in evs if e["pid"] == r and e["ph"] == "X"]
        assert {e["args"]["kind"] for e in mine if e["cat"] == "compute"} == {"F", "B", "W"}
        assert {e["args"]["op"] for e in mine if e["cat"] == "comm"} >= {"all_reduce", "reduce_scatter", "all_gather"}
        assert {"step", "data", "pipeline", "optimizer", "eval", "checkpoint"} <= {e["cat"] for e in mine}
        assert all(e["dur"] >= 0 for e in mine)
    ops = {e["args"]["op"] for e in evs if e.get("cat") == "comm"}
    assert {"send", "recv"} <= ops
    for e in evs:
        if e.get("cat") == "comm" and e["args"]["op"] not in ("send", "recv"):
            assert 0 <= e["args"]["wait_ms"] <= e["dur"] / 1e3 + 1e-9
    starts = [(e["id"], e["pid"]) for e in evs if e["ph"] == "s"]
    ends = [(e["id"], e["pid"]) for e in evs if e["ph"] == "f"]
    assert starts and sorted(i for i, _ in starts) == sorted(i for i, _ in ends)  # each arrow closed, once
    by_id = dict(starts)
    assert all(by_id[i] != pid for i, pid in ends)  # between two ranks
    clock = trace["otherData"]["numesh"]["clock"]
    assert clock["max_uncertainty_us"] >= 0 and "max_residual_us" in clock


def test_report_of_the_run(traced_run: tuple[Path, str]) -> None:
    out, log = traced_run
    assert "numesh report: mesh pp=2,dp=2,ep=1,cp=1,tp=2" in log  # printed at the end of the traced run
    rep = report.build(report.load(out))
    assert rep["steps"] == 3  # 4 steps, the first left out
    for r, t in rep["time_ms"].items():  # the categories partition each step: their sum is the step
        assert sum(t[c] for c in report.CATEGORIES) == pytest.approx(t["step_ms"], rel=1e-9), r
        assert t["compute"] > 0
    # each traced step lies inside the loop's own timing of it (metrics.jsonl, rank 0): an
    # order of two clock readings, which no load on the machine can turn round
    dts = {r["step"]: r["dt_ms"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
           if "dt_ms" in r}
    spans = {e["args"]["step"]: e["dur"] / 1e3 for e in json.loads((out / "trace.json").read_text())["traceEvents"]
             if e.get("cat") == "step" and e["pid"] == 0}
    assert sorted(spans) == sorted(dts) == [0, 1, 2, 3]
    assert all(0 < spans[s] <= dts[s] * (1 + 1e-9) for s in dts), (spans, dts)
    assert rep["bytes_match"]
    for b in rep["bytes"].values():
        assert b["measured"] == b["formula"]
        assert {k.split("/")[0] for k in b["measured"]} >= {"dp", "tp", "pp"}
    b = rep["bubble"]
    assert (b["p"], b["m"], b["schedule"]) == (2, 2, "zb-h1")
    assert 0 <= b["measured"] < 1 and len(b["measured_idle_per_stage"]) == 2
    f = rep["flops"]  # MFU is not clamped (a peak read on a busy machine can sit below a step's rate)
    assert f["achieved_per_s"] > 0 and f["mfu"] == pytest.approx(f["achieved_per_s"] / f["peak_per_s"], rel=1e-12)
    assert rep["slowest"]["rank"] in range(8)

    res = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(out), "--json"], capture_output=True,
                         text=True, env=clean_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert set(got) == {"run", "clock", "steps", "step_ms", "time_ms", "bubble", "bytes", "bytes_match", "flops",
                        "slowest"}
    text = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(out)], capture_output=True, text=True,
                          env=clean_env(), timeout=120).stdout
    assert "pipeline bubble (zb-h1" in text and "every rank matches the formulas" in text


def test_report_of_a_sequence_parallel_run_matches_the_formulas(tmp_path: Path) -> None:
    """With --sequence-parallel the tp traffic is all-gathers and reduce-scatters (and the
    LayerNorm grads' all-reduce), and the report's formulas still equal the measurement."""
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "run"
    launch(2, out, data, "--mesh", "tp=2", "--sequence-parallel")
    rep = report.build(report.load(out))
    assert rep["bytes_match"]
    for b in rep["bytes"].values():
        assert b["measured"] == b["formula"]
        assert {"tp/all_gather", "tp/reduce_scatter", "tp/all_reduce"} <= set(b["measured"])


def test_report_of_an_expert_parallel_run_matches_the_formulas(tmp_path: Path) -> None:
    """With experts over ep the report sees the token all-to-alls, and its formula (from the
    routing counts each step span records, the rerun forward of --recompute full counted)
    equals what every rank sent."""
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "run"
    launch(2, out, data, "--mesh", "ep=2", "--moe-experts", "4", "--moe-every", "2", "--recompute", "full")
    rep = report.build(report.load(out))
    assert rep["bytes_match"]
    for b in rep["bytes"].values():
        assert b["measured"] == b["formula"]
        assert b["formula"]["ep/all_to_all"] > 0


def test_report_of_a_run_without_trace_is_one_error_line(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(tmp_path)], capture_output=True,
                         text=True, env=clean_env(), timeout=120)
    assert res.returncode != 0 and "numesh train --trace" in res.stderr


def test_an_injected_slow_rank_is_the_slowest_in_the_report(tmp_path: Path) -> None:
    """NUMESH_INJECT=slow:rank=1:ms=200 (numesh/observe/inject.py) sleeps rank 1 at every step's
    start: the report names it the slowest, slower by a positive delay, and the other rank
    is the one that spends it waiting. Orders and signs only: how close the delay comes to
    200 ms depends on the machine's load (it read 224.8 ms on a busy CI machine), so that
    number is `python benchmarks/bench_trace.py slow`'s to print."""
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "run"
    launch(2, out, data, "--mesh", "dp=2", "--max-iters", "5", env={"NUMESH_INJECT": "slow:rank=1:ms=200"})
    rep = report.build(report.load(out))
    assert rep["slowest"]["rank"] == 1 and rep["slowest"]["slower_by_ms"] > 0
    assert rep["time_ms"]["0"]["comm"] > rep["time_ms"]["1"]["comm"]  # rank 0 spends it waiting, exposed
