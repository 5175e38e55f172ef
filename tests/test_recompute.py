"""Activation recomputation (`--recompute none|full`) and activation accounting.

* Full recomputation gives the same losses and gradients as keeping everything, bit for
  bit, with dropout, on one thread and split over threads, whole backward or zero-bubble B
  then W: the recomputed context is the forward's (a block rerun from its input, dropout
  redrawn from the dropout key).
* What a stage's forward saves, measured from the buffers (`numesh.base.tree.held_bytes`),
  equals `numesh.perf.formulas.activation_bytes` exactly, for every mode, with and without
  dropout, float32 and float64, first, middle and last stages, one or two threads; what a
  zero-bubble B leaves for W equals `weight_ctx_bytes`; the executor's measured peak over
  a step equals `peak_activation_bytes` replayed over the schedule (pp=1 here; pp and tp
  in tests/test_mpi_recompute.py).
* Nothing kept grows as s²: none and full grow linearly in the context.
* Whole training runs with each mode log the same numbers; a bad mode is one line, and so
  is the retired "selective" (the fused attention keeps nothing T×T, so it would keep
  exactly what none keeps).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import self_mesh, tiny_config
from numesh.base.errors import ConfigError
from numesh.base.tree import held_bytes, tree_leaves
from numesh.host import threads
from numesh.nn import walk as S
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import ARCHS, GPTConfig, init_gpt
from numesh.nn.transformer import block_fwd
from numesh.nn.units import Unit
from numesh.perf import formulas
from numesh.pipeline.schedules import make_schedule
from numesh.run.config import config_from
from numesh.run.train import Trainer, train

MODES = ("none", "full")


@pytest.fixture
def thread_count(monkeypatch):
    """Set the intra-op thread count for a test, restoring it afterwards. With more than one,
    blocks of these tiny models also run as pieces of one sequence, as a large model's blocks
    run as pieces (numesh.nn.walk.block_pieces); with one they stay whole."""
    before, cores, piece_tokens = threads.threads(), threads.cores(), S.PIECE_TOKENS

    def set_count(n: int) -> None:
        monkeypatch.setattr(S, "PIECE_TOKENS", 1 if n > 1 else piece_tokens)
        threads.set_cores(16)
        threads.set_threads(n)

    yield set_count
    threads.set_threads(before)
    threads.set_cores(cores)


def batch(cfg: GPTConfig, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and targets [rows, T], each its own array (as `numesh.data.batches.local_batch` gives)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, cfg.vocab_size, (rows, cfg.block_size)) for _ in range(2))


def key(cfg: GPTConfig, rows: int, dropout: bool) -> DropoutKey | None:
    return DropoutKey(0.2, 5, 3, 0, rows) if dropout else None


def assert_trees_equal(a, b) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------------------
# the same numbers in every mode


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("dropout", [False, True])
def test_every_mode_gives_the_same_losses_and_grads(thread_count, dropout: bool, n_threads: int) -> None:
    thread_count(n_threads)
    cfg = tiny_config(dropout=0.2 if dropout else 0.0, n_layer=3)
    mesh = self_mesh()
    params = init_gpt(cfg, mesh, seed=1, dtype=np.float64)
    rows = 4
    idx, tgt = batch(cfg, rows)
    drop = key(cfg, rows, dropout)
    runs = {m: S.loss_and_grads(params, idx, tgt, cfg, mesh, 1.0 / idx.size, drop, recompute=m) for m in MODES}
    assert runs["full"][0] == runs["none"][0]
    assert_trees_equal(runs["full"][1], runs["none"][1])

    # the zero-bubble halves: B recomputes, W uses what B left
    stage = S.whole_model(cfg.n_layer)
    split = {}
    for m in MODES:
        units = S.ResidentParams(params)
        _, ctx = S.stage_forward(units, stage, idx, tgt, cfg, mesh, drop, recompute=m)
        if n_threads > 1:
            assert all(isinstance(c, threads.RowChunks) for c in ctx.blocks)
        _, outer, deferred = S.stage_backward(units, stage, ctx, 1.0 / idx.size, cfg, mesh, split=True)
        S.stage_weight(units, deferred)
        split[m] = (outer, [units.grads[Unit(i)] for i in range(cfg.n_layer)])
    assert_trees_equal(split["full"], split["none"])
    assert_trees_equal(split["none"][1], list(runs["none"][1].blocks))  # the split backward is the whole one


@pytest.mark.parametrize("dropout", [False, True])
def test_recomputed_contexts_are_the_forwards(thread_count, dropout: bool) -> None:
    """Full's rerun gives the forward's whole context back (arrays equal bit for bit), the
    same attention dropout pattern redrawn; none keeps the forward's context itself."""
    thread_count(1)  # one context, not pieces
    cfg = tiny_config(dropout=0.2 if dropout else 0.0)
    mesh = self_mesh()
    p = init_gpt(cfg, mesh, seed=2, dtype=np.float32).blocks[1]
    x = np.random.default_rng(1).standard_normal((3, cfg.block_size, cfg.n_embd)).astype(np.float32)
    drop = key(cfg, 3, dropout)
    _, ctx = block_fwd(p, x, cfg, mesh, 1, drop)
    _, kept = S.run_block_fwd(p, x, cfg, mesh, 1, drop, recompute="none")
    assert_trees_equal(S._restored(p, kept, cfg, mesh), ctx)
    _, saved = S.run_block_fwd(p, x, cfg, mesh, 1, drop, recompute="full")
    assert isinstance(saved, S.BlockInput) and saved.x is x and saved.drop == drop
    assert_trees_equal(S._restored(p, saved, cfg, mesh), ctx)


# ---------------------------------------------------------------------------------------
# measured activation bytes == the formula


def stage_kinds(n_layer: int) -> dict[str, S.Stage]:
    blocks = tuple((i, Unit(i)) for i in range(n_layer))
    return {
        "whole": S.Stage(blocks, first=True, last=True),
        "first": S.Stage(blocks, first=True, last=False),
        "middle": S.Stage(blocks, first=False, last=False),
        "last": S.Stage(blocks, first=False, last=True),
    }


# the model kinds the accounting is checked on: GPT-2's block; Llama's (RMSNorm, rotary, SwiGLU,
# grouped-query attention with one kv head, untied head); Llama's with every head its own kv
# (the fused QKV, rotated), a narrower SwiGLU and the head tied
KINDS = {"gpt2": {}, "llama": dict(ARCHS["llama"], n_kv_head=1, norm_eps=1e-6),
         "llama-mha-tied": dict(ARCHS["llama"], ffn_hidden=12, tie_embeddings=True)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_measured_activation_bytes_equal_the_formula(thread_count, mode: str, dropout: bool, dtype,
                                                     n_threads: int, kind: str) -> None:
    """Every kind; with rotary positions each stage's context also holds the rotary tables
    once (`rotary_table_bytes`), whatever its blocks, unless fully recomputed."""
    thread_count(n_threads)
    cfg = tiny_config(dropout=0.2 if dropout else 0.0, n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11,
                      **KINDS[kind])
    mesh = self_mesh()
    params = init_gpt(cfg, mesh, seed=0, dtype=dtype)
    rows = 4
    idx, tgt = batch(cfg, rows)
    x = np.random.default_rng(2).standard_normal((rows, cfg.block_size, cfg.n_embd)).astype(dtype)
    drop = key(cfg, rows, dropout)
    for name, stage in stage_kinds(cfg.n_layer).items():
        _, ctx = S.stage_forward(S.ResidentParams(params), stage, idx if stage.first else x, tgt, cfg, mesh, drop,
                                 recompute=mode)
        shape = formulas.ActivationShape(rows, cfg.block_size, cfg.n_embd, cfg.n_head, recompute=mode,
                                         itemsize=np.dtype(dtype).itemsize, parts=formulas.Parts.of(cfg))
        chunk = formulas.Chunk(cfg.n_layer, stage.first, stage.last)
        want = formulas.activation_bytes(shape, chunk, cfg.vocab_size)
        tables = formulas.rotary_table_bytes(shape) if mode == "none" else 0
        assert (tables > 0) == (kind != "gpt2" and mode == "none")
        assert held_bytes(ctx) == want + tables, (name, formulas.activation_parts(shape, chunk, cfg.vocab_size))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_what_b_leaves_for_w_equals_the_formula(thread_count, mode: str, bias: bool, n_threads: int,
                                                kind: str) -> None:
    """Every kind; a W's context holds the rotary tables too (once), in either mode."""
    thread_count(n_threads)
    cfg = tiny_config(dropout=0.2, bias=bias, n_layer=2, **KINDS[kind])
    mesh = self_mesh()
    params = init_gpt(cfg, mesh, seed=0, dtype=np.float64)
    rows = 4
    idx, tgt = batch(cfg, rows)
    units = S.ResidentParams(params)
    stage = S.whole_model(cfg.n_layer)
    _, ctx = S.stage_forward(units, stage, idx, tgt, cfg, mesh, key(cfg, rows, True), recompute=mode)
    _, _, deferred = S.stage_backward(units, stage, ctx, 1.0, cfg, mesh, split=True)
    shape = formulas.ActivationShape(rows, cfg.block_size, cfg.n_embd, cfg.n_head, itemsize=8,
                                     parts=formulas.Parts.of(cfg))
    want = formulas.weight_ctx_bytes(shape, cfg.n_layer, bias=bias,
                                     chunks=len(threads.runs_for(n_threads,
                                                                 S.block_pieces(1, 1, rows, cfg.block_size, 16))))
    assert held_bytes(deferred) == want + formulas.rotary_table_bytes(shape)


def test_no_mode_keeps_an_s2_term() -> None:
    """The fused attention keeps nothing s×s, so none and full both grow linearly in s;
    "selective" is no mode."""
    kw = dict(micro_batch=3, n_embd=64, n_head=8, tp=2, itemsize=4)
    middle = formulas.Chunk(5, first=False, last=False)
    lin = [formulas.activation_bytes(formulas.ActivationShape(seq=s, recompute=m, **kw), middle, vocab=65)
           for m in MODES for s in (64, 128)]
    assert lin[1] == 2 * lin[0] and lin[3] == 2 * lin[2]
    for bad in ("most", "selective"):
        with pytest.raises(ValueError, match="recompute must be none or full"):
            formulas.activation_bytes(formulas.ActivationShape(seq=8, recompute=bad, **kw), middle, vocab=65)


# ---------------------------------------------------------------------------------------
# whole steps and runs


def run_config(data: Path, out: Path, **kw: object):
    base: dict = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=8, max_iters=3, dropout=0.1,
                      bias=True, learning_rate=3e-2, warmup_iters=1, lr_decay_iters=3, eval_interval=2,
                      eval_iters=1, data=str(data), out=str(out), seed=3, dtype="float64")
    base.update(kw)
    return config_from(base)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule, m", [("1f1b", 2), ("gpipe", 4), ("zb-h1", 2)])
@pytest.mark.parametrize("mode", MODES)
def test_step_peak_bytes_equal_the_formula(thread_count, char_dataset: Path, tmp_path: Path, mode: str, schedule: str,
                                          m: int, kind: str) -> None:
    """The executor's measured peak over one step (pp=1) is the schedule replayed with the
    formula's bytes per micro-batch (GPipe holds all m, 1F1B one, zb-h1 one and its W);
    with rotary positions every context shares one pair of rotary tables, counted once."""
    thread_count(1)
    cfg = run_config(char_dataset, tmp_path / "o", recompute=mode, schedule=schedule, micro_batches=m, dtype="float32",
                     **KINDS[kind])
    trainer = Trainer(cfg, MPI.COMM_SELF)
    trainer.train_step()
    model, rows = trainer.model, cfg.batch_size // m
    shape = formulas.ActivationShape(rows, cfg.block_size, model.n_embd, model.n_head, recompute=mode,
                                     parts=formulas.Parts.of(model))
    saved = formulas.activation_bytes(shape, formulas.Chunk(model.n_layer, True, True), model.vocab_size)
    deferred = formulas.weight_ctx_bytes(shape, model.n_layer, bias=True)
    tables = formulas.rotary_table_bytes(shape)
    shared = (0 if mode == "full" else tables, tables)
    s = make_schedule(schedule, 1, m)
    assert trainer.last_stats.peak_bytes == formulas.peak_activation_bytes(s, 0, lambda c: saved, lambda c: deferred,
                                                                           shared)
    if schedule == "gpipe":
        assert trainer.last_stats.peak_bytes == m * saved + shared[0]


@pytest.mark.parametrize("threads_n", [1, 2])
def test_runs_log_the_same_numbers_in_every_mode(thread_count, char_dataset: Path, tmp_path: Path,
                                                 threads_n: int) -> None:
    thread_count(threads_n)
    records = {}
    for mode in MODES:
        got = []
        train(run_config(char_dataset, tmp_path / mode, recompute=mode, micro_batches=2), MPI.COMM_SELF,
              on_step=lambda step, rec: got.append({k: v for k, v in rec.items()
                                                    if k not in ("dt_ms", "tokens_per_s", "mfu", "flops_per_s")}))
        records[mode] = got
    assert records["none"] and records["full"] == records["none"]


def test_recompute_field_is_checked(char_dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        S.check_recompute("Full")
    assert str(info.value) == "--recompute must be one of none, full, got 'Full'"
    assert attrs.fields_dict(type(run_config(char_dataset, tmp_path)))["recompute"].default == "none"


def test_selective_is_retired_in_one_line() -> None:
    """--recompute selective says it is retired, and why, in one line."""
    with pytest.raises(ConfigError) as info:
        S.check_recompute("selective")
    msg = str(info.value)
    assert msg.startswith("--recompute selective is retired: ") and "\n" not in msg
    assert "T×T" in msg and "--recompute none" in msg
