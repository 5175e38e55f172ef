"""Activation recomputation on parallel meshes: parity, activation memory and tp bytes.

Adapts to the world size N (2, 4 or 8):

* parity: whole `numesh.run.train.train` runs in float64 (dropout 0.1, biases) with each
  `--recompute` mode equal to 1e-10 relative to the plain dp=1,tp=1,pp=1 run without
  recomputation, on tp, pp (1F1B, zb-h1, interleaved), dp with ZeRO-3 and mixed meshes;
* activation memory: every rank's measured peak over a step (`StepStats.peak_bytes`,
  each buffer counted once) equals the schedule replayed with
  `formulas.activation_bytes` / `weight_ctx_bytes` for its stages, for every mode, 1F1B
  and zb-h1, float32 without dropout and float64 with, with tp and pp;
* tp bytes: the byte counter's tp all-reduce payload over a step equals
  `formulas.step_bytes`, whose full-recomputation term counts the rerun forward's two
  all-reduces per block.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from conftest import WORLD, assert_same_run, serial_reference, train_records
from numesh.host import threads
from numesh.nn.units import OUTER
from numesh.nn.walk import block_pieces
from numesh.perf import formulas
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer

pytestmark = pytest.mark.mpi(min_size=2)

N = max(WORLD.Get_size(), 2)
MODES = ("none", "full")
N_HEAD = 4


def run_config(data: Path, out: Path, mesh: str, **kw: object) -> TrainConfig:
    base: dict = dict(
        n_layer=4, n_head=N_HEAD, n_embd=16, block_size=8, batch_size=8, max_iters=3, dropout=0.1, bias=True,
        learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=3, grad_clip=0.5, eval_interval=2,
        eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=13, dtype="float64",
        peak_flops=1e12,  # MFU's denominator given: parity ignores MFU, and measuring it took a third of a run
    )
    base.update(kw)
    return config_from(base)


def plain_reference(cfg: TrainConfig):
    """The dp=1,tp=1,pp=1 run without recomputation, one micro-batch, no ZeRO."""
    return serial_reference(attrs.evolve(cfg, schedule="1f1b", virtual_stages=1, micro_batches=1, zero=0,
                                         recompute="none"))


def parity_meshes(n: int) -> list[tuple[str, dict]]:
    """(mesh, overrides): at least one pipeline schedule per mesh, ZeRO-3 beside tp."""
    return {
        2: [("tp=2", {}), ("pp=2", dict(schedule="1f1b", micro_batches=2)),
            ("pp=2", dict(schedule="zb-h1", micro_batches=4)), ("dp=2", dict(zero=3, micro_batches=2))],
        4: [("dp=2,tp=2", dict(zero=3, micro_batches=2)), ("tp=2,pp=2", dict(schedule="zb-h1", micro_batches=2)),
            ("pp=4", dict(schedule="interleaved", virtual_stages=2, n_layer=8, micro_batches=4)),
            ("dp=2,pp=2", dict(schedule="1f1b", micro_batches=2, zero=3))],
        8: [("dp=2,tp=2,pp=2", dict(schedule="interleaved", virtual_stages=2, micro_batches=2, zero=3)),
            ("tp=2,pp=4", dict(schedule="zb-h1", micro_batches=4))],
    }.get(n, [])


def parity_cases(n: int) -> list:
    return [pytest.param(mesh, kw, mode, id=f"{mesh}-{kw.get('schedule', '1f1b')}-zero{kw.get('zero', 0)}-{mode}")
            for mesh, kw in parity_meshes(n) for mode in MODES]


@pytest.mark.parametrize("mesh, kw, mode", parity_cases(N))
def test_recompute_matches_one_rank(shared_dataset: Path, shared_tmp: Path, mesh: str, kw: dict, mode: str) -> None:
    out = shared_tmp / f"rc-{mesh}-{kw.get('schedule', '1f1b')}-{mode}"
    cfg = run_config(shared_dataset, out, mesh, recompute=mode, **kw)
    assert_same_run(train_records(cfg, WORLD), plain_reference(cfg))


def test_parity_cases_cover_the_brief() -> None:
    """Every mode meets every mesh, and the meshes include tp, pp with 1F1B and zb-h1,
    ZeRO-3 and (on 8 ranks) dp×tp×pp interleaved."""
    n = WORLD.Get_size()
    cases = parity_cases(n)
    if n in (2, 4, 8):
        assert len(cases) == len(MODES) * len(parity_meshes(n)) > 0
        scheds = {kw.get("schedule", "1f1b") for _, kw in parity_meshes(n)}
        assert scheds & {"zb-h1", "interleaved"}
        assert any(kw.get("zero") == 3 for _, kw in parity_meshes(n))


# ---------------------------------------------------------------------------------------
# activation memory: measured == formula


def memory_meshes(n: int) -> list[str]:
    return {2: ["tp=2", "pp=2", "tp=2 sp", "cp=2"], 4: ["tp=2,pp=2", "tp=2,pp=2 sp", "cp=2,pp=2", "cp=2,tp=2 sp"],
            8: ["tp=2,pp=4", "cp=2,tp=2,pp=2 sp"]}.get(n, [])


def memory_cases(n: int) -> list:
    return [pytest.param(mesh, schedule, mode, dtype, dropout, id=f"{mesh}-{schedule}-{mode}-{dtype}-drop{dropout}")
            for mesh in memory_meshes(n) for schedule in ("1f1b", "zb-h1") for mode in MODES
            for dtype, dropout in (("float32", False), ("float64", True))]


def chunks_per_block(trainer: Trainer, rows: int) -> int:
    """Runs of pieces a block runs as (numesh.nn.walk.row_chunks): >1 only without tp and cp."""
    mesh = trainer.mesh
    pieces = block_pieces(mesh.size("tp"), mesh.size("cp"), rows, trainer.cfg.block_size // mesh.size("cp"),
                          threads.cores())
    return len(threads.runs_for(threads.threads(), pieces))


@pytest.mark.parametrize("mesh, schedule, mode, dtype, dropout", memory_cases(N))
def test_measured_peak_activation_bytes_equal_the_formula(shared_dataset: Path, shared_tmp: Path, mesh: str,
                                                          schedule: str, mode: str, dtype: str, dropout: bool) -> None:
    mesh, _, sp = mesh.partition(" ")
    sizes = dict(a.split("=") for a in mesh.split(","))
    pp, cp = int(sizes.get("pp", "1")), int(sizes.get("cp", "1"))
    m = 2 * pp
    cfg = run_config(shared_dataset, shared_tmp / f"mem-{mesh}{sp}-{schedule}-{mode}-{dtype}-{dropout}", mesh,
                     schedule=schedule, micro_batches=m, recompute=mode, dtype=dtype, dropout=0.1 if dropout else 0.0,
                     n_layer=2 * pp, sequence_parallel=bool(sp))
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    model, rows, tp = trainer.model, cfg.batch_size // m, trainer.mesh.size("tp")
    k = np.dtype(dtype).itemsize
    stages = trainer.pipeline.stages

    shape = formulas.ActivationShape(rows, cfg.block_size, model.n_embd, model.n_head, tp=tp, cp=cp, sp=bool(sp),
                                     recompute=mode, itemsize=k)

    def saved(chunk: int) -> int:
        s = stages[chunk]
        return formulas.activation_bytes(shape, formulas.Chunk(len(s.blocks), s.first, s.last), model.vocab_size)

    def deferred(chunk: int) -> int:
        return formulas.weight_ctx_bytes(shape, len(stages[chunk].blocks), bias=True,
                                         chunks=chunks_per_block(trainer, rows))

    want = formulas.peak_activation_bytes(trainer.schedule, trainer.mesh.index("pp"), saved, deferred)
    assert trainer.last_stats.peak_bytes == want


# ---------------------------------------------------------------------------------------
# tp bytes: full recomputation reruns the forward's all-reduces


def bytes_meshes(n: int) -> list[tuple[str, dict]]:
    return {2: [("tp=2", {})], 4: [("tp=2,pp=2", dict(schedule="zb-h1", micro_batches=2)),
                                   ("dp=2,tp=2", dict(zero=3, micro_batches=2))],
            8: [("dp=2,tp=2,pp=2", dict(schedule="zb-h1", micro_batches=2, zero=3))]}.get(n, [])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh, kw", bytes_meshes(N), ids=[m for m, _ in bytes_meshes(N)])
def test_tp_bytes_follow_the_formula(shared_dataset: Path, shared_tmp: Path, mesh: str, kw: dict, mode: str) -> None:
    cfg = run_config(shared_dataset, shared_tmp / f"bytes-{mesh}-{mode}", mesh, recompute=mode, **kw)
    trainer = Trainer(cfg, WORLD)
    trainer.mesh.counter.reset()
    trainer.train_step()
    shape, units, itemsize = trainer.mesh.shape, trainer.opt.units, np.dtype(cfg.dtype).itemsize
    want = formulas.step_bytes(
        formulas.StepShape(shape, cfg.zero, cfg.micro_batches, cfg.batch_size // (shape["dp"] * cfg.micro_batches),
                           cfg.block_size, cfg.n_embd, itemsize, trainer.schedule.split_backward, recompute=mode),
        formulas.RankUnits([formulas.Chunk(len(s.blocks), s.first, s.last) for s in trainer.pipeline.stages],
                           sum(u.padded for key, u in units.items() if not key.is_outer), units[OUTER].padded))
    got = trainer.mesh.counter.total("tp", "all_reduce", kind="payload")
    assert got == want[("tp", "all_reduce")]
    blocks = sum(len(s.blocks) for s in trainer.pipeline.stages)
    per_block = 6 if mode == "full" else 4
    act = cfg.batch_size // (shape["dp"] * cfg.micro_batches) * cfg.block_size * cfg.n_embd * itemsize
    assert got >= cfg.micro_batches * per_block * blocks * act  # the rerun's two all-reduces are counted
