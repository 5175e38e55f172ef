"""`numesh plan`'s memory model on several ranks: every rank's predicted parameters,
gradients, optimiser state, workspace and peak saved activations equal what it measures
(`ZeroOptimizer.memory()`, `StepStats.peak_bytes`) after a step, for dp with every ZeRO
stage, tp, and pp with every schedule, and for cp (with ZeRO over dp beside it), sequence
parallelism and selective and full recomputation. Adapts to the world size N (2, 4 or 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi4py import MPI

from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.memory import rank_memory
from numesh.threads import threads
from numesh.train import TrainConfig, Trainer

pytestmark = pytest.mark.mpi(min_size=2)
WORLD = MPI.COMM_WORLD
N = WORLD.Get_size()


def layouts() -> list[tuple[str, int, str, int, int, str, bool]]:
    """(mesh, zero, schedule, micro-batches, virtual stages, recompute, sp) for N ranks."""
    out = [(f"dp={N}", z, "1f1b", 2, 1) for z in range(4)]
    out += [(f"pp=2,dp={N // 2}", 1, s, 4, 1) for s in ("gpipe", "1f1b", "zb-h1")]
    out += [(f"pp=2,tp={N // 2}", 0, "interleaved", 4, 2)] if N <= 4 else [("pp=2,tp=2,dp=2", 3, "interleaved", 2, 2)]
    out += [(f"tp={N // 2 if N > 2 else 2},dp={2 if N > 2 else 1}", 2 if N > 2 else 0, "1f1b", 1, 1)]
    return [(*lay, "none", False) for lay in out] + new_axes()


def new_axes() -> list[tuple[str, int, str, int, int, str, bool]]:
    """cp, sp and recomputation layouts: cp beside dp (ZeRO shards over dp only), tp and pp."""
    return {
        2: [("cp=2", 0, "1f1b", 2, 1, "none", False), ("cp=2", 0, "1f1b", 2, 1, "selective", False),
            ("tp=2", 0, "1f1b", 2, 1, "selective", True), ("tp=2", 0, "1f1b", 2, 1, "full", True)],
        4: [("dp=2,cp=2", 1, "1f1b", 2, 1, "selective", False), ("dp=2,cp=2", 3, "1f1b", 2, 1, "full", False),
            ("cp=2,tp=2", 0, "1f1b", 2, 1, "none", True), ("pp=2,tp=2", 0, "zb-h1", 4, 1, "selective", True),
            ("pp=2,cp=2", 0, "zb-h1", 4, 1, "none", False)],
        8: [("dp=2,cp=2,tp=2", 2, "1f1b", 2, 1, "selective", True), ("pp=2,cp=2,tp=2", 0, "zb-h1", 4, 1, "full", True),
            ("pp=2,dp=2,cp=2", 3, "interleaved", 2, 2, "none", False)],
    }.get(N, [])


@pytest.mark.parametrize("mesh, zero, schedule, m, v, recompute, sp", layouts())
def test_predicted_memory_equals_measured(shared_dataset: Path, shared_tmp: Path, mesh: str, zero: int,
                                          schedule: str, m: int, v: int, recompute: str, sp: bool) -> None:
    cfg = TrainConfig(data=str(shared_dataset), out=str(shared_tmp / "o"), n_layer=4, n_head=4, n_embd=32, block_size=16,
                      batch_size=16, mesh=mesh, zero=zero, schedule=schedule, micro_batches=m, virtual_stages=v,
                      recompute=recompute, sequence_parallel=sp, max_iters=1, collective_timeout=0.0)
    t = Trainer(cfg, WORLD)
    t.train_step()
    s = t.mesh.shape
    model = ModelSpec(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, t.model.vocab_size, cfg.batch_size)
    layout = Layout(s["dp"], s["tp"], s["pp"], zero, schedule, m, v, recompute, cp=s["cp"], sp=sp)
    pred = rank_memory(model, layout, t.mesh.index("pp"), 4, threads())
    got = {**t.opt.memory(), "activations": t.last_stats.peak_bytes}
    want = {k: getattr(pred, k) for k in got}
    bad = WORLD.allreduce(int(got != want))
    assert got == want, f"rank {WORLD.Get_rank()}: measured {got}, predicted {want}"
    assert bad == 0


def test_new_axes_cover_cp_sp_and_selective() -> None:
    """On 2, 4 and 8 ranks the memory cases include cp, sp and selective recomputation."""
    cases = new_axes()
    if N in (2, 4, 8):
        assert any("cp=" in c[0] for c in cases) and any(c[6] for c in cases)
        assert any(c[5] == "selective" for c in cases)
