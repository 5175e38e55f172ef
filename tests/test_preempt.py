"""Preemptible runs (issue 33): the same command line continues a run that was stopped.

`--resume auto` continues from OUT/ckpt/latest when there is one and starts fresh when there
is none, so the identical command serves the first attempt and every requeue; the continued
run equals the uninterrupted one (bit for bit on the same mesh) and logs each step once.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import cli, one_error_line
from numesh.checkpoint import read_params_dict
from numesh.config import config_from
from numesh.errors import Interrupted
from numesh.train import train


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
        train(cfg, MPI.COMM_SELF, on_step=_signal_at(2, signal.SIGTERM))
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


def test_resume_auto_redoes_an_attempt_that_saved_nothing(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(Interrupted, match="no checkpoint saved"):  # --ckpt-interval 0: nothing saved
        train(_config(char_dataset, out), MPI.COMM_SELF, on_step=_signal_at(1, signal.SIGTERM))
    assert _steps(out) == [0, 1]
    train(_config(char_dataset, out), MPI.COMM_SELF)  # not refused as a reused directory: started over
    assert _steps(out) == [0, 1, 2, 3, 4, 5, 6]


def test_resume_auto_never_starts_over_a_dangling_latest(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    os.symlink("step_000009", out / "ckpt" / "latest")  # its step directory is gone
    res = cli("train", "--data", str(char_dataset), "--out", str(out), "--resume", "auto", "--n-layer", "1",
              "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--max-iters", "2")
    assert f"no checkpoint at {out / 'ckpt' / 'latest'}" in one_error_line(res)
    assert not (out / "metrics.jsonl").exists()
