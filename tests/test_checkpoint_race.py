"""Reading `latest` while a job saves and prunes (issue 31): `numesh sample --ckpt
RUN/ckpt/latest` beside a job run with `--keep 1` failed 1 time in 25 with "...npy is not
a readable .npy file", because pruning removed the step directory under the reader.

The first tests prune in the middle of a read, at a chosen moment, in this process; the
last one reads a real job's `latest` over and over while it saves at every step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import make_dataset
from numesh.base.tree import tree_leaves
from numesh.checkpoint import (
    CheckpointError,
    common,
    export_nanogpt,
    import_nanogpt,
    read_global,
    read_local_state,
    read_state,
    reshard,
    save_checkpoint,
)
from numesh.checkpoint import format as fmt
from numesh.checkpoint.hf import write_all
from numesh.checkpoint.save import point_latest
from numesh.mesh import Mesh
from numesh.run.config import config_from
from numesh.run.sample import load_checkpoint
from numesh.run.train import Trainer, train, train_state
from test_mpi_suites import clean_env

TINY = dict(n_layer=1, n_head=2, n_embd=8, block_size=8, batch_size=4, eval_interval=100, eval_iters=1,
            dtype="float64", peak_flops=1e12)


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints of steps 2 and 4 (the module's pristine copy)."""
    tmp = tmp_path_factory.mktemp("race")
    cfg = config_from(dict(TINY, data=str(make_dataset(tmp / "data")), out=str(tmp / "run"), max_iters=4,
                           ckpt_interval=2))
    train(cfg, MPI.COMM_SELF)
    return tmp / "run" / "ckpt"


@pytest.fixture
def ckpt(two_steps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy whose `latest` is step 2; the first file a reader hashes makes a "save" move
    `latest` to step 4 and prune step 2, as a job with --keep 1 does."""
    ck = tmp_path / "ckpt"
    shutil.copytree(two_steps, ck, symlinks=True)
    point_latest(ck, "step_000002")
    hash_file = fmt.sha256_file
    pruned = []

    def prune_once(path: Path, chunk: int = 1 << 20) -> str:
        if not pruned:
            pruned.append(path)
            point_latest(ck, "step_000004")
            shutil.rmtree(ck / "step_000002")
        return hash_file(path, chunk)

    monkeypatch.setattr(fmt, "sha256_file", prune_once)
    return ck


def test_sample_reads_the_next_step_when_latest_is_pruned_mid_read(ckpt: Path) -> None:
    ck = load_checkpoint(ckpt / "latest")
    assert ck.step == 4
    assert not (ckpt / "step_000002").exists()


@pytest.mark.parametrize("reader", ["read_global", "read_state", "export", "reshard", "read_local_state"])
def test_every_reader_of_latest_survives_pruning(ckpt: Path, tmp_path: Path, reader: str) -> None:
    latest = ckpt / "latest"
    if reader == "read_global":
        meta, params = read_global(latest)
        step = meta.step
    elif reader == "read_state":
        meta, trees = read_state(latest)
        step = meta.step
    elif reader == "export":
        export_nanogpt(latest, tmp_path / "m.safetensors")
        step = import_nanogpt(tmp_path / "m.safetensors")[4]
    elif reader == "reshard":
        out = reshard(latest, "tp=2", tmp_path / "tp2")
        step = read_global(out)[0].step
    else:
        trainer = Trainer(config_from(dict(TINY, data=str(make_dataset(tmp_path / "data")),
                                           out=str(tmp_path / "o"), max_iters=8)), MPI.COMM_SELF)
        got = read_local_state(latest, Mesh.create(comm=MPI.COMM_SELF), trainer.model, trainer.layout, np.float64)
        step = got.step
    assert step == 4


def test_a_step_directory_pruned_mid_read_is_one_line(ckpt: Path) -> None:
    """A reader given step_000002 itself cannot go on to another step: it says what happened."""
    with pytest.raises(CheckpointError, match=r"step_000002 was removed while it was being read .*--keep"):
        read_global(ckpt / "step_000002")


def test_a_step_saved_again_under_its_name_mid_read(two_steps: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A run resumed from an older step saves the later steps again over their old copies
    (renamed away, the new one renamed in): a reader of the old step_000004 then found the
    new files under the same path and called them corrupted. It reads the new copy now."""
    ck = tmp_path / "ckpt"
    shutil.copytree(two_steps, ck, symlinks=True)
    hash_file = fmt.sha256_file
    swapped = []

    def save_again(path: Path, chunk: int = 1 << 20) -> str:
        if not swapped:  # the new step 4 stands in as a copy of step 2 (other values, same files)
            swapped.append(path)
            os.replace(ck / "step_000004", ck / ".tmp-old-step_000004")
            shutil.copytree(ck / "step_000002", ck / "step_000004")
            shutil.rmtree(ck / ".tmp-old-step_000004")
        return hash_file(path, chunk)

    monkeypatch.setattr(fmt, "sha256_file", save_again)
    meta, _ = read_global(ck / "latest")
    assert swapped and meta.step == 2  # what step_000004 holds now


def test_meta_and_params_come_from_one_step(two_steps: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`latest` moving between reading meta.json and the arrays (no pruning, so no error)
    gave `numesh sample` step 2's metadata with step 4's weights: it follows the link once now."""
    ck = tmp_path / "ckpt"
    shutil.copytree(two_steps, ck, symlinks=True)
    point_latest(ck, "step_000002")
    read_meta = common.read_any_meta

    def then_move(path: Path, describe: object, groups: object) -> fmt.Meta:
        meta = read_meta(path, describe, groups)
        point_latest(ck, "step_000004")
        return meta

    monkeypatch.setattr(common, "read_any_meta", then_move)
    got = load_checkpoint(ck / "latest")
    monkeypatch.undo()
    want = read_global(ck / "step_000002")[1]
    assert got.step == 2
    for a, b in zip(tree_leaves(got.params), tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(300)
def test_readers_of_a_running_jobs_latest_with_keep_1(tmp_path: Path) -> None:
    """A real job saving every step with --keep 1, read back-to-back: before the fix about 1
    read in 40 failed. Two hundred reads spanning at least 3 saved steps, counted, not timed
    (a busy machine reads more slowly; the deadlines only stop a hung job)."""
    data, out = make_dataset(tmp_path / "data"), tmp_path / "run"
    cmd = [sys.executable, "-m", "numesh.cli.app", "train", "--data", str(data), "--out", str(out),
           "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
           "--max-iters", "1000000", "--eval-interval", "1000000", "--eval-iters", "1", "--peak-flops", "1e12",
           "--ckpt-interval", "1", "--keep", "1"]
    job = subprocess.Popen(cmd, env={**clean_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        latest, deadline = out / "ckpt" / "latest", time.monotonic() + 120
        while not latest.exists():
            assert job.poll() is None, job.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint within 120 s (hung?)"
            time.sleep(0.05)
        steps, reads, deadline = set(), 0, time.monotonic() + 120
        while reads < 200 or len(steps) < 3:
            steps.add(load_checkpoint(latest).step)
            reads += 1
            assert job.poll() is None, job.stderr.read()
            assert time.monotonic() < deadline, f"the job saved only steps {sorted(steps)} within 120 s (hung?)"
    finally:
        job.kill()
        job.wait()


def test_a_save_spares_a_reshard_writing_beside_it(tmp_path: Path) -> None:
    """`numesh reshard RUN/ckpt/latest --to tp=2` writes RUN/ckpt/.tmp-step_N-tp2 while the
    job goes on; the job's next save removed every `.tmp-` directory, that one included.
    Now only a killed save's own leftovers go."""
    ck = tmp_path / "run" / "ckpt"
    reshard_tmp, killed_save = ck / ".tmp-step_000002-tp2", ck / ".tmp-step_000007"
    (reshard_tmp / "params").mkdir(parents=True)
    (reshard_tmp / "params" / "wte.tp0.npy").write_bytes(b"being written")
    killed_save.mkdir()
    cfg = config_from(dict(TINY, data=str(make_dataset(tmp_path / "data")), out=str(tmp_path / "run"), max_iters=2))
    save_checkpoint(train_state(Trainer(cfg, MPI.COMM_SELF)), tmp_path / "run")
    assert (reshard_tmp / "params" / "wte.tp0.npy").read_bytes() == b"being written"
    assert not killed_save.exists() and (ck / "latest").is_dir()


def test_an_hf_export_that_fails_half_way_leaves_the_old_export_whole(tmp_path: Path) -> None:
    """`numesh export --format hf --force` wrote its files one by one into the directory: a
    failure (or a reader) between two found new weights beside an old config. Now every
    file is written aside first and only then renamed into place."""
    out = tmp_path / "hf"
    out.mkdir()
    write_all(out, {"model.safetensors": b"old weights", "config.json": "old config"})

    with pytest.raises(TypeError):  # the second file cannot be written, after the weights were
        write_all(out, {"model.safetensors": b"new weights", "config.json": object()})  # type: ignore[dict-item]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temporary left
    assert (out / "model.safetensors").read_bytes() == b"old weights"
