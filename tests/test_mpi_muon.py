"""Muon on every mesh: float64 parity with one rank (dp with ZeRO 0-3 and micro-batches,
tp with sp, pp under two schedules, ep with experts, cp, dp×tp×pp), resume and reshard of its
state, one test per DeepSpeed Muon bug, and the bytes and state per rank against the formulas.

DeepSpeed's distributed Muon shipped three silent bugs; each test below would catch its own:
Muon switched off under ZeRO-3 (AdamW ran instead), plain SGD at ZeRO stage 0, and ZeRO-3
orthogonalising each micro-batch's gradient instead of their sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from conftest import (
    WORLD,
    assert_close,
    assert_same_run,
    model_config,
    on_root,
    prefetch_serial,
    serial_reference,
    small_run_config,
    train_records,
)
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.checkpoint import read_state, reshard
from numesh.mesh import Mesh
from numesh.nn.gpt import gpt_specs, init_gpt
from numesh.nn.units import OUTER, split_units
from numesh.optim import Leaf, make_optimizer
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step
from numesh.optim.interface import matrix_view
from numesh.optim.muon import is_hidden_matrix, lr_factor, orthogonalise
from numesh.optim.zero import ZeroOptimizer
from numesh.perf import formulas
from numesh.run.train import Trainer
from test_mpi_zero import held_bytes

pytestmark = pytest.mark.mpi(min_size=2)

MUON = dict(optimizer="muon", max_iters=2, eval_interval=2, lr_decay_iters=2, muon_momentum=0.9)

# (mesh, options) per world size: the 2-rank suite takes each axis alone, the 8-rank one all three
PARITY = {
    2: [("dp=2", dict(zero=z, micro_batches=2)) for z in range(4)] + [
        ("tp=2", dict(sequence_parallel=True)),
        ("pp=2", dict(micro_batches=2, schedule="1f1b")),
        ("pp=2", dict(micro_batches=2, schedule="zb-h1")),
        ("ep=2", dict(moe_experts=4, zero=1)),
        ("cp=2", dict(zero=0)),
    ],
    4: [("dp=2,tp=2", dict(zero=3, micro_batches=2)),
        ("dp=2,tp=2", dict(zero=0)),  # ZeRO 0 deals tp-split matrices over dp and all-gathers the results
        ("dp=2,pp=2", dict(zero=0, micro_batches=2, schedule="1f1b")),
        ("cp=2,tp=2", dict(zero=1)),  # the matrices dealt over the cp x tp replicas
        ("ep=2,tp=2", dict(moe_experts=4, zero=0))],  # experts over their ep rank's tp ranks, the others over all
    8: [("dp=2,tp=2,pp=2", dict(zero=1, micro_batches=2)),
        ("ep=2,cp=2,tp=2", dict(moe_experts=4, zero=1))],  # the replicas over all three axes, experts apart
}


def parity_configs(shared_dataset: Path, shared_tmp: Path) -> list[Any]:
    return [small_run_config(shared_dataset, shared_tmp / f"muon-{i}", mesh, **MUON, **kw)
            for i, (mesh, kw) in enumerate(PARITY.get(WORLD.Get_size(), []))]


@pytest.mark.parametrize("case", range(9))
def test_muon_matches_one_rank(shared_dataset: Path, shared_tmp: Path, case: int) -> None:
    cfgs = parity_configs(shared_dataset, shared_tmp)
    if case >= len(cfgs):
        pytest.skip(f"no case {case} on {WORLD.Get_size()} ranks")
    if case == 0:
        prefetch_serial([attrs.evolve(c, zero=0, micro_batches=1, schedule="1f1b") for c in cfgs])
    cfg = cfgs[case]
    assert_same_run(train_records(cfg, WORLD),
                    serial_reference(attrs.evolve(cfg, zero=0, micro_batches=1, schedule="1f1b")))


def test_muon_state_resumes_and_reshards_across_meshes(shared_dataset: Path, shared_tmp: Path) -> None:
    """Two steps on dp=2 with ZeRO 2 saving at step 1, that checkpoint resharded to tp=2
    offline (`numesh reshard`), one more step on tp=2: the 2-step run's losses, parameters,
    momentum and moments."""
    if WORLD.Get_size() != 2:
        pytest.skip("the 2-rank suite holds this case")
    kw = dict(MUON, zero=2)
    whole = small_run_config(shared_dataset, shared_tmp / "muon-whole", "dp=2", ckpt_interval=1, **kw)
    want = train_records(whole, WORLD)
    step1 = shared_tmp / "muon-whole" / "ckpt" / "step_000001"
    moved = shared_tmp / "muon-tp2-ckpt"
    if WORLD.Get_rank() == 0:
        reshard(step1, "dp=1,tp=2", moved)
    WORLD.Barrier()
    resumed = small_run_config(shared_dataset, shared_tmp / "muon-resumed", "tp=2", resume=str(moved), **kw)
    got = train_records(resumed, WORLD)

    def check() -> None:
        assert [r["step"] for r in got[0]] == [1, 2]
        assert_same_run(got, ([r for r in want[0] if r["step"] >= 1], want[1]))
        meta_a, a = read_state(shared_tmp / "muon-whole" / "ckpt" / "latest")
        meta_b, b = read_state(shared_tmp / "muon-resumed" / "ckpt" / "latest")
        assert meta_a.optimizer == meta_b.optimizer == "muon" and set(a) == {"params", "momentum", "m", "v"}
        for group in a:
            for (path, x), (_, y) in zip(tree_leaves_with_path(b[group]), tree_leaves_with_path(a[group])):
                assert_close(x, y, 1e-10, f"{group}/{path}")
        assert np.abs(a["momentum"].blocks[0].attn.qkv.w).max() > 0

    on_root(check)


# ---------------------------------------------------------------------------------------
# DeepSpeed's three bugs


def expected_update(p: dict, g: dict, lr: float, cfg: Any) -> dict:
    """One first step of Muon (zero momentum) on whole leaves with summed gradients `g`,
    written out: each matrix orthogonalised apart; AdamW on the other leaves."""
    out = {}
    mu = cfg.momentum
    for k, x in p.items():
        if not is_hidden_matrix(Leaf(k, x.shape)):
            flat = x.reshape(-1).copy()
            adamw_step(flat, g[k].reshape(-1).copy(), AdamWState(np.zeros(x.size), np.zeros(x.size)), lr,
                       AdamWConfig(), np.full(x.size, float(x.ndim >= 2 and not k.endswith(".b"))))
            out[k] = flat.reshape(x.shape)
            continue
        buf = (1 - mu) * g[k]
        u = g[k] + mu * (buf - g[k])
        o = np.stack([orthogonalise(m, cfg) for m in matrix_view(Leaf(k, x.shape)).matrices(u)], axis=1)
        out[k] = x * (1 - lr * cfg.weight_decay) - lr * lr_factor(x.shape[0], x.shape[-1], cfg.adjust_lr) * o.reshape(
            x.shape)
    return out


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_bugs_muon_is_active_at_every_stage_on_the_summed_gradient(zero: int) -> None:
    """dp=N, each rank two micro-batches of its own gradients: the update of every matrix is
    Muon's of the gradient summed over ranks and micro-batches. Not AdamW's (Muon off under
    ZeRO-3), not SGD's (stage 0), and not the sum of each micro-batch's orthogonalised
    gradient (ZeRO-3 per micro-batch), each of which the test shows to differ."""
    cfg = model_config(dropout=0.0)
    mesh = Mesh.create(WORLD, dp=WORLD.Get_size())
    try:
        params = init_gpt(cfg, mesh, 0, np.float64)
        units = split_units(params)
        names = {u: "" if u.is_outer else f"{u}." for u in units}
        opt = make_optimizer("muon", {"learning_rate": 1e-2})
        zo = ZeroOptimizer(units, split_units(gpt_specs(cfg)), mesh, stage=zero, optimizer=opt, paths=names)
        p0 = {names[u] + p: x.copy() for u, t in units.items() for p, x in tree_leaves_with_path(t)}

        def grad(rank: int, micro: int) -> dict:
            rng = np.random.default_rng([rank, micro])
            return {k: rng.standard_normal(x.shape) for k, x in p0.items()}

        zo.begin_step(2)
        for micro in range(2):
            mine = grad(WORLD.Get_rank(), micro)
            for u, t in units.items():  # in the order backward finishes them
                zo.grads_ready(u, [mine[names[u] + p].copy() for p, _ in tree_leaves_with_path(t)])
        zo.step(1e-2)
        got = {names[u] + p: x for u, t in zo.local_params().items() for p, x in tree_leaves_with_path(t)}
        every = [grad(r, m) for r in range(WORLD.Get_size()) for m in range(2)]
        summed = {k: sum(g[k] for g in every) for k in p0}
        want = expected_update(p0, summed, 1e-2, opt.config)
        for k in p0:
            assert_close(got[k], want[k], 1e-12, k)
        qkv, lr, wd = "blocks.0.attn.qkv.w", 1e-2, opt.config.weight_decay
        step = got[qkv] - p0[qkv] * (1 - lr * wd)
        scale = np.abs(step).max()
        per_micro = sum(expected_update(p0, g, lr, opt.config)[qkv] - p0[qkv] * (1 - lr * wd) for g in every)
        adamw_first = -lr * summed[qkv] / (np.abs(summed[qkv]) + 1e-8)  # AdamW's first step, decay aside
        for other in (-lr * summed[qkv], per_micro, adamw_first):  # SGD, per micro-batch, AdamW
            assert np.abs(step - other).max() > 0.1 * scale
        # no rank orthogonalises every matrix, under ZeRO 0 either: each owns some
        assert {s.owner for s in zo.matrix_slabs} == set(range(WORLD.Get_size()))
    finally:
        mesh.free()


# ---------------------------------------------------------------------------------------
# bytes and memory per rank


BYTES_CASES = {2: [("dp=2", 0, 1), ("dp=2", 1, 1), ("dp=2", 2, 2), ("dp=2", 3, 2), ("tp=2", 0, 1), ("cp=2", 0, 1),
                   ("ep=2", 1, 1)],
               4: [("dp=2,tp=2", 1, 1), ("dp=2,tp=2", 0, 1), ("cp=2,tp=2", 1, 1), ("ep=2,tp=2", 0, 1)],
               8: [("dp=2,tp=2,pp=2", 3, 2)]}


@pytest.mark.parametrize("case", range(7))
def test_muon_bytes_per_step_follow_the_formula(shared_dataset: Path, shared_tmp: Path, case: int) -> None:
    """The byte counter of one step equals `formulas.step_bytes`, Muon's all-to-alls over dp
    and exchange with the ep x cp x tp replicas (`formulas.matrix_exchange_bytes`) included."""
    cases = BYTES_CASES.get(WORLD.Get_size(), [])
    if case >= len(cases):
        pytest.skip("no such case on this world size")
    mesh, zero, m = cases[case]
    experts = dict(moe_experts=4) if "ep" in mesh else {}
    cfg = small_run_config(shared_dataset, shared_tmp / f"muon-bytes-{case}", mesh, zero=zero, micro_batches=m,
                           dropout=0.0, **MUON, **experts)
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    counter = trainer.mesh.counter
    counter.reset()
    trainer.train_step()
    shape, units = trainer.mesh.shape, trainer.rank_units()
    want = formulas.step_bytes(
        formulas.StepShape(shape, zero, m, cfg.batch_size // (shape["dp"] * shape["ep"] * m), cfg.block_size,
                           cfg.n_embd, 8, trainer.schedule.split_backward,
                           moe=formulas.ExpertShape(trainer.model.moe_experts, trainer.model.moe_top_k, shape["ep"],
                                                    trainer.model.moe_capacity_factor > 0) if experts else None),
        units, all_to_all_bytes=trainer.all_to_all_bytes())
    got = {("+".join(axes), op): v for (axes, op), v in counter.payload.items() if v}
    if units.tied_bytes:  # the counter books the tied-embedding group under its axis
        want[("pp", "all_reduce")] = want.get(("pp", "all_reduce"), 0) + want.pop(
            (f"pp[0,{shape['pp'] - 1}]", "all_reduce"))
    assert got == want
    assert (units.matrix_all_to_all > 0) == (shape["dp"] > 1 and zero > 0)
    assert (units.matrix_dp_gather > 0) == (shape["dp"] > 1 and zero == 0)  # ZeRO 0: the results all-gathered
    assert units.matrix_all_gather == 0  # the tp gather of older runs: now an exchange with the replicas
    # every replica over ep x cp x tp computes some of its owner's matrices
    assert (units.matrix_replica_all_to_all > 0) == (shape["tp"] * shape["cp"] * shape["ep"] > 1)


def rule_runs_of(trainer: Trainer) -> list[list[tuple[int, int]]]:
    """Each unit's (rule, values) runs from the model's own leaves: the optimiser's choice
    on each leaf's path and tp-local shape (the formula's input, not the optimiser's buffers)."""
    owned = trainer.layout.owned(trainer.mesh.index("pp"))
    out = []
    for u, t in split_units(trainer.params).items():
        prefix = "" if u.is_outer else f"blocks.{owned[u.block]}."
        specs = tree_leaves(split_units(trainer.specs)[u])
        out.append([(trainer.optimizer.rule_index(Leaf(prefix + p, x.shape, s)), x.size)
                    for (p, x), s in zip(tree_leaves_with_path(t), specs)])
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_bytes_per_rank_follow_the_formula(shared_dataset: Path, shared_tmp: Path, zero: int,
                                                 optimizer: str) -> None:
    n = WORLD.Get_size()
    cfg = small_run_config(shared_dataset, shared_tmp / f"muon-mem-{optimizer}-{zero}", f"dp={n}", zero=zero,
                           dtype="float32", optimizer=optimizer)
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    opt, k = trainer.opt, 4
    runs = rule_runs_of(trainer)
    values = formulas.rule_state_values(runs, n, trainer.mesh.index("dp"), zero, trainer.optimizer.state_per_value)
    mem = opt.memory()
    assert mem["optimizer"] == k * values
    assert held_bytes(opt) == sum(mem.values())  # and the optimiser holds nothing else
    sizes = [sum(v for _, v in r) for r in runs]
    assert formulas.zero_buffer_bytes(sizes, n, zero, k, values) == mem
    if optimizer == "adamw":  # two moments of every value of the slice: the ZeRO paper's 8Ψ/N
        assert formulas.zero_buffer_bytes(sizes, n, zero, k) == mem
    else:  # one momentum value per matrix value, two moments for the rest: less
        assert mem["optimizer"] < formulas.zero_buffer_bytes(sizes, n, zero, k)["optimizer"]
        assert opt.state["momentum"].size > 0 and opt.state["m"].size > 0
    assert OUTER in opt.units
