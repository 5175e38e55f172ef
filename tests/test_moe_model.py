"""The GPT with MoE blocks on one rank: its gradient against finite differences (through
the router losses), full recomputation, the KV cache, its parameter tree and the formulas
for its parameters and FLOPs."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from conftest import random_global_params, self_mesh, tiny_config
from numesh.base.errors import CheckpointError, ConfigError
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.nn import moe as M
from numesh.nn.gpt import ARCHS, MLP, gpt_global_shapes
from numesh.nn.layers import Linear
from numesh.nn.moe import MoE, MoEConfig
from numesh.nn.walk import ResidentParams, loss_and_grads, stage_forward, whole_model
from numesh.perf import formulas
from numesh.run.config import check_layout, config_from
from numesh.run.train import flops_per_token
from test_layers import _batch, _entries, assert_fd, fd_grad
from test_moe import make_moe

MOE = dict(moe_experts=3, moe_top_k=2, moe_every=2, moe_aux_coef=0.2, moe_z_coef=0.05)


def _objective(params, idx, tgt, cfg, scale: float, recompute: str = "none") -> tuple[float, tuple]:
    """The training objective (mean token loss plus every MoE block's aux and z loss) and the stats."""
    loss, ctx = stage_forward(ResidentParams(params), whole_model(cfg.n_layer), idx, tgt, cfg, self_mesh(),
                              recompute=recompute)
    return float(loss.sum()) * scale + sum(s.aux_sum / s.sequences + s.z_sum / s.positions for s in ctx.moe), ctx.moe


def assert_grads_match_fd(cfg, seed: int, rng: np.random.Generator):
    """`loss_and_grads` of `cfg`'s model with experts (random parameters of `seed`) against
    finite differences of the whole objective, the router losses included, at 4 entries of
    every leaf; returns the parameters."""
    params = random_global_params(cfg, seed=seed)
    idx, tgt = _batch(cfg, rng)
    scale = 1.0 / idx.size
    _, grads = loss_and_grads(params, idx, tgt, cfg, self_mesh(), scale)

    def f() -> float:
        return _objective(params, idx, tgt, cfg, scale)[0]

    for (path, p), g in zip(tree_leaves_with_path(params), tree_leaves(grads)):
        assert g.shape == p.shape, path
        entries = _entries(p.shape, rng, 4)
        assert_fd(g, fd_grad(f, p, entries), path, entries)
    return params


@pytest.mark.parametrize("top_k", [1, 2])
def test_gpt_with_experts_grads_match_finite_differences(top_k: int) -> None:
    cfg = tiny_config(n_layer=3, **{**MOE, "moe_top_k": top_k})
    params = assert_grads_match_fd(cfg, 2, np.random.default_rng(8))
    assert [type(b.mlp) for b in params.blocks] == [MoE, MLP, MoE]  # blocks 0 and 2 (every 2nd)


def test_full_recomputation_gives_the_same_bits() -> None:
    cfg = tiny_config(n_layer=2, **MOE)
    params = random_global_params(cfg, seed=3)
    idx, tgt = _batch(cfg, np.random.default_rng(1))
    a = loss_and_grads(params, idx, tgt, cfg, self_mesh(), 0.1)
    b = loss_and_grads(params, idx, tgt, cfg, self_mesh(), 0.1, recompute="full")
    assert a[0] == b[0]
    for x, y in zip(tree_leaves(a[1]), tree_leaves(b[1])):
        assert np.array_equal(x, y)
    stats = _objective(params, idx, tgt, cfg, 0.1, "full")[1]
    assert len(stats) == 1 and stats[0].tokens.sum() == idx.size * 2


def test_kv_cache_logits_match_the_training_forward_with_experts() -> None:
    from numesh.nn.decode import logits_cached, new_kv_cache
    from test_layers import _full_logits

    cfg = tiny_config(**MOE)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=4)
    idx = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, cfg.block_size))
    want = _full_logits(params, idx, cfg, mesh)
    cache = new_kv_cache(cfg, mesh, 2, np.float64)
    np.testing.assert_allclose(logits_cached(params, idx[:, :3], cache, cfg, mesh), want[:, 2], rtol=1e-12, atol=1e-13)
    for t in range(3, cfg.block_size):
        got = logits_cached(params, idx[:, t : t + 1], cache, cfg, mesh)
        np.testing.assert_allclose(got, want[:, t], rtol=1e-12, atol=1e-13)


def test_sampling_a_model_with_a_capacity_runs_it_dropless() -> None:
    """A generated token cannot see its successors, which a capacity ranks: `generate`
    samples the dropless model, with and without the KV cache, token for token."""
    from numesh.run.sample import generate

    cfg = tiny_config(**MOE, moe_capacity_factor=0.25)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=4, scale=1.0)
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 5))
    runs = [generate(params, m, mesh, prompt, 12, temperature=0.0, top_k=None, kv_cache=kv)
            for m, kv in ((cfg, True), (cfg, False), (attrs.evolve(cfg, moe_capacity_factor=0.0), False))]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[1], runs[2])


def test_parameter_tree_dense_and_with_experts() -> None:
    dense = tiny_config()
    assert tiny_config(moe_experts=0, moe_top_k=7, moe_every=3).moe_blocks == 0
    assert [p for p, _ in tree_leaves_with_path(gpt_global_shapes(dense))] == \
        [p for p, _ in tree_leaves_with_path(gpt_global_shapes(tiny_config(moe_experts=0)))]
    shapes = dict(tree_leaves_with_path(gpt_global_shapes(tiny_config(moe_experts=4, n_embd=8))))
    assert shapes["blocks.0.mlp.router.w"] == (8, 4)
    assert shapes["blocks.0.mlp.fc.w"] == (4, 8, 32) and shapes["blocks.0.mlp.fc.b"] == (4, 32)
    assert shapes["blocks.1.mlp.proj.w"] == (4, 32, 8) and shapes["blocks.1.mlp.proj.b"] == (4, 8)


@pytest.mark.parametrize("overrides, match", [
    (dict(moe_experts=-1), "moe_experts must be >= 0"),
    (dict(moe_experts=4, moe_top_k=5), "moe_top_k must be between 1 and moe_experts=4"),
    (dict(moe_experts=4, moe_top_k=0), "moe_top_k must be between 1"),
    (dict(moe_experts=4, moe_every=0), "moe_every must be >= 1"),
    (dict(moe_experts=4, moe_aux_coef=-1.0), "moe_aux_coef must be >= 0"),
    (dict(moe_experts=4, moe_capacity_factor=-1.0), "moe_capacity_factor must be finite and >= 0 \\(0 = dropless\\)"),
    (dict(moe_experts=4, moe_capacity_factor=math.inf), "moe_capacity_factor must be a finite number, got inf"),
    (dict(moe_experts=4, moe_capacity_factor=math.nan), "moe_capacity_factor must be a finite number, got nan"),
])
def test_bad_moe_settings_are_one_line_errors(overrides: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        tiny_config(**overrides).validate(1)
    if "moe_capacity_factor" in overrides:  # one line through the CLI's config too (which refuses inf and nan itself)
        with pytest.raises(ConfigError, match="moe.capacity.factor must be") as e:
            check_layout(config_from({"moe_experts": 4, "moe_capacity_factor": overrides["moe_capacity_factor"]}),
                         1, 65)
        assert "\n" not in str(e.value)


def test_export_refuses_experts_in_either_format() -> None:
    from numesh.checkpoint.export import to_nanogpt
    from numesh.checkpoint.hf import to_hf

    cfg = tiny_config(moe_experts=2)
    params = random_global_params(cfg, seed=1)
    with pytest.raises(CheckpointError, match="mixture of experts .* nanoGPT's format cannot hold"):
        to_nanogpt(params, cfg)
    with pytest.raises(CheckpointError, match="transformers has no model class for it: .* gated SiLU experts"):
        to_hf(params, cfg)


# ---------------------------------------------------------------------------------------
# formulas


# Mixtral's block with a narrower SwiGLU (F = 12, not 4C) and grouped-query attention: 2 query heads, 1 kv head
MIXTRAL = dict(ARCHS["llama"], n_kv_head=1, ffn_hidden=12, norm_eps=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
@pytest.mark.parametrize("bias", [True, False])
def test_parameter_formulas_equal_the_tree(bias: bool, kind: str) -> None:
    cfg = tiny_config(n_layer=3, bias=bias, **MOE, **(MIXTRAL if kind == "mixtral" else {}))
    parts = formulas.Parts.of(cfg)
    assert (parts == formulas.GPT2) == (kind == "gpt2")
    shapes = gpt_global_shapes(cfg)
    sizes = [sum(math.prod(s) for s in tree_leaves(b)) for b in shapes.blocks]
    C, E = cfg.n_embd, cfg.moe_experts
    assert sizes == [formulas.moe_block_params(C, E, bias, parts), formulas.block_params(C, 1, bias, parts),
                     formulas.moe_block_params(C, E, bias, parts)]
    expert = sum(math.prod(s[1:]) for s in tree_leaves(attrs_mlp_experts(shapes.blocks[0].mlp)))
    assert expert == formulas.expert_params(C, bias, 1, parts)
    total = sum(math.prod(s) for s in tree_leaves(shapes))
    active = formulas.active_params(total, C, cfg.moe_blocks, E, cfg.moe_top_k, bias, parts)
    assert total - active == 2 * (E - cfg.moe_top_k) * expert
    counted = formulas.counted_params(active, cfg.vocab_size, C, parts)  # an untied wte is looked up: not counted
    assert counted == active - (0 if kind == "gpt2" else cfg.vocab_size * C)
    assert flops_per_token(cfg, total) == formulas.flops_per_token(cfg.n_layer, C, cfg.block_size, counted)
    dense = tiny_config(bias=bias)
    n_dense = sum(math.prod(s) for s in tree_leaves(gpt_global_shapes(dense)))
    assert flops_per_token(dense, n_dense) == formulas.flops_per_token(dense.n_layer, C, dense.block_size, n_dense)


def attrs_mlp_experts(mlp: MoE) -> list:
    """The experts' leaves of an MoE's shapes (router left out)."""
    gate = () if mlp.gate is None else (mlp.gate.w, mlp.gate.b)
    return [x for x in (mlp.fc.w, mlp.fc.b, mlp.proj.w, mlp.proj.b, *gate) if x is not None]


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_flops_formula_equals_the_matmuls_run(monkeypatch: pytest.MonkeyPatch, top_k: int, gated: bool) -> None:
    """Every matmul of the layer's forward and backward counted (2·m·k·n each): GELU
    experts of F = 4C, and SwiGLU experts of F = 12 (a gate beside fc)."""
    counted = [0.0]
    real_gemm, real_matmul = M._gemm, M.matmul

    def gemm(a, b, out):
        counted[0] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        real_gemm(a, b, out)

    def matmul(a, b):
        counted[0] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        return real_matmul(a, b)

    monkeypatch.setattr(M, "_gemm", gemm)
    monkeypatch.setattr(M, "matmul", matmul)
    rng = np.random.default_rng(0)
    C, E, N, F = 8, 4, 50, 12
    p = make_moe(rng, C, E, True)
    parts = formulas.GPT2
    if gated:
        p = MoE(router=p.router, fc=Linear(rng.standard_normal((E, C, F)), rng.standard_normal((E, F))),
                proj=Linear(rng.standard_normal((E, F, C)), p.proj.b),
                gate=Linear(rng.standard_normal((E, C, F)), rng.standard_normal((E, F))))
        parts = formulas.Parts(hidden=F, gated=True)
    cfg = MoEConfig(E, top_k, 0.1, 0.1, gated=gated)
    mesh = self_mesh()
    y, ctx = M.moe_fwd(p, rng.standard_normal((5, N // 5, C)), cfg, mesh)
    M.moe_bwd(p, ctx, y, cfg, mesh, 1.0 / N)
    assert counted[0] == N * formulas.moe_mlp_flops_per_token(C, E, top_k, parts)


@pytest.mark.parametrize("kind", ["gpt2", "mixtral"])
@pytest.mark.parametrize("capacity", [0.0, 1.0], ids=["dropless", "cap1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_moe_block_activation_bytes_equal_the_formula(recompute: str, dtype, capacity: float, kind: str) -> None:
    """What an MoE block's forward keeps (`held_bytes` of its context) equals
    `formulas.moe_activation_parts` given the rows it sent and received; under full
    recomputation its input and stats; the dense blocks beside it keep what they did.
    Mixtral's block (SwiGLU experts, GQA, rotary) also holds the rotary tables, once."""
    from numesh.base.tree import held_bytes
    from numesh.nn.gpt import init_gpt

    cfg = tiny_config(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11,
                      **{**MOE, "moe_capacity_factor": capacity, **(MIXTRAL if kind == "mixtral" else {})})
    mesh = self_mesh()
    params = init_gpt(cfg, mesh, seed=0, dtype=dtype)
    rows = 4
    rng = np.random.default_rng(2)
    idx = rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    _, ctx = stage_forward(ResidentParams(params), whole_model(cfg.n_layer), idx, idx, cfg, mesh, recompute=recompute)
    q = np.dtype(dtype).itemsize
    (stats,) = ctx.moe
    assert (sum(stats.send) < rows * cfg.block_size * 2) == (capacity > 0)  # the capacity drops some
    shape = formulas.ActivationShape(rows, cfg.block_size, cfg.n_embd, cfg.n_head, recompute=recompute, itemsize=q,
                                     parts=formulas.Parts.of(cfg))
    want = formulas.moe_activation_parts(
        shape, formulas.ExpertShape(cfg.moe_experts, cfg.moe_top_k, capacity=capacity > 0),
        rows_sent=sum(stats.send), rows_received=sum(stats.recv))
    tables = formulas.rotary_table_bytes(shape) if recompute == "none" else 0
    assert (tables > 0) == (kind == "mixtral" and recompute == "none")
    assert held_bytes(ctx.blocks[0]) == sum(want.values()) + tables, want
    dense = formulas.activation_bytes(shape, formulas.Chunk(1, first=False, last=False), cfg.vocab_size)
    assert held_bytes(ctx.blocks[1]) == dense + tables
    assert held_bytes(ctx.blocks) == sum(want.values()) + dense + tables  # one pair of tables for both blocks
