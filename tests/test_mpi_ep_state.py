"""A trainer's state on an expert-parallel mesh (dp=2, ep=2 on 4 ranks), no forward needed:
each rank reads its row block of dp×ep; a one-rank MoE checkpoint restores with each ep rank
holding its block of experts, and saving it again writes the same whole [E, ...] arrays.
Training on ep meshes against one rank is tests/test_mpi_moe.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import read_meta, read_state, save_checkpoint
from numesh.data.batches import local_batch, train_key
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer, restore, train_state

pytestmark = [pytest.mark.mpi(min_size=4),
              pytest.mark.skipif(WORLD.Get_size() != 4, reason="dp=2 x ep=2 runs on 4 ranks")]


def config(data: Path, out: Path, mesh: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=4, bias=True, learning_rate=1e-2,
        warmup_iters=1, lr_decay_iters=8, eval_interval=100, eval_iters=1, data=str(data), out=str(out), seed=5,
        dtype="float64", moe_experts=4, moe_every=2, moe_top_k=2, mesh=mesh,
    )
    base.update(kw)
    return config_from(base)


@pytest.fixture(scope="module")
def one_rank_ckpt(shared_dataset: Path, shared_tmp: Path) -> Path:
    """A checkpoint of 2 steps on one rank (rank 0 trains; the others wait)."""
    out = shared_tmp / "ep-one-rank"
    if WORLD.Get_rank() == 0:
        t = Trainer(config(shared_dataset, out, ""), MPI.COMM_SELF)
        for _ in range(2):
            t.train_step()
        save_checkpoint(train_state(t), out)
    WORLD.Barrier()
    return out / "ckpt" / "step_000002"


def test_each_rank_reads_its_row_block_of_dp_x_ep(shared_dataset: Path, shared_tmp: Path) -> None:
    t = Trainer(config(shared_dataset, shared_tmp / "rows", "dp=2,ep=2", micro_batches=2), WORLD)
    key = train_key(5, 3)
    mine = t._micro_batches(t.train_data, key, 2)
    whole = local_batch(t.train_data, key, 8, 8, 0, 1, 1)[0]
    i = t.mesh.index("dp") * 2 + t.mesh.index("ep")
    x = np.concatenate([m[0] for m in mine])
    np.testing.assert_array_equal(x, whole[0][2 * i : 2 * i + 2])
    assert [m[0].shape for m in mine] == [(1, 8), (1, 8)]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_one_rank_moe_checkpoint_restores_and_saves_on_dp2_ep2(shared_dataset: Path, shared_tmp: Path,
                                                                   one_rank_ckpt: Path, zero: int) -> None:
    t = Trainer(config(shared_dataset, shared_tmp / f"ep-restore-{zero}", "dp=2,ep=2", zero=zero), WORLD)
    restore(t, one_rank_ckpt)
    assert t.step == 2
    _, want = read_state(one_rank_ckpt)
    e = t.mesh.index("ep")
    local = dict(tree_leaves_with_path(t.params))
    whole = dict(tree_leaves_with_path(want["params"]))
    np.testing.assert_array_equal(local["blocks.0.mlp.fc.w"], whole["blocks.0.mlp.fc.w"][2 * e : 2 * e + 2])
    np.testing.assert_array_equal(local["blocks.0.mlp.router.w"], whole["blocks.0.mlp.router.w"])
    got = dict(tree_leaves_with_path(t.gathered_params()))
    for path, x in whole.items():
        np.testing.assert_array_equal(got[path], x, err_msg=path)
    t.opt.check_replicas()

    out = shared_tmp / f"ep-saved-{zero}"
    path = save_checkpoint(train_state(t), out)
    WORLD.Barrier()
    meta = read_meta(path)
    assert meta.raw["mesh"]["ep"] == 2
    files = meta.raw["leaves"]["m/blocks.0.mlp.proj.w"]["files"]
    assert [(f["file"].rsplit(".", 2)[-2], f["offset"][0]) for f in files] == [("ep0-tp0", 0), ("ep1-tp0", 2)]
    _, again = read_state(path)
    for group in ("params", "m", "v"):
        for (p, x), (_, y) in zip(tree_leaves_with_path(again[group]), tree_leaves_with_path(want[group])):
            np.testing.assert_array_equal(x, y, err_msg=f"{group}/{p}")
