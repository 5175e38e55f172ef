"""Hangs become a diagnosis and exit code 3 (issue #16 points 3 and 4): the flight recorder
(numesh/observe/flight.py, numesh/observe/diagnosis.py) and fault injection (numesh/observe/inject.py).

Unit tests: the NUMESH_INJECT parser, and `diagnose` on synthetic ring states. Real jobs
(launched like tests/test_interrupt.py, whose Job they reuse): a fault is injected at step 2
of a tiny model with --collective-timeout 10; the test checks that every process ends
(test_interrupt.HANG_S only stops a hung test: how soon is not asserted, a busy machine
slows it), that the job failed, and that the diagnosis names the right rank and collective.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from numesh.base.errors import ConfigError
from numesh.mesh.hook import SkipCall
from numesh.mesh.mesh import Mesh, parse_mesh
from numesh.observe import flight
from numesh.observe.diagnosis import SKIPPED, CallRec, RankState, diagnose
from numesh.observe.flight import FlightRecorder, postmortem
from numesh.observe.inject import Fault, FaultInjector, parse_faults
from numesh.run.config import config_from
from numesh.run.train import Trainer, _attach_observers
from test_interrupt import HANG_S, START_WITHIN_S, Job, _alive, _children

# --collective-timeout of the fault runs: any wait longer is a hang, so every normal wait of
# steps 0 and 1, before the fault, must stay under it however busy the machine is (a tiny
# model's step takes milliseconds; 3 s once left too little room for 8 ranks sharing 2 busy
# cores). Each run waits this long once the fault has fired, and no longer.
TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------
# the spec parser


def test_parse_faults() -> None:
    assert parse_faults("", 4) == parse_faults(None, 4) == ()
    assert parse_faults("hang:rank=3:step=5; skip:rank=0:step=0;slow:rank=1:ms=20", 4) == (
        Fault("hang", 3, 5), Fault("skip", 0, 0), Fault("slow", 1, 0, 20))
    assert parse_faults("CRASH:rank=1:step=2;mismatch:step=1:rank=2;", 4) == (
        Fault("crash", 1, 2), Fault("mismatch", 2, 1))


@pytest.mark.parametrize("spec, why", [
    ("hang:rank=4:step=1", "rank 4 is not a rank of this 4-rank job"),
    ("boom:rank=1:step=1", "unknown kind 'boom'"),
    ("hang:rank=1", "missing step"),
    ("hang:rank=x:step=1", "rank must be an integer"),
    ("slow:rank=1:ms=0", "ms must be > 0"),
    ("hang:rank=1:step=-1", "step must be >= 0"),
    ("hang:rank=1:step=2:ms=3", "unknown key 'ms' for hang"),
    ("hang:rank=1:rank=2:step=1", "'rank' given twice"),
    ("hang:rank:step=1", "'rank' is not key=value"),
])
def test_bad_specs_are_one_line_config_errors(spec: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_faults(f"slow:rank=0:ms=1;{spec}", 4)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"NUMESH_INJECT: bad fault '{spec}': {why}")


def test_a_bad_spec_stops_training_before_it_starts(char_dataset: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NUMESH_INJECT", "hang:rank=1:step=1")  # a 1-rank job has no rank 1
    cfg = config_from(dict(n_layer=1, n_head=2, n_embd=8, block_size=8, batch_size=2, data=str(char_dataset),
                           out=str(tmp_path / "run")))
    with pytest.raises(ConfigError, match="rank 1 is not a rank of this 1-rank job"):
        Trainer(cfg, MPI.COMM_SELF)


def test_nothing_is_attached_when_both_are_off(char_dataset: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("NUMESH_INJECT", raising=False)
    cfg = config_from(dict(n_layer=1, n_head=2, n_embd=8, block_size=8, batch_size=2, data=str(char_dataset),
                           out=str(tmp_path / "run")))
    t = Trainer(cfg, MPI.COMM_SELF)
    assert _attach_observers(t, tmp_path / "run") is None and t.mesh.observer is None  # single process: off
    t = Trainer(attrs_evolve(cfg, collective_timeout=0.0), MPI.COMM_SELF)
    assert _attach_observers(t, tmp_path / "run") is None and t.mesh.observer is None
    assert not (tmp_path / "run" / "flight").exists()


def attrs_evolve(cfg, **kw):
    import attrs

    return attrs.evolve(cfg, **kw)


# ---------------------------------------------------------------------------------------
# an error after a collective fault


def _recorder(tmp_path: Path, monkeypatch, faults: str) -> FlightRecorder:
    """A flight recorder of a 1-rank mesh whose job abort raises SystemExit(code) instead."""
    def abort(comm, code):
        raise SystemExit(code)
    monkeypatch.setattr(flight, "abort_job", abort)
    mesh = Mesh(parse_mesh("", 1), MPI.COMM_SELF)
    inject = FaultInjector(parse_faults(faults, 1), 0, mesh)
    return FlightRecorder(mesh, tmp_path / "flight", 10.0, inject, grace_s=0.0, leader_wait_s=0.0)


def test_an_error_after_a_skipped_collective_ends_with_the_diagnosis(tmp_path: Path, monkeypatch) -> None:
    """A rank that skipped a collective leaves its peers' calls paired with the wrong ones:
    whichever rank first trips over the mixed data raises (CI saw `global_norm` take the
    square root of a negative sum). That error ends the job as the time-out would have:
    the skip named, exit code 3."""
    rec = _recorder(tmp_path, monkeypatch, "skip:rank=0:step=0")
    with pytest.raises(SkipCall):
        rec.begin("all_reduce", "tp", 64)
    rec.end(rec.begin("all_reduce", "tp", 64))
    with pytest.raises(SystemExit) as info:
        rec.after_error(ValueError("math domain error"))
    assert info.value.code == 3
    text = (tmp_path / "flight" / "diagnosis.txt").read_text()
    assert text.startswith("numesh flight recorder: rank 0 raised ValueError: math domain error after a "
                           "collective fault")
    assert text.splitlines()[1].startswith("cause: rank 0 (the only rank) skipped all_reduce over tp #0 at step 0")
    assert "gave up: ValueError: math domain error" in text
    rec.close()


def test_an_error_without_a_collective_fault_is_left_to_unwind(tmp_path: Path, monkeypatch) -> None:
    rec = _recorder(tmp_path, monkeypatch, "")
    rec.end(rec.begin("all_reduce", "tp", 64))
    rec.after_error(ValueError("a bug of this rank's own"))  # returns: the caller re-raises
    assert not (tmp_path / "flight" / "diagnosis.txt").exists() and not (tmp_path / "flight" / "rank-0.json").exists()
    rec.close()


# ---------------------------------------------------------------------------------------
# the diagnosis on synthetic rings

NOW = 1000.0


def _state(rank: int, shape: dict, coords: dict, calls: list[CallRec], waiting: int | None = None, **kw) -> RankState:
    counts: dict[str, int] = {}
    for c in calls:
        if not c.flags & SKIPPED:
            counts[c.comm] = max(counts.get(c.comm, 0), c.seq + 1)
    w = calls[waiting] if waiting is not None else None
    beat = max(c.start for c in calls) if calls else 0.0
    return RankState(rank, coords, shape, calls, counts, beat, 2, w, NOW - 12.0 if w else 0.0, **kw)


def _tp_calls(n: int, stuck: bool, nbytes: int = 64) -> list[CallRec]:
    calls = [CallRec(i, "tp", "all_reduce", nbytes, 2, NOW - 20 + i * 0.001, NOW - 20 + i * 0.001 + 0.0005)
             for i in range(n)]
    if stuck:
        calls.append(CallRec(n, "tp", "all_reduce", nbytes, 2, NOW - 12.0, None))
    return calls


def test_diagnosis_names_the_rank_that_never_entered() -> None:
    shape = {"pp": 1, "dp": 2, "tp": 4}
    states = {}
    for r in range(8):
        coords = {"pp": 0, "dp": r // 4, "tp": r % 4}
        stuck = r in (0, 1, 2)
        calls = _tp_calls(1042, stuck)
        states[r] = _state(r, shape, coords, calls, waiting=-1 if stuck else None)
    states[3].beat = NOW - 13.0
    for r in (4, 5, 6, 7):  # the other dp replica waits over dp for 3's replica group
        states[r].calls.append(CallRec(0, "dp", "all_reduce", 8, 2, NOW - 11.0, None))
        states[r].counts["dp"] = 1
        states[r].waiting, states[r].wait_since = states[r].calls[-1], NOW - 11.0
    text, culprits = diagnose(states, NOW, 3.0)
    first = text.splitlines()[1]
    assert first.startswith("cause: rank 3 (dp=0,tp=3) never entered all_reduce over tp #1042 "
                            "(it is outside MPI since 13.0 s")
    assert first.endswith("ranks 0-2 wait in it since 12.0 s")
    assert culprits[0] == 3


def _both_in_the_same_call(**rank1: object) -> dict[int, RankState]:
    """tp=2, both ranks in the same all-reduce (#40) since 12 s; rank 0 gave up."""
    shape, states = {"tp": 2}, {}
    for r in range(2):
        states[r] = _state(r, shape, {"tp": r}, _tp_calls(40, stuck=True), waiting=-1, pid=100 + r,
                           **({"failed": "timeout"} if r == 0 else rank1))
    return states


def test_a_stopped_rank_inside_the_call_its_peers_wait_in_is_named() -> None:
    """kill -STOP on a rank polling a collective: it entered the call, so before its process
    state was read every rank waited in a call its peers had entered ("cause: unknown")."""
    text, culprits = diagnose(_both_in_the_same_call(stopped=True), NOW, 3.0)
    assert culprits[0] == 1
    assert text.splitlines()[1] == (
        "cause: rank 1 (tp=1) entered all_reduce over tp #40 but cannot finish it (its process 101 is stopped: "
        "kill -STOP, Ctrl-Z or a debugger; SIGCONT resumes it); rank 0 waits in it since 12.0 s")
    assert "  rank 1 (tp=1) step 2: waits in all_reduce over tp #40 (all_reduce of 64 B) since 12.0 s; " \
           "process 101 stopped" in text


def test_a_rank_past_the_timeout_that_did_not_give_up_is_named_without_its_process_state() -> None:
    """On another host its process state is unknown; waiting 12 s past a 3 s time-out without
    having given up, it has not run since. Within the time-out (30 s) it is no cause."""
    text, culprits = diagnose(_both_in_the_same_call(), NOW, 3.0)
    assert culprits[0] == 1 and "rank 1 (tp=1) entered all_reduce over tp #40 but cannot finish it (it has not " \
                                "given up though past the 3 s time-out" in text.splitlines()[1]
    text, culprits = diagnose(_both_in_the_same_call(), NOW, 30.0)
    assert culprits == [] and text.splitlines()[1].startswith("cause: unknown")
    text, culprits = diagnose(_both_in_the_same_call(failed="timeout"), NOW, 3.0)
    assert culprits == [] and text.splitlines()[1].startswith("cause: unknown")


def test_a_stopped_rank_outside_mpi_is_said_to_be_stopped() -> None:
    shape = {"tp": 2}
    states = {0: _state(0, shape, {"tp": 0}, _tp_calls(40, stuck=True), waiting=-1, failed="timeout"),
              1: _state(1, shape, {"tp": 1}, _tp_calls(40, stuck=False), pid=101, stopped=True)}
    text, culprits = diagnose(states, NOW, 3.0)
    assert culprits[0] == 1 and text.splitlines()[1].startswith(
        "cause: rank 1 (tp=1) never entered all_reduce over tp #40 (its process 101 is stopped: kill -STOP")


def test_diagnosis_names_the_rank_that_called_another_size() -> None:
    shape = {"pp": 1, "dp": 2, "tp": 2}
    states = {}
    for r in range(4):
        coords = {"pp": 0, "dp": r // 2, "tp": r % 2}
        calls = _tp_calls(40, stuck=False)
        calls.append(CallRec(40, "tp", "all_reduce", 4120 if r == 0 else 2048, 2, NOW - 12.0,
                             None if r < 2 else NOW - 11.9))
        if r == 1:
            calls.append(CallRec(41, "tp", "all_reduce", 2048, 2, NOW - 11.0, None))
        states[r] = _state(r, shape, coords, calls, waiting=-1 if r < 2 else None)
    text, culprits = diagnose(states, NOW, 3.0)
    assert culprits[0] == 0
    assert ("cause: rank 0 (dp=0,tp=0) called all_reduce of 4120 B as tp #40 (step 2) "
            "where the others called all_reduce of 2048 B") in text


def test_a_rank_that_recorded_its_own_end_first_is_the_cause_whatever_the_witness_saw_first() -> None:
    """Under CPU contention the kernel can finish the exit of a rank mpiexec SIGKILLed before
    that of the rank whose crash made it send the kill (a loaded CI machine: the killed rank
    "ended first" by 6 ms). A rank that recorded ending itself before the witness saw the
    first one gone is named instead; a witness whose first rank ended itself, or a rank on
    another host (another clock), or one that ended after, changes nothing."""
    shape = {"tp": 4}
    states = {r: _state(r, shape, {"tp": r}, _tp_calls(3, False), host="a") for r in range(4)}
    first = {"at": NOW, "gone": [1], "alive": [0, 2, 3], "host": "a", "ms_before": 6.1}
    assert flight._began_first(first, states) == []  # nobody recorded an exit of its own
    states[3].exited = NOW - 0.004  # rank 3 crashed (an injected crash marks it) before rank 1 was seen gone
    assert flight._began_first(first, states) == [3]
    line = flight.witness_line(first, states, [3])
    assert line.startswith("witness: rank 1 ") and "rank 3 had recorded ending itself by then" in line
    assert flight._began_first({**first, "gone": [3]}, states) == []  # the witness agrees
    assert flight._began_first({**first, "gone": [1, 3]}, states) == [3]  # seen gone together with a killed one
    assert flight._began_first({**first, "at": NOW - 0.01}, states) == []  # it ended after the first seen gone
    assert flight._began_first({**first, "host": "b"}, states) == []  # another host's clock
    assert flight._began_first(None, states) == []


def test_diagnosis_of_skips_dead_ranks_and_pipeline_waits() -> None:
    shape = {"pp": 4, "dp": 1, "tp": 1}
    states = {}
    for r in range(4):
        coords = {"pp": r, "dp": 0, "tp": 0}
        calls = [CallRec(i, "pp", "recv" if i % 2 else "send", 1024, 2, NOW - 20 + i, NOW - 20 + i + 0.1)
                 for i in range(5)]
        if r in (1, 3):
            calls.append(CallRec(5, "pp", "recv", 1024, 2, NOW - 12.0, None))
        states[r] = _state(r, shape, coords, calls, waiting=-1 if r in (1, 3) else None)
    states[0].calls.append(CallRec(5, "pp", "send", 1024, 2, NOW - 12.0, NOW - 12.0, SKIPPED))
    text, culprits = diagnose(states, NOW, 3.0)
    assert culprits[0] == 0 and text.splitlines()[1].startswith(
        "cause: rank 0 (pp=0) skipped send over pp #5 at step 2")
    assert "rank 2 (pp=2) never entered the pp send/recv its neighbours wait for" in text
    states[2].alive = False
    text, culprits = diagnose(states, NOW, 3.0)
    assert culprits[0] == 2 and text.splitlines()[1].startswith("cause: rank 2 (pp=2) is dead")
    states[2] = None
    text, culprits = diagnose(states, NOW, 3.0)
    assert culprits[0] == 2 and "rank 2 left no flight record" in text


# ---------------------------------------------------------------------------------------
# real jobs


def run_fault(tmp: Path, monkeypatch, ranks: int, mesh: str, spec: str, *args: str,
              timeout: float = TIMEOUT_S) -> tuple[Job, int]:
    """Launch `numesh train` with NUMESH_INJECT=spec and --collective-timeout `timeout`;
    (job, mpiexec's code) once every process is gone."""
    monkeypatch.setenv("NUMESH_INJECT", spec)
    j = Job(tmp, ranks, "--mesh", mesh, "--collective-timeout", str(timeout), "--n-head", "4", *args)
    deadline = time.monotonic() + START_WITHIN_S
    while "fires at step" not in j.stderr():
        if j.proc.poll() is not None or time.monotonic() > deadline:
            j.kill()
            pytest.fail(f"the fault did not fire (exit {j.proc.returncode}):\n{j.stderr()}")
        time.sleep(0.1)
    j.rank_pids = [k for p in _children(j.proc.pid) for k in _children(p)]
    rc = j.finish()
    assert not any(_alive(p) for p in j.rank_pids)
    return j, rc


def cause(j: Job) -> str:
    diag = j.out / "flight" / "diagnosis.txt"
    assert diag.is_file(), j.stderr()
    text = diag.read_text()
    assert text in j.stderr()  # the same block on stderr
    return text.splitlines()[1]


FAULTS = [
    # (ranks, mesh, NUMESH_INJECT, extra args, the diagnosis's first cause line)
    (4, "dp=4", "hang:rank=1:step=2", (),
     r"cause: rank 1 \(dp=1\) never entered all_reduce over (pp,)?dp #\d+ \(it is outside MPI"),
    (4, "tp=4", "hang:rank=2:step=2", (),
     r"cause: rank 2 \(tp=2\) never entered all_reduce over tp #\d+ .*ranks 0,1,3 wait in it"),
    (4, "pp=4", "hang:rank=2:step=2", ("--n-layer", "4", "--micro-batches", "2"),
     r"cause: rank 2 \(pp=2\) never entered the pp send/recv its neighbours wait for \(it is outside MPI"),
    (4, "dp=2,tp=2", "skip:rank=3:step=2", (),
     r"cause: rank 3 \(dp=1,tp=1\) skipped all_reduce over tp #\d+ at step 2"),
    (4, "dp=2,tp=2", "mismatch:rank=0:step=2", (),
     r"cause: rank 0 \(dp=0,tp=0\) called all_reduce of \d+ B as tp #\d+ \(step 2\) "
     r"where the others called all_reduce of \d+ B"),
    (4, "dp=2,pp=2", "hang:rank=3:step=2", ("--micro-batches", "2"), r"cause: rank 3 \(pp=1,dp=1\) never entered"),
    (4, "tp=2,pp=2", "skip:rank=2:step=2", ("--micro-batches", "2"),
     r"cause: rank 2 \(pp=1,tp=0\) skipped \w+ over \w+ #\d+ at step 2"),
    (8, "dp=2,tp=2,pp=2", "hang:rank=5:step=2", ("--micro-batches", "2"),
     r"cause: rank 5 \(pp=1,dp=0,tp=1\) never entered"),
    (8, "dp=2,tp=2,pp=2", "skip:rank=6:step=2", ("--micro-batches", "2"), r"cause: rank 6 \(pp=1,dp=1,tp=0\) skipped"),
    (8, "dp=2,tp=2,pp=2", "mismatch:rank=1:step=2", ("--micro-batches", "2"),
     r"cause: rank 1 \(pp=0,dp=0,tp=1\) called \w+ of \d+ B as"),
    (4, "dp=2,tp=2", f"slow:rank=1:ms={int(3 * TIMEOUT_S * 1000)}:step=2", (),  # late by 3 time-outs
     r"cause: rank 1 \(dp=0,tp=1\) never entered all_reduce over tp #\d+ \(it is outside MPI .*slow\)"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, mesh, spec, args, expect", FAULTS, ids=[f"{f[1]}-{f[2]}" for f in FAULTS])
def test_a_fault_is_diagnosed_and_the_job_ends(tmp_path: Path, monkeypatch, ranks, mesh, spec, args, expect) -> None:
    j, rc = run_fault(tmp_path, monkeypatch, ranks, mesh, spec, *args)
    assert rc == 3, j.stderr()
    assert re.match(expect, cause(j)), j.stderr()
    flight = j.out / "flight"
    assert sorted(p.name for p in flight.glob("rank-*.json")) == [f"rank-{r}.json" for r in range(ranks)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh, spec", [("dp=2,pp=2", "crash:rank=2:step=2"), ("tp=4", "crash:rank=3:step=2")])
def test_a_crashed_rank_ends_the_job_and_the_post_mortem_names_it(tmp_path: Path, monkeypatch, mesh: str,
                                                                   spec: str) -> None:
    """MPICH ends the job itself when a rank dies, before any time-out; `numesh report OUT`
    (flight.postmortem) then diagnoses the rings the ranks left behind."""
    j, rc = run_fault(tmp_path, monkeypatch, 4, mesh, spec, "--micro-batches", "2")
    assert rc != 0
    dead = spec.split("rank=")[1].split(":")[0]
    text = postmortem(j.out / "flight")
    assert text is not None and (j.out / "flight" / "diagnosis.txt").read_text() == text
    assert re.match(rf"cause: rank {dead} \(", text.splitlines()[1]), text
    report = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(j.out)],
                            capture_output=True, text=True)
    assert report.returncode == 0 and text.strip() in report.stdout, report.stderr
    as_json = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", "--json", str(j.out)],
                             capture_output=True, text=True)  # it printed nothing once
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["diagnosis"] == text, as_json.stderr


@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named(tmp_path: Path) -> None:
    """`kill -STOP` on rank 1 of a tp=2 job mid-run: rank 0 times out and the diagnosis names
    rank 1 as stopped, whether the signal caught it in a collective (which it had entered, like
    rank 0: "cause: unknown" before the recorder read its process state) or between two."""
    j = Job(tmp_path, 2, "--mesh", "tp=2", "--collective-timeout", str(TIMEOUT_S))
    j.wait_for_steps()
    os.kill(j.rank_pid(1), signal.SIGSTOP)
    try:
        rc = j.proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within {HANG_S} s of the SIGSTOP:\n{j.stderr()}")
    finally:
        for pid in j.rank_pids:  # a stopped process ignores every signal but SIGKILL and SIGCONT
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        j.kill()
    assert rc == 3, j.stderr()
    assert re.match(r"cause: rank 1 \(tp=1\) .*its process \d+ is stopped: kill -STOP", cause(j)), j.stderr()


@pytest.mark.timeout(300)
def test_a_slow_rank_within_the_timeout_is_not_a_hang(tmp_path: Path, monkeypatch) -> None:
    """A rank 1.5 s late at every step, under a 30 s collective timeout: the others wait for
    it, the recorder stays quiet. (The margin is 20 times the delay, so that a busy machine
    cannot push a wait past the timeout; with 3 s it was twice.)"""
    j, rc = run_fault(tmp_path, monkeypatch, 4, "dp=2,tp=2", "slow:rank=1:ms=1500", "--max-iters", "3",
                      timeout=30.0)
    assert rc == 0, j.stderr()
    assert not (j.out / "flight").exists() and "flight recorder" not in j.stderr()


def test_the_witness_asks_to_run_ahead_of_the_job_and_runs_without_the_right(monkeypatch) -> None:
    """`witness._ahead_of_the_job`: the lowest real-time priority where the kernel allows it,
    else a higher nice, else nothing, and never an error (a user without CAP_SYS_NICE)."""
    import os

    from numesh.observe import witness

    asked: list = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: asked.append((pid, policy,
                                                                                          param.sched_priority)))
    assert witness._ahead_of_the_job() == "SCHED_FIFO 1" and asked == [(0, os.SCHED_FIFO, 1)]

    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    monkeypatch.setattr(os, "nice", lambda inc: asked.append(inc))
    assert witness._ahead_of_the_job() == "nice -10" and asked[-1] == -10
    monkeypatch.setattr(os, "nice", refused)
    assert witness._ahead_of_the_job() == "as started"
