"""The Llama kind on one rank: its parameter tree, its loss against the plain reference
model (numesh.nn.reference) and against transformers' `LlamaForCausalLM`, its gradients
against finite differences, and the one-line errors of its options."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import random_global_params, self_mesh, tiny_config
from numesh.base.errors import ConfigError
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.checkpoint.hf import llama_config as hf_llama_config
from numesh.checkpoint.hf_llama import to_llama
from numesh.nn import reference
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import ARCHS, GPTConfig, gpt_specs, swiglu_hidden
from numesh.nn.walk import forward_loss, loss_and_grads
from numesh.run.config import config_from
from test_layers import _batch

LLAMA = ARCHS["llama"]
# small enough for finite differences: 2 layers, 16 wide, 4 query heads of size 4
KINDS = {
    "gqa": dict(LLAMA, n_kv_head=2),
    "mqa-tied": dict(LLAMA, n_kv_head=1, tie_embeddings=True),
    "mha": dict(LLAMA),  # kv heads = heads: the fused QKV Linear, rotated
    "gqa-bias-ffn": dict(LLAMA, n_kv_head=2, bias=True, ffn_hidden=24),
    "mixtral": dict(LLAMA, n_kv_head=2, moe_experts=4, moe_top_k=2),  # SwiGLU experts
    "gpt2-gqa-rotary": dict(ARCHS["gpt2"], n_kv_head=2, positions="rotary"),
}
DENSE = [k for k in KINDS if not KINDS[k].get("moe_experts")]


def llama_config(kind: str, **overrides) -> GPTConfig:
    kw = dict(n_embd=16, n_head=4, bias=False, rope_theta=100.0)
    kw.update(KINDS[kind])
    if kw["norm"] == "rmsnorm":
        kw["norm_eps"] = 1e-6
    kw.update(overrides)
    return tiny_config(**kw)


def _ce(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).reshape(-1)


def test_the_llama_tree_holds_its_kinds_leaves() -> None:
    cfg = llama_config("gqa")
    paths = {p for p, _ in tree_leaves_with_path(gpt_specs(cfg))}
    assert "wpe" not in paths and "lm_head" in paths  # rotary positions, untied head
    assert {"blocks.0.attn.q.w", "blocks.0.attn.k.w", "blocks.0.attn.v.w", "blocks.0.mlp.gate.w"} <= paths
    assert not any(p.endswith(".b") for p in paths)  # RMSNorm has no bias, and bias=False
    specs = dict(tree_leaves_with_path(gpt_specs(cfg)))
    assert str(specs["blocks.0.attn.k.w"]) == str(specs["blocks.0.ln1.w"])  # k replicated over tp, like a norm
    assert cfg.hidden == swiglu_hidden(16) == 64  # 8C/3 = 42 rounded up to a multiple of 32
    tied = {p for p, _ in tree_leaves_with_path(gpt_specs(llama_config("mqa-tied")))}
    assert "lm_head" not in tied


@pytest.mark.parametrize("kind", DENSE)  # the reader's reference is dense
def test_forward_equals_the_reference_model(kind: str) -> None:
    rng = np.random.default_rng(1)
    cfg = llama_config(kind)
    params = random_global_params(cfg, seed=3)
    idx, tgt = _batch(cfg, rng)
    want = _ce(reference.logits(params, idx, cfg), tgt)
    np.testing.assert_allclose(forward_loss(params, idx, tgt, cfg, self_mesh()), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", DENSE)
def test_loss_and_grads_match_finite_differences(kind: str) -> None:
    from test_layers import _entries, assert_fd, fd_grad

    rng = np.random.default_rng(7)
    cfg = llama_config(kind, dropout=0.1)
    mesh = self_mesh()
    params = random_global_params(cfg, seed=11)
    idx, tgt = _batch(cfg, rng)
    scale = 1.0 / idx.size
    drop = DropoutKey(p=0.1, seed=3, step=2, row0=0, global_rows=idx.shape[0])
    loss, grads = loss_and_grads(params, idx, tgt, cfg, mesh, scale, drop)

    def f() -> float:
        return loss_and_grads(params, idx, tgt, cfg, mesh, scale, drop)[0]

    for (path, p), g in zip(tree_leaves_with_path(params), tree_leaves(grads)):
        assert g.shape == p.shape, path
        entries = _entries(p.shape, rng)
        assert_fd(g, fd_grad(f, p, entries), path, entries)


def test_mixtral_grads_match_finite_differences_through_the_router_losses() -> None:
    """SwiGLU experts (gate, up and down per expert) under the router and its two losses."""
    from test_moe_model import assert_grads_match_fd

    cfg = llama_config("mixtral", moe_every=2, n_layer=3, moe_aux_coef=0.2, moe_z_coef=0.05)
    params = assert_grads_match_fd(cfg, 2, np.random.default_rng(8))
    assert params.blocks[0].mlp.gate.w.shape == (4, 16, 64)  # [E, C, F]


def test_logits_equal_transformers_llama() -> None:
    """numesh's Llama is transformers' LlamaForCausalLM (float64, the same weights): the
    rotate-half RoPE, GQA, SwiGLU and RMSNorm as transformers computes them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = llama_config("gqa", block_size=12)
    p = random_global_params(cfg, seed=5, scale=0.2)
    # config.json and tensors as `numesh export --format hf` writes them (numesh.checkpoint's one table)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(
        hf_llama_config(cfg, "llama", None, "float64"))).double().eval()
    assert not model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    sd = {name: torch.tensor(a) for name, a in to_llama(p, cfg).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    idx, tgt = _batch(cfg, np.random.default_rng(2), B=3)
    with torch.no_grad():
        logits = model(torch.tensor(idx)).logits.numpy()
    # transformers computes the rotary angles in float32 even in a float64 model (its
    # rotary embedding casts to float), so the two agree to float32's rounding of the angles
    np.testing.assert_allclose(reference.logits(p, idx, cfg), logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(forward_loss(p, idx, tgt, cfg, self_mesh()), _ce(logits, tgt), rtol=0, atol=1e-5)


def test_arch_fills_the_parts_no_option_names() -> None:
    cfg = config_from({"arch": "llama"})
    assert (cfg.norm, cfg.positions, cfg.mlp, cfg.tie_embeddings) == ("rmsnorm", "rotary", "swiglu", False)
    cfg = config_from({"arch": "llama", "tie_embeddings": True, "mlp": "gelu"})
    assert (cfg.norm, cfg.mlp, cfg.tie_embeddings) == ("rmsnorm", "gelu", True)
    assert config_from({}).norm == "layernorm"
    with pytest.raises(ConfigError, match="--arch must be one of gpt2, llama, got 'mistral'"):
        config_from({"arch": "mistral"})


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(n_kv_head=3), 1, "n_kv_head=3 must divide n_head=4"),
    (dict(n_kv_head=-1), 1, "n_kv_head=-1 must divide n_head=4"),
    (dict(n_head=8, n_embd=32, n_kv_head=4), 8, None),  # tp a multiple of the kv heads: fine
    (dict(n_head=12, n_embd=48, n_kv_head=4), 6, "tp=6 splits the 4 kv heads' query groups across ranks"),
    (dict(norm="batchnorm"), 1, "--norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
    (dict(positions="alibi"), 1, "--positions must be one of learned, rotary"),
    (dict(mlp="relu"), 1, "--mlp must be one of gelu, swiglu"),
    (dict(norm="layernorm", norm_eps=1e-6), 1, "LayerNorm's epsilon is 1e-05"),
    (dict(rope_theta=0.0), 1, "rope_theta must be > 0"),
    (dict(n_embd=12, n_head=4), 1, "head size n_embd/n_head=3 must be even"),
    (dict(ffn_hidden=30), 4, "hidden size 30 is not divisible by tp=4"),
])
def test_impossible_models_and_meshes_are_one_line_errors(overrides: dict, tp: int, message: str | None) -> None:
    cfg = llama_config("gqa", **overrides)
    if message is None:
        cfg.validate(tp)
        return
    with pytest.raises(ConfigError, match=message) as err:
        cfg.validate(tp)
    assert "\n" not in str(err.value)


def test_numesh_train_arch_llama_trains_and_records_its_parts(char_dataset, tmp_path) -> None:
    """`numesh train --arch llama` end to end: the run's config.json holds the kind's parts,
    the loss falls, and the checkpoint holds Llama's leaves."""
    import json

    from conftest import cli
    from numesh.checkpoint import read_params_dict

    out = tmp_path / "run"
    res = cli("train", "--arch", "llama", "--n-kv-head", "2", "--data", str(char_dataset), "--out", str(out),
              "--n-layer", "2", "--n-embd", "32", "--block-size", "16", "--max-iters", "30", "--eval-interval", "30",
              "--eval-iters", "2", "--learning-rate", "1e-2", "--warmup-iters", "0", "--peak-flops", "1e12")
    assert res.exit_code == 0, res.output
    config = json.loads((out / "config.json").read_text())
    config = config.get("config", config)
    assert {k: config[k] for k in ("arch", "norm", "positions", "mlp", "n_kv_head", "tie_embeddings")} == dict(
        arch="llama", norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2, tie_embeddings=False)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"step"' in line]
    assert losses[-1] < losses[0] - 0.3
    params = read_params_dict(out / "ckpt" / "latest")
    assert "lm_head" in params and "wpe" not in params and "blocks.0.attn.k.w" in params


@pytest.mark.parametrize("args, message", [
    (["--arch", "llama", "--n-kv-head", "3"], "n_kv_head=3 must divide n_head=4"),
    (["--arch", "qwen"], "--arch must be one of gpt2, llama, got 'qwen'"),
])
def test_numesh_train_refuses_impossible_kinds_in_one_line(args, message, char_dataset, tmp_path) -> None:
    from conftest import cli, one_error_line

    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), *args))
    assert message in line


@pytest.mark.parametrize("options, ranks, message", [
    (dict(mesh="tp=3"), 3, "n_head=8 is not divisible by tp=3: use a tp that divides the heads"),
    (dict(n_head=12, n_embd=48, n_kv_head=4, mesh="tp=6"), 6, "tp=6 splits the 4 kv heads' query groups"),
    (dict(n_kv_head=2, mesh="tp=8"), 8, None),  # 8 query heads on 8 ranks, 4 ranks per kv head
])
def test_meshes_that_cannot_split_the_heads_fail_before_training(options, ranks, message) -> None:
    from numesh.run.config import check_layout

    cfg = config_from({"arch": "llama", "n_head": 8, "n_embd": 32, "n_kv_head": 2, **options})
    if message is None:
        assert check_layout(cfg, ranks, 65)[0]["tp"] == 8
        return
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, ranks, 65)
