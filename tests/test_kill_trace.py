"""`kill -9` of one rank of a `--trace` run (issue 31): mpiexec SIGKILLs the others at
once, so nothing at the end of the run happens. Before, `numesh report OUT` said "cause:
unknown" (a tp job's ranks were both computing, or both in one all-reduce) and no trace was
left. Now every rank's events up to its last flush are in OUT/trace.parts, which the report
turns into a partial trace, and the flight recorder's witness names the rank that ended
first. A real job, killed as a user would (the job infrastructure of tests/test_interrupt.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_interrupt import Job
from test_mpi_suites import clean_env

FLUSHES_BEFORE = 3  # lines in the killed rank's part: its header and two flushes (over half a second of steps)


def wait_for_flushes(j: Job, rank: int, lines: int, within: float = 180) -> None:
    part = j.out / "trace.parts" / f"rank-{rank}.jsonl"
    deadline = time.monotonic() + within
    while not (part.is_file() and part.read_bytes().count(b"\n") >= lines):
        if j.proc.poll() is not None:
            pytest.fail(f"the job ended before it was killed (exit {j.proc.returncode}):\n{j.stderr()}")
        assert time.monotonic() < deadline, f"no {lines} lines in {part} within {within} s"
        time.sleep(0.1)


# The witness tells which rank ended first only if the kernel runs it before mpiexec has
# killed the other rank too (milliseconds); on a loaded machine it can miss that, and says
# so ("none saw one rank end before the others"): the job is then killed again, a fresh one.
WITNESS_TRIES = 3


def _killed_run(where: Path) -> tuple[Job, subprocess.CompletedProcess]:
    """A 2-rank tp job, its rank 1 SIGKILLed after two trace flushes, and `numesh report` of it."""
    where.mkdir()
    j = Job(where, 2, "--mesh", "tp=2", "--trace", "--peak-flops", "1e12")
    try:
        j.wait_for_steps()
        wait_for_flushes(j, 1, FLUSHES_BEFORE)
        os.kill(j.rank_pid(1), signal.SIGKILL)
        rc = j.finish()
    finally:
        if j.proc.poll() is None:
            j.kill()
    assert rc != 0
    assert not (j.out / "trace.json").exists()  # the job itself never got to write it
    res = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(j.out)], capture_output=True,
                         text=True, env=clean_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    return j, res


@pytest.mark.timeout(300 * WITNESS_TRIES)
def test_kill_9_of_a_rank_keeps_the_trace_and_names_the_rank(tmp_path: Path) -> None:
    for attempt in range(WITNESS_TRIES):
        j, res = _killed_run(tmp_path / f"try{attempt}")
        if "witness: none saw one rank end before the others" not in res.stdout:
            break
    lines = res.stdout.splitlines()
    assert lines[1].startswith("cause: rank 1 (tp=1) is dead"), res.stdout
    assert any(x.startswith("witness: rank 1 (pid ") and "never exited on its own" in x for x in lines), res.stdout
    assert any(x.startswith("partial trace: the job ended before writing it") for x in lines), res.stdout
    assert "time per step (ms)" in res.stdout and "every rank matches the formulas" in res.stdout

    trace = json.loads((j.out / "trace.json").read_text())  # rebuilt by the report, for Perfetto
    partial = trace["otherData"]["numesh"]["partial"]
    assert partial["ranks_recorded"] == [0, 1] and partial["ranks_missing"] == []
    steps = {int(r): s for r, s in partial["last_step"].items()}
    assert all(s is not None and s >= 1 for s in steps.values()), steps  # the killed rank's flushed steps too
    for r in (0, 1):
        mine = [e for e in trace["traceEvents"] if e["pid"] == r and e["ph"] == "X"]
        assert {"step", "compute", "comm"} <= {e["cat"] for e in mine}


@pytest.mark.timeout(300)
def test_report_while_a_traced_run_goes_on_then_after_it_is_killed(tmp_path: Path) -> None:
    """The parts are there while the run goes on too: the report says the run is still
    going and leaves trace.json to the run; once the run is killed, it writes trace.json."""
    j = Job(tmp_path, 0, "--trace", "--peak-flops", "1e12")
    try:
        j.wait_for_steps()
        wait_for_flushes(j, 0, FLUSHES_BEFORE)
        live = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(j.out)], capture_output=True,
                              text=True, env=clean_env(), timeout=120)
        assert live.returncode == 0, live.stderr
        assert "partial trace: the run is still going" in live.stdout
        assert not (j.out / "trace.json").exists()
        os.kill(j.proc.pid, signal.SIGKILL)
        j.finish()
    finally:
        if j.proc.poll() is None:
            j.kill()
    dead = subprocess.run([sys.executable, "-m", "numesh.cli.app", "report", str(j.out), "--json"],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert dead.returncode == 0, dead.stderr
    rep = json.loads(dead.stdout)
    assert rep["partial"]["running"] == [] and rep["steps"] >= 1
    assert json.loads((j.out / "trace.json").read_text())["otherData"]["numesh"]["partial"]["ranks_recorded"] == [0]
