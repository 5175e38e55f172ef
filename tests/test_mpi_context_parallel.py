"""Context parallelism (ring attention on the cp axis) reproduces the 1-rank model.

float64, 1e-10 relative against dp=1,tp=1,pp=1:
* the loss and every leaf's gradient of one forward/backward (`loss_and_grads`, dropout
  on and off: attention, residual and embedding dropout masks are the whole sequence's);
* whole `numesh.train.train` runs (losses, gradient norms, evaluation losses, final
  parameters) on every mesh of the issue that fits the world size: cp=2 (2 ranks); cp=4,
  dp=2,cp=2 (ZeRO 0 and 3), cp=2,tp=2, cp=2,pp=2 (1f1b and zb-h1) (4 ranks);
  dp=2,cp=2,tp=2, cp=2,tp=2,pp=2, cp=4,tp=2, cp=4,dp=2 (ZeRO 0, 2) (8 ranks);
* the bytes one step moves on every axis, from the byte counter, equal
  `formulas.step_bytes` (the ring's K/V and dK/dV blocks, the gradients' sum over cp);
* bad combinations fail at start-up with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import (
    assert_close,
    assert_same_run,
    gather_tree,
    random_global_params,
    self_mesh,
    serial_reference,
    shard_params,
    tiny_config,
    train_records,
)
from numesh import formulas
from numesh.errors import ConfigError
from numesh.mesh import Mesh, psum, psum_scalar
from numesh.nn.context_parallel import take_local
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPTConfig, gpt_specs
from numesh.nn.stage import forward_loss, loss_and_grads
from numesh.nn.units import OUTER
from numesh.train import Trainer, config_from
from numesh.tree import tree_leaves, tree_leaves_with_path, tree_map

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD

# meshes of the issue, by world size: (mesh, schedule, micro-batches, ZeRO stage)
TRAIN_CASES = {
    2: [("cp=2", "1f1b", 1, 0), ("cp=2", "1f1b", 2, 1)],
    4: [("cp=4", "1f1b", 1, 0), ("dp=2,cp=2", "1f1b", 1, 0), ("dp=2,cp=2", "1f1b", 2, 3), ("cp=2,tp=2", "1f1b", 1, 0),
        ("cp=2,pp=2", "1f1b", 2, 0), ("cp=2,pp=2", "zb-h1", 2, 0)],
    8: [("dp=2,cp=2,tp=2", "1f1b", 1, 1), ("cp=2,tp=2,pp=2", "1f1b", 2, 0), ("cp=4,tp=2", "1f1b", 1, 0),
        ("cp=4,dp=2", "1f1b", 1, 0), ("cp=4,dp=2", "1f1b", 2, 2)],
}
LAYER_MESHES = {2: ["cp=2"], 4: ["cp=4", "cp=2,tp=2"], 8: ["cp=4,tp=2", "cp=2,tp=4"]}


def model_config(**kw: object) -> GPTConfig:
    base = dict(vocab_size=11, n_head=4, n_embd=16, block_size=16, dropout=0.1, bias=True)
    base.update(kw)
    return tiny_config(**base)


@pytest.fixture(params=range(2))
def layer_mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    meshes = LAYER_MESHES.get(WORLD.Get_size(), [])
    if request.param >= len(meshes):
        pytest.skip("no such cp mesh on this world size")
    mesh = Mesh.parse(meshes[request.param], WORLD)
    yield mesh
    mesh.free()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_grads_match_one_rank(layer_mesh: Mesh, dropout: float) -> None:
    """Each cp rank's loss and gradients are its tokens' share: summed over cp they are the
    1-rank loss and gradient of the whole sequences."""
    mesh = layer_mesh
    cfg = model_config(dropout=dropout)
    gp = random_global_params(cfg, seed=21)
    rng = np.random.default_rng(0)  # the same batch on every rank
    idx, tgt = (rng.integers(0, cfg.vocab_size, (3, cfg.block_size)) for _ in range(2))
    scale = 1.0 / idx.size
    drop = DropoutKey(dropout, seed=5, step=2, row0=0, global_rows=idx.shape[0]) if dropout else None
    cp, r = mesh.size("cp"), mesh.index("cp")
    mine = take_local(idx, cp, r), take_local(tgt, cp, r)
    local = shard_params(gp, cfg, mesh)
    loss, grads = loss_and_grads(local, *mine, cfg, mesh, scale, drop)
    loss = psum_scalar(loss, mesh, "cp")
    grads = tree_map(lambda g: psum(np.ascontiguousarray(g), mesh, "cp"), grads)
    full = gather_tree(grads, gpt_specs(cfg), mesh)
    eval_loss = psum_scalar(float(forward_loss(local, *mine, cfg, mesh).sum()), mesh, "cp")

    want_loss, want = loss_and_grads(gp, idx, tgt, cfg, self_mesh(), scale, drop)
    assert loss == pytest.approx(want_loss, rel=1e-10, abs=0)
    assert eval_loss == pytest.approx(float(forward_loss(gp, idx, tgt, cfg, self_mesh()).sum()), rel=1e-10)
    for (path, got), w in zip(tree_leaves_with_path(full), tree_leaves(want)):
        if path == "wte":
            got = got[: cfg.vocab_size]
        assert_close(got, w, 1e-10, what=path)


def test_observers_see_the_ring(layer_mesh: Mesh) -> None:
    """Every K/V block goes through the mesh's observer hook (the tracer and the flight
    recorder see cp traffic): one layer's ring sends and receives, on the cp axis, with the
    same results as unobserved."""
    from numesh.mesh import Recorder, attach
    from numesh.nn.context_parallel import MeshRing
    from numesh.nn.ring_attention import ring_attention_bwd, ring_attention_fwd

    mesh = layer_mesh
    cp = mesh.size("cp")
    rng = np.random.default_rng(mesh.index("cp"))
    q, k, v, dy = (rng.standard_normal((2, 2, 4, 3)) for _ in range(4))
    y0, c0 = ring_attention_fwd(q, k, v, MeshRing(mesh))
    g0 = ring_attention_bwd(c0, dy, MeshRing(mesh))
    rec = Recorder()
    attach(mesh, rec)
    try:
        y1, c1 = ring_attention_fwd(q, k, v, MeshRing(mesh))
        g1 = ring_attention_bwd(c1, dy, MeshRing(mesh))
    finally:
        mesh.observer = None
    np.testing.assert_array_equal(y0, y1)
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(a, b)
    sends = [c for c in rec.calls if c.op == "send"]
    assert {c.axes for c in rec.calls} == {("cp",)}
    assert len(sends) == len([c for c in rec.calls if c.op == "recv"]) == 2 * (cp - 1) * 2 + 2 * cp
    assert all(c.end is not None for c in rec.calls)


def run_config(data: Path, out: Path, mesh: str, schedule: str, m: int, zero: int, sp: bool = False):
    pp = int(dict(p.split("=") for p in mesh.split(",")).get("pp", 1))
    return config_from(dict(
        n_layer=2 * pp, n_head=4, n_embd=16, block_size=16, batch_size=4, max_iters=3, dropout=0.1, bias=True,
        learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=3, grad_clip=0.5, eval_interval=2,
        eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=11, dtype="float64", schedule=schedule,
        micro_batches=m, zero=zero, sequence_parallel=sp,
    ))


def train_cases() -> list:
    n = WORLD.Get_size()
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-m{c[2]}-zero{c[3]}") for c in TRAIN_CASES.get(n, [])]


@pytest.mark.parametrize("mesh, schedule, m, zero", train_cases())
def test_training_matches_one_rank(shared_dataset: Path, shared_tmp: Path, mesh: str, schedule: str, m: int,
                                   zero: int) -> None:
    cfg = run_config(shared_dataset, shared_tmp / f"cp-{mesh}-{schedule}-{m}-{zero}", mesh, schedule, m, zero)
    want = serial_reference(attrs.evolve(cfg, schedule="1f1b", micro_batches=1, zero=0))
    assert_same_run(train_records(cfg, WORLD), want)


SP_CASES = {4: [("cp=2,tp=2", "1f1b", 1, 0)], 8: [("dp=2,cp=2,tp=2", "1f1b", 1, 1), ("cp=2,tp=2,pp=2", "zb-h1", 2, 0)]}


@pytest.mark.parametrize("mesh, schedule, m, zero", [pytest.param(*c, id=f"{c[0]}-{c[1]}-sp") for c in
                                                     SP_CASES.get(WORLD.Get_size(), [])])
def test_sequence_parallel_with_cp_matches_one_rank(shared_dataset: Path, shared_tmp: Path, mesh: str, schedule: str,
                                                    m: int, zero: int) -> None:
    """sp slices each cp rank's tokens over tp (numesh.nn.transformer.token_positions)."""
    cfg = run_config(shared_dataset, shared_tmp / f"cpsp-{mesh}-{schedule}", mesh, schedule, m, zero, sp=True)
    want = serial_reference(attrs.evolve(cfg, schedule="1f1b", micro_batches=1, zero=0))
    assert_same_run(train_records(cfg, WORLD), want)


def byte_cases() -> list:
    n = WORLD.Get_size()
    cases = {2: [("cp=2", 0), ("cp=2", 2)], 4: [("dp=2,cp=2", 0), ("dp=2,cp=2", 1), ("cp=2,pp=2", 3)],
             8: [("dp=2,cp=2,tp=2", 3), ("cp=2,tp=2,pp=2", 0)]}
    return [pytest.param(mesh, zero, id=f"{mesh}-zero{zero}") for mesh, zero in cases.get(n, [])]


@pytest.mark.parametrize("mesh, zero", byte_cases())
def test_bytes_per_step_follow_the_formula(shared_dataset: Path, shared_tmp: Path, mesh: str, zero: int) -> None:
    """The byte counter after one optimiser step equals `formulas.step_bytes` on every axis,
    cp included: K and V blocks forward, K, V, dK and dV backward, per layer and micro-batch."""
    cfg = attrs.evolve(run_config(shared_dataset, shared_tmp / f"cpbytes-{mesh}-{zero}", mesh, "1f1b", 2, zero),
                       dtype="float32")
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    counter = trainer.mesh.counter
    counter.reset()
    trainer.train_step()
    shape, units = trainer.mesh.shape, trainer.opt.units
    pp_rank = trainer.mesh.index("pp")
    holds_tied = shape["pp"] > 1 and pp_rank in (0, shape["pp"] - 1)
    want = formulas.step_bytes(
        shape, zero, cfg.micro_batches, cfg.batch_size // (shape["dp"] * cfg.micro_batches), cfg.block_size,
        cfg.n_embd, 4, [formulas.Chunk(len(s.blocks), s.first, s.last) for s in trainer.pipeline.stages],
        sum(u.padded for k, u in units.items() if not k.is_outer), units[OUTER].padded,
        trainer.model.padded_vocab(shape["tp"]) // shape["tp"] * cfg.n_embd * 4 if holds_tied else 0,
        trainer.schedule.split_backward,
    )
    got = {("+".join(axes), op): v for (axes, op), v in counter.payload.items() if v}
    if holds_tied:  # the counter books the tied-embedding group under its axis, with the norm's scalar
        tied = want.pop((f"pp[0,{shape['pp'] - 1}]", "all_reduce"))
        want[("pp", "all_reduce")] = want.get(("pp", "all_reduce"), 0) + tied
    assert got == want
    assert want[("cp", "send")] > 0


def test_bad_combinations_fail_at_start_up(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    bs = 12 if n > 2 else 6
    cfg = attrs.evolve(run_config(shared_dataset, shared_tmp / "cp-bad", f"cp={n}", "1f1b", 1, 0), block_size=bs)
    with pytest.raises(ConfigError, match=rf"block_size={bs} does not split into 2\*cp={2 * n} equal chunks"):
        Trainer(cfg, WORLD)
