"""A run never silently loses or corrupts work (issue #18, points 3, 7, 8 and 10): divergence
stops with one line and leaves the good checkpoints alone; an output directory is held by
one run and never silently reused; a full disk is found before training, not at the end."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from numesh.cli.app import app

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--batch-size", "4",
        "--eval-interval", "100", "--eval-iters", "2"]


def run(data: Path, out: Path, *args: str):
    res = CliRunner().invoke(app, ["train", "--data", str(data), "--out", str(out), *TINY, *args])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    return res, errors


def strict_lines(path: Path) -> list[dict]:
    def reject(c: str) -> None:
        raise ValueError(f"bare {c} in metrics")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_divergence_stops_with_one_line_and_keeps_the_good_checkpoint(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Adam moves each weight by about the rate a step: at 1e7 float32 overflows within a few steps
    res, errors = run(char_dataset, out, "--learning-rate", "1e7", "--weight-decay", "0", "--max-iters", "300",
                      "--ckpt-interval", "2", "--keep", "1")
    assert res.exit_code == 2, res.output
    assert len(errors) == 1 and "training diverged at step" in errors[0], res.stderr
    assert "RuntimeWarning" not in res.stderr
    step = int(errors[0].split("at step ")[1].split()[0])
    assert step < 300  # it stopped; it did not train on NaN to the end
    latest = (out / "ckpt" / "latest").resolve()
    assert f"last good checkpoint: {latest}" in errors[0]
    assert int(latest.name.split("_")[1]) <= step  # never a checkpoint of the diverged state
    lines = strict_lines(out / "metrics.jsonl")  # strict JSON: NaN written as null
    last = lines[-1]
    assert set(last) == {"step", "loss", "grad_norm", "diverged"} and last["step"] == step and last["diverged"]
    # what diverged is non-finite, written as null; the other may still be finite (a loss of 2e17
    # whose gradients overflowed float32), depending on the path the rounding took
    assert None in (last["loss"], last["grad_norm"]), last
    import numpy as np

    from numesh.checkpoint import read_state

    _, trees = read_state(latest)
    from numesh.base.tree import tree_leaves

    assert all(np.isfinite(x).all() for t in trees.values() for x in tree_leaves(t))


def test_on_nan_skip_counts_skips_and_stops_after_the_limit(char_dataset: Path, tmp_path: Path) -> None:
    res, errors = run(char_dataset, tmp_path / "run", "--learning-rate", "1e7", "--weight-decay", "0",
                      "--max-iters", "300", "--on-nan", "skip", "--max-skips", "3")
    assert res.exit_code == 2, res.output
    assert len(errors) == 1 and "4 steps skipped, over --max-skips" in errors[0]
    assert "last good checkpoint: none" in errors[0]


def test_a_fresh_run_never_reuses_a_run_directory(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    res, _ = run(char_dataset, out, "--max-iters", "3")
    assert res.exit_code == 0, res.output
    first = (out / "metrics.jsonl").read_text()
    res, errors = run(char_dataset, out, "--max-iters", "4")
    assert res.exit_code == 2 and len(errors) == 1 and "already holds a run" in errors[0]
    assert f"pass --resume {out / 'ckpt' / 'latest'} to continue it" in errors[0]
    assert (out / "metrics.jsonl").read_text() == first  # nothing truncated or mixed
    res, _ = run(char_dataset, out, "--max-iters", "4", "--overwrite")
    assert res.exit_code == 0, res.output
    assert [p.name for p in (out / "ckpt").iterdir() if p.name.startswith("step_")] == ["step_000004"]
    assert strict_lines(out / "metrics.jsonl")[-1]["step"] == 4


def test_a_run_that_stopped_before_its_first_checkpoint_is_not_told_to_resume(char_dataset: Path,
                                                                               tmp_path: Path) -> None:
    """A run that died before any save leaves config.json and metrics.jsonl but no
    ckpt/latest: the next run was told to pass --resume OUT/ckpt/latest, which does not exist."""
    out = tmp_path / "run"
    # diverges, saves nothing
    res, _ = run(char_dataset, out, "--learning-rate", "1e7", "--weight-decay", "0", "--max-iters", "300")
    assert res.exit_code == 2 and not (out / "ckpt" / "latest").exists() and (out / "metrics.jsonl").exists()
    res, errors = run(char_dataset, out, "--max-iters", "4")
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert errors[0].endswith("it has no checkpoint to resume from: pass --overwrite to replace it, or another --out")
    assert "--resume" not in errors[0]
    assert run(char_dataset, out, "--max-iters", "4", "--overwrite")[0].exit_code == 0  # what it says works


def test_a_locked_directory_names_its_holder(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"pid 4242 on somehost since 2026-01-01 00:00:00")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another run holds it
    try:
        res, errors = run(char_dataset, out, "--max-iters", "2")
    finally:
        os.close(fd)
    assert res.exit_code == 2 and len(errors) == 1
    assert "is in use by pid 4242 on somehost" in errors[0]
    assert not (out / "metrics.jsonl").exists()
    res, _ = run(char_dataset, out, "--max-iters", "2")  # released: a killed holder leaves no stale lock
    assert res.exit_code == 0, res.output


def test_the_run_holds_its_directory_until_its_last_file_is_written(char_dataset: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock was released when the loop ended, before the final checkpoint and the trace
    were written: a resume or an --overwrite taking OUT then wrote or removed files under
    the run still finishing. Checked from inside the final save."""
    from numesh.run import train as T

    out, held = tmp_path / "run", []
    save_step = T.save_step

    def probe(trainer: object, out_dir: Path, keep: int = 0) -> Path:
        fd = os.open(out / ".lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return save_step(trainer, out_dir, keep)

    monkeypatch.setattr(T, "save_step", probe)
    res, _ = run(char_dataset, out, "--max-iters", "2", "--trace", "--peak-flops", "1e12")
    assert res.exit_code == 0, res.output
    assert held == [True] and (out / "trace.json").is_file()


def test_resume_at_max_iters_is_an_error_not_a_rewrite(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run(char_dataset, out, "--max-iters", "2")[0].exit_code == 0
    step_dir = (out / "ckpt" / "latest").resolve()
    before = (step_dir / "meta.json").read_bytes()
    res, errors = run(char_dataset, out, "--max-iters", "2", "--resume", str(out / "ckpt" / "latest"), "--mesh", "")
    assert res.exit_code == 2 and len(errors) == 1 and "already at max_iters=2" in errors[0]
    assert (step_dir / "meta.json").read_bytes() == before
    res, _ = run(char_dataset, out, "--max-iters", "4", "--resume", str(out / "ckpt" / "latest"))
    assert res.exit_code == 0, res.output
    assert (out / "ckpt" / "latest").resolve().name == "step_000004"
    assert [r["step"] for r in strict_lines(out / "metrics.jsonl") if "loss" in r] == [0, 1, 2, 3]


def test_no_room_for_a_checkpoint_is_found_before_training(char_dataset: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    res, errors = run(char_dataset, tmp_path / "run", "--max-iters", "50")
    assert res.exit_code == 2 and len(errors) == 1
    assert "MiB free but a checkpoint of this model needs" in errors[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failing_metrics_write_is_one_line(char_dataset: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from numesh.run import rundir

    class Full:
        def write(self, _s: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None: ...

        def close(self) -> None: ...

    real_open = rundir.RunDir._open

    def open_full(self, *a, **k):
        real_open(self, *a, **k)
        self.metrics.close()
        self.metrics = Full()

    monkeypatch.setattr(rundir.RunDir, "_open", open_full)
    res, errors = run(char_dataset, tmp_path / "run", "--max-iters", "5")
    assert res.exit_code == 2, res.output
    assert len(errors) == 1 and "cannot write" in errors[0] and "No space left on device" in errors[0]


def test_resuming_another_runs_checkpoint_into_a_run_directory_needs_overwrite(char_dataset: Path,
                                                                               tmp_path: Path) -> None:
    """--resume A/ckpt/latest --out B, with B holding a run of its own, kept B's metrics lines
    before the step and appended A's continuation: two runs mixed in one metrics.jsonl, silently.
    Now it needs --overwrite, which replaces B (and never touches A)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(char_dataset, a, "--max-iters", "2")[0].exit_code == 0
    assert run(char_dataset, b, "--max-iters", "6", "--seed", "7")[0].exit_code == 0
    before = (b / "metrics.jsonl").read_text()
    res, errors = run(char_dataset, b, "--max-iters", "4", "--resume", str(a / "ckpt" / "latest"))
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert "already holds another run" in errors[0] and "pass --overwrite to replace it" in errors[0]
    assert (b / "metrics.jsonl").read_text() == before
    res, _ = run(char_dataset, b, "--max-iters", "4", "--resume", str(a / "ckpt" / "latest"), "--overwrite")
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in strict_lines(b / "metrics.jsonl") if "loss" in r] == [2, 3]
    assert (a / "ckpt" / "latest").exists()
    # continuing B from its own checkpoint needs nothing more, and --overwrite there deletes nothing
    res, _ = run(char_dataset, b, "--max-iters", "5", "--resume", str(b / "ckpt" / "latest"), "--overwrite")
    assert res.exit_code == 0, res.output
    assert [r["step"] for r in strict_lines(b / "metrics.jsonl") if "loss" in r] == [2, 3, 4]


def test_checkpoints_that_cannot_be_written_are_found_before_training(char_dataset: Path, tmp_path: Path) -> None:
    """OUT/ckpt linked to a disk that is not there trained every step, then failed at the
    first save ("File exists"): now one line before step 0, nothing logged."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt").symlink_to(tmp_path / "not-mounted")
    res, errors = run(char_dataset, out, "--max-iters", "2")
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert f"{out / 'ckpt'} links to {tmp_path / 'not-mounted'}, which does not exist" in errors[0]
    assert not (out / "metrics.jsonl").exists()


def test_a_linked_empty_checkpoint_directory_is_used_and_overwritten_in_place(char_dataset: Path,
                                                                            tmp_path: Path) -> None:
    """OUT/ckpt linked to an empty directory (checkpoints on another disk) was "already holds
    a run", and --overwrite then failed in shutil ("Cannot call rmtree on a symbolic link")."""
    out, disk = tmp_path / "run", tmp_path / "disk"
    out.mkdir()
    disk.mkdir()
    (out / "ckpt").symlink_to(disk)
    res, _ = run(char_dataset, out, "--max-iters", "2")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "step_000002"]
    (disk / "notes.txt").write_text("mine")
    res, _ = run(char_dataset, out, "--max-iters", "3", "--overwrite")
    assert res.exit_code == 0, res.output
    assert (out / "ckpt").is_symlink() and sorted(p.name for p in disk.iterdir()) == ["latest", "notes.txt",
                                                                                      "step_000003"]
