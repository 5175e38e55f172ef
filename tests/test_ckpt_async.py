"""`--ckpt-async` (issue 33): checkpoints written by a background thread while training goes on.

The files are those a synchronous save writes; training goes on while they are written;
`latest` moves only once every rank's files are complete, so a failed write, or a rank
killed (kill -9) while its writer runs, leaves the previous checkpoint `latest`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from numesh.base.errors import Preempted
from numesh.base.tree import tree_leaves
from numesh.checkpoint import CheckpointError, read_meta, read_params_dict
from numesh.checkpoint import save as save_mod
from numesh.checkpoint.background import AsyncCheckpoints
from numesh.run.config import config_from
from numesh.run.train import Trainer, train, train_state
from test_interrupt import START_WITHIN_S, Job, _alive


def _config(data: Path, out: Path, **kw: object):
    base: dict = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, max_iters=8, ckpt_interval=2,
                      eval_interval=4, eval_iters=1, data=str(data), out=str(out), seed=3, dtype="float64",
                      dropout=0.1, peak_flops=1e12)
    base.update(kw)
    return config_from(base)


def _files(step_dir: Path) -> dict[str, list]:
    """Each leaf's file records (names, offsets, shapes, sha256) in a checkpoint's meta.json."""
    return {k: v["files"] for k, v in json.loads((step_dir / "meta.json").read_text())["leaves"].items()}


def _in_writer() -> bool:
    return threading.current_thread() is not threading.main_thread()


def _hold_writers(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the checkpoint writer threads wait, before each file, until the returned event is set."""
    gate, real = threading.Event(), save_mod.write_npy

    def gated(path: Path, array: np.ndarray) -> str:
        if _in_writer():
            assert gate.wait(60)
        return real(path, array)

    monkeypatch.setattr(save_mod, "write_npy", gated)
    return gate


def test_async_checkpoints_are_the_sync_ones(char_dataset: Path, tmp_path: Path) -> None:
    records = {}
    for mode in ("sync", "async"):
        got: list = []
        train(_config(char_dataset, tmp_path / mode, ckpt_async=mode == "async"), MPI.COMM_SELF,
              on_step=lambda s, r: got.append((s, r.get("loss"), r.get("val_loss"))))
        records[mode] = got
    assert records["async"] == records["sync"]
    steps = [f"step_{s:06d}" for s in (2, 4, 6, 8)]
    for mode in ("sync", "async"):
        assert sorted(p.name for p in (tmp_path / mode / "ckpt").iterdir()) == ["latest", *steps]
    for name in steps:  # the same blocks with the same bytes
        assert _files(tmp_path / "async" / "ckpt" / name) == _files(tmp_path / "sync" / "ckpt" / name)


def test_training_goes_on_while_a_checkpoint_is_written(char_dataset: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _hold_writers(monkeypatch)
    latest = tmp_path / "run" / "ckpt" / "latest"
    seen: dict[int, str | None] = {}

    def on_step(step: int, record: dict) -> None:
        seen[step] = os.readlink(latest) if latest.is_symlink() else None
        if step == 2:
            gate.set()  # step 2 was trained while step 2's checkpoint could not be written

    train(_config(char_dataset, tmp_path / "run", ckpt_async=True), MPI.COMM_SELF, on_step=on_step)
    assert seen[2] is None
    order = [seen[s] for s in sorted(seen) if seen[s] is not None]
    assert order == sorted(order)  # latest only moves forward
    assert os.readlink(latest) == "step_000008"
    for s in (2, 4, 6, 8):  # every save finished: the end of the run waited for the last one
        assert read_meta(latest.parent / f"step_{s:06d}").step == s


def test_a_failed_background_write_fails_the_run_and_keeps_latest(char_dataset: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = save_mod.write_npy

    def full_at_step_4(path: Path, array: np.ndarray) -> str:
        if _in_writer() and "step_000004" in str(path):
            raise OSError(28, "No space left on device")
        return real(path, array)

    monkeypatch.setattr(save_mod, "write_npy", full_at_step_4)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*step_000004.*No space left"):
        train(_config(char_dataset, tmp_path / "run", ckpt_async=True), MPI.COMM_SELF)
    ck = tmp_path / "run" / "ckpt"
    assert os.readlink(ck / "latest") == "step_000002" and not (ck / "step_000004").exists()


def test_a_preemption_finishes_the_save_in_flight_first(char_dataset: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _hold_writers(monkeypatch)
    def on_step(step: int, record: dict) -> None:
        if step == 2:  # step 2's save is in flight, its writer held for a moment longer
            os.kill(os.getpid(), signal.SIGUSR1)
            threading.Timer(0.3, gate.set).start()

    with pytest.raises(Preempted) as info:
        train(_config(char_dataset, tmp_path / "run", ckpt_async=True), MPI.COMM_SELF, on_step=on_step)
    ck = tmp_path / "run" / "ckpt"
    assert info.value.step == 3 and os.readlink(ck / "latest") == "step_000003"
    assert read_meta(ck / "step_000002").step == 2 and read_params_dict(ck / "step_000002")


def test_the_snapshot_is_a_copy_and_a_non_finite_one_never_becomes_latest(char_dataset: Path,
                                                                         tmp_path: Path) -> None:
    t = Trainer(_config(char_dataset, tmp_path / "run"), MPI.COMM_SELF)
    t.train_step()
    state = train_state(t)
    live = (t.opt.residency.buffer, t.opt.state["m"], t.opt.state["v"])
    assert not any(np.shares_memory(x, b) for tree in state.trees.values() for x in tree_leaves(tree) for b in live)
    saves = AsyncCheckpoints(MPI.COMM_SELF)
    assert saves.start(state, tmp_path / "run") == tmp_path / "run" / "ckpt" / "step_000001"
    assert saves.wait() == tmp_path / "run" / "ckpt" / "step_000001"
    t.train_step()
    state = train_state(t)
    state.trees["m"].wpe[0, 0] = np.nan
    saves.start(state, tmp_path / "run")
    with pytest.raises(CheckpointError, match="not saving step 2: its parameters or optimiser state are not finite"):
        saves.wait()
    ck = tmp_path / "run" / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000001"]
    assert os.readlink(ck / "latest") == "step_000001" and saves.pending is None


# ---------------------------------------------------------------------------------------
# kill -9 of a rank while its writer runs

# each rank's writer announces step 10's save (a file MARK.<rank>) and then writes slowly
SLOW_WRITER = """
import os, threading, time
import numesh.checkpoint.save as _save
_real = _save.write_npy
def _slow(path, array):
    if threading.current_thread() is not threading.main_thread() and "step_000010" in str(path):
        open(os.environ["MARK"] + "." + os.environ.get("PMI_RANK", "0"), "w").close()
        time.sleep(0.1)
    return _real(path, array)
_save.write_npy = _slow
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_during_an_async_write_keeps_the_previous_checkpoint(tmp_path: Path, victim: int) -> None:
    args = ("--mesh", "tp=2", "--ckpt-async", "--ckpt-interval", "5", "--resume", "auto", "--max-iters", "30",
            "--dtype", "float64")
    mark = tmp_path / "writing"
    j = Job(tmp_path, 2, *args, env={"MARK": str(mark)}, prelude=SLOW_WRITER)
    try:
        j.wait_for_steps(1)
        deadline = time.monotonic() + START_WITHIN_S
        while not Path(f"{mark}.{victim}").exists():
            assert j.proc.poll() is None and time.monotonic() < deadline, j.stderr()
            time.sleep(0.01)
        os.kill(j.rank_pid(victim), signal.SIGKILL)
        rc = j.proc.wait(timeout=60)
    finally:
        j.kill()
    assert rc != 0
    ck = j.out / "ckpt"
    assert os.readlink(ck / "latest") == "step_000005" and not (ck / "step_000010").exists()
    assert (ck / ".tmp-step_000010").is_dir()  # killed mid-write: what it wrote is where no reader looks
    assert read_meta(ck / "latest").step == 5 and read_params_dict(ck / "latest")  # every file, checksums verified
    again = Job(tmp_path, 2, *args)  # the same command: continues from the checkpoint that stayed
    try:
        assert again.proc.wait(timeout=START_WITHIN_S) == 0, again.stderr()
    finally:
        if again.proc.poll() is None or any(_alive(p) for p in again.rank_pids):
            again.kill()
    assert "continuing from step 5 (" in again.stderr()
    assert os.readlink(ck / "latest") == "step_000030"
