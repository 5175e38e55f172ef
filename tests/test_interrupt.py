"""Ctrl-C (SIGINT) or SIGTERM stops a training job on every rank, never hangs it (issue #18).

Before numesh/interrupt.py, a Ctrl-C to `mpiexec -n 2 numesh train --mesh pp=2` hung the
job 6 times out of 6: mpiexec forwards SIGINT to every rank, one rank raised
KeyboardInterrupt and left mid-step, its peer waited forever in an MPI receive.

The first tests run `train()` in this process (fast). The others launch real jobs as
subprocesses, like tests/test_mpi_suites.py (whose way of finding mpiexec they reuse),
and are not marked `mpi`: they signal mpiexec or one rank once a few steps are logged and
check that every process ends with exit code 130 (HANG_S only stops a hung test: how soon
a job ends is not asserted, since a busy machine slows it), one "interrupted at step N"
line, and (with --ckpt-interval) a loadable checkpoint of step N that `latest` points to.
Every rank runs the CLI through WRAPPER, which writes the code the rank exits with to
rc.<rank>, so the test sees each rank's code and not only mpiexec's.
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

from conftest import make_dataset
from numesh.base.errors import Interrupted
from numesh.checkpoint import read_meta, read_params_dict
from numesh.host.runtime import guarded
from numesh.run.config import config_from
from numesh.run.train import train
from test_mpi_suites import clean_env, launcher

START_WITHIN_S = 180  # to start and log STEPS_BEFORE steps (imports and set-up on a loaded 2-core machine)
# a job whose processes are not all gone this long after the signal is hung (one ends in
# seconds; the watchdog's own grace is interrupt.GRACE_S): a bound that stops the test, not a timing
HANG_S = 120
STEPS_BEFORE = 3

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--max-iters", "1000000", "--eval-interval", "1000000", "--eval-iters", "1", "--dtype", "float32"]

WRAPPER = """
import os, sys
sys.argv = ["numesh", *sys.argv[1:]]
from numesh.cli.app import main
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
    raise
finally:
    with open(os.path.join(os.environ["RC_DIR"], "rc." + os.environ.get("PMI_RANK", "0")), "w") as f:
        f.write(str(code))
"""

LINE = re.compile(r"interrupted at step (\d+) by (SIG\w+): (.*)")


# ---------------------------------------------------------------------------------------
# in this process


def _config(data: Path, out: Path, **kw: object):
    base: dict = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, max_iters=50, eval_interval=1000,
                      eval_iters=1, data=str(data), out=str(out), seed=3)
    base.update(kw)
    return config_from(base)


def test_signal_in_the_loop_stops_at_the_next_step_and_saves(char_dataset: Path, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

    def on_step(step: int, record: dict) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # as a Ctrl-C would, while the loop runs

    with pytest.raises(Interrupted) as info:
        train(_config(char_dataset, tmp_path / "run", ckpt_interval=100), MPI.COMM_SELF, on_step=on_step)
    e = info.value
    assert isinstance(e, KeyboardInterrupt)  # what library callers already catch
    assert (e.step, e.signum) == (3, signal.SIGINT)
    assert str(e) == f"interrupted at step 3 by SIGINT: checkpoint saved to {tmp_path / 'run' / 'ckpt' / 'step_000003'}"
    assert read_meta(e.checkpoint).step == 3
    assert (tmp_path / "run" / "ckpt" / "latest").resolve() == Path(e.checkpoint).resolve()
    # numesh's handlers and wakeup fd are gone once train() is left
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert signal.set_wakeup_fd(-1) == -1


def test_an_interrupted_traced_run_writes_its_trace(char_dataset: Path, tmp_path: Path) -> None:
    """Every rank stops at one step, so the trace is gathered as at a clean end (before, an
    interrupted --trace run left none) and the spool parts go."""
    def on_step(step: int, record: dict) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "run"
    with pytest.raises(Interrupted):
        train(_config(char_dataset, out, trace=True, peak_flops=1e12), MPI.COMM_SELF, on_step=on_step)
    trace = json.loads((out / "trace.json").read_text())
    assert "partial" not in trace["otherData"]["numesh"]
    assert sorted(e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step") == [0, 1, 2]
    assert not (out / "trace.parts").exists()


def test_without_ckpt_interval_nothing_is_saved(char_dataset: Path, tmp_path: Path) -> None:
    def on_step(step: int, record: dict) -> None:
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted,
                       match=r"^interrupted at step 2 by SIGTERM: no checkpoint saved \(--ckpt-interval is 0\)$"):
        train(_config(char_dataset, tmp_path / "run", save_on_signal="none"), MPI.COMM_SELF, on_step=on_step)
    assert not (tmp_path / "run" / "ckpt").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_guarded_exits_130_with_one_line(capsys: pytest.CaptureFixture) -> None:
    def interrupted() -> None:
        raise Interrupted(7, signal.SIGINT, "runs/x/ckpt/step_000007")

    def ctrl_c() -> None:
        raise KeyboardInterrupt

    for fn, line in ((interrupted, "interrupted at step 7 by SIGINT: checkpoint saved to runs/x/ckpt/step_000007"),
                     (ctrl_c, "interrupted")):
        with pytest.raises(SystemExit) as info:
            guarded(fn)
        assert info.value.code == 130
        assert capsys.readouterr().err.splitlines() == [line]


def test_guarded_exits_128_plus_the_signal(capsys: pytest.CaptureFixture) -> None:
    """SIGTERM under --save-on-signal none stops the run as Ctrl-C does, but exits 143 as a
    shell reports a SIGTERM'd command (it exited 130, as for SIGINT)."""
    def terminated() -> None:
        raise Interrupted(4, signal.SIGTERM, None, " (--ckpt-interval is 0)")

    with pytest.raises(SystemExit) as info:
        guarded(terminated)
    assert info.value.code == 143
    assert capsys.readouterr().err.splitlines() == [
        "interrupted at step 4 by SIGTERM: no checkpoint saved (--ckpt-interval is 0)"]


# ---------------------------------------------------------------------------------------
# real jobs


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return sorted(kids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Job:
    """`numesh train` on `ranks` ranks (0: without mpiexec), with stderr in a file."""

    def __init__(self, tmp: Path, ranks: int, *args: str, env: dict[str, str] | None = None, prelude: str = ""):
        if not sys.platform.startswith("linux"):
            pytest.skip("finds rank processes through /proc")
        self.dir, self.out = tmp, tmp / "run"
        data = make_dataset(tmp / "data")
        cmd = [sys.executable, "-c", prelude + WRAPPER, "train", "--data", str(data), "--out", str(self.out),
               *TINY, *args]
        if ranks:
            found = launcher()
            if found is None:
                pytest.skip("no mpiexec beside this Python or on PATH")
            cmd = [found[0], "-n", str(ranks), *cmd]
        env = {**clean_env(), "RC_DIR": str(tmp), "OMP_NUM_THREADS": "1", **(env or {})}
        self.err_file = open(tmp / "stderr.txt", "w+")
        # its own session: our signals reach only whom we send them to
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.err_file,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.ranks_expected = max(ranks, 1)
        self.rank_pids: list[int] = [self.proc.pid] if not ranks else []

    def wait_for_steps(self, n: int = STEPS_BEFORE) -> None:
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + START_WITHIN_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before training (exit {self.proc.returncode}):\n{self.stderr()}")
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"no {n} metrics lines within {START_WITHIN_S} s:\n{self.stderr()}")
        if not self.rank_pids:  # mpiexec -> hydra_pmi_proxy -> the ranks
            self.rank_pids = [k for p in _children(self.proc.pid) for k in _children(p)]
        assert len(self.rank_pids) == self.ranks_expected, self.rank_pids

    def rank_pid(self, rank: int) -> int:
        """The pid of `rank` (its PMI_RANK)."""
        for pid in self.rank_pids:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"PMI_RANK={rank}".encode() in env:
                return pid
        raise AssertionError(f"no process of rank {rank} among {self.rank_pids}")

    def finish(self, within: float = HANG_S) -> int:
        """mpiexec's exit code, once every process is gone; kills the job and fails as hung
        after `within` seconds (a deadline that stops the test, not a timing of the job)."""
        deadline = time.monotonic() + within
        try:
            rc = self.proc.wait(timeout=within)
            while any(_alive(p) for p in self.rank_pids) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [p for p in self.rank_pids if _alive(p)]
            assert not left, f"ranks {left} still running {within} s after the signal (hung)"
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {within} s of the signal (a hang):\n{self.stderr()}")
        finally:
            self.kill()
        return rc

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.rank_pids]:  # the ranks are in sessions of their own
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.proc.wait()
        self.err_file.close()

    def stderr(self) -> str:
        return (self.dir / "stderr.txt").read_text()

    def rank_codes(self) -> list[int | None]:
        files = [self.dir / f"rc.{r}" for r in range(self.ranks_expected)]
        return [int(f.read_text()) if f.is_file() else None for f in files]


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[Job] = []

    def make(ranks: int, *args: str) -> Job:
        jobs.append(Job(tmp_path, ranks, *args))
        return jobs[-1]

    yield make
    for j in jobs:
        if j.proc.poll() is None or any(_alive(p) for p in j.rank_pids):
            j.kill()


def check_stopped(j: Job, signame: str, saved: bool) -> int:
    """Every rank exited 128 + the signal with one 'interrupted at step N' line; returns N."""
    err = j.stderr()
    lines = [m for m in map(LINE.search, err.splitlines()) if m]
    assert len(lines) == 1, err
    step, sig, rest = int(lines[0][1]), lines[0][2], lines[0][3]
    assert sig == signame, err
    assert "Traceback" not in err, err
    assert j.rank_codes() == [128 + signal.Signals[signame]] * j.ranks_expected, err
    records = [json.loads(x) for x in (j.out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step - 1  # stopped at a step boundary, every step before it logged
    ckpt = j.out / "ckpt"
    if saved:
        path = ckpt / f"step_{step:06d}"
        assert rest == f"checkpoint saved to {path}", err
        assert (ckpt / "latest").resolve() == path.resolve()
        assert read_meta(path).step == step
        assert read_params_dict(path)  # every file there, checksums verified
    else:
        assert rest == "no checkpoint saved (--ckpt-interval is 0)", err
        assert not ckpt.exists()
    return step


# (ranks, options, whom the signal goes to: "launched" is mpiexec, which forwards it to every
# rank, or the single process; a number is that rank alone, as a scheduler might), the signal,
# whether the stopped step is saved
STOPS = [
    pytest.param(2, ("--mesh", "pp=2", "--micro-batches", "2", "--ckpt-interval", "1000"), "launched", signal.SIGINT,
                 True, id="ctrl-c-to-mpiexec-pp2-saves"),
    pytest.param(2, ("--mesh", "dp=2", "--ckpt-interval", "1000", "--save-on-signal", "none"), 1, signal.SIGTERM,
                 True, id="sigterm-as-ctrl-c-to-rank-1-dp2-saves"),
    pytest.param(2, ("--mesh", "tp=2"), 0, signal.SIGINT, False, id="ctrl-c-to-rank-0-tp2-without-checkpoints"),
    pytest.param(0, ("--ckpt-interval", "1000"), "launched", signal.SIGINT, True, id="ctrl-c-to-a-single-process"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, args, whom, sig, saved", STOPS)
def test_a_signal_stops_every_rank_at_one_step(job, ranks: int, args: tuple, whom: str | int, sig: signal.Signals,
                                               saved: bool) -> None:
    """Every rank stops at the same step boundary and exits 128 + the signal, saving that step where
    checkpoints are on; a rank not signalled learns it at the next step. (pp=2 hung 6 times
    out of 6 before.)"""
    j = job(ranks, *args)
    j.wait_for_steps()
    os.kill(j.proc.pid if whom == "launched" else j.rank_pid(whom), sig)
    assert j.finish() == 128 + sig, j.stderr()  # 130 for SIGINT, 143 for SIGTERM
    check_stopped(j, sig.name, saved)


@pytest.mark.timeout(300)
def test_a_stuck_rank_cannot_hang_the_job(job) -> None:
    """Rank 1 is frozen (SIGSTOP) and rank 0 is interrupted: rank 0 cannot agree with it,
    so its watchdog aborts the whole job after the grace period, with exit code 130."""
    j = job(2, "--mesh", "pp=2", "--ckpt-interval", "1000")
    j.wait_for_steps()
    os.kill(j.rank_pid(1), signal.SIGSTOP)
    os.kill(j.rank_pid(0), signal.SIGINT)
    rc = j.finish()
    assert rc == 130, j.stderr()
    assert "[rank 0] interrupted: SIGINT: the ranks did not stop together in time" in j.stderr()
