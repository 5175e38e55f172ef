"""A preempted run continues on another number of ranks (issue 33): `--mesh auto` picks a
layout for whatever ranks the job comes back with, `--resume auto` continues the run, and
the result equals the uninterrupted run (float64, 1e-10), because every mesh computes the
same thing.

4 ranks train to step 20, where a SIGUSR1 (`--save-on-signal`) stops them; the run is
continued to step 40 once on 2 ranks and once on 1 rank, against one uninterrupted run on
4 ranks. Runs under `mpirun -n N python -m mpi4py -m pytest --with-mpi -m mpi` with N >= 4.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import WORLD, assert_close, on_first, on_root
from numesh.base.errors import Preempted
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import read_meta, read_state
from numesh.plan.auto import auto_layout
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import train

pytestmark = pytest.mark.mpi(min_size=4)

STOP, END = 20, 40


def config(data: Path, out: Path) -> TrainConfig:
    return config_from(dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=END, dropout=0.1, bias=True,
        learning_rate=1e-2, min_lr=1e-3, warmup_iters=2, lr_decay_iters=END, eval_interval=STOP, eval_iters=1,
        data=str(data), out=str(out), seed=5, dtype="float64", mesh="auto", resume="auto",
        peak_flops=1e12,  # given: the planner's CPU profile then measures nothing, so every pick is the same
    ))


def run(cfg: TrainConfig, comm: MPI.Comm, stop_at: int | None = None) -> str:
    """`numesh train --mesh auto --resume auto` on `comm`; with `stop_at`, rank 0 signals
    itself SIGUSR1 once step stop_at - 1 is logged. Returns the chosen mesh."""
    lines: list[str] = []
    chosen = auto_layout(cfg, comm, lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"--mesh auto on {comm.Get_size()} rank")

    def on_step(step: int, record: dict) -> None:
        if step == stop_at - 1 and comm.Get_rank() == 0:
            os.kill(os.getpid(), signal.SIGUSR1)

    if stop_at is None:
        train(chosen, comm)
    else:
        with pytest.raises(Preempted) as info:
            train(chosen, comm, on_step=on_step)
        assert info.value.step == stop_at
    return chosen.mesh


def test_preempted_on_4_ranks_continues_on_2_and_on_1(shared_dataset: Path, shared_tmp: Path) -> None:
    base = shared_tmp / "preempt-auto"
    whole = on_first(4, lambda comm: run(config(shared_dataset, base / "whole"), comm))
    first = on_first(4, lambda comm: run(config(shared_dataset, base / "two"), comm, stop_at=STOP))
    assert first == whole
    if WORLD.Get_rank() == 0:
        shutil.copytree(base / "two", base / "one", symlinks=True)
    WORLD.Barrier()
    meshes = [on_first(n, lambda comm: run(config(shared_dataset, base / name), comm))
              for n, name in ((2, "two"), (1, "one"))]
    assert meshes[1] == "dp=1,tp=1,pp=1"

    def check() -> None:
        meta_w, want = read_state(base / "whole" / "ckpt" / "latest")
        assert meta_w.step == END
        for name in ("two", "one"):
            assert read_meta(base / name / "ckpt" / f"step_{STOP:06d}").step == STOP
            meta, got = read_state(base / name / "ckpt" / "latest")
            assert (meta.step, meta.opt_step) == (END, END)
            for group in ("params", "m", "v"):
                pairs = zip(tree_leaves_with_path(got[group]), tree_leaves_with_path(want[group]))
                for (path, x), (_, y) in pairs:
                    assert_close(x, y, 1e-10, f"{name}: {group}/{path}")

    on_root(check)
