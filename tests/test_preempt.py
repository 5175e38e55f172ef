"""Preemptible runs (issue 33): the same command line continues a run that was stopped.

`--resume auto` continues from OUT/ckpt/latest when there is one and starts fresh when there
is none, so the identical command serves the first attempt and every requeue; the continued
run equals the uninterrupted one (bit for bit on the same mesh) and logs each step once.
`--save-on-signal` (SIGTERM and SIGUSR1 by default) saves the step every rank stops at and
exits 75; the real-job tests reuse tests/test_interrupt.py's `Job` (mpiexec, rank exit codes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import assert_close, cli, one_error_line
from numesh.base.errors import CheckpointError, ConfigError, Interrupted, Preempted
from numesh.checkpoint import read_meta, read_params_dict
from numesh.host import startup_signals
from numesh.host.runtime import guarded
from numesh.host.startup_signals import parse_signals
from numesh.run.config import config_from
from numesh.run.train import train
from test_interrupt import START_WITHIN_S, Job, _alive


def _config(data: Path, out: Path, **kw: object):
    base: dict = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, max_iters=6, eval_interval=3,
                      eval_iters=1, data=str(data), out=str(out), seed=3, dtype="float64", dropout=0.1,
                      resume="auto", peak_flops=1e12)
    base.update(kw)
    return config_from(base)


def _signal_at(step: int, signum: int):
    """An on_step callback that signals this process after step `step` is logged."""
    def on_step(s: int, record: dict) -> None:
        if s == step:
            os.kill(os.getpid(), signum)

    return on_step


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_auto_starts_fresh_then_continues_bit_for_bit(char_dataset: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    cfg = _config(char_dataset, tmp_path / "run", ckpt_interval=100)
    with pytest.raises(Interrupted) as info:  # the first attempt is stopped after step 2, saving step 3
        train(cfg, MPI.COMM_SELF, on_step=_signal_at(2, signal.SIGINT))
    assert info.value.step == 3
    assert "--resume auto: no checkpoint in" in capsys.readouterr().err
    train(cfg, MPI.COMM_SELF)  # the identical config again
    err = capsys.readouterr().err
    assert f"continuing from step 3 ({tmp_path / 'run' / 'ckpt' / 'step_000003'})" in err
    assert _steps(tmp_path / "run") == [0, 1, 2, 3, 4, 5, 6]  # appended, each step once

    whole = train(_config(char_dataset, tmp_path / "whole", resume=""), MPI.COMM_SELF)
    got, want = read_params_dict(tmp_path / "run" / "ckpt" / "latest"), read_params_dict(whole.checkpoint)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_resume_auto_of_a_finished_run_is_a_success_that_changes_nothing(char_dataset: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """A requeue of a job that had completed reruns the command: it must not fail (a scheduler
    would retry it) nor train or write anything."""
    out = tmp_path / "run"
    first = train(_config(char_dataset, out), MPI.COMM_SELF)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.is_symlink()}
    capsys.readouterr()
    again = train(_config(char_dataset, out), MPI.COMM_SELF)
    assert "the run is already finished, nothing to do" in capsys.readouterr().err
    assert again.steps == 0 and again.final_loss == first.final_loss and again.final_val_loss == first.final_val_loss
    from numesh.cli.app import done_lines

    assert f"done: 0 steps in 0.0 s, final loss {first.final_loss:.4f}, val " in done_lines(again)  # not n/a
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.is_symlink()} == before
    with pytest.raises(ConfigError, match="past max_iters=5"):  # a shorter run than the checkpoint is still refused
        train(_config(char_dataset, out, max_iters=5), MPI.COMM_SELF)


def test_resume_auto_redoes_an_attempt_that_saved_nothing(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(Interrupted, match="no checkpoint saved"):  # --ckpt-interval 0: nothing saved
        train(_config(char_dataset, out), MPI.COMM_SELF, on_step=_signal_at(1, signal.SIGINT))
    assert _steps(out) == [0, 1]
    train(_config(char_dataset, out), MPI.COMM_SELF)  # not refused as a reused directory: started over
    assert _steps(out) == [0, 1, 2, 3, 4, 5, 6]


def test_resume_auto_keeps_an_attempt_that_saved_nothing_from_another_command(char_dataset: Path,
                                                                              tmp_path: Path) -> None:
    """Only a requeue of the same settings redoes the attempt: another --max-iters started over
    and replaced its metrics without a word. A layout or checkpointing option is no setting."""
    out = tmp_path / "run"
    with pytest.raises(Interrupted, match="no checkpoint saved"):
        train(_config(char_dataset, out), MPI.COMM_SELF, on_step=_signal_at(1, signal.SIGINT))
    logged = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError) as info:
        train(_config(char_dataset, out, max_iters=3, seed=4), MPI.COMM_SELF)
    assert str(info.value) == (
        f"--out {out} holds an attempt that saved no checkpoint, and --resume auto would replace its metrics with a "
        "run of other settings: --max-iters 3 (it ran with --max-iters 6), --seed 4 (it ran with --seed 3); rerun "
        "it as it was, pass --overwrite to replace it, or choose another --out")
    assert (out / "metrics.jsonl").read_bytes() == logged
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(out), "--resume", "auto",
                              "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8"))
    assert "holds an attempt that saved no checkpoint" in line  # alone: not after "starting at step 0"
    train(_config(char_dataset, out, ckpt_interval=2, micro_batches=2), MPI.COMM_SELF)  # the same steps: redone
    assert _steps(out) == [0, 1, 2, 3, 4, 5, 6]


def test_resume_auto_never_starts_over_a_dangling_latest(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    os.symlink("step_000009", out / "ckpt" / "latest")  # its step directory is gone
    res = cli("train", "--data", str(char_dataset), "--out", str(out), "--resume", "auto", "--n-layer", "1",
              "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--max-iters", "2")
    assert f"no checkpoint at {out / 'ckpt' / 'latest'}" in one_error_line(res)
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("damage", ["its step removed", "a file of its step removed"])
def test_resume_auto_names_the_intact_step_before_a_broken_latest(char_dataset: Path, tmp_path: Path,
                                                                  damage: str) -> None:
    """It said only "pass a checkpoint directory such as RUN/ckpt/latest", which is the one broken."""
    out, ck = tmp_path / "run", tmp_path / "run" / "ckpt"
    train(_config(char_dataset, out, resume="", max_iters=4, ckpt_interval=2), MPI.COMM_SELF)  # steps 2 and 4
    if damage == "its step removed":
        shutil.rmtree(ck / "step_000004")
        what = "points at a missing step_000004"
    else:
        next((ck / "step_000004" / "params").glob("*.npy")).unlink()
        what = "leads to a broken checkpoint ("
    logged = _steps(out)
    with pytest.raises(CheckpointError) as info:
        train(_config(char_dataset, out, max_iters=6), MPI.COMM_SELF)
    assert str(info.value).startswith(f"--resume auto: {ck / 'latest'} {what}")
    assert str(info.value).endswith(f"; resume the intact step_000002 with --resume {ck / 'step_000002'}")
    assert "\n" not in str(info.value) and _steps(out) == logged  # nothing started over


# ---------------------------------------------------------------------------------------
# --save-on-signal: a scheduler's warning saves the step and exits 75


def test_a_save_signal_saves_whatever_the_interval_and_exits_75(char_dataset: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    with pytest.raises(Preempted) as info:  # --ckpt-interval 0: nothing would be saved on Ctrl-C
        train(_config(char_dataset, out, resume=""), MPI.COMM_SELF, on_step=_signal_at(1, signal.SIGUSR1))
    e = info.value
    assert isinstance(e, Interrupted) and (e.step, e.signum) == (2, signal.SIGUSR1)
    step_dir = out / "ckpt" / "step_000002"
    assert str(e) == (f"preempted by SIGUSR1: checkpoint at step 2 ({step_dir}); "
                      "rerun with --resume auto to continue")
    assert (out / "ckpt" / "latest").resolve() == step_dir and read_meta(step_dir).step == 2
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # the caller's handler again
    with pytest.raises(SystemExit) as code:
        guarded(lambda: (_ for _ in ()).throw(e))
    assert code.value.code == Preempted.EXIT_CODE == 75
    assert capsys.readouterr().err.splitlines()[-1] == str(e)


@pytest.fixture
def startup_catch():
    """`numesh train`'s start-up catch (numesh/host/startup_signals.py) in this process, as
    its first line installs it; released afterwards."""
    startup_signals.catch_for_command(["numesh", "train"])  # the default TERM,USR1
    yield
    startup_signals.release()


def test_a_save_signal_during_start_up_exits_75_at_the_first_step(char_dataset: Path, tmp_path: Path,
                                                                  startup_catch) -> None:
    """Before the training loop: at step 0 nothing trained, so nothing is saved; a run that
    continues OUT's own checkpoint names that one and writes no second copy. (Before, the
    signal was lost: the run trained on to the end and exited 0 without a save.)"""
    out = tmp_path / "run"
    os.kill(os.getpid(), signal.SIGUSR1)  # as if it came while the kernels compiled or MPI started
    with pytest.raises(Preempted) as info:
        train(_config(char_dataset, out), MPI.COMM_SELF)
    assert (info.value.step, info.value.checkpoint) == (0, None)
    assert str(info.value) == ("preempted by SIGUSR1 before step 0 ran: no checkpoint needed; "
                               "rerun with --resume auto to start")
    assert _steps(out) == [] and not (out / "ckpt").exists()

    train(_config(char_dataset, out, max_iters=3), MPI.COMM_SELF)  # the requeue starts over, saves step 3
    saved = (out / "ckpt" / "step_000003").stat().st_mtime_ns
    os.kill(os.getpid(), signal.SIGTERM)  # the next attempt (more steps) is preempted as it loads step 3
    with pytest.raises(Preempted) as info:
        train(_config(char_dataset, out), MPI.COMM_SELF)
    assert (info.value.step, info.value.checkpoint) == (3, str(out / "ckpt" / "step_000003"))
    # step 3's line goes on resuming (step 3 logs again when it runs); its checkpoint stays as written
    assert _steps(out) == [0, 1, 2] and (out / "ckpt" / "step_000003").stat().st_mtime_ns == saved
    assert (out / "ckpt" / "latest").resolve().name == "step_000003"


def test_save_on_signal_names_are_checked(char_dataset: Path, tmp_path: Path) -> None:
    assert parse_signals("TERM, sigusr1,USR1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == parse_signals("") == ()
    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--save-on-signal", "KILL")
    assert "--save-on-signal: 'KILL' is not one of HUP, INT" in one_error_line(res)


@pytest.fixture
def launch(tmp_path: Path):
    """Job(tmp_path, ranks, *args, env=...), every process of each killed at the end."""
    jobs: list[Job] = []

    def make(ranks: int, *args: str, env: dict[str, str] | None = None, prelude: str = "") -> Job:
        jobs.append(Job(tmp_path, ranks, *args, env=env, prelude=prelude))
        return jobs[-1]

    yield make
    for j in jobs:
        if j.proc.poll() is None or any(_alive(p) for p in j.rank_pids):
            j.kill()


# a rank's process sends itself $SIGNAL when it first imports the module $SIGNAL_AT (on the
# ranks in $SIGNAL_RANKS): a moment of start-up hit every time, where a sleep would race
SIGNAL_AT_IMPORT = """
import importlib.abc, os, signal, sys
class _SignalAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["SIGNAL_AT"] and os.environ.get("PMI_RANK", "0") in os.environ["SIGNAL_RANKS"]:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
        return None
sys.meta_path.insert(0, _SignalAt())
"""

# (ranks, options, the module whose import the signal comes at, the ranks it goes to)
START_UP = [
    pytest.param(0, (), "mpi4py.MPI", "0", id="sigusr1-before-mpi-init"),  # once exit 138 and no message
    pytest.param(2, ("--mesh", "dp=2"), "numesh.run.train", "1", id="sigusr1-to-rank-1-of-2-after-mpi-init"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, args, at, whom", START_UP)
def test_a_save_signal_during_start_up_of_a_job_exits_75(launch, ranks: int, args: tuple, at: str,
                                                          whom: str) -> None:
    """`numesh train` keeps SIGUSR1 from its first line: before MPI initialisation (whose
    handlers replace numesh's) and after it, on any rank. Every rank exits 75 at step 0
    with nothing to save; before, the process died (exit 138) or trained to the end, exit 0."""
    j = launch(ranks, *args, "--max-iters", "3", prelude=SIGNAL_AT_IMPORT,
               env={"SIGNAL_AT": at, "SIGNAL_RANKS": whom, "SIGNAL": "SIGUSR1"})
    rc = j.finish(within=START_WITHIN_S)
    err = j.stderr()
    assert rc == 75 and j.rank_codes() == [75] * j.ranks_expected, err
    assert "preempted by SIGUSR1 before step 0 ran: no checkpoint needed" in err and "Traceback" not in err, err
    assert not (j.out / "ckpt").exists()


@pytest.mark.timeout(300)
def test_save_on_signal_none_leaves_sigusr1_its_default_action(launch, tmp_path: Path) -> None:
    """`save_on_signal = "none"` in a --config file: the SIGUSR1 that start-up kept while
    the file was unread ends the process as SIGUSR1's default action does (once MPI's
    handler swallowed it and the run went on)."""
    config = tmp_path / "none.toml"
    config.write_text('save_on_signal = "none"\n')
    j = launch(0, "--config", str(config), "--max-iters", "3", prelude=SIGNAL_AT_IMPORT,
               env={"SIGNAL_AT": "numesh.run.train", "SIGNAL_RANKS": "0", "SIGNAL": "SIGUSR1"})
    assert j.finish(within=START_WITHIN_S) == -signal.SIGUSR1, j.stderr()
    assert j.rank_codes() == [None]  # killed: the wrapper wrote no exit code


TINY_F64 = ["--max-iters", "40", "--dtype", "float64", "--dropout", "0.1", "--peak-flops", "1e12"]
SLOW = {"NUMESH_INJECT": "slow:rank=0:ms=60"}  # steps long enough to signal mid-run


def _reference(j: Job, max_iters: int = 40) -> dict[str, np.ndarray]:
    """The final parameters of the same run, uninterrupted, in this process on one rank."""
    cfg = config_from(dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=max_iters,
                           eval_interval=1000000, eval_iters=1, dtype="float64", dropout=0.1, peak_flops=1e12,
                           data=str(j.dir / "data"), out=str(j.dir / "reference")))
    return read_params_dict(train(cfg, MPI.COMM_SELF).checkpoint)


def _assert_params_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert_close(got[k], want[k], 1e-10, what=k)


def _preempted(j: Job) -> int:
    """Every rank exited 75 after one 'preempted ... checkpoint at step N' line; returns N."""
    err = j.stderr()
    lines = [m for m in map(PREEMPTED.search, err.splitlines()) if m]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert j.rank_codes() == [75] * j.ranks_expected, err
    step = int(lines[0][2])
    assert lines[0][1] == "SIGUSR1" and lines[0][3] == str(j.out / "ckpt" / f"step_{step:06d}"), err
    assert (j.out / "ckpt" / "latest").resolve().name == f"step_{step:06d}"
    return step


PREEMPTED = re.compile(r"preempted by (SIG\w+): checkpoint at step (\d+) \((.*)\); rerun with --resume auto")


@pytest.mark.timeout(300)
def test_sigusr1_to_mpiexec_then_the_same_command_finishes_the_run(launch) -> None:
    """A Slurm-style requeue: SIGUSR1 mid-run, then the identical command line again."""
    args = ("--mesh", "dp=2", "--resume", "auto", *TINY_F64)
    j = launch(2, *args, env=SLOW)
    j.wait_for_steps()
    os.kill(j.proc.pid, signal.SIGUSR1)  # mpiexec forwards it to every rank
    rc = j.finish()
    assert rc == 75, j.stderr()
    step = _preempted(j)
    assert 0 < step < 40
    again = launch(2, *args, env=SLOW)
    rc = again.finish(within=START_WITHIN_S)
    assert rc == 0 and again.rank_codes() == [0, 0], again.stderr()
    assert f"continuing from step {step} (" in again.stderr()
    assert [json.loads(x)["step"] for x in (j.out / "metrics.jsonl").read_text().splitlines()] == list(range(41))
    _assert_params_close(read_params_dict(j.out / "ckpt" / "latest"), _reference(j))


@pytest.mark.timeout(300)
def test_requeued_on_fewer_ranks_with_mesh_auto(launch) -> None:
    """Preempted on 2 ranks; the same command on 1 rank (the nodes that came back) finishes the run."""
    args = ("--mesh", "auto", "--resume", "auto", *TINY_F64)
    j = launch(2, *args, env=SLOW)
    j.wait_for_steps()
    os.kill(j.proc.pid, signal.SIGUSR1)
    rc = j.finish()
    assert rc == 75, j.stderr()
    step = _preempted(j)
    assert "--mesh auto on 2 ranks" in j.stderr()
    alone = launch(0, *args)
    rc = alone.finish(within=START_WITHIN_S)
    assert rc == 0, alone.stderr()
    assert "--mesh auto on 1 rank" in alone.stderr() and f"continuing from step {step} (" in alone.stderr()
    _assert_params_close(read_params_dict(j.out / "ckpt" / "latest"), _reference(j))
