"""Megatron tensor parallelism reproduces the 1-rank model (float64, 1e-10 relative).

tp = the world size, on 2 or 4 ranks (n_head=4 caps tp at 4; with 8 ranks tensor
parallelism is covered by the dp=2 x tp=4 run in test_mpi_data_parallel.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import (
    WORLD,
    assert_close,
    assert_one_step_matches,
    assert_same_run,
    gather_tree,
    mesh_for_world,
    model_config,
    one_step,
    random_batch,
    random_global_params,
    self_mesh,
    serial_reference,
    shard_params,
    train_records,
    world_mesh,
)
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.data.dataset import load_tokenizer
from numesh.mesh import Mesh
from numesh.nn.gpt import gpt_specs, init_gpt
from numesh.nn.parallel import vocab_parallel_cross_entropy_bwd, vocab_parallel_cross_entropy_fwd
from numesh.nn.walk import loss_and_grads
from numesh.perf.formulas import Chunk, tp_all_reduce_bytes
from numesh.run.config import config_from

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture
def tp_mesh() -> Iterator[Mesh]:
    """tp = the world size."""
    yield from world_mesh(mesh_for_world({2: ["tp=2"], 4: ["tp=4"]}, why="tp parity runs on 2 and 4 ranks"))


def test_vocab_is_padded(tp_mesh: Mesh) -> None:
    cfg = model_config()
    n = tp_mesh.size("tp")
    params = init_gpt(cfg, tp_mesh, seed=0, dtype=np.float64)
    assert params.wte.shape == (12 // n, 16)  # 11 rounded up to 12 rows, split over tp
    assert params.blocks[0].attn.qkv.w.shape == (16, 3, 16 // n)
    assert params.blocks[0].attn.qkv.b.shape == (3, 16 // n)
    assert params.blocks[0].mlp.fc.w.shape == (16, 64 // n)
    assert params.blocks[0].mlp.proj.w.shape == (64 // n, 16)
    assert params.blocks[0].attn.proj.b.shape == (16,)


def test_init_is_mesh_independent(tp_mesh: Mesh) -> None:
    cfg = model_config()
    full = gather_tree(init_gpt(cfg, tp_mesh, seed=3, dtype=np.float64), gpt_specs(cfg), tp_mesh)
    ref = init_gpt(cfg, self_mesh(), seed=3, dtype=np.float64)
    np.testing.assert_array_equal(full.wte[11:], 0.0)  # padding rows
    np.testing.assert_array_equal(full.wte[:11], ref.wte)
    for (path, a), b in zip(tree_leaves_with_path(full), tree_leaves(ref)):
        if path != "wte":
            np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_grads_match_one_rank(tp_mesh: Mesh, dropout: float) -> None:
    step = one_step(tp_mesh, dropout)
    assert_one_step_matches(step)
    assert step.full.wte.shape[0] == step.cfg.padded_vocab(tp_mesh.size("tp")) == 12
    np.testing.assert_array_equal(step.full.wte[step.cfg.vocab_size :], 0.0)  # padding rows get no gradient
    # every rank holds the same loss (the all-reduced cross-entropy)
    assert WORLD.allgather(step.loss) == [step.loss] * WORLD.Get_size()


def test_unsigned_ids_as_a_datasets_shards_hold_them_give_the_same_loss(tp_mesh: Mesh) -> None:
    """uint16 ids (train.bin's dtype) on tp: "not on this rank" was -1, which wrapped to
    65535 and indexed past the embedding's shard (a segfault); they are read as int64."""
    cfg = model_config()
    gp = random_global_params(cfg, seed=21)
    idx, tgt = random_batch(cfg)
    local = shard_params(gp, cfg, tp_mesh)
    want_loss, want = loss_and_grads(local, idx, tgt, cfg, tp_mesh, 1.0 / idx.size)
    loss, grads = loss_and_grads(local, idx.astype(np.uint16), tgt.astype(np.uint16), cfg, tp_mesh, 1.0 / idx.size)
    assert loss == want_loss
    for a, b in zip(tree_leaves(grads), tree_leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_cross_entropy_with_a_rank_far_below_matches_one_rank(tp_mesh: Mesh) -> None:
    """Each rank shifts its columns by its own max and rescales its sum to the common max:
    rows whose last rank's logits lie 60 below the others', or whose other ranks' lie 1,000
    below the last's (their exps underflow, their sums' rescaling overflows), give the
    1-rank loss and gradient (vocab 11 padded to 12, float64, per-token dloss)."""
    n, r = tp_mesh.size("tp"), tp_mesh.index("tp")
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((5, 12)) * 3
    cut = 12 - 12 // n  # the last rank's first column
    logits[1, cut:] -= 60.0
    logits[2, :cut] -= 1000.0
    targets = np.array([3, 11 - 1, 0, cut, 7])
    dloss = rng.standard_normal(5)
    loss1, ctx1 = vocab_parallel_cross_entropy_fwd(logits.copy(), targets, 11, self_mesh())
    grad1 = vocab_parallel_cross_entropy_bwd(ctx1, dloss)
    mine = logits[:, r * 12 // n:(r + 1) * 12 // n].copy()
    loss, ctx = vocab_parallel_cross_entropy_fwd(mine, targets, 11, tp_mesh)
    grad = np.concatenate(WORLD.allgather(vocab_parallel_cross_entropy_bwd(ctx, dloss)), axis=1)
    assert np.isfinite(loss).all() and np.isfinite(grad).all()
    assert_close(loss, loss1, 1e-10, "loss")
    assert_close(grad, grad1, 1e-10, "dlogits")


def test_tp_all_reduce_bytes_follow_megatron(tp_mesh: Mesh) -> None:
    cfg = model_config(dropout=0.0)
    n = tp_mesh.size("tp")
    params = init_gpt(cfg, tp_mesh, seed=0, dtype=np.float64)
    B, T, C, L = 4, cfg.block_size, cfg.n_embd, cfg.n_layer
    idx, tgt = random_batch(cfg, B)
    tp_mesh.counter.reset()
    loss_and_grads(params, idx, tgt, cfg, tp_mesh, 1.0 / (B * T))
    item = 8  # float64
    act = B * T * C * item
    per_block = 2 * act + 2 * act  # g after attention and MLP forward, f of both halves backward
    embedding = act  # vocab-parallel lookup, forward
    head = act  # the LM head's input gradient, backward
    cross_entropy = B * T * item + 2 * B * T * item  # pmax of the row maxima, psum of [sum-exp, target logit]
    expected = L * per_block + embedding + head + cross_entropy
    assert expected == tp_all_reduce_bytes(Chunk(L, first=True, last=True), B, T, C, item)  # the formula agrees
    c = tp_mesh.counter
    assert c.total("tp", "all_reduce", kind="payload") == expected
    assert c.total("tp", "all_reduce", kind="calls") == 4 * L + 2 + 2
    assert c.total("tp", "all_reduce") == pytest.approx(2 * (n - 1) / n * expected, rel=1e-15)
    assert c.total(kind="payload") == expected  # nothing else moves: no gathers, no other axes


# ---------------------------------------------------------------------------------------
# whole training runs


def run_config(data: Path, out: Path, mesh: str) -> object:
    return config_from(dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=4, dropout=0.1, bias=True,
        learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=4, grad_clip=0.5,
        eval_interval=2, eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=11, dtype="float64",
        peak_flops=1e12,  # MFU's denominator given: parity ignores MFU, and measuring it took a third of a run
    ))


def test_training_run_matches_one_rank(tp_mesh: Mesh, shared_dataset: Path, shared_tmp: Path) -> None:
    n = tp_mesh.size("tp")
    cfg = run_config(shared_dataset, shared_tmp / f"tp{n}", f"tp={n}")
    got = train_records(cfg, WORLD)
    want = serial_reference(cfg)
    assert len([r for r in want[0] if "loss" in r]) == 4
    assert any(r["grad_norm"] > 0.5 for r in want[0] if "grad_norm" in r), "clipping should be exercised"
    assert_same_run(got, want)
    vocab = load_tokenizer(shared_dataset).vocab_size
    assert vocab % n, "the dataset's vocabulary should need padding for this tp"
    assert got[1]["wte"].shape == (vocab, 16)  # saved unpadded


def test_kv_cache_logits_match_one_rank(tp_mesh: Mesh) -> None:
    """Generation's vocab-parallel logits (gathered over tp, unpadded) equal the 1-rank ones."""
    from numesh.nn.decode import logits_cached, new_kv_cache

    cfg = model_config(dropout=0.0)
    gp = random_global_params(cfg, seed=8)
    local = shard_params(gp, cfg, tp_mesh)
    idx, _ = random_batch(cfg, 2, seed=4)
    c_tp = new_kv_cache(cfg, tp_mesh, 2, np.float64)
    c_1 = new_kv_cache(cfg, self_mesh(), 2, np.float64)
    for t0, t1 in ((0, 4), (4, 5), (5, 8)):
        got = logits_cached(local, idx[:, t0:t1], c_tp, cfg, tp_mesh)
        want = logits_cached(gp, idx[:, t0:t1], c_1, cfg, self_mesh())
        assert got.shape == (2, cfg.vocab_size)
        assert_close(got, want, 1e-10, what=f"logits at {t1 - 1}")


@pytest.mark.parametrize("temperature, top_k", [(0.8, 5), (0.0, None)])
def test_sampling_gives_the_same_tokens_as_one_rank(tp_mesh: Mesh, temperature: float, top_k: int | None) -> None:
    """`numesh sample --mesh tp=N` draws the tokens tp=1 draws for the same seed."""
    from numesh.run.sample import generate

    cfg = model_config(dropout=0.0)
    gp = random_global_params(cfg, seed=9)
    prompt, _ = random_batch(cfg, 2, seed=5)
    prompt = prompt[:, :3]
    kw = dict(max_new_tokens=cfg.block_size + 2, temperature=temperature, top_k=top_k, seed=21)  # past the context
    got = generate(shard_params(gp, cfg, tp_mesh), cfg, tp_mesh, prompt, **kw)
    want = generate(gp, cfg, self_mesh(), prompt, **kw)
    assert got.shape == (2, 3 + cfg.block_size + 2)
    np.testing.assert_array_equal(got, want)


def test_llama_kv_cache_with_fewer_kv_heads_than_tp_matches_one_rank(tp_mesh: Mesh) -> None:
    """A Llama (rotary, SwiGLU, untied vocab-parallel head) with tp/2 kv heads, fewer than
    tp: each rank caches only the kv head its query heads read, and the cached logits equal
    the 1-rank full forward at every step; generation draws the 1-rank tokens."""
    from numesh.nn.decode import logits_cached, logits_last, new_kv_cache
    from numesh.nn.gpt import ARCHS
    from numesh.run.sample import generate

    n = tp_mesh.size("tp")
    cfg = model_config(**ARCHS["llama"], dropout=0.0, bias=False, n_kv_head=n // 2, norm_eps=1e-6, rope_theta=100.0)
    gp = random_global_params(cfg, seed=8)
    local = shard_params(gp, cfg, tp_mesh)
    cache = new_kv_cache(cfg, tp_mesh, 2, np.float64)
    assert cache.k[0].shape[1] == 1  # the one kv head this rank's query heads share
    idx, _ = random_batch(cfg, 2, seed=4)
    for t0, t1 in ((0, 4), (4, 5), (5, 8)):
        got = logits_cached(local, idx[:, t0:t1], cache, cfg, tp_mesh)
        assert got.shape == (2, cfg.vocab_size)
        assert_close(got, logits_last(gp, idx[:, :t1], cfg, self_mesh()), 1e-10, what=f"logits at {t1 - 1}")
    kw = dict(max_new_tokens=cfg.block_size, temperature=1.0, top_k=None, seed=3)  # past the context
    got = generate(local, cfg, tp_mesh, idx[:, :3], **kw)
    np.testing.assert_array_equal(got, generate(gp, cfg, self_mesh(), idx[:, :3], **kw))
