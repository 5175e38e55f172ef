"""`numesh plan`'s memory model on several ranks: every rank's predicted parameters,
gradients, optimiser state, workspace and peak saved activations equal what it measures
(`ZeroOptimizer.memory()`, `StepStats.peak_bytes`) after a step, for dp with every ZeRO
stage, tp, and pp with every schedule, and for cp (with ZeRO over dp beside it), sequence
parallelism and full recomputation. Adapts to the world size N (2, 4 or 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import WORLD
from numesh.host.threads import threads
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.memory import rank_memory
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer

pytestmark = pytest.mark.mpi(min_size=2)
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
        2: [("cp=2", 0, "1f1b", 2, 1, "none", False), ("cp=2", 0, "1f1b", 2, 1, "full", False),
            ("tp=2", 0, "1f1b", 2, 1, "none", True), ("tp=2", 0, "1f1b", 2, 1, "full", True)],
        4: [("dp=2,cp=2", 1, "1f1b", 2, 1, "none", False), ("dp=2,cp=2", 3, "1f1b", 2, 1, "full", False),
            ("cp=2,tp=2", 0, "1f1b", 2, 1, "none", True), ("pp=2,tp=2", 0, "zb-h1", 4, 1, "full", True),
            ("pp=2,cp=2", 0, "zb-h1", 4, 1, "none", False)],
        8: [("dp=2,cp=2,tp=2", 2, "1f1b", 2, 1, "none", True), ("pp=2,cp=2,tp=2", 0, "zb-h1", 4, 1, "full", True),
            ("pp=2,dp=2,cp=2", 3, "interleaved", 2, 2, "none", False)],
    }.get(N, [])


# Llama's parts (RMSNorm, rotary, SwiGLU, untied head) with 2 kv heads of 4: k and v replicated over tp
LLAMA = dict(arch="llama", n_kv_head=2)


def llama_layouts() -> list[tuple[str, int, str, int, int, str, bool]]:
    """Llama layouts: tp = 2 (a kv head per rank), with sp and full recomputation, beside pp
    under zb-h1 (the W contexts hold the rotary tables too); tp = 4 > kv heads (two ranks
    per kv head); ZeRO-3 over dp beside tp."""
    return {
        2: [("tp=2", 0, "1f1b", 2, 1, "none", False), ("tp=2", 0, "zb-h1", 2, 1, "full", True)],
        4: [("tp=4", 0, "1f1b", 2, 1, "none", False), ("pp=2,tp=2", 0, "zb-h1", 4, 1, "none", True),
            ("dp=2,tp=2", 3, "1f1b", 2, 1, "full", False)],
        8: [("dp=2,tp=4", 2, "1f1b", 2, 1, "none", True), ("pp=2,dp=2,tp=2", 1, "interleaved", 2, 2, "none", False)],
    }.get(N, [])


@pytest.mark.parametrize("mesh, zero, schedule, m, v, recompute, sp, kind",
                         [(*lay, {}) for lay in layouts()] + [(*lay, LLAMA) for lay in llama_layouts()])
def test_predicted_memory_equals_measured(shared_dataset: Path, shared_tmp: Path, mesh: str, zero: int,
                                          schedule: str, m: int, v: int, recompute: str, sp: bool, kind: dict) -> None:
    cfg = config_from(dict(data=str(shared_dataset), out=str(shared_tmp / "o"), n_layer=4, n_head=4, n_embd=32,
                           block_size=16, batch_size=16, mesh=mesh, zero=zero, schedule=schedule, micro_batches=m,
                           virtual_stages=v, recompute=recompute, sequence_parallel=sp, max_iters=1,
                           collective_timeout=0.0, **kind))
    t = Trainer(cfg, WORLD)
    t.train_step()
    s = t.mesh.shape
    model = ModelSpec.of(cfg, t.model.vocab_size)
    layout = Layout(s["dp"], s["tp"], s["pp"], zero, schedule, m, v, recompute, cp=s["cp"], sp=sp)
    pred = rank_memory(model, layout, t.mesh.index("pp"), 4, threads())
    got = {**t.opt.memory(), "activations": t.last_stats.peak_bytes}
    want = {k: getattr(pred, k) for k in got}
    bad = WORLD.allreduce(int(got != want))
    assert got == want, f"rank {WORLD.Get_rank()}: measured {got}, predicted {want}"
    assert bad == 0


def moe_layouts() -> list[tuple[str, int, str, int]]:
    """(mesh, zero, schedule, micro-batches) of an MoE model with ep = 2 on N ranks."""
    out = [(f"ep=2,dp={N // 2}", z, "1f1b", 2) for z in (0, 1, 3)]
    if N >= 4:
        out += [(f"ep=2,tp=2,dp={N // 4}", 0, "1f1b", 1), (f"pp=2,ep=2,dp={N // 4}", 0, "1f1b", 2)]
    return out


@pytest.mark.parametrize("kind", [{}, LLAMA], ids=["gelu", "mixtral"])
@pytest.mark.parametrize("mesh, zero, schedule, m", moe_layouts())
def test_moe_memory_on_ep_equals_measured(shared_dataset: Path, shared_tmp: Path, mesh: str, zero: int,
                                          schedule: str, m: int, kind: dict) -> None:
    """With experts on ep = 2 (GELU ones, and Mixtral's SwiGLU ones in a Llama block):
    parameters, gradients, optimiser state and workspace exactly what
    `ZeroOptimizer.memory()` holds (E/ep experts, sharded over dp only), the values all-
    reduced over ep what it all-reduces, and the activations those of balanced routing (the
    real routing of an untrained router on 64-token micro-batches is only near it: within
    25 %; on ep = 1, where the rows a rank's experts get are all its own, they are exact:
    test_plan.py's one-rank MoE cases)."""
    from numesh.plan.timing import ep_replicated_values

    cfg = config_from(dict(data=str(shared_dataset), out=str(shared_tmp / "o"), n_layer=2, n_head=4, n_embd=32,
                           block_size=16, batch_size=16, mesh=mesh, zero=zero, schedule=schedule, micro_batches=m,
                           moe_experts=4, max_iters=1, collective_timeout=0.0, **kind))
    t = Trainer(cfg, WORLD)
    t.train_step()
    s = t.mesh.shape
    model = ModelSpec.of(cfg, t.model.vocab_size)
    layout = Layout(s["dp"], s["tp"], s["pp"], zero, schedule, m, cp=s["cp"], ep=s["ep"])
    pred = rank_memory(model, layout, t.mesh.index("pp"), 4, threads())
    got = t.opt.memory()
    want = {k: getattr(pred, k) for k in got}
    bad = WORLD.allreduce(int(got != want))
    assert got == want, f"rank {WORLD.Get_rank()}: measured {got}, predicted {want}"
    assert bad == 0
    if s["pp"] == 1:  # exact without ZeRO; with it, the most any dp rank all-reduces (where its cut falls)
        values = WORLD.allgather(t.opt.ep_replicated_values)
        assert ep_replicated_values(model, layout) == (values[WORLD.Get_rank()] if zero == 0 else max(values))
    assert t.last_stats.peak_bytes == pytest.approx(pred.activations, rel=0.25)


def test_new_axes_cover_cp_sp_and_full_recompute() -> None:
    """On 2, 4 and 8 ranks the memory cases include cp, sp and full recomputation."""
    cases = new_axes()
    if N in (2, 4, 8):
        assert any("cp=" in c[0] for c in cases) and any(c[6] for c in cases)
        assert any(c[5] == "full" for c in cases)


def test_the_waits_are_fitted_on_a_real_mesh_step(shared_dataset: Path, shared_tmp: Path) -> None:
    """Calibration's last part (`fit_sync`, called by `fit_steps`) runs a real step of a tp
    mesh on every rank, alternating with the one-rank step the kernels were fitted on, and
    spreads what the mesh step takes beyond the prediction over its blocking calls and its
    compute: the same on every rank, never negative, and the fitted profile adds exactly
    min(sync_s x calls, sync_share x compute) to that mesh, both terms equal there."""
    import attrs

    from numesh.plan.calibrate import KERNELS, fit_steps, sync_layout
    from numesh.plan.hardware import Measured, Profile
    from numesh.plan.timing import Placement, blocking_calls, predict_time

    base = TrainConfig(data=str(shared_dataset), out=str(shared_tmp / "o"), n_layer=2, n_head=4, n_embd=32,
                       block_size=16, batch_size=8)
    model = ModelSpec(2, 4, 32, 16, 65, 8)
    curve = ((8.0, 1e-7), (1e8, 1e-5))
    kernels = Measured(N, 1, {}, ((1e3, 1e-8), (1e9, 1e-5)), {k: ((10.0, 1e-8), (1e6, 1e-6)) for k in KERNELS},
                       {f"all_reduce:{g}": curve for g in range(2, N + 1) if N % g == 0} | {"send": curve})
    fitted = fit_steps(WORLD, base, model, kernels)
    assert fitted.sync_s >= 0 and fitted.sync_share >= 0 and fitted.in_situ > 0
    assert WORLD.allgather((fitted.sync_s, fitted.sync_share)) == [(fitted.sync_s, fitted.sync_share)] * N
    lay, place = sync_layout(model, N), Placement(N, True, True, True, True)
    assert lay is not None and lay.tp > 1
    bare = Profile(name="t", source="", itemsize=4, cores=2,
                   measured={N: attrs.evolve(fitted, sync_s=0.0, sync_share=0.0)})
    step = predict_time(model, lay, bare, place=place)
    with_waits = predict_time(model, lay, attrs.evolve(bare, measured={N: fitted}), place=place)
    calls = blocking_calls(model, lay, bare, place)
    assert calls > 0
    assert fitted.sync_s * calls == pytest.approx(fitted.sync_share * step.compute, rel=1e-9, abs=1e-15)
    assert with_waits.total - step.total == pytest.approx(fitted.sync_s * calls, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_muon_state_is_predicted(shared_dataset: Path, shared_tmp: Path, zero: int) -> None:
    """Muon's state (a momentum value per matrix value, AdamW's two moments for the rest):
    exactly what the optimiser holds under ZeRO 0; under ZeRO >= 1 the rules' expected share
    of each 1/dp slice, within 2 % (the cut falls where it falls in each unit)."""
    cfg = TrainConfig(data=str(shared_dataset), out=str(shared_tmp / "o"), n_layer=4, n_head=4, n_embd=32,
                      block_size=16, batch_size=16, mesh=f"dp={N}", zero=zero, max_iters=1, optimizer="muon",
                      collective_timeout=0.0)
    t = Trainer(cfg, WORLD)
    pred = rank_memory(ModelSpec.of(cfg, t.model.vocab_size), Layout(N, 1, 1, zero, "1f1b", 1), 0, 4, threads())
    got = t.opt.memory()
    assert {k: getattr(pred, k) for k in got if k != "optimizer"} == {k: v for k, v in got.items() if k != "optimizer"}
    if zero == 0:
        assert pred.optimizer == got["optimizer"]
    else:
        assert pred.optimizer == pytest.approx(got["optimizer"], rel=0.02)
