"""Honest MFU: the peak is one core's matmul rate, measured once per machine and cached, times
the cores the job uses (a host's cores counted once), or given; MFU is never clamped."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import self_mesh, tiny_config
from numesh.base.tree import tree_leaves_with_path
from numesh.host import runtime
from numesh.nn import layers, transformer
from numesh.nn.gpt import ARCHS, gpt_global_shapes, init_gpt
from numesh.nn.walk import loss_and_grads
from numesh.perf import formulas
from numesh.run.train import train
from test_train import run_config


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    """A private peak cache, so tests never write the user's."""
    monkeypatch.setenv("NUMESH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_mfu_formula() -> None:
    assert formulas.mfu(5e9, 10e9) == 0.5
    assert formulas.mfu(10e9, 10e9) == 1.0
    assert formulas.mfu(12e9, 10e9) == pytest.approx(1.2)  # a peak below the achieved rate shows, it is not hidden
    assert formulas.mfu(0.0, 10e9) == 0.0
    assert formulas.mfu(1e9, 0.0) == 0.0


@pytest.mark.parametrize("kind", [
    dict(),  # GPT-2's block: fused QKV, GELU, learned positions, tied head
    dict(ARCHS["llama"], n_kv_head=1, norm_eps=1e-6),  # GQA (one kv head of 2), SwiGLU, rotary, untied head
    dict(ARCHS["llama"], ffn_hidden=12, tie_embeddings=True, norm_eps=1e-6),  # every head its kv, tied
], ids=["gpt2", "llama-gqa", "llama-tied"])
def test_flops_per_token_counts_the_matmuls_a_step_runs(monkeypatch: pytest.MonkeyPatch, kind: dict) -> None:
    """The parameter term of `flops_per_token` (6 per counted parameter) is the matmuls of
    one forward and backward on one rank (2·m·k·n each: the Linears' forward, input and
    weight gradients, and the LM head's), per token, less 6 per value that no matmul
    multiplies and the convention counts anyway (wpe's rows, norms, biases): an untied
    embedding is a lookup and is not counted, an untied head is; a tied wte is the head."""
    counted = [0.0]

    def counting(real):
        def matmul(a, b, *args, **kw):
            counted[0] += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            return real(a, b, *args, **kw)
        return matmul

    def counting_each(real):  # several products in one call: threads.matmuls, matmul_sum
        def products(pairs, *args, **kw):
            counted[0] += sum(2.0 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs)
            return real(pairs, *args, **kw)
        return products

    monkeypatch.setattr(layers, "matmul", counting(layers.matmul))
    monkeypatch.setattr(layers, "matmuls", counting_each(layers.matmuls))
    monkeypatch.setattr(layers, "matmul_sum", counting_each(layers.matmul_sum))
    monkeypatch.setattr(transformer, "matmul", counting(transformer.matmul))
    cfg = tiny_config(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11, bias=True, **kind)
    params = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, cfg.block_size))
    loss_and_grads(params, idx, idx, cfg, self_mesh(), 1.0 / idx.size)
    parts = formulas.Parts.of(cfg)
    leaves = dict(tree_leaves_with_path(gpt_global_shapes(cfg)))
    n_params = sum(math.prod(s) for s in leaves.values())
    unmultiplied = sum(math.prod(s) for path, s in leaves.items()
                       if path == "wpe" or path.endswith(".b") or re.search(r"(ln1|ln2|ln_f)\.", path))
    per_token = counted[0] / idx.size
    assert per_token == 6 * (formulas.counted_params(n_params, cfg.vocab_size, cfg.n_embd, parts) - unmultiplied)
    assert (formulas.counted_params(n_params, cfg.vocab_size, cfg.n_embd, parts) == n_params) == parts.tied


def test_one_cores_peak_is_the_best_reading_kept_per_machine_and_dtype(cache_dir: Path, monkeypatch) -> None:
    """A reading under load is low: the cache keeps the highest, so a low first reading is
    raised later and a low later one never lowers it."""
    readings = iter([50e9, 40e9, 97e9, 60e9, 30e9, 70e9])
    monkeypatch.setattr(runtime, "gemm_flops", lambda *a, **kw: next(readings))
    first, where = runtime.core_peak_flops(np.float32)
    assert first == 50e9 and "measured now" in where and str(cache_dir) in where
    again, where = runtime.core_peak_flops(np.float32)
    assert again == 50e9 and "cached in" in where  # 40 read now: lower, the cache stands
    raised, where = runtime.core_peak_flops(np.float32)
    assert raised == 97e9 and "above the 50.0 GFLOP/s cached" in where
    assert runtime.core_peak_flops(np.float32)[0] == 97e9  # 60: kept 97
    assert runtime.core_peak_flops(np.float64)[0] == 30e9  # its own entry
    cache = json.loads((cache_dir / "peak_flops.json").read_text())
    assert sorted(k.rsplit(" | ", 1)[1] for k in cache) == ["float32", "float64"]
    (cache_dir / "peak_flops.json").write_text("{not json")  # a broken cache is measured again and rewritten
    assert runtime.core_peak_flops(np.float32)[0] == 70e9
    assert json.loads((cache_dir / "peak_flops.json").read_text())


@pytest.mark.parametrize("cores, threads, want", [
    (2, [1], 1), (2, [2], 2), (2, [1, 1], 2),
    (2, [1, 1, 1, 1], 2),  # 4 ranks time-sharing 2 cores: the host's 2 cores, not 4
    (16, [4, 4], 8), (16, [16, 16], 16),
])
def test_a_hosts_cores_are_counted_once(cores: int, threads: list[int], want: int) -> None:
    assert runtime.host_cores_used(cores, threads) == want


def test_job_peak_is_cores_times_one_cores_peak(cache_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(runtime, "gemm_flops", lambda *a, **kw: 80e9)  # each start checks again: a fixed reading
    per_core, _ = runtime.core_peak_flops(np.float32)
    for n in (1, 2, 64):
        peak, source = runtime.job_peak_flops(MPI.COMM_SELF, n, np.float32)
        used = runtime.host_cores_used(os.cpu_count() or 1, [n])
        assert peak == pytest.approx(used * per_core, rel=1e-12)
        assert source.startswith(f"{used} core(s) on 1 host(s)") and "cached in" in source


def _train_records(char_dataset: Path, out: Path, **kw) -> list[dict]:
    cfg = run_config(char_dataset, out, max_iters=4, eval_interval=100, **kw)
    train(cfg, MPI.COMM_SELF)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_metrics_carry_flops_and_mfu_over_one_peak(char_dataset: Path, tmp_path: Path, cache_dir: Path) -> None:
    records = _train_records(char_dataset, tmp_path / "a")
    peaks = [r["flops_per_s"] / r["mfu"] for r in records]
    assert all(r["flops_per_s"] > 0 and r["mfu"] > 0 for r in records)
    assert peaks == pytest.approx([peaks[0]] * len(peaks), rel=1e-9)  # every step against the same peak
    assert (cache_dir / "peak_flops.json").is_file()


def test_peak_flops_option_is_the_denominator(char_dataset: Path, tmp_path: Path, cache_dir: Path) -> None:
    """--peak-flops replaces the measurement, and a peak below what a step achieves is shown."""
    for peak in (1e15, 1.0):
        for r in _train_records(char_dataset, tmp_path / f"p{peak:g}", peak_flops=peak):
            assert r["mfu"] == pytest.approx(r["flops_per_s"] / peak, rel=1e-12)
    assert not (cache_dir / "peak_flops.json").exists()  # nothing measured


@pytest.mark.parametrize("world, n_threads, batch, micro, want", [
    (1, 16, 12, 1, (12, 1)),
    (1, 16, 64, 1, (16, 1)),
    (1, 16, 8, 1, (8, 2)),
    (1, 8, 12, 2, (6, 1)),
    (1, 4, 12, 1, (4, 1)),
    (1, 2, 12, 1, (2, 1)),
    (1, 1, 12, 1, None),    # one thread: nothing to split
    (4, 16, 12, 1, None),   # already several ranks
    (1, 4, 7, 1, None),     # no dp <= 4 divides the batch
])
def test_dp_hint(world: int, n_threads: int, batch: int, micro: int, want: tuple[int, int] | None) -> None:
    from numesh.host.runtime import dp_hint

    got = dp_hint(world, n_threads, batch, micro)
    if want is None:
        assert got is None
        return
    dp, per = want
    assert got is not None and got.startswith("hint:") and "\n" not in got
    assert f"mpirun -n {dp} numesh train --mesh dp={dp} ..." in got
    assert f"({dp} ranks x {per} thread" in got
