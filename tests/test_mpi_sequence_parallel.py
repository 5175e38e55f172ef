"""Megatron sequence parallelism on tp (`--sequence-parallel`) reproduces the 1-rank model
(float64, 1e-10 relative), moves the bus bytes of plain tp, and shrinks the saved activations.

Meshes by world size (each runs where the job has exactly its ranks; the others cover the
rest): 2 ranks tp=2; 4 ranks tp=4, dp=2,tp=2 with ZeRO 1, 2 and 3, tp=2,pp=2 with 1F1B,
ZB-H1 and GPipe; 8 ranks dp=2,tp=2,pp=2 interleaved with ZeRO 1. Without sequence parallelism the same meshes are
held to the 1-rank run by test_mpi_tensor_parallel.py, test_mpi_zero.py, test_mpi_pipeline.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import (
    WORLD,
    assert_close,
    assert_one_step_matches,
    assert_same_run,
    mesh_for_world,
    model_config,
    one_step,
    random_batch,
    random_global_params,
    self_mesh,
    serial_reference,
    shard_params,
    small_run_config,
    train_records,
    world_mesh,
)
from numesh.base.errors import ConfigError, MeshError
from numesh.base.tree import held_bytes as nbytes  # each buffer once, as the activation accounting counts
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.mesh import Mesh, P
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import gpt_specs
from numesh.nn.units import OUTER
from numesh.nn.walk import ResidentParams, loss_and_grads, stage_forward, whole_model
from numesh.optim.zero import ZeroOptimizer
from numesh.perf import formulas
from numesh.run.train import Trainer

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(params=[False, True], ids=["tp", "tp+sp"])
def tp_mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    """tp = the world size (2 or 4), with and without sequence parallelism."""
    spec = mesh_for_world({2: ["tp=2"], 4: ["tp=4"]}, why="single-stage tp on 2 and 4 ranks (n_head=4 caps tp at 4)")
    yield from world_mesh(spec, sequence_parallel=request.param)


# ---------------------------------------------------------------------------------------
# one forward and backward


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_every_grad_match_one_rank(tp_mesh: Mesh, dropout: float) -> None:
    step = one_step(tp_mesh, dropout)
    assert_one_step_matches(step)
    # tp-replicated leaves (LayerNorms, row-parallel biases, wpe) hold the same grad on every tp rank
    for (path, g), s in zip(tree_leaves_with_path(step.grads), tree_leaves(gpt_specs(step.cfg))):
        if "tp" not in s.axes():
            assert all(np.array_equal(g, o) for o in WORLD.allgather(g)), path


def test_layernorm_grads_are_partial_before_the_tp_sum() -> None:
    """With sp each rank's LayerNorm grads cover its own tokens only: summed over tp they
    are the 1-rank grads (what `reduce_sequence_partial` and the optimiser do)."""
    n = WORLD.Get_size()
    if n not in (2, 4):
        pytest.skip("runs on 2 and 4 ranks")
    from numesh.nn.units import join_units
    from numesh.nn.walk import stage_backward

    mesh = Mesh.create(WORLD, sequence_parallel=True, tp=n)
    cfg = model_config(dropout=0.0)
    gp = random_global_params(cfg, seed=4)
    idx, tgt = random_batch(cfg, seed=2)
    units = ResidentParams(shard_params(gp, cfg, mesh))
    stage = whole_model(cfg.n_layer)
    _, ctx = stage_forward(units, stage, idx, tgt, cfg, mesh)
    _, outer, _ = stage_backward(units, stage, ctx, 1.0 / idx.size, cfg, mesh)
    units.grads_ready(OUTER, outer)
    partial = join_units(units.grads)
    _, want = loss_and_grads(gp, idx, tgt, cfg, self_mesh(), 1.0 / idx.size)
    for (path, g), w in zip(tree_leaves_with_path(partial), tree_leaves(want)):
        if set(path.split(".")) & {"ln1", "ln2", "ln_f"}:
            assert not np.allclose(g, w, rtol=1e-6), f"{path} should be partial on one tp rank"
            assert_close(sum(WORLD.allgather(g)), w, 1e-10, what=path)
    mesh.free()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_bytes_are_plain_tp_plus_the_regathers(tp_mesh: Mesh, recompute: str) -> None:
    """Payload per op follows numesh.perf.formulas: plain tp's all-reduces become all-gather +
    reduce-scatter pairs, each LayerNorm's slice is gathered again in backward (not under
    full recomputation, whose rerun keeps its gathered outputs but gathers and scatters
    twice per block more), plus the one all-reduce of the LayerNorm grads (4C per block +
    2C for ln_f, with biases)."""
    cfg = model_config(dropout=0.0)
    n, B, T, C, L, k = tp_mesh.size("tp"), 4, cfg.block_size, cfg.n_embd, cfg.n_layer, 8
    params = shard_params(random_global_params(cfg, seed=1), cfg, tp_mesh)
    idx, tgt = random_batch(cfg, B)
    tp_mesh.counter.reset()
    loss_and_grads(params, idx, tgt, cfg, tp_mesh, 1.0 / (B * T), recompute=recompute)
    c, chunk = tp_mesh.counter, formulas.Chunk(L, first=True, last=True)
    plain = formulas.tp_all_reduce_bytes(chunk, B, T, C, k, recompute)
    if not tp_mesh.sequence_parallel:
        assert c.total("tp", "all_reduce", kind="payload") == plain
        return
    ln_bytes = (4 * C * L + 2 * C) * k
    want = formulas.tp_sequence_parallel_bytes(chunk, B, T, C, k, recompute)
    act = B * T * C * k
    pairs = (6 if recompute == "full" else 4) * L + 2
    gathers = pairs + (1 if recompute == "full" else 2 * L + 1)
    assert want == {"all_gather": gathers * act, "reduce_scatter": pairs * act, "all_reduce": 3 * B * T * k}
    got = {op: c.total("tp", op, kind="payload") for op in ("all_gather", "reduce_scatter", "all_reduce")}
    assert got == {**want, "all_reduce": want["all_reduce"] + ln_bytes}
    assert c.total("tp", "all_gather", kind="calls") == gathers
    assert c.total("tp", "reduce_scatter", kind="calls") == pairs
    plain_bus = 2 * (n - 1) / n * plain + (gathers - pairs) * (n - 1) / n * act
    assert c.total("tp") - 2 * (n - 1) / n * ln_bytes == pytest.approx(plain_bus, rel=1e-14)


def test_saved_activations_shrink(tp_mesh: Mesh) -> None:
    """With sp each LayerNorm (ln1, ln2 of every block, ln_f) keeps its xhat and rstd on
    this rank's slice [B, T/tp, C], [B, T/tp, 1], and not its output (gathered again for the
    weight grad); plain tp keeps xhat, rstd [B, T, 1] and the output [B, T, C]. Everything
    else saved keeps its plain-tp shape (attention and MLP insides are split over heads and
    columns by tp already), so a block saves 1/tp of what it saves on the 1-rank mesh,
    less the LayerNorm outputs."""
    cfg = model_config(dropout=0.1)
    n, B, T, C, L, k = tp_mesh.size("tp"), 4, cfg.block_size, cfg.n_embd, cfg.n_layer, 8
    params = shard_params(random_global_params(cfg, seed=1), cfg, tp_mesh)
    idx, tgt = random_batch(cfg, B)
    drop = DropoutKey(0.1, seed=5, step=0, row0=0, global_rows=B)
    _, ctx = stage_forward(ResidentParams(params), whole_model(L), idx, tgt, cfg, tp_mesh, drop)
    plain_mesh = Mesh.create(WORLD, tp=n)
    _, plain = stage_forward(ResidentParams(params), whole_model(L), idx, tgt, cfg, plain_mesh, drop)
    plain_mesh.free()
    sp = tp_mesh.sequence_parallel
    t = T // n if sp else T
    for b in [*ctx.blocks, ctx.head]:
        for ln in ((b.ln1, b.ln2) if b is not ctx.head else (b.ln_f,)):
            assert ln[0].shape == (B, t, C) and ln[1].shape == (B, t, 1)
    assert all((b.h1 is None) == (b.h2 is None) == sp for b in ctx.blocks) and (ctx.head.xf is None) == sp
    per_norm = (B * T * C + (B * T - B * t) * (C + 1)) * k if sp else 0  # the output, x-hat's and rstd's other slices
    assert nbytes(plain) - nbytes(ctx) == (2 * L + 1) * per_norm
    if sp:  # a block's saved bytes are exactly 1/tp of the 1-rank mesh's
        _, whole = stage_forward(ResidentParams(random_global_params(cfg, seed=1)), whole_model(L), idx, tgt, cfg,
                                 self_mesh(), drop)
        assert [nbytes(b) * n for b in ctx.blocks] == [nbytes(b) - b.h1.nbytes - b.h2.nbytes for b in whole.blocks]


# ---------------------------------------------------------------------------------------
# the optimiser sums the LayerNorm grads over tp, once per step


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_optimizer_sums_tp_partial_grads_once(stage: int) -> None:
    n = WORLD.Get_size()
    shape = {"dp": 2, "tp": n // 2} if n >= 4 else {"tp": n}
    mesh = Mesh.create(WORLD, **shape)
    dp, tp = mesh.size("dp"), mesh.size("tp")
    units = {"a": {"ln": np.zeros(5), "w": np.zeros(3)}, "b": {"ln": np.zeros(2)}}
    specs = {"a": {"ln": P(), "w": P()}, "b": {"ln": P()}}
    opt = ZeroOptimizer(units, specs, mesh, stage, tp_partial={("a", "ln"), ("b", "ln")})
    held = opt.tp_partial_values  # this rank's share of the 7 LayerNorm values (its dp shard under ZeRO >= 1)
    assert (mesh.comm("dp").allreduce(held) if opt.sync.sharded and dp > 1 else held) == 7

    def grads(d: int, t: int) -> dict:
        r = np.random.default_rng([d, t])  # partial over tp and dp; w differs over dp only
        return {"a": {"ln": r.standard_normal(5), "w": np.random.default_rng(d).standard_normal(3)},
                "b": {"ln": r.standard_normal(2)}}

    mine = grads(mesh.index("dp"), mesh.index("tp"))
    opt.begin_step(1)
    for key in ("a", "b"):
        opt.grads_ready(key, mine[key])
    norm = opt.global_norm()
    every = [grads(d, t) for d in range(dp) for t in range(tp)]
    want_ln_a = sum(g["a"]["ln"] for g in every)
    want_ln_b = sum(g["b"]["ln"] for g in every)
    want_w = sum(grads(d, 0)["a"]["w"] for d in range(dp))
    assert norm == pytest.approx(math.sqrt(want_ln_a @ want_ln_a + want_ln_b @ want_ln_b + want_w @ want_w), rel=1e-12)
    opt.global_norm()  # a second wait sums nothing again
    got = {key: opt.sync.grad(key) for key in ("a", "b")}
    lay = opt.layout
    for key, want in (("a", np.concatenate([want_ln_a, want_w])), ("b", want_ln_b)):
        u = lay.units[key]
        if opt.sync.sharded:
            padded = np.concatenate([want, np.zeros(u.padded - u.size)])
            want = padded[lay.rank * u.shard_size : (lay.rank + 1) * u.shard_size]
            np.testing.assert_allclose(got[key], want, rtol=1e-12, atol=1e-15)
        else:
            np.testing.assert_allclose(got[key][: u.size], want, rtol=1e-12)
    mesh.free()


# ---------------------------------------------------------------------------------------
# whole training runs: losses, grad norms and final parameters against the 1-rank run

MESHES = {
    2: [("tp=2", {})],
    4: [("tp=4", {}), ("dp=2,tp=2", {"zero": 1}), ("dp=2,tp=2", {"zero": 2, "micro_batches": 2}),
        ("dp=2,tp=2", {"zero": 3}), ("tp=2,pp=2", {"micro_batches": 2, "schedule": "1f1b"}),
        ("tp=2,pp=2", {"micro_batches": 2, "schedule": "zb-h1"}),
        ("tp=2,pp=2", {"micro_batches": 2, "schedule": "gpipe"})],
    8: [("dp=2,tp=2,pp=2",
         {"micro_batches": 2, "schedule": "interleaved", "virtual_stages": 2, "n_layer": 4, "zero": 1})],
}
# only this job's size: the other sizes' meshes are collected by their own suites
CASES = [pytest.param(n, mesh, kw, id=f"{mesh}-" + "-".join(f"{k}{v}" for k, v in kw.items()))
         for n, runs in MESHES.items() if n == WORLD.Get_size() for mesh, kw in runs]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("n, mesh, kw", CASES)
def test_training_run_matches_one_rank(shared_dataset: Path, shared_tmp: Path, n: int, mesh: str, kw: dict,
                                       dropout: float) -> None:
    name = f"sp-{mesh}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{dropout}".replace(",", "_").replace("=", "")
    cfg = small_run_config(shared_dataset, shared_tmp / name, mesh, sequence_parallel=True, dropout=dropout, **kw)
    assert_same_run(train_records(cfg, WORLD), serial_reference(cfg))


@pytest.mark.parametrize("n, mesh, kw", CASES)
def test_step_bytes_follow_the_formula(shared_dataset: Path, shared_tmp: Path, n: int, mesh: str, kw: dict) -> None:
    """Every (axes, op)'s payload in one step equals `formulas.step_bytes` with sp; the tp bus
    bytes equal a run without sp but for the LayerNorm all-reduce and the backward's
    re-gathers of the LayerNorm slices, and pp sends shrink by tp."""
    got = {}
    for sp in (False, True):
        cfg = small_run_config(shared_dataset, shared_tmp / f"bytes-{mesh}-{sp}", mesh, sequence_parallel=sp, **kw)
        trainer = Trainer(cfg, WORLD)
        trainer.train_step()
        trainer.mesh.counter.reset()
        trainer.train_step()
        got[sp] = trainer
        counter = trainer.mesh.counter
        measured = {("+".join(a), op): v for (a, op), v in counter.payload.items()}
        # the counter books the tied-embedding group "pp[0,P-1]" under its axis
        assert measured == {(a.split("[")[0], op): v for (a, op), v in step_bytes(trainer).items()}, (sp, measured)
    plain, sp = got[False].mesh.counter, got[True].mesh.counter
    tp = got[True].mesh.size("tp")
    ln_bus = 2 * (tp - 1) / tp * got[True].opt.tp_partial_values * 8
    assert got[True].opt.tp_partial_values > 0 or got[True].opt.sync.sharded
    # the LayerNorm slices gathered again in backward: the all-gathers beyond the pairs
    regather = sp.total("tp", "all_gather", kind="payload") - sp.total("tp", "reduce_scatter", kind="payload")
    assert regather > 0
    assert sp.total("tp") - ln_bus - (tp - 1) / tp * regather == pytest.approx(plain.total("tp"), rel=1e-14)
    assert sp.total("pp", "send", kind="payload") * tp == plain.total("pp", "send", kind="payload")
    assert sp.total("dp") == plain.total("dp")


def step_bytes(trainer: Trainer) -> dict[tuple[str, str], int]:
    """`formulas.step_bytes` for a trainer's rank (as `numesh report` computes it)."""
    c, shape, units = trainer.cfg, trainer.mesh.shape, trainer.opt.units
    pp_rank, k = trainer.mesh.index("pp"), 8
    holds_tied = shape["pp"] > 1 and pp_rank in (0, shape["pp"] - 1)
    return formulas.step_bytes(
        formulas.StepShape(shape, c.zero, c.micro_batches, c.batch_size // (shape["dp"] * c.micro_batches),
                           c.block_size, c.n_embd, k, trainer.schedule.split_backward, c.sequence_parallel),
        formulas.RankUnits(
            [formulas.Chunk(len(s.blocks), s.first, s.last) for s in trainer.pipeline.stages],
            sum(u.padded for key, u in units.items() if not key.is_outer), units[OUTER].padded,
            trainer.model.padded_vocab(shape["tp"]) // shape["tp"] * c.n_embd * k if holds_tied else 0,
            trainer.opt.tp_partial_values),
    )


# ---------------------------------------------------------------------------------------
# start-up checks


def test_bad_combinations_fail_at_start_up(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    with pytest.raises(MeshError, match="sequence parallelism splits the sequence over tp, which is 1"):
        Mesh.create(WORLD, sequence_parallel=True, dp=n)
    cfg = small_run_config(shared_dataset, shared_tmp / "sp-bad", f"dp={n}", sequence_parallel=True)
    with pytest.raises(ConfigError, match="add tp=N"):
        Trainer(cfg, WORLD)
    cfg = small_run_config(shared_dataset, shared_tmp / "sp-bad", f"tp={n}", sequence_parallel=True, block_size=n + 1,
                           n_head=n, n_embd=4 * n)
    with pytest.raises(ConfigError, match=f"use a --block-size divisible by {n}"):
        Trainer(cfg, WORLD)


def test_a_sequence_sp_cannot_split_is_one_line() -> None:
    """With sp a T not divisible by tp was numpy's "dimension 1 of size 3 does not divide
    by 2 ranks", which never said sequence parallelism."""
    n = WORLD.Get_size()
    if n not in (2, 4):
        pytest.skip("runs on 2 and 4 ranks")
    from numesh.base.errors import ConfigError

    mesh = Mesh.create(WORLD, sequence_parallel=True, tp=n)
    cfg = model_config(dropout=0.0)
    params = shard_params(random_global_params(cfg, seed=4), cfg, mesh)
    idx = np.zeros((1, n + 1), np.int64)
    with pytest.raises(ConfigError, match=f"with sequence parallelism over tp={n} .* idx's T \\({n + 1}\\) must be "
                                          f"a multiple of {n}"):
        loss_and_grads(params, idx, idx, cfg, mesh, 1.0)
    from numesh.run.sample import generate  # refused as sp, not as a prompt length to change

    with pytest.raises(ConfigError, match="generation does not use sequence parallelism"):
        generate(params, cfg, mesh, idx, 1)
    mesh.free()
