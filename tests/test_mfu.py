"""Honest MFU: the peak is measured as the node is used, or given; MFU never exceeds 1."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from numesh import formulas
from numesh.runtime import gemm_flops, rank_peak_flops
from numesh.threads import set_threads, threads
from numesh.train import train
from test_train import run_config


def test_mfu_formula() -> None:
    assert formulas.mfu(5e9, 10e9) == 0.5
    assert formulas.mfu(10e9, 10e9) == 1.0
    # a step faster than the peak: the peak was measured low, MFU is 1, never more
    assert formulas.mfu(12e9, 10e9) == 1.0
    assert formulas.mfu(0.0, 10e9) == 0.0
    assert formulas.mfu(1e9, 0.0) == 1.0


def test_model_gemm_shapes() -> None:
    shapes = formulas.model_gemm_shapes(rows=96, n_embd=32, vocab_local=40, tp=2)
    assert shapes == [(96, 32, 48), (96, 16, 32), (96, 32, 64), (96, 64, 32), (96, 32, 40)]


@pytest.mark.parametrize("n", [1, 2])
def test_rank_peak_covers_the_model_shapes(n: int) -> None:
    """The peak is at least the rate of each of the model's GEMMs measured the same way,
    whole and split over the threads: the model's matmuls cannot beat it."""
    saved = threads()
    set_threads(n)
    try:
        shapes = formulas.model_gemm_shapes(rows=64, n_embd=32, vocab_local=65, tp=1)
        got = rank_peak_flops(shapes, np.float32, large=128)
        assert got["peak"] == max(got["model"], got["large"])
        assert got["model"] > 0 and got["large"] > 0
        # the best of several measurements bounds each one made the same way (within timer noise)
        one = max(gemm_flops(m, k, n_, np.float32) for m, k, n_ in shapes)
        assert got["peak"] >= 0.5 * one
    finally:
        set_threads(saved)


def _train_records(char_dataset: Path, out: Path, **kw) -> list[dict]:
    cfg = run_config(char_dataset, out, max_iters=4, eval_interval=100, **kw)
    train(cfg, MPI.COMM_SELF)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_metrics_carry_flops_and_mfu_at_most_one(char_dataset: Path, tmp_path: Path) -> None:
    for r in _train_records(char_dataset, tmp_path / "a"):
        assert r["flops_per_s"] > 0 and 0 < r["mfu"] <= 1
        assert r["mfu"] == pytest.approx(formulas.mfu(r["flops_per_s"], r["flops_per_s"] / r["mfu"]))


def test_peak_flops_option_is_the_denominator(char_dataset: Path, tmp_path: Path) -> None:
    """--peak-flops replaces the measurement; a peak below what a step achieves gives MFU 1."""
    big = 1e15
    for r in _train_records(char_dataset, tmp_path / "big", peak_flops=big):
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / big, rel=1e-12)
    for r in _train_records(char_dataset, tmp_path / "tiny", peak_flops=1.0):
        assert r["mfu"] == 1.0


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
    from numesh.runtime import dp_hint

    got = dp_hint(world, n_threads, batch, micro)
    if want is None:
        assert got is None
        return
    dp, per = want
    assert got is not None and got.startswith("hint:") and "\n" not in got
    assert f"mpirun -n {dp} numesh train --mesh dp={dp} ..." in got
    assert f"({dp} ranks x {per} thread" in got
