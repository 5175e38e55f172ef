"""`numesh plan`: the memory model against what numesh measures, the layout search against
train's validation, the cost models on hand-worked numbers, profiles, and the CLI.

Memory is exact by construction (the same units, padding, sharding and contexts), so the
single-process checks compare bytes for equality; the multi-rank ones are in
test_mpi_plan.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import attrs
import numpy as np
import pytest
from typer.testing import CliRunner

from numesh.base.errors import ConfigError, UserError
from numesh.base.tree import tree_leaves
from numesh.cli.app import app
from numesh.host.threads import threads
from numesh.perf import formulas
from numesh.pipeline.schedules import make_schedule, simulate
from numesh.plan import costs, plan, predict
from numesh.plan.calibrate import KERNELS, fit_scale_and_overhead
from numesh.plan.command import base_config, model_spec
from numesh.plan.hardware import (
    Link,
    Measured,
    Profile,
    builtin_profiles,
    load_profile,
    profile_from_json,
    save_profile,
)
from numesh.plan.layout import Layout, ModelSpec, schedule_of
from numesh.plan.memory import blocks_floor, layout_memory, memory_floor, rank_memory
from numesh.plan.pipesim import makespan_and_busy
from numesh.plan.predict import Plan
from numesh.plan.search import _cp_sizes, candidates, least_recompute, train_config, valid_layouts
from numesh.plan.timing import Placement, attention_cost, block_cost, placement, predict_time, ring_hop_bytes
from numesh.run.config import TrainConfig, config_from, validate
from numesh.run.train import Trainer
from test_recipes import command, config_of


def spec_of(cfg: TrainConfig, vocab: int) -> ModelSpec:
    return ModelSpec.of(cfg, vocab)


# ---------------------------------------------------------------------------------------
# memory: formulas and the model against ZeroOptimizer.memory() and peak_bytes


def test_activation_bytes_hand_worked() -> None:
    # b=2, T=4, C=8, H=2, one block, tp=1, float32, the middle of a pipeline:
    # per block 4bTC + 2bT + 12bTC + b·H·T = 256 + 16 + 768 + 16 = 1056 values = 4224 bytes
    # (12bTC: the QKV buffer q, k and v are views of, the attention output, the MLP-up
    # output and GELU's output; b·H·T: each query row's log-sum-exp, all the fused
    # attention keeps of its softmax: nothing T×T)
    shape = formulas.ActivationShape(micro_batch=2, seq=4, n_embd=8, n_head=2)
    assert formulas.activation_bytes(shape, formulas.Chunk(1, first=False, last=False), vocab=10) == 4224
    # the first stage adds the int64 token ids (8 bT = 64 bytes); with tp=2 a byte mask too
    assert formulas.activation_bytes(shape, formulas.Chunk(1, first=True, last=False), vocab=10) == 4224 + 64
    # the last stage: x̂, output (2bTC), 1/σ, sum-exp and target logit (3bT), logits bT·V (vocab 10),
    # int64 targets, a byte mask
    head = (2 * 64 + 3 * 8 + 8 * 10) * 4 + 8 * 8 + 8
    assert formulas.activation_bytes(shape, formulas.Chunk(1, first=False, last=True), vocab=10) == 4224 + head
    with pytest.raises(ValueError):
        formulas.activation_bytes(formulas.ActivationShape(1, 1, 8, 2, recompute="some"), formulas.Chunk(1, True, True),
                                  vocab=10)


def test_zero_buffer_bytes_hand_worked() -> None:
    # units of 5 and 3 values on dp=2: padded 6 + 4 = 10 full, 5 per shard
    assert formulas.zero_buffer_bytes([5, 3], 2, 0) == {"params": 40, "grads": 40, "optimizer": 80, "workspace": 60}
    assert formulas.zero_buffer_bytes([5, 3], 2, 1) == {"params": 40, "grads": 40, "optimizer": 40, "workspace": 30}
    assert formulas.zero_buffer_bytes([5, 3], 2, 2)["grads"] == 20
    assert formulas.zero_buffer_bytes([5, 3], 2, 3)["params"] == 20


@pytest.mark.parametrize("overrides", [
    dict(micro_batches=1), dict(micro_batches=2, bias=True), dict(micro_batches=4, dropout=0.1),
    dict(micro_batches=2, dtype="float64"), dict(micro_batches=3, batch_size=6, schedule="zb-h1"),
    # experts (dropless, one rank: the balanced-routing assumption is exact with ep = 1)
    dict(moe_experts=4), dict(moe_experts=4, moe_every=2, micro_batches=2, bias=True),
    dict(moe_experts=4, moe_top_k=1, recompute="full"), dict(moe_experts=4, micro_batches=2, schedule="zb-h1"),
    # Llama: RMSNorm, rotary (the tables held once), SwiGLU, grouped-query attention, untied head
    dict(arch="llama", n_kv_head=2, micro_batches=2), dict(arch="llama", n_kv_head=1, bias=True, schedule="zb-h1",
                                                           micro_batches=2, dtype="float64"),
    dict(arch="llama", tie_embeddings=True, ffn_hidden=48, recompute="full", micro_batches=4, schedule="zb-h1"),
    dict(arch="llama", n_kv_head=2, moe_experts=4, moe_every=2, micro_batches=2),  # Mixtral's SwiGLU experts
    # Muon: one momentum value per matrix value, AdamW's two moments for the rest
    dict(optimizer="muon", micro_batches=2, bias=True), dict(optimizer="muon", moe_experts=4),
    dict(optimizer="muon", arch="llama", n_kv_head=2, moe_experts=4, moe_every=2),  # Muon on q, k, v, gate and up
])
def test_memory_model_equals_measured_single_process(char_dataset: Path, tmp_path: Path, overrides: dict) -> None:
    cfg = config_from({**dict(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=2, n_embd=32, n_head=4,
                              block_size=16, batch_size=8, max_iters=1), **overrides})  # --arch fills its parts
    assert cfg.positions == ("rotary" if overrides.get("arch") == "llama" else "learned")
    t = Trainer(cfg)
    t.train_step()
    itemsize = np.dtype(cfg.dtype).itemsize
    layout = Layout(1, 1, 1, 0, cfg.schedule, cfg.micro_batches, recompute=cfg.recompute)
    pred = rank_memory(spec_of(cfg, t.model.vocab_size), layout, 0, itemsize, threads())
    assert {**t.opt.memory(), "activations": t.last_stats.peak_bytes} == {
        k: getattr(pred, k) for k in ("params", "grads", "optimizer", "workspace", "activations")}
    assert n_params_match(cfg, t)


def n_params_match(cfg: TrainConfig, t: Trainer) -> bool:
    return spec_of(cfg, t.model.vocab_size).n_params == t.n_params


def test_pipeline_peak_walks_the_schedule() -> None:
    """GPipe holds all m micro-batches, 1F1B at most p on rank 0 (the middle of a 4-stage pipe)."""
    model = ModelSpec(8, 4, 32, 16, 50, 16)
    one = formulas.activation_bytes(formulas.ActivationShape(micro_batch=2, seq=16, n_embd=32, n_head=4),
                                    formulas.Chunk(2, first=False, last=False), vocab=50)
    gp = [rank_memory(model, Layout(1, 1, 4, 0, "gpipe", 8), r) for r in range(4)]
    fb = [rank_memory(model, Layout(1, 1, 4, 0, "1f1b", 8), r) for r in range(4)]
    assert gp[1].activations == gp[2].activations == 8 * one
    assert [fb[1].activations, fb[2].activations] == [3 * one, 2 * one]  # rank s of 4 holds p - s
    assert fb[0].activations > fb[3].activations  # rank 0 holds 4 (with the embedding), the last 1
    # layout_memory keeps the ranks that can hold the most: first, second, last
    assert max(m.total for m in layout_memory(model, Layout(1, 1, 4, 0, "1f1b", 8))) == max(m.total for m in fb)


# ---------------------------------------------------------------------------------------
# the search


def test_every_listed_layout_passes_validate_and_no_valid_one_is_missing(char_dataset: Path, tmp_path: Path) -> None:
    base = TrainConfig(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=4, batch_size=8)
    shape, gpt = validate(base, 1)
    model = spec_of(base, gpt.vocab_size)
    for ranks in (1, 2, 4, 8):
        listed = valid_layouts(base, model, ranks)
        assert listed, ranks
        for lay in listed:
            validate(train_config(base, lay), ranks)  # raises if train would refuse it
        rejected = 0
        for lay in candidates(model, ranks):
            if lay in listed:
                continue
            rejected += 1
            with pytest.raises(UserError):
                validate(train_config(base, lay), ranks)
        assert len(set(listed)) == len(listed)
    # tp=8 cannot split 4 heads: never listed
    assert not [lay for lay in valid_layouts(base, model, 8) if lay.tp == 8]


def test_search_lists_cp_sp_and_every_recompute(char_dataset: Path, tmp_path: Path) -> None:
    """cp over every size check_layout takes (block_size into 2·cp chunks), sp only with tp > 1
    (and then both ways), every recomputation mode on every mesh."""
    base = TrainConfig(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=2, n_head=4, block_size=8, batch_size=4)
    model = spec_of(base, 20)
    listed = valid_layouts(base, model, 8)
    assert {lay.cp for lay in listed} == {1, 2, 4}  # cp=8 would need 16 | block_size
    assert all(lay.tp > 1 for lay in listed if lay.sp)
    meshes = {(lay.dp, lay.cp, lay.tp, lay.pp) for lay in listed}
    for mesh in meshes:
        same = [lay for lay in listed if (lay.dp, lay.cp, lay.tp, lay.pp) == mesh]
        assert {lay.recompute for lay in same} == {"none", "full"}
        assert {lay.sp for lay in same} == ({False, True} if mesh[2] > 1 else {False})
    assert (2, 2, 2, 1) in meshes and (1, 4, 2, 1) in meshes
    lay = next(x for x in listed if x.cp == 2 and x.tp == 2 and x.sp and x.recompute == "full")
    assert lay.mesh == f"dp={lay.dp},cp=2,tp=2,pp={lay.pp}" and lay.ranks == 8
    assert lay.train_flags().endswith("--recompute full --sequence-parallel")
    validate(train_config(base, lay), 8)


def test_search_at_scale_keeps_cp_to_long_chunks() -> None:
    """Beyond SCALE_RANKS, cp only while each rank keeps CP_MIN_TOKENS tokens of a sequence."""
    model = ModelSpec(8, 8, 64, 2048, 100, 256)
    assert _cp_sizes(model, 128, 128) == [1, 2]
    assert _cp_sizes(model, 16, 16) == [1, 2, 4, 8, 16]  # below the scale: every size that splits the block


def test_least_recompute_keeps_the_first_that_fits() -> None:
    lays = [Layout(2, 2, 1, z, "1f1b", 1, recompute=r, sp=True) for z in (0, 3) for r in ("full", "none")]
    fits = {(0, "full"), (3, "none"), (3, "full")}
    kept = least_recompute(lays, lambda lay: (lay.zero, lay.recompute) in fits)
    assert sorted((lay.zero, lay.recompute) for lay in kept) == [(0, "full"), (3, "none")]
    assert [lay.recompute for lay in least_recompute(lays[:2], lambda lay: False)] == ["full"]  # none fit: the smallest


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                          ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3), ("zb-h1", 4, 8, 1),
                                          ("zb-h1", 1, 3, 1)])
@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "python"])
def test_pipesim_equals_simulate(name: str, p: int, m: int, v: int, compiled: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops, numba's and Python's (without numba), give `simulate`'s numbers."""
    from numesh.plan import pipesim

    if compiled and not pipesim.HAVE_NUMBA:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(pipesim, "HAVE_NUMBA", compiled)
    rng = np.random.default_rng(p * 100 + m * 10 + v)
    sched = make_schedule(name, p, m, v)
    for _ in range(4):
        t_f, t_b, t_w, comm = (float(x) for x in rng.uniform(0.1, 2.0, 4))
        tl = simulate(sched, t_f=t_f, t_b=t_b, t_w=t_w, comm=comm)
        got = makespan_and_busy(sched, t_f, t_b, t_w, comm)
        assert got == pytest.approx((tl.makespan, max(tl.busy(r) for r in range(p))), rel=1e-12)


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                          ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3), ("zb-h1", 4, 8, 1),
                                          ("zb-h1", 1, 3, 1)])
def test_the_planners_activation_walk_is_the_formulas(name: str, p: int, m: int, v: int) -> None:
    """plan.memory's vectorised walk gives `formulas.peak_activation_bytes`' peak on every
    rank, with chunks of different sizes and shared buffers or none."""
    from numesh.plan import memory

    rng = np.random.default_rng(p * 100 + m * 10 + v)
    sched = make_schedule(name, p, m, v)
    for _ in range(3):
        cost = tuple((int(a), int(b)) for a, b in rng.integers(1, 10**9, (v, 2)))
        shared = tuple(int(x) for x in rng.integers(0, 10**8, 2)) if rng.random() < 0.7 else (0, 0)
        for rank in range(p):
            want = formulas.peak_activation_bytes(sched, rank, lambda c: cost[c][0], lambda c: cost[c][1], shared)
            assert memory._walk(name, p, m, v, rank, cost, shared) == want


# ---------------------------------------------------------------------------------------
# cost models


def test_ring_and_tree_hand_worked() -> None:
    # all-reduce of 1000 B on 4 ranks, α = 1 s, β = 100 B/s: ring 2·3·1 + 2·3·250/100 = 21; tree 2·2·1 + 2·1000/100 = 24
    assert costs.ring_time("all_reduce", 1000, 4, 1.0, 100.0) == pytest.approx(21.0)
    assert costs.tree_time("all_reduce", 1000, 4, 1.0, 100.0) == pytest.approx(24.0)
    assert costs.collective_time("all_reduce", 1000, 4, 1.0, 100.0) == pytest.approx(21.0)
    # tiny payload on many ranks: the tree's log2 latency wins (ring 2·63 = 126 s, tree 2·6 + ...)
    assert costs.collective_time("all_reduce", 8, 64, 1.0, 1e9) == pytest.approx(12.0, rel=1e-6)
    assert costs.ring_time("all_gather", 1000, 4, 1.0, 100.0) == pytest.approx(3 + 7.5)
    assert costs.ring_time("send", 1000, 2, 1.0, 100.0) == pytest.approx(11.0)
    assert costs.ring_time("all_reduce", 1000, 1, 1.0, 100.0) == 0.0


def test_interpolation_and_fit() -> None:
    pts = [(10.0, 1.0), (1000.0, 100.0)]
    assert costs.interp_loglog(pts, 100.0) == pytest.approx(10.0)
    assert costs.interp_time(pts, 1.0) == 1.0  # below the smallest: its time (a per-call floor)
    assert costs.interp_time(pts, 2000.0) == pytest.approx(200.0)  # above: its rate
    alpha, beta = 2e-6, 5e9
    meas = [(s, 6 * alpha + 1.5 * s / beta) for s in (1e3, 1e5, 1e7)]  # ring all-reduce on 4 ranks
    a, b = costs.fit_alpha_beta(meas, 6, 1.5)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def synthetic_profile(**kw) -> Profile:
    return Profile(name="test", source="test", itemsize=4, memory_bytes=1e9, devices_per_node=8, peak_flops=1e12,
                   gemm_efficiency=0.5, mem_bandwidth=1e11, intra=Link(1e-6, 1e10), inter=Link(1e-5, 1e9), **kw)


def test_time_model_single_rank_is_micro_batches_times_a_pass() -> None:
    model = ModelSpec(4, 4, 64, 32, 100, 8)
    prof = synthetic_profile()
    one = predict_time(model, Layout(1, 1, 1, 0, "1f1b", 1), prof)
    two = predict_time(model, Layout(1, 1, 1, 0, "1f1b", 2), prof)
    # GEMMs and element-wise work are linear in tokens on a spec profile: same compute
    assert two.compute == pytest.approx(one.compute, rel=1e-9)
    assert one.comm == {"tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.0, "dp": 0.0, "other": 0.0, "wait": 0.0}
    assert one.bubble == 0.0
    assert one.total == pytest.approx(one.compute + one.optimizer)
    # the model's FLOPs over the achieved rate bound the compute from below
    flops = 6 * model.n_params * model.tokens_per_step
    assert one.compute > flops / (prof.peak_flops * prof.gemm_efficiency)


def test_time_model_prices_muons_matrices_and_exchange() -> None:
    """Muon's step: its Newton–Schulz GEMMs on every matrix under ZeRO 0, about 1/dp of them
    under ZeRO 1, plus the exchange over dp that brings them whole; AdamW has neither."""
    prof = synthetic_profile()
    adamw, muon = ModelSpec(4, 4, 64, 32, 100, 8), ModelSpec(4, 4, 64, 32, 100, 8, optimizer="muon")
    t = {(m.optimizer, z): predict_time(m, Layout(4, 1, 1, z, "1f1b", 1), prof).optimizer
         for m in (adamw, muon) for z in (0, 1)}
    ns = t["muon", 0] - t["adamw", 0]  # all the matrices' iterations, no exchange
    assert ns > 0
    # ZeRO 1: a quarter of the iterations, a quarter of the elementwise work, and the exchange
    assert t["muon", 1] - t["adamw", 1] > ns / 4
    assert t["muon", 1] < t["muon", 0]


def test_time_model_prices_muons_newton_schulz_steps_as_the_run_sets_them() -> None:
    """The plan built Muon at its defaults: its step cost 5 iterations whatever
    --muon-ns-steps said (and `--mesh auto` chose from that). ModelSpec.of keeps the run's."""
    from numesh.run.config import config_from

    prof, lay = synthetic_profile(), Layout(4, 1, 1, 0, "1f1b", 1)
    base = dict(n_layer=4, n_head=4, n_embd=64, block_size=32, batch_size=8, optimizer="muon")
    adamw = predict_time(ModelSpec.of(config_from({**base, "optimizer": "adamw"}), 100), lay, prof).optimizer
    ns = {s: predict_time(ModelSpec.of(config_from({**base, "muon_ns_steps": s}), 100), lay, prof).optimizer - adamw
          for s in (1, 5, 50)}
    per_step = (ns[5] - ns[1]) / 4  # the iterations' GEMMs: linear in the steps, above Muon's other work
    assert per_step > 0 and ns[50] - ns[5] == pytest.approx(45 * per_step)


def test_time_model_bubble_is_simulate_and_comm_is_exposed_per_axis() -> None:
    model = ModelSpec(8, 4, 64, 32, 100, 16)
    prof = synthetic_profile()
    pp = predict_time(model, Layout(1, 1, 4, 0, "1f1b", 4), prof)
    gp = predict_time(model, Layout(1, 1, 4, 0, "gpipe", 4), prof)
    zb = predict_time(model, Layout(1, 1, 4, 0, "zb-h1", 4), prof)
    assert pp.bubble > 0 and zb.bubble < pp.bubble  # zero-bubble fills the cool-down with W
    assert gp.bubble == pytest.approx(pp.bubble, rel=1e-9)  # the same idle time, more memory
    assert pp.comm["pp"] > 0
    tp = predict_time(model, Layout(1, 4, 1, 0, "1f1b", 1), prof)
    assert tp.comm["tp"] > 0 and tp.comm["dp"] == 0
    z = [predict_time(model, Layout(4, 1, 1, s, "1f1b", 2), prof) for s in range(4)]
    assert z[3].comm["dp"] > z[0].comm["dp"]  # ZeRO-3 gathers parameters in every F and B
    no_overlap = predict_time(model, Layout(4, 1, 1, 0, "1f1b", 2), attrs.evolve(prof, overlap=False))
    assert no_overlap.comm["dp"] >= z[0].comm["dp"]


def test_time_model_prices_a_llama_block_at_its_own_shapes() -> None:
    """Grouped-query attention multiplies q at C/tp and k, v at the rank's kv columns (1 kv
    head of 4 here: fewer FLOPs than the fused QKV); SwiGLU runs three GEMMs of its hidden
    size; with tp > 1 the k and v gradients are all-reduced over tp once per step (with or
    without sp); an untied head sums no embedding gradient across pp."""
    from numesh.plan.timing import projection_columns, tp_partial_values

    gpt2 = ModelSpec(4, 4, 64, 32, 65, 8)
    llama = attrs.evolve(gpt2, parts=formulas.Parts(hidden=96, gated=True, kv_heads=1, head_size=16, rmsnorm=True,
                                                    rotary=True, tied=False))
    tp2 = Layout(1, 2, 1, 0, "1f1b", 1)
    assert projection_columns(gpt2, tp2) == [96] and projection_columns(llama, tp2) == [32, 16, 16]
    assert tp_partial_values(gpt2, tp2) == 0 and tp_partial_values(llama, tp2) == 4 * 2 * 64 * 16
    assert tp_partial_values(llama, attrs.evolve(tp2, sp=True)) == 4 * 2 * 64 * 16 + (2 * 4 + 1) * 64
    prof = load_profile("a100-80gb")
    one = Layout(1, 1, 1, 0, "1f1b", 1)
    for lay in (one, tp2):
        a, b = (block_cost(m, lay, prof, placement(lay, prof), False) for m in (gpt2, llama))
        assert a.w != b.w  # other GEMMs: the narrower k, v and the gate
    # tp = 2: beside the same activations' all-reduces as every head's own kv (fused QKV), GQA
    # all-reduces its k and v gradients once
    fused = attrs.evolve(llama, parts=attrs.evolve(llama.parts, kv_heads=0))
    extra = predict_time(llama, tp2, prof).comm["tp"] - predict_time(fused, tp2, prof).comm["tp"]
    place = placement(tp2, prof)
    want = prof.comm_time("all_reduce", tp_partial_values(llama, tp2) * prof.itemsize, 2, place.tp_intra,
                          place.ranks_on_node)
    assert extra == pytest.approx(want, rel=1e-9) and want > 0
    pp2 = Layout(1, 1, 2, 0, "1f1b", 2)
    tied = attrs.evolve(llama, parts=attrs.evolve(llama.parts, tied=True))
    assert predict_time(tied, pp2, prof).comm["other"] > predict_time(llama, pp2, prof).comm["other"]


def test_time_model_recompute_cp_and_sp() -> None:
    """Full recomputation costs a block's forward again; cp splits a rank's work and adds
    ring hops, whose payloads are formulas.cp_ring_bytes; sp moves tp traffic as
    all-gathers and reduce-scatters."""
    model = ModelSpec(4, 4, 64, 256, 100, 8)
    prof = synthetic_profile()
    t = {r: predict_time(model, Layout(1, 1, 1, 0, "1f1b", 2, recompute=r), prof) for r in ("none", "full")}
    assert t["none"].compute < t["full"].compute
    att = attention_cost(model, Layout(1, 1, 1, 0, "1f1b", 2), prof, placement(Layout(1, 1, 1, 0, "1f1b", 2), prof))
    assert t["full"].compute - t["none"].compute > 2 * model.n_layer * att.f  # the rerun includes attention's forward
    # the scores' GEMM alone: 2·b·s²·h FLOPs per layer per micro-batch (b = 4 rows, h = n_embd)
    assert att.f > 2 * 4 * 256**2 * 64 / (prof.peak_flops * prof.gemm_efficiency)
    one = predict_time(model, Layout(1, 1, 1, 0, "1f1b", 2), prof)
    cp = predict_time(model, Layout(1, 1, 1, 0, "1f1b", 2, cp=2), prof)
    assert cp.compute < one.compute and cp.comm["dp"] > 0  # ZeRO 0 sums the gradients over dp x cp
    slow = predict_time(model, Layout(1, 1, 1, 0, "1f1b", 2, cp=4), attrs.evolve(prof, intra=Link(1e-3, 1e6)))
    assert slow.comm["cp"] > 0
    lay = Layout(1, 2, 1, 0, "1f1b", 2, cp=4)
    fwd, bwd = ring_hop_bytes(model, lay, 4)
    assert sum(fwd) + sum(bwd) == formulas.cp_ring_bytes(formulas.Chunk(1, False, False), 4, 256, 64, 2, 4, 4)
    z1 = predict_time(model, Layout(2, 1, 1, 1, "1f1b", 2, cp=2), prof)
    assert z1.comm["cp"] > 0  # ZeRO 1-3: the cp all-reduce of the gradients before dp's reduce-scatter
    plain = predict_time(model, Layout(1, 2, 1, 0, "1f1b", 2), prof)
    sp = predict_time(model, Layout(1, 2, 1, 0, "1f1b", 2, sp=True), prof)
    assert sp.comm["tp"] > 0
    # LayerNorms and residual adds on half the tokens, and the whole-sequence copies of the
    # gathers, reduce-scatters and LayerNorm affines (SP_COPIES) on top, per micro-batch
    bt, C, ew = 4 * 256, 64, lambda op, n: prof.elementwise_time(op, n, 2)  # noqa: E731
    ln_saved = sum(2 * (ew(op, bt * C) - ew(op, bt * C // 2)) for op in ("layernorm_fwd", "layernorm_bwd"))
    ln_saved += 4 * (ew("copy", bt * C) - ew("copy", bt * C // 2))  # two residual adds in F, two in B
    ln_saved = model.n_layer * ln_saved + sum(ew(op, bt * C) - ew(op, bt * C // 2)
                                              for op in ("layernorm_fwd", "layernorm_bwd"))
    copies = model.n_layer * ew("copy", 14 * bt * C) + ew("copy", 2 * bt * C) + ew("copy", 5 * bt * C)
    assert sp.compute - plain.compute == pytest.approx(2 * (copies - ln_saved), rel=1e-9)


def test_placement_tp_inside_a_node_first() -> None:
    model = ModelSpec(8, 8, 64, 32, 100, 64)
    prof = synthetic_profile()
    inside = predict_time(model, Layout(2, 8, 1, 0, "1f1b", 1), prof)  # tp=8 fills a node of 8
    across = predict_time(model, Layout(1, 8, 2, 0, "1f1b", 2), attrs.evolve(prof, devices_per_node=4))
    assert across.comm["tp"] > inside.comm["tp"] * 2  # tp over the slower inter-node link


def test_plan_lists_what_fits_fastest_first(char_dataset: Path, tmp_path: Path) -> None:
    """With a memory limit, plan predicts exactly the layouts whose memory fits (those its
    floor rules out included nowhere), in the order of the unlimited plan; and when none
    fits it names the layout that needs the least, as predicting every one would."""
    base = TrainConfig(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=4, batch_size=8)
    model = spec_of(base, 20)
    every = plan(base, model, 4, synthetic_profile(), 0.0, 4)
    preds = every.fitting
    tps = [p.tokens_per_s for p in preds]
    assert tps == sorted(tps, reverse=True) and every.layouts == len(preds) and every.smallest is None
    sizes = sorted({p.memory.total for p in preds})
    limit = sizes[len(sizes) // 2]
    limited = plan(base, model, 4, synthetic_profile(), limit, 4)
    assert limited.layouts == every.layouts and 0 < len(limited.fitting) < len(preds)
    assert limited.fitting == [attrs.evolve(p, fits=True) for p in preds if p.memory.total <= limit]
    none = plan(base, model, 4, synthetic_profile(), sizes[0] - 1, 4)
    assert none.fitting == [] and none.smallest_bytes == sizes[0]
    assert none.smallest in [p.layout for p in preds if p.memory.total == sizes[0]]


def test_memory_floor_is_below_the_prediction() -> None:
    """The floors that reject a layout before its schedule is built, or before its blocks
    are listed, are never above the prediction, on every kind of layout (pipelines,
    interleaving, ZeRO, cp, sp, experts, Muon's state)."""
    for base, ranks in ((TrainConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, batch_size=16, moe_experts=4,
                                     moe_every=2), 8),
                        (TrainConfig(n_layer=6, n_head=4, n_embd=64, block_size=64, batch_size=24, bias=True), 6),
                        (TrainConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, batch_size=16,
                                     optimizer="muon"), 4)):
        model = spec_of(base, 100)
        layouts = valid_layouts(base, model, ranks)
        assert {lay.virtual_stages for lay in layouts} > {1} and {lay.ep for lay in layouts} >= {1}
        for lay in layouts:
            floor = memory_floor(model, lay, 4)
            assert 0 < blocks_floor(model, lay, 4) <= floor <= max(m.total for m in layout_memory(model, lay, 4)), lay


def test_a_big_model_on_few_ranks_is_answered_without_building_its_schedules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`numesh plan --model gpt3-175b --ranks 8 --hardware a100-80gb` built, walked and
    simulated every schedule of up to 1,536 micro-batches × 12 virtual stages and printed
    nothing for a quarter of an hour: no layout fits, and their floors say so. It now
    builds the schedules of the few layouts whose floors are the smallest."""
    built = []

    def counted(*args: object) -> object:
        built.append(args)
        assert len(built) <= 8, "the plan builds the schedules of layouts that cannot fit"
        return make_schedule(*args)

    schedule_of.cache_clear()
    monkeypatch.setattr("numesh.plan.layout.make_schedule", counted)
    base = base_config({}, None, "gpt3-175b")
    model = model_spec(base, None, "gpt3-175b")
    found = plan(base, model, 8, load_profile("a100-80gb"), 80 * 2**30, 2)
    assert found.fitting == [] and found.layouts > 10_000 and found.smallest is not None
    assert found.smallest_bytes > 80 * 2**30 and found.smallest.tp == 8
    schedule_of.cache_clear()


# ---------------------------------------------------------------------------------------
# profiles


def test_builtin_profiles_load() -> None:
    names = builtin_profiles()
    assert {"a100-80gb", "h100-80gb"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.peak_flops > 0 and p.mem_bandwidth > 0 and p.source


def test_measured_profile_round_trip_and_lookup(tmp_path: Path) -> None:
    meas = Measured(2, 1, {"1,64,64,64": 1e-4}, ((1e3, 1e-6), (1e9, 1e-2)), {"copy": ((10.0, 1e-6), (1e6, 1e-3))},
                    {"all_reduce:2": ((8.0, 1e-5), (1e6, 1e-3)), "send": ((8.0, 1e-5), (1e6, 5e-4))})
    prof = Profile(name="local", source="test", cores=2, overlap=False, measured={2: meas})
    path = save_profile(prof, tmp_path / "p.json")
    back = load_profile(str(path))
    assert back == prof
    assert back.gemm_time(1, 64, 64, 64, 2) == 1e-4  # an exact shape
    assert back.gemm_time(1, 1000, 1000, 500, 2) == pytest.approx(1e-2 * 1e9 / 1e9)  # the curve
    assert back.gemm_time(1, 64, 64, 64, 4) == pytest.approx(2e-4)  # 4 ranks share 2 cores: twice as slow as 2
    assert back.comm_time("all_reduce", 1e6, 2, True, 2) == pytest.approx(1e-3)
    assert back.comm_time("reduce_scatter", 1e6, 2, True, 2) == pytest.approx(5e-4)


def test_in_situ_scale_and_call_overhead_apply_and_round_trip(tmp_path: Path) -> None:
    """The fitted step terms scale every measured kernel and add one overhead per block
    action; an older profile without them loads with 1 and 0."""
    meas = Measured(2, 1, {"1,64,64,64": 1e-4}, ((1e3, 1e-6), (1e9, 1e-2)),
                    {k: ((10.0, 1e-6), (1e6, 1e-3)) for k in KERNELS},
                    {"all_reduce:2": ((8.0, 1e-5), (1e6, 1e-3)), "send": ((8.0, 1e-5), (1e6, 5e-4))})
    fitted = attrs.evolve(meas, in_situ=1.5, call_overhead_s=2e-4)
    prof = Profile(name="local", source="test", cores=2, measured={2: fitted})
    back = load_profile(str(save_profile(prof, tmp_path / "p.json")))
    assert back == prof
    assert back.gemm_time(1, 64, 64, 64, 2) == pytest.approx(1.5e-4)
    assert back.elementwise_time("copy", 1e6, 2) == pytest.approx(1.5e-3)
    assert back.comm_time("all_reduce", 1e6, 2, True, 2) == pytest.approx(1e-3)  # communication is not scaled
    assert back.call_overhead(2) == 2e-4 and back.call_overhead(4) == pytest.approx(4e-4)  # 4 ranks share 2 cores
    plain = attrs.evolve(prof, measured={2: meas})
    d = plain.to_json()
    for m in d["measured"].values():
        del m["in_situ"], m["call_overhead_s"]
    assert profile_from_json(d, "old") == plain
    model = ModelSpec(2, 2, 64, 64, 65, 8)
    for split in (False, True):
        place = Placement(2, True, True, True, True)
        lay = Layout(1, 1, 1, 0, "zb-h1" if split else "1f1b", 1)
        without = block_cost(model, lay, attrs.evolve(prof, measured={2: attrs.evolve(fitted, call_overhead_s=0.0)}),
                             place, split)
        with_ = block_cost(model, lay, prof, place, split)
        assert with_.f - without.f == pytest.approx(2e-4) and with_.b - without.b == pytest.approx(2e-4)
        assert with_.w - without.w == pytest.approx(2e-4 if split else 0.0)


def test_full_recompute_reruns_the_kernels_inside_b() -> None:
    """Full recomputation's rerun forward runs inside B's action: B grows by F's kernels
    (and its communication) but not by a second action's overhead."""
    from numesh.plan.timing import Placement

    meas = Measured(2, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), {k: ((10.0, 1e-7), (1e6, 1e-3)) for k in KERNELS},
                    {"all_reduce:2": ((8.0, 1e-5), (1e6, 1e-3)), "send": ((8.0, 1e-5), (1e6, 5e-4))},
                    in_situ=1.2, call_overhead_s=3e-4)
    prof = Profile(name="t", source="", itemsize=4, cores=2, measured={2: meas})
    model, place = ModelSpec(2, 2, 64, 64, 65, 8), Placement(2, True, True, True, True)
    for tp in (1, 2):
        none, full = (block_cost(model, Layout(1, tp, 1, 0, "1f1b", 2, recompute=r), prof, place, False)
                      for r in ("none", "full"))
        assert full.f == pytest.approx(none.f)
        assert full.b - none.b == pytest.approx(none.f - 3e-4)  # F's kernels and its tp all-reduces, no overhead
        assert full.tp == pytest.approx(1.5 * none.tp)


def test_fit_scale_and_overhead() -> None:
    # T = 1.5 K + 0.1 A on both points: solved exactly
    assert fit_scale_and_overhead([(20.0, 8, 30.8), (21.0, 32, 34.7)]) == pytest.approx((1.5, 0.1))
    # a negative overhead (noise) falls back to the ratio of the sums, no overhead
    assert fit_scale_and_overhead([(20.0, 8, 40.0), (21.0, 32, 30.0)]) == pytest.approx((70.0 / 41.0, 0.0))
    assert fit_scale_and_overhead([(20.0, 8, 30.0)]) == pytest.approx((1.5, 0.0))


def test_fit_steps_on_real_steps(char_dataset: Path, tmp_path: Path) -> None:
    """Calibration's last part trains the model on this rank at two micro-batch counts and
    fits T = in_situ·K + overhead·A to them; without a dataset it keeps the kernel times."""
    from mpi4py import MPI

    from numesh.plan.calibrate import _kernel_time, fit_steps

    base = TrainConfig(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=2, n_head=2, n_embd=32,
                       block_size=16, batch_size=4)
    model = ModelSpec(2, 2, 32, 16, 65, 4)
    kernels = Measured(1, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), {k: ((10.0, 1e-7), (1e6, 1e-3)) for k in KERNELS}, {})
    meas = fit_steps(MPI.COMM_SELF, base, model, kernels)
    assert meas.in_situ > 0 and meas.call_overhead_s >= 0 and (meas.in_situ, meas.call_overhead_s) != (1.0, 0.0)
    bare = fit_steps(MPI.COMM_SELF, attrs.evolve(base, data=str(tmp_path / "none")), model, kernels)
    assert (bare.in_situ, bare.call_overhead_s) == (1.0, 0.0)  # no dataset: nothing fitted
    assert _kernel_time(model, meas, 4, 4) > _kernel_time(model, meas, 4, 1) > 0  # the fit's two points differ


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"),
    ('{"name": "x", "source": "y", "colour": 1}', "unknown keys colour"),
    ('{"name": "x", "source": "y"}', "neither measurements nor peak_flops"),
])
def test_bad_profiles(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "p.json").write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_profile(str(tmp_path / "p.json"))


def test_a_profile_path_that_is_missing_or_a_directory_is_one_line(tmp_path: Path) -> None:
    """The hardware profile reader is the config file's (`read_user_file`): a missing file
    and a directory are told apart, each with what to pass instead."""
    (tmp_path / "d.json").mkdir()
    for name, says in (("gone.json", "not found: give"), ("d.json", "not found (it is a directory): give")):
        with pytest.raises(ConfigError, match=re.escape(f"hardware profile {tmp_path / name} {says}")):
            load_profile(str(tmp_path / name))


# ---------------------------------------------------------------------------------------
# the command


def invoke(args: list[str]):
    return CliRunner().invoke(app, ["plan", *args])


def test_cli_json_schema(char_dataset: Path) -> None:
    res = invoke(["--ranks", "4", "--data", str(char_dataset), "--hardware", "a100-80gb", "--batch-size", "8",
                  "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert len(rows) > 10
    for r in rows:
        assert {"mesh", "dp", "cp", "tp", "pp", "sequence_parallel", "recompute", "zero", "schedule", "micro_batches",
                "fits", "memory_bytes_per_rank", "step_time_s"} <= set(r)
        assert isinstance(r["fits"], bool) and r["memory_bytes_per_rank"] > 0 and r["step_time_s"] > 0
        sizes = ({a: 1 for a in ("dp", "cp", "tp", "pp")}
                 | {k: int(v) for k, v in (x.split("=") for x in r["mesh"].split(","))})
        assert sizes == {a: r[a] for a in sizes} and r["dp"] * r["cp"] * r["tp"] * r["pp"] == 4
        assert ("cp=" in r["mesh"]) == (r["cp"] > 1)
        assert isinstance(r["sequence_parallel"], bool) and (r["tp"] > 1 or not r["sequence_parallel"])
        assert ("--sequence-parallel" in r["train_flags"]) == r["sequence_parallel"]
        assert r["recompute"] in ("none", "full")
        assert ("--recompute" in r["train_flags"]) == (r["recompute"] != "none")
    assert {r["cp"] for r in rows} == {1, 2, 4} and {r["recompute"] for r in rows} == {"none", "full"}
    assert {r["sequence_parallel"] for r in rows} == {False, True}
    times = [r["step_time_s"] for r in rows]  # sorted by tokens/s: step times ascending, to rounding
    assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:]))


def test_cli_table_and_command(char_dataset: Path) -> None:
    res = invoke(["--ranks", "2", "--data", str(char_dataset), "--hardware", "h100-80gb", "--top", "3"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 + 3 + 2 and lines[-1].startswith("best: mpirun -n 2 numesh train --mesh ")


def test_cli_preset_at_scale() -> None:
    res = invoke(["--ranks", "16", "--model", "gpt2-xl", "--batch-size", "32", "--hardware", "a100-80gb",
                  "--memory-per-rank", "16GiB", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    # only what fits is listed: dp=16 without ZeRO holds 1.5B parameters' state on every rank
    assert rows and not any(r["dp"] == 16 and r["zero"] == 0 for r in rows)
    assert all(r["fits"] and r["memory_bytes_per_rank"] <= 16 * 2**30 for r in rows)
    res = invoke(["--ranks", "16", "--model", "gpt2-xl", "--batch-size", "32", "--hardware", "a100-80gb",
                  "--memory-per-rank", "16GiB"])
    counted = re.search(r"^(\d+) layouts on 16 ranks \((\d+) fit in 16.0 GiB per rank\).* --json lists the (\d+) "
                        r"that fit,", res.stdout, re.M)
    assert counted and int(counted[2]) == int(counted[3]) == len(rows) < int(counted[1]), res.stdout


@pytest.mark.parametrize("name, published", [
    ("smollm2-135m", 134_515_008), ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
    ("llama3-405b", 405_853_388_800),
])
def test_llama_presets_carry_their_parts_and_count_the_published_parameters(name: str, published: int) -> None:
    """The planner's model of a Llama preset counts what the model's own parameter tree holds,
    and that is the count its makers publish (GQA's k, v, SwiGLU's three matrices, RMSNorm,
    no wpe, the untied head; SmolLM2's tied)."""
    from numesh.nn.gpt import gpt_global_shapes
    from numesh.plan.command import base_config, model_spec

    cfg = base_config({}, None, name)
    model = model_spec(cfg, None, name)
    assert model.parts == formulas.Parts.of(cfg.model(model.vocab_size)) and model.parts.kv_heads in (3, 8)
    shapes = gpt_global_shapes(cfg.model(model.vocab_size))
    assert model.n_params == sum(math.prod(x) for x in tree_leaves(shapes)) == published


def test_cli_llama3_preset_json_and_table() -> None:
    """`numesh plan --model llama3-8b` lists layouts with the Llama block's memory and time,
    in JSON and as the table with the command that runs the best one; the state of a
    dp-only ZeRO-2 layout (ZeRO-0 does not fit in 80 GiB, so --json leaves it out) holds the
    8.03 B parameters whole (in the profile's itemsize), not a GPT-2 model's of the same width."""
    args = ["--ranks", "8", "--model", "llama3-8b", "--batch-size", "8", "--hardware", "h100-80gb"]
    res = invoke([*args, "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows[0]["fits"] and {r["tp"] for r in rows} == {1, 2, 4, 8}
    profile = load_profile("h100-80gb")
    plain = next(r for r in rows if r["mesh"] == "dp=8,tp=1,pp=1" and r["zero"] == 2)
    values = plain["memory"]["params"] / profile.itemsize  # every unit padded to a multiple of dp = 8
    assert 8_030_261_248 <= values < 8_030_261_248 + 8 * 33
    res = invoke([*args, "--top", "3"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 + 3 + 2 and lines[-1].startswith("best: mpirun -n 8 numesh train --mesh ")
    assert "--arch llama --n-kv-head 8 --ffn-hidden 14336 --rope-theta 500000.0" in lines[-1]
    # --json's rows name the whole command too (train_flags alone trained the default model)
    assert rows[0]["command"] == lines[-1].removeprefix("best: ")


@pytest.mark.parametrize("name", ["gpt3-1.3b", "smollm2-135m"])
def test_the_best_command_trains_the_model_planned(name: str) -> None:
    """The table's `best:` line, read by `numesh train`'s own option parsing, runs the model
    the plan priced: its sizes and parts, a GPT-3 preset's biases among them (off by default
    in train: the line once left them out) and a Llama preset's kind."""
    res = invoke(["--ranks", "4", "--model", name, "--batch-size", "4", "--hardware", "h100-80gb", "--top", "1"])
    assert res.exit_code == 0, res.output
    ranks, argv = command(res.stdout.strip().splitlines()[-1].removeprefix("best: "))
    planned = model_spec(base_config({"batch_size": 4}, None, name), None, name)
    assert ranks == 4 and ModelSpec.of(config_of(argv), planned.vocab_size) == planned


def test_the_best_command_of_a_llama_preset_with_learned_positions_has_no_rope_theta() -> None:
    """The preset's --rope-theta on the `best:` line beside --positions learned is an option
    train refuses (it would ignore it): the line leaves it out."""
    res = invoke(["--ranks", "2", "--model", "smollm2-135m", "--positions", "learned", "--batch-size", "4",
                  "--hardware", "h100-80gb", "--top", "1"])
    assert res.exit_code == 0, res.output
    best = res.stdout.strip().splitlines()[-1]
    assert "--rope-theta" not in best and "--positions learned" in best
    assert config_of(command(best.removeprefix("best: "))[1]).positions == "learned"


def test_the_best_command_of_a_recipe_trains_the_recipes_model() -> None:
    """`numesh plan --config configs/moe.toml` planned the recipe's mixture of experts, and
    its `best:` line, without the --config, trained a dense model."""
    recipe = Path(__file__).resolve().parents[1] / "configs" / "moe.toml"
    res = invoke(["--ranks", "4", "--config", str(recipe), "--vocab-size", "65", "--hardware", "h100-80gb", "--top",
                  "1"])
    assert res.exit_code == 0, res.output
    ranks, argv = command(res.stdout.strip().splitlines()[-1].removeprefix("best: "))
    trained = config_of(argv)
    assert ranks == 4 and trained.moe_experts == base_config({}, recipe, None).moe_experts > 0


def test_the_search_never_lists_a_tp_that_splits_the_kv_heads_query_groups(char_dataset: Path,
                                                                            tmp_path: Path) -> None:
    """12 query heads in 3 kv groups on 12 ranks: tp = 2 and 4 would split a group across
    ranks and `GPTConfig.validate` refuses them; tp = 3, 6 and 12 (a kv head on 1, 2 or 4
    ranks) are listed, and the listed layouts pass train's validation."""
    base = config_from(dict(data=str(char_dataset), out=str(tmp_path / "o"), arch="llama", n_layer=2, n_head=12,
                            n_kv_head=3, n_embd=48, ffn_hidden=96, block_size=16, batch_size=12))
    _, gpt = validate(base, 1)
    model = spec_of(base, gpt.vocab_size)
    listed = valid_layouts(base, model, 12)
    assert {lay.tp for lay in listed} == {1, 3, 6, 12}
    for lay in listed[::50]:
        validate(train_config(base, lay), 12)
    with pytest.raises(UserError, match="splits the 3 kv heads' query groups"):
        validate(train_config(base, Layout(3, 4, 1, 0, "1f1b", 1)), 12)


@pytest.mark.parametrize("args, match", [
    (["--ranks", "7"], "no layout of this model uses 7 ranks"),
    (["--ranks", "4", "--no-overlap"], "leave --no-overlap out"),  # once accepted and ignored
    (["--ranks", str(10**18)], "--ranks 1,000,000,000,000,000,000 is more than numesh plans for: give at most "
                               "1,048,576"),  # once minutes of silence
    (["--ranks", "2", "--memory-per-rank", "1KiB"], "no layout of this model fits in 1.0 KiB per rank"),
    (["--ranks", "2", "--hardware", "tpu-v9"], "unknown hardware profile 'tpu-v9'"),
    (["--ranks", "2", "--memory-per-rank", "lots"], "is not a finite size > 0"),
    (["--ranks", "2", "--memory-per-rank", "0"], "is not a finite size > 0"),  # once "no limit", silently
    (["--ranks", "2", "--memory-per-rank", "1e999"], "is not a finite size > 0"),
    (["--ranks", "2", "--memory-per-rank", ""], "is not a finite size > 0"),  # once the default, silently
    (["--ranks", "2", "--top", "0"], "--top must be >= 1"),
    (["--ranks", "4", "--mesh", "dp=2,tp=2"], "numesh plan searches the layout over every value of --mesh: leave it"),
    (["--ranks", "4", "--zero", "3", "--recompute", "full"],
     "searches the layout over every value of --zero, --recompute: leave them out"),
    (["--ranks", "2", "--model", ""], "unknown model preset ''"),  # once no preset, silently
    (["--ranks", "2", "--bucket-mb", "nan"], "--bucket-mb must be a finite number, got nan"),  # once a traceback
    # a model no layout runs is said as such, not as "no layout uses 2 ranks: 2 works"
    (["--ranks", "2", "--block-size", "0"], "block_size must be >= 1, got 0"),
    # options of the other mode, once ignored without a word
    (["--ranks", "2", "--profile-out", "p.json"], "--profile-out is where --calibrate saves"),
    (["--calibrate", "--ranks", "4"], "--calibrate measures the ranks of its own job"),
    (["--calibrate", "--memory-per-rank", "1GiB"], "--memory-per-rank is a limit for planning"),
    (["--calibrate", "--hardware", "a100-80gb", "--json"], "--hardware, --json are for planning, not for --calibrate"),
    (["--ranks", "2", "--model", "gpt5"], "unknown model preset 'gpt5'"),
    ([], "give --ranks N"),
])
def test_cli_bad_input_is_one_line(char_dataset: Path, args: list[str], match: str) -> None:
    res = invoke(["--data", str(char_dataset), "--hardware", "a100-80gb", "--batch-size", "12", *args])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], res.stderr


def test_cli_missing_local_profile(char_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMESH_PROFILE_DIR", str(tmp_path / "none"))
    res = invoke(["--ranks", "2", "--data", str(char_dataset)])
    assert res.exit_code == 2 and "run `numesh plan --calibrate`" in res.stderr


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_fit_predicts_the_steps_it_was_fitted_on(ranks: int) -> None:
    """Calibration fits T = in_situ·K + overhead·A with K the kernel-time prediction of a
    one-rank step; the planner must then predict exactly that T for the same step (one
    rank alone, `ranks` sharing the node), so K has to count everything the planner counts,
    the weight gradients included, and A every F and B action of the step."""
    from numesh.plan.calibrate import _kernel_time
    from numesh.plan.timing import Placement

    model = ModelSpec(4, 4, 128, 64, 65, 8)
    kernels = Measured(ranks, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), {k: ((10.0, 1e-7), (1e6, 1e-3)) for k in KERNELS}, {})
    fitted = attrs.evolve(kernels, in_situ=1.7, call_overhead_s=3e-4)
    prof = Profile(name="t", source="", itemsize=4, cores=2, measured={ranks: fitted})
    for m in (1, 2, 8):
        step = predict_time(model, Layout(1, 1, 1, 0, "1f1b", m), prof, place=Placement(ranks, True, True, True, True))
        assert step.total == pytest.approx(1.7 * _kernel_time(model, kernels, 4, m) + 3e-4 * m * 2 * model.n_layer)
        split = block_cost(model, Layout(1, 1, 1, 0, "1f1b", m), attrs.evolve(prof, measured={ranks: kernels}),
                           Placement(ranks, True, True, True, True), False)
        assert split.w > 0  # the weight gradients are real work, inside K
        assert _kernel_time(model, kernels, 4, m) > m * model.n_layer * (split.f + split.b)


def test_rmsnorm_and_swiglu_are_priced_by_their_own_kernels(char_dataset: Path, tmp_path: Path) -> None:
    """A Llama block's norms and activation take the calibrated `rmsnorm_*` and `swiglu_*`
    times (a GPT-2 block's do not); a profile calibrated before those kernels were prices
    them as LayerNorm's and GELU's, as the planner did then."""
    common = dict(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=2, n_head=4, n_embd=64, block_size=16,
                  batch_size=4)
    llama, gpt = config_from(dict(common, arch="llama", n_kv_head=2)), config_from(common)
    place, lay = Placement(1, True, True, True, True), Layout(1, 1, 1, 0, "1f1b", 1)

    def cost(cfg: TrainConfig, slow: tuple[str, ...], kernels: tuple[str, ...] = KERNELS) -> float:
        times = {k: ((10.0, 1e-7), (1e6, (1.0 if k in slow else 1e-3))) for k in kernels}
        prof = Profile(name="t", source="", itemsize=4, cores=2,
                       measured={1: Measured(1, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), times, {})})
        c = block_cost(spec_of(cfg, 65), lay, prof, place, False)
        return c.f + c.b

    new = ("rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd")
    old = ("layernorm_fwd", "layernorm_bwd", "gelu_fwd", "gelu_bwd")
    assert cost(llama, new) > 5 * cost(llama, ())
    assert cost(llama, old) == pytest.approx(cost(llama, ()))
    assert cost(gpt, new) == pytest.approx(cost(gpt, ()))
    before = tuple(k for k in KERNELS if k not in new)  # an older calibration: no Llama kernels
    assert cost(llama, old, before) > 5 * cost(llama, (), before)


def _measured_profile(ranks: int, **fit) -> Profile:
    curve = ((8.0, 5e-6), (1e6, 1e-4), (1e8, 1e-2))
    meas = Measured(ranks, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), {k: ((10.0, 1e-7), (1e6, 1e-3)) for k in KERNELS},
                    {f"all_reduce:{g}": curve for g in (2, 4) if ranks % g == 0} | {"send": curve}, **fit)
    return Profile(name="t", source="", itemsize=4, cores=2, measured={ranks: meas})


def test_blocking_calls_are_counted_where_ranks_wait_for_each_other() -> None:
    """`blocking_calls` counts the collectives and ring hops of a step (not pipeline sends,
    whose waits the schedule's simulation already holds): tp's four all-reduces per block
    and micro-batch, more with sp, dp's few buckets, cp's hops even when their transfer
    hides behind attention."""
    from numesh.plan.timing import blocking_calls

    model = ModelSpec(4, 4, 128, 64, 65, 16)
    prof = _measured_profile(2)
    place = Placement(2, True, True, True, True)
    calls = lambda lay: blocking_calls(model, lay, prof, place)  # noqa: E731
    assert calls(Layout(1, 1, 1, 0, "1f1b", 1)) == pytest.approx(0.0, abs=1e-6)
    tp1, tp2 = calls(Layout(1, 2, 1, 0, "1f1b", 1)), calls(Layout(1, 2, 1, 0, "1f1b", 2))
    # per micro-batch: blocks, lookup, head, 2 in the loss
    assert tp2 - tp1 == pytest.approx(4 * model.n_layer + 4, abs=1e-3)
    assert calls(Layout(1, 2, 1, 0, "1f1b", 1, sp=True)) > tp1
    dp = calls(Layout(2, 1, 1, 0, "1f1b", 1))
    assert 1 <= dp <= 5  # buckets of gradients, the loss and the norm
    assert calls(Layout(2, 1, 1, 3, "1f1b", 1)) > dp + 2 * model.n_layer  # ZeRO-3 gathers each block in F and B
    assert calls(Layout(1, 1, 1, 0, "1f1b", 1, cp=2)) >= 2 * model.n_layer  # a hop per block forward and backward
    assert calls(Layout(1, 1, 2, 0, "1f1b", 4)) == pytest.approx(3.0)  # tied embedding, loss, norm: no sends


@pytest.mark.parametrize("sync_s, sync_share, bound", [(1e-4, 10.0, "calls"), (10.0, 0.05, "compute")])
def test_the_wait_is_the_smaller_of_per_call_and_per_compute(sync_s: float, sync_share: float, bound: str) -> None:
    from numesh.plan.timing import blocking_calls

    model = ModelSpec(4, 4, 128, 64, 65, 16)
    lay, place = Layout(1, 2, 1, 0, "1f1b", 2), Placement(2, True, True, True, True)
    bare = predict_time(model, lay, _measured_profile(2), place=place)
    fitted = predict_time(model, lay, _measured_profile(2, sync_s=sync_s, sync_share=sync_share), place=place)
    calls = blocking_calls(model, lay, _measured_profile(2), place)
    want = sync_s * calls if bound == "calls" else sync_share * bare.compute
    assert fitted.comm["wait"] == pytest.approx(want, rel=1e-6) and bare.comm["wait"] == 0.0
    assert fitted.total == pytest.approx(bare.total + want, rel=1e-9)


def test_a_profile_keeps_its_fitted_waits_and_not_the_probe(tmp_path: Path) -> None:
    prof = _measured_profile(2, sync_s=2e-4, sync_share=0.1)
    prof = attrs.evolve(prof, measured={2: attrs.evolve(prof.measured[2], call_probe_s=1.0)})
    save_profile(prof, tmp_path / "p.json")
    assert "call_probe_s" not in (tmp_path / "p.json").read_text()
    back = load_profile(str(tmp_path / "p.json")).measured[2]
    assert (back.sync_s, back.sync_share, back.call_probe_s) == (2e-4, 0.1, 0.0)


def test_the_table_shows_waits_only_where_the_profile_has_them() -> None:
    from numesh.plan.render import table

    model = ModelSpec(4, 4, 128, 64, 65, 16)
    lays = [Layout(2, 1, 1, 0, "1f1b", 1), Layout(1, 2, 1, 0, "1f1b", 1)]
    for fit, shown in (({}, False), ({"sync_s": 1e-4, "sync_share": 0.1}, True)):
        prof = _measured_profile(2, **fit)
        preds = [predict(model, lay, prof, 0, 4) for lay in lays]
        head = table(Plan(preds, len(preds)), 2, 5, 0, "t").splitlines()[0].split()
        assert ("wait" in head) == shown
        for p in preds:  # the step is the sum of its parts, the wait among them
            assert (p.time.comm["wait"] > 0) == shown
            assert p.time.total == pytest.approx(p.time.compute + sum(p.time.comm.values()) + p.time.bubble
                                                 + p.time.optimizer, rel=1e-12)


def test_the_table_shows_every_part_of_the_step() -> None:
    """comm_other (the tied embedding's gradient summed across pp, the loss's and norm's
    scalar all-reduces) was in the step but in no column: the columns did not add up to it."""
    from numesh.plan.render import human_seconds, table

    prof = load_profile("a100-80gb")
    pred = predict(ModelSpec(4, 4, 128, 64, 65, 16), Layout(1, 1, 2, 0, "1f1b", 2), prof, 0, prof.itemsize)
    head, row = (re.split(r"\s{2,}", line.strip()) for line in table(Plan([pred], 1), 2, 1, 0, "t").splitlines()[:2])
    cells = dict(zip(head, row))
    assert pred.time.comm["other"] > 0 and cells["other"] == human_seconds(pred.time.comm["other"])
    assert {k for k, v in pred.time.comm.items() if v} <= set(head)  # each part of the step that is not 0


@pytest.mark.parametrize("ranks, kind", [(1, {}), (2, {}), (4, {}), (8, {}), (4, dict(arch="llama", n_kv_head=2))])
def test_calibration_collects_every_gemm_shape_the_time_model_asks_for(ranks: int, kind: dict, tmp_path: Path) -> None:
    """`model_gemm_shapes` runs the time model on a stand-in profile that records GEMM shapes
    (cp layouts among them from 2 ranks on); every shape predict_time then asks a profile
    calibrated for those ranks is one that calibration measured: a Llama model's q, k, v
    and SwiGLU GEMMs too."""
    from numesh.plan.calibrate import model_gemm_shapes

    base = config_from(dict(data=str(tmp_path), n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16,
                            **kind))
    model = ModelSpec.of(base, 65)
    shapes = model_gemm_shapes(base, model, ranks, 4)
    asked: set = set()

    class Asking(Profile):
        def gemm_time(self, b: int, m: int, k: int, n: int, ranks_on_node: int) -> float:
            asked.add((b, m, k, n))
            return super().gemm_time(b, m, k, n, ranks_on_node)

    prof = Asking(**{f.name: getattr(_measured_profile(ranks), f.name) for f in attrs.fields(Profile)})
    lays = valid_layouts(base, model, ranks)
    assert ranks == 1 or any(lay.cp > 1 for lay in lays)
    for lay in lays:
        predict_time(model, lay, prof)
    assert asked and asked <= shapes


def test_the_wait_fit_takes_the_machine_speed_out() -> None:
    """`sync_from_step`: fit_sync scales the prediction by how the one-rank step now compares
    with its fit, so a machine running 2x slower during the mesh step is not read as waits."""
    from numesh.plan.calibrate import sync_from_step

    pred, compute, calls = 0.040, 0.036, 20
    assert sync_from_step(0.080, 2 * pred, compute, calls) == (0.0, 0.0)  # all of it the drift
    q, r = sync_from_step(0.082, 2 * pred, compute, calls)
    assert q == pytest.approx(0.002 / calls) and r == pytest.approx(0.002 / compute)
    assert sync_from_step(0.030, pred, compute, calls) == (0.0, 0.0)  # faster than predicted: no negative wait
    assert sync_from_step(0.050, pred, compute, 0) == (0.0, 0.0)  # nothing to spread it over


def _calibrated(counts: tuple[int, ...]) -> Profile:
    """A measured profile as `--calibrate` runs on each of `counts` ranks leave it (one rank times no collectives)."""
    profiles = [_measured_profile(n) for n in counts]
    measured = {n: attrs.evolve(p.measured[n], collectives={} if n == 1 else p.measured[n].collectives)
                for n, p in zip(counts, profiles)}
    return attrs.evolve(profiles[0], name="local", measured=measured)


def test_a_one_rank_calibration_plans_more_ranks_in_one_line(char_dataset: Path, tmp_path: Path) -> None:
    """`numesh plan --calibrate` on one process times no communication: planning 2 ranks on
    it said `ValueError: min() arg is an empty sequence`; now one line saying how to calibrate."""
    path = save_profile(_calibrated((1,)), tmp_path / "local.json")
    for ranks in ("2", "8"):
        res = invoke(["--ranks", ranks, "--data", str(char_dataset), "--hardware", str(path)])
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1, res.output
        assert lines[0].startswith("error: hardware profile local was calibrated on one rank, which times no "
                                   f"communication: to plan for {ranks} ranks") and "mpirun -n " in lines[0]
    assert invoke(["--ranks", "1", "--data", str(char_dataset), "--hardware", str(path)]).exit_code == 0


def test_plan_says_when_it_extrapolates_other_rank_counts(char_dataset: Path, tmp_path: Path) -> None:
    """Calibrated on 1 and 2 ranks: 2 ranks are measured (no note), 4 and 16 take compute and
    communication from the 2-rank measurement, and say so; a 1-rank measurement beside a
    4-rank one times 2 ranks' communication with the 4-rank collectives."""
    path = save_profile(_calibrated((1, 2)), tmp_path / "local.json")
    args = ["--data", str(char_dataset), "--hardware", str(path), "--top", "1"]
    res = invoke(["--ranks", "2", *args])
    assert res.exit_code == 0 and "note:" not in res.stderr, res.output
    for ranks in ("4", "16"):
        res = invoke(["--ranks", ranks, *args])
        assert res.exit_code == 0, res.output
        assert (f"note: profile local was calibrated with 1 and 2 ranks, not {ranks}: compute is scaled from the "
                "2-rank measurement; communication is extrapolated from the 2-rank one") in res.stderr
    assert _calibrated((1, 4)).comm_measurement(2).ranks == 4


def test_a_profile_that_is_not_a_json_object_is_one_line(char_dataset: Path, tmp_path: Path) -> None:
    """A binary file was a UnicodeDecodeError traceback; [] read as 'missing name and source'."""
    for content, says in ((b"\xff\xfe", "is not valid JSON: 'utf-8' codec"), (b"[]", "is not a JSON object")):
        (tmp_path / "hw.json").write_bytes(content)
        res = invoke(["--ranks", "2", "--data", str(char_dataset), "--hardware", str(tmp_path / "hw.json")])
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and says in lines[0], res.output


@pytest.mark.parametrize("entry, says", [
    ('"peak_flops": "abc"', "peak_flops must be a finite number >= 0, got 'abc'"),  # was a TypeError in the plan
    ('"peak_flops": NaN', "peak_flops must be a finite number >= 0, got nan"),
    ('"gemm_efficiency": 0', "gemm_efficiency must be a finite number > 0, got 0"),
    ('"intra": {"latency_s": 1e-6, "bandwidth": 0}', "intra.bandwidth must be a finite number > 0, got 0"),
])
def test_a_hand_written_profile_with_a_bad_number_is_one_line(char_dataset: Path, tmp_path: Path, entry: str,
                                                              says: str) -> None:
    base = {"name": "x", "source": "by hand", "peak_flops": 1e12, "mem_bandwidth": 1e12}
    text = json.dumps(base)[:-1] + ", " + entry + "}"  # a later key wins
    (tmp_path / "hw.json").write_text(text)
    res = invoke(["--ranks", "2", "--data", str(char_dataset), "--hardware", str(tmp_path / "hw.json")])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and lines == [f"error: hardware profile {tmp_path / 'hw.json'}: {says}"], res.output


# ---------------------------------------------------------------------------------------
# experts: ep layouts, their memory and the all-to-all's price


def moe_model(**kw: int) -> ModelSpec:
    return ModelSpec(**{**dict(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=65, batch_size=16,
                               moe_experts=8, moe_top_k=2), **kw})


def test_moe_parameters_per_rank_follow_ep_and_tp() -> None:
    """An MoE block holds the router and E/ep experts, each tp-split; ep = tp = 1 is
    `formulas.moe_block_params`, and the model's parameters the sum over its blocks."""
    from numesh.plan.memory import moe_block_rank_params

    C, E = 64, 8
    for bias in (False, True):
        assert moe_block_rank_params(C, E, 1, 1, bias) == formulas.moe_block_params(C, E, bias)
        for ep, tp in ((2, 1), (4, 2), (8, 4)):
            dense = formulas.block_params(C, tp, bias)
            expert = 8 * C * C // tp + ((4 * C // tp + C) if bias else 0)  # one expert, tp-split as the dense MLP
            # a dense block with its MLP swapped for the router and E/ep of the MLPs
            assert moe_block_rank_params(C, E, ep, tp, bias) == dense + C * E + (E // ep - 1) * expert
    model = moe_model(moe_every=2)
    one = rank_memory(model, Layout(2, 1, 1, 1, "1f1b", 1), 0)
    two = rank_memory(model, Layout(1, 1, 1, 1, "1f1b", 1, ep=2), 0)
    expert = formulas.expert_params(64)
    assert one.params - two.params == 2 * 4 * expert * 4  # 2 MoE blocks lose 4 of their 8 experts (float32)
    assert two.optimizer == 2 * two.params  # ZeRO shards over dp (1 here), never over ep
    outer = 65 * 64 + 64 * 64 + 64
    assert model.n_params == 2 * formulas.block_params(64) + 2 * formulas.moe_block_params(64, 8) + outer
    assert model.flops_per_token == formulas.flops_per_token(4, 64, 64, formulas.active_params(
        model.n_params, 64, 2, 8, 2))


def test_all_to_all_price_is_the_hand_computation() -> None:
    """Per MoE layer and micro-batch, forward: the counts (E int64) and the N·k rows there and
    back; backward: the rows both ways again; each call (ep-1) latencies and (ep-1)/ep of its
    buffer over the link (a spec-sheet profile, the ep group inside a node)."""
    from numesh.plan.timing import all_to_all_time

    prof = synthetic_profile()
    model = moe_model()
    lay = Layout(1, 1, 1, 0, "1f1b", 2, ep=4)
    place = placement(lay, prof)
    assert place.ep_intra
    n = 16 // 4 // 2 * 64  # rows of a micro-batch on this rank x tokens
    rows = n * 2 * 64 * 4  # N·k rows of C float32 values
    a, beta = prof.intra.latency_s, prof.intra.bandwidth
    call = lambda s: 3 * a + 3 / 4 * s / beta  # noqa: E731
    fwd, bwd = all_to_all_time(model, lay, prof, place)
    assert fwd == pytest.approx(call(8 * 8) + 2 * call(rows), rel=1e-12)
    assert bwd == pytest.approx(2 * call(rows), rel=1e-12)
    # the bytes it sends are those formulas counts for a uniform routing (each rank N·k/ep to each)
    uniform = [n * 2 // 4] * 4
    sent = 4 * 3 / 4 * rows + 3 * 2 * 8  # 4 row calls, each (ep-1)/ep of the buffer; counts to 3 ranks
    assert formulas.moe_all_to_all_bytes(uniform, uniform, 0, 64, 8, 4) == sent
    rerun = 6 * 3 / 4 * rows + 2 * 3 * 2 * 8  # full recomputation: the forward's calls once more
    assert formulas.moe_all_to_all_bytes(uniform, uniform, 0, 64, 8, 4, "full") == rerun
    # in the step: every MoE block's F and B, once more with full recomputation, on the ep axis
    blocks = 4 * 2  # blocks x micro-batches
    t = predict_time(model, lay, prof)
    ep_sum = t.comm["ep"] - blocks * (fwd + bwd)
    assert ep_sum > 0  # the ep all-reduce of the non-expert gradients, once a step
    full = predict_time(model, attrs.evolve(lay, recompute="full"), prof)
    assert full.comm["ep"] - ep_sum == pytest.approx(blocks * (2 * fwd + bwd), rel=1e-9)
    assert predict_time(model, Layout(4, 1, 1, 1, "1f1b", 2), prof).comm["ep"] == 0.0
    # a calibrated profile prices each call from the measured all-reduce curve of the ep group
    # size, halved (ep-1 steps of 1/ep of the buffer, as an all-gather), plus the probe
    meas = _measured_profile(4)
    m_fwd, m_bwd = all_to_all_time(model, lay, meas, placement(lay, meas))
    curve = meas.measured[4].collectives["all_reduce:4"]
    assert m_bwd == pytest.approx(2 * costs.interp_time(curve, rows) / 2, rel=1e-12)
    assert m_fwd == pytest.approx(m_bwd + costs.interp_time(curve, 64) / 2, rel=1e-12)


def test_search_enumerates_ep_only_for_experts_that_it_divides() -> None:
    moe = {lay.ep for lay in candidates(moe_model(), 8)}
    assert moe == {1, 2, 4, 8}
    assert {lay.ep for lay in candidates(moe_model(moe_experts=6), 8)} == {1, 2}
    assert {lay.ep for lay in candidates(moe_model(moe_experts=0), 8)} == {1}  # a dense model: never ep > 1
    assert all(lay.ranks == 8 and 16 % (lay.dp * lay.ep * lay.micro_batches) == 0 for lay in candidates(moe_model(), 8))


def test_cli_plans_ep_layouts_with_their_all_to_all(char_dataset: Path) -> None:
    args = ["plan", "--data", str(char_dataset), "--ranks", "4", "--n-layer", "2", "--n-head", "4", "--n-embd", "32",
            "--block-size", "32", "--batch-size", "8", "--hardware", "a100-80gb"]
    rows = json.loads(CliRunner().invoke(app, args + ["--moe-experts", "4", "--json"]).stdout)
    ep = [r for r in rows if r["ep"] > 1]
    assert ep and all("ep=" in r["mesh"] and r["time"]["comm_ep"] > 0 for r in ep)
    assert {r["ep"] for r in rows} == {1, 2, 4}
    dense = json.loads(CliRunner().invoke(app, args + ["--json"]).stdout)
    assert {r["ep"] for r in dense} == {1} and all(r["time"]["comm_ep"] == 0 for r in dense)
    table = CliRunner().invoke(app, args + ["--moe-experts", "4", "--top", "400"]).stdout
    assert "  ep  " in table and "ep=2" in table
    bad = CliRunner().invoke(app, args + ["--moe-experts", "4", "--moe-top-k", "5"])
    assert bad.exit_code != 0 and len(bad.output.strip().splitlines()) == 1


def test_the_fit_check_counts_e_over_ep_experts(char_dataset: Path) -> None:
    """`numesh train --mesh ep=N`'s memory check holds E/ep experts per rank (it held all E)."""
    from numesh.plan.fits import run_memory

    cfg = TrainConfig(data=str(char_dataset), n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=8,
                      moe_experts=8)
    shape = {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1}
    one = run_memory(cfg, shape, 65, 1)
    four = run_memory(cfg, {**shape, "ep": 4}, 65, 1)
    assert one.params - four.params == 2 * 6 * formulas.expert_params(64) * 4
    assert four.activations < one.activations  # a quarter of the batch's rows on each rank


@pytest.mark.parametrize("n", [1000 * 2**30, 1.5 * 2**50, 3 * 2**60, 5 * 2**20])
def test_memory_per_rank_reads_back_what_plan_prints(n: float) -> None:
    """`plan` tells a model that fits nowhere to pass a --memory-per-rank above what it
    printed: that text must parse (PiB and EiB, and 1000.0 GiB, once failed)."""
    from numesh.plan.command import parse_bytes
    from numesh.plan.render import human_bytes

    text = human_bytes(n)
    assert parse_bytes(text) == pytest.approx(n, rel=1e-3), text


def test_available_memory_without_proc_is_the_machines_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without /proc/meminfo (macOS) train's memory check was skipped; it now checks the
    run against the machine's RAM (a container limit still caps it on Linux)."""
    import builtins

    from numesh.plan import fits

    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path) == "/proc/meminfo":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(fits, "_CGROUP_LIMITS", ())
    assert fits.available_memory() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_best_command_says_an_option_given_over_a_preset_once() -> None:
    """`--model smollm2-135m --n-kv-head 1 --batch-size 4`: the `best:` line said the
    preset's --n-kv-head 3 and then the given 1 (and the batch twice); each once now, as
    given, and train reads the line as the model planned."""
    res = invoke(["--ranks", "2", "--model", "smollm2-135m", "--n-kv-head", "1", "--batch-size", "4",
                  "--hardware", "h100-80gb", "--top", "1"])
    assert res.exit_code == 0, res.output
    best = res.stdout.strip().splitlines()[-1]
    assert best.count("--n-kv-head") == 1 and "--n-kv-head 1" in best
    assert best.count("--batch-size") == 1 and "--batch-size 4" in best
    assert config_of(command(best.removeprefix("best: "))[1]).n_kv_head == 1


def test_the_best_command_of_a_recipe_overrides_the_recipes_layout(tmp_path: Path) -> None:
    """A recipe's sequence parallelism, recompute and virtual stages were left to the
    recipe: the `best:` line of a dp=2 layout then failed (sp on tp=1) or trained another
    layout than the one planned. The line now sets each, defaults too; and a path in it is
    shell-quoted."""
    recipe = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
    text = recipe.read_text().replace("sequence_parallel = false", "sequence_parallel = true")
    text = text.replace('mesh = ""', 'mesh = "tp=2"').replace('recompute = "none"', 'recompute = "full"')
    mine = tmp_path / "my recipe.toml"
    mine.write_text(text)
    res = invoke(["--ranks", "2", "--config", str(mine), "--vocab-size", "65", "--hardware", "h100-80gb", "--top", "1"])
    assert res.exit_code == 0, res.output
    best = res.stdout.strip().splitlines()[-1]
    assert f"--config '{mine}'" in best
    row = res.stdout.strip().splitlines()[1].split()
    ranks, argv = command(best.removeprefix("best: "))
    trained = config_of(argv)
    assert (trained.sequence_parallel, trained.recompute, trained.virtual_stages) == \
        (row[2] == "yes", row[7], int(row[6]))


def test_small_plan_messages_say_what_is_wrong() -> None:
    """'on 1 ranks'; a unit plan cannot read was only 'not a finite size > 0'; one expert
    blamed a top-k the user never gave."""
    res = invoke(["--ranks", "1", "--vocab-size", "65", "--hardware", "h100-80gb", "--top", "1"])
    assert res.exit_code == 0 and " layouts on 1 rank (" in res.stdout, res.output
    res = invoke(["--ranks", "2", "--vocab-size", "65", "--hardware", "h100-80gb", "--memory-per-rank", "4G"])
    assert "one of the units B, KB, MB, GB" in res.output
    res = invoke(["--ranks", "2", "--vocab-size", "65", "--hardware", "h100-80gb", "--moe-experts", "1"])
    assert "got 2 (the default): give at least 2 experts or moe_top_k 1" in res.output
