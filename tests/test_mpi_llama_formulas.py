"""The formulas of the Llama kind on several ranks: one training step's bytes per axis and
op equal `formulas.step_bytes` as `numesh report` computes it from a trace's metadata
(the model's parts recorded there): the once-per-step all-reduce over tp of grouped-query
attention's k and v gradients (each tp rank's zero off the kv heads its query heads read),
beside sequence parallelism's norm gradients; the K/V blocks of the kv heads around the cp
ring; SwiGLU experts' all-to-alls over ep and their combine weights' gradient summed over
tp; no tied-embedding sum across pp with an untied head. Memory (state and activations)
is test_mpi_plan.py's. Adapts to the world size."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from conftest import WORLD, small_run_config
from numesh.perf import formulas, report
from numesh.run.train import Trainer

pytestmark = pytest.mark.mpi(min_size=2)
N = WORLD.Get_size()
# 4 query heads, 2 kv heads, RMSNorm, rotary, SwiGLU, an untied head (k and v replicated over tp)
LLAMA = dict(arch="llama", n_kv_head=2, norm_eps=1e-6)


def cases() -> list:
    """(mesh, options) per world size: tp = 2 with and without sp, cp = 2, ep = 2 with
    experts, pp = 2; on 4 ranks tp = 4 > kv heads, tp with cp, ep with tp (the experts'
    combine-weight gradients summed over tp: `formulas.moe_tp_bytes`) and ep with cp (the
    routing of each sequence's chunks summed and, with a capacity, gathered over cp:
    `formulas.moe_cp_bytes`)."""
    moe = dict(moe_experts=4, moe_every=2)
    out = {2: [("tp=2", {}), ("tp=2", dict(sequence_parallel=True, zero=0)), ("cp=2", {}), ("ep=2", moe),
               ("pp=2", dict(micro_batches=2))],
           4: [("tp=4", {}), ("dp=2,tp=2", dict(zero=1, sequence_parallel=True)), ("cp=2,tp=2", {}),
               ("ep=2,tp=2", dict(moe, recompute="full")),
               ("ep=2,cp=2", dict(moe, moe_capacity_factor=1.0, recompute="full"))],
           8: [("ep=2,cp=2,tp=2", dict(moe, sequence_parallel=True)),
               ("pp=2,dp=2,tp=2", dict(zero=3, micro_batches=2))]}.get(N, [])
    return [pytest.param(mesh, kw, id=f"{mesh}-{'-'.join(f'{k}{v}' for k, v in kw.items())}") for mesh, kw in out]


@pytest.mark.parametrize("mesh, kw", cases())
def test_step_bytes_follow_the_formula(shared_dataset: Path, shared_tmp: Path, mesh: str, kw: dict) -> None:
    name = f"llama-bytes-{mesh}-{sorted(kw.items())}".replace(" ", "").replace(",", "_").replace("=", "")
    cfg = small_run_config(shared_dataset, shared_tmp / name, mesh, block_size=16, **{**LLAMA, **kw})
    trainer = Trainer(cfg, WORLD)
    trainer.start_trace(cfg.peak_flops)
    trainer.train_step()
    counter = trainer.mesh.counter
    counter.reset()
    trainer.train_step()
    step = report.step_shape(trainer.trace_meta)  # as `numesh report` reads a trace
    assert step.parts == formulas.Parts.of(trainer.model) and step.parts.kv_heads == 2 and step.parts.rotary
    rank = report.rank_units(attrs.asdict(trainer.rank_units()))
    want = formulas.step_bytes(step, rank, trainer.all_to_all_bytes())
    got = {("+".join(axes), op): v for (axes, op), v in counter.payload.items() if v}
    assert got == want
    shape = trainer.mesh.shape
    if shape["tp"] > 1:  # k and v of every block this rank holds (its dp shard's), summed over tp once
        assert WORLD.allreduce(trainer.opt.tp_partial_values) > 0
        assert want[("tp", "all_reduce")] >= rank.tp_partial_values * 8
    if shape["cp"] > 1:  # the K/V blocks are the kv heads': half of the query heads' width here
        c = formulas.Chunk(cfg.n_layer, True, True)
        assert formulas.cp_ring_bytes(c, step.rows, cfg.block_size, cfg.n_embd, shape["tp"], 2, 8, step.parts) * 2 \
            == formulas.cp_ring_bytes(c, step.rows, cfg.block_size, cfg.n_embd, shape["tp"], 2, 8)
    if shape["ep"] > 1:
        assert want[("ep", "all_to_all")] > 0
    assert not any(axes.startswith("pp[") for axes, _ in want)  # untied: no embedding sum across pp
