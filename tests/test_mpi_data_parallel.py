"""Data parallelism (alone and with tensor parallelism) reproduces the 1-rank training run.

Whole `numesh.run.train.train` runs in float64: losses, gradient norms, evaluation losses and
final parameters equal to 1e-10 relative. Adapts to the world size N: dp=N always,
dp=2 x tp=N/2 when N is 4 or 8, and dp=N/2 with two micro-batches when that divides.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL_BATCH, WORLD, assert_same_run, serial_reference, small_run_config, train_records
from numesh.base.errors import ConfigError
from numesh.mesh import MeshError
from numesh.run.train import train

pytestmark = pytest.mark.mpi(min_size=2)



@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_matches_one_rank(shared_dataset: Path, shared_tmp: Path, zero: int) -> None:
    n = WORLD.Get_size()
    cfg = small_run_config(shared_dataset, shared_tmp / f"dp{n}-zero{zero}", f"dp={n}", zero=zero)
    assert_same_run(train_records(cfg, WORLD), serial_reference(cfg))


def test_dp_with_micro_batches_matches_one_rank(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    if SMALL_BATCH % (2 * n):
        pytest.skip(f"batch {SMALL_BATCH} does not split over dp={n} x 2 micro-batches")
    cfg = small_run_config(shared_dataset, shared_tmp / f"dp{n}-mb2", "dp=-1", micro_batches=2)
    assert_same_run(train_records(cfg, WORLD), serial_reference(cfg))


def test_dp_and_tp_match_one_rank(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    if n not in (4, 8):
        pytest.skip("dp=2 x tp=N/2 runs on 4 and 8 ranks")
    cfg = small_run_config(shared_dataset, shared_tmp / f"dp2tp{n // 2}", f"dp=2,tp={n // 2}")
    assert_same_run(train_records(cfg, WORLD), serial_reference(cfg))


def test_float32_dp_close_to_one_rank(shared_dataset: Path, shared_tmp: Path) -> None:
    """float32 parity is ~1e-5 (the design's bound), not exact. Adam moves a weight by
    about lr·g/(|g| + eps) per step, so a weight whose gradient is at float32 noise level
    (a few in ten thousand) can move differently by up to lr per step whatever the
    rounding: all but 2 % of each tensor must agree to 1e-5 and every value within what
    Adam can move it (2·lr per step). (0.5 % held until the kernels' float32 exp32 (within
    1 ulp of exp) moved a small tensor's noise-level weights: 8 of mlp.proj.w's 1,024.)"""
    n = WORLD.Get_size()
    cfg = small_run_config(shared_dataset, shared_tmp / f"dp{n}-f32", f"dp={n}", dtype="float32", max_iters=2)
    got, want = train_records(cfg, WORLD), serial_reference(cfg)
    for a, b in zip(got[0], want[0]):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4), (a["step"], k)
    for k in want[1]:
        off = np.abs(got[1][k] - want[1][k])
        assert (off > 1e-5 + 1e-4 * np.abs(want[1][k])).mean() <= 0.02, k
        assert off.max() <= 2 * cfg.learning_rate * cfg.max_iters, k


def test_every_rank_raises_the_same_config_error(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    with pytest.raises(ConfigError, match="not divisible"):
        train(small_run_config(shared_dataset, shared_tmp / "bad1", f"dp={n}", batch_size=n + 1), WORLD)
    with pytest.raises(MeshError, match=f"needs {2 * n} ranks"):
        train(small_run_config(shared_dataset, shared_tmp / "bad2", f"dp={2 * n}"), WORLD)
    WORLD.Barrier()
    assert not (shared_tmp / "bad1").exists() and not (shared_tmp / "bad2").exists()


def test_replicas_stay_identical(shared_dataset: Path, shared_tmp: Path) -> None:
    """After optimiser steps every dp replica holds the same parameters, and leaves
    replicated over tp (layer norms, row-parallel biases) agree across tp."""
    from numesh.base.tree import tree_leaves, tree_leaves_with_path
    from numesh.mesh import P
    from numesh.run.train import Trainer

    n = WORLD.Get_size()
    mesh_spec = f"dp=2,tp={n // 2}" if n in (4, 8) else f"dp={n}"
    trainer = Trainer(small_run_config(shared_dataset, shared_tmp / "replicas", mesh_spec), WORLD)
    mesh = trainer.mesh
    for _ in range(2):
        trainer.train_step()
    params = trainer.params
    for (path, leaf), spec in zip(tree_leaves_with_path(params), tree_leaves(trainer.specs)):
        for other in mesh.comm("dp").allgather(np.array(leaf)):  # pickled gather: fine in a test
            np.testing.assert_allclose(other, leaf, rtol=1e-13, atol=1e-15, err_msg=path)
        if mesh.size("tp") > 1 and "tp" not in P(*spec).axes():
            for other in mesh.comm("tp").allgather(np.array(leaf)):
                np.testing.assert_allclose(other, leaf, rtol=1e-13, atol=1e-15, err_msg=path)


def test_run_dir_refusals_and_divergence_are_the_same_error_on_every_rank(shared_dataset: Path,
                                                                           shared_tmp: Path) -> None:
    """An --out that holds a run, and a diverged step, stop every rank with one error (no hang)."""
    n = WORLD.Get_size()
    out = shared_tmp / f"reuse-dp{n}"
    cfg = small_run_config(shared_dataset, out, f"dp={n}", max_iters=1)
    train(cfg, WORLD)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, WORLD)
    bad = small_run_config(shared_dataset, out, f"dp={n}", max_iters=50, learning_rate=1e200, grad_clip=0.0,
                           weight_decay=0.0, overwrite=True)
    with pytest.raises(ConfigError, match="training diverged at step"):
        train(bad, WORLD)
