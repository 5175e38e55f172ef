"""ZeRO over dp: memory per rank and bytes per step as the ZeRO paper says, parity with
tensor parallelism, and bad input that fails cleanly on every rank.

Memory (Rajbhandari et al. 2020, section 5, with K = 8 for fp32 AdamW's two moments):
params 4Ψ, grads 4Ψ, moments 8Ψ per rank; stage 1 shards the moments, 2 also the
gradients, 3 also the parameters. Ψ is this rank's tp-local parameter count. What
`ZeroOptimizer.memory()` reports is checked against both the formula and every array the
optimiser actually holds.

Communication (bus bytes on the dp axis, NCCL-tests convention: all-reduce 2(n-1)/n·S,
all-gather and reduce-scatter (n-1)/n·S): plain DP all-reduces every gradient once,
2(n-1)/n·Ψ·itemsize per step; stage 1 and 2 reduce-scatter the gradients and all-gather the
updated parameters, the same bytes; stage 3 gathers the parameters for forward and again
for backward and reduce-scatters the gradients, 1.5× plain DP.

Adapts to the world size N: dp=N, and dp=2 × tp=N/2 on 4 and 8 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from conftest import SMALL_BATCH, WORLD, assert_same_run, serial_reference, small_run_config, train_records
from numesh.base.tree import tree_leaves
from numesh.mesh import Mesh, MeshError
from numesh.mesh.mesh import ByteCounter
from numesh.nn.gpt import ConfigError, gpt_specs, init_gpt
from numesh.nn.units import OUTER, split_units
from numesh.optim.zero import ZeroOptimizer
from numesh.perf.formulas import dp_bytes, memory_formula
from numesh.run.train import Trainer, train

pytestmark = pytest.mark.mpi(min_size=2)



def mesh_for(kind: str) -> str:
    n = WORLD.Get_size()
    if kind == "dp":
        return f"dp={n}"
    if n not in (4, 8):
        pytest.skip("dp=2 x tp=N/2 runs on 4 and 8 ranks")
    return f"dp=2,tp={n // 2}"


# ---------------------------------------------------------------------------------------
# memory per rank


def paper_bytes(psi: int, n: int, stage: int) -> float:
    """Total bytes per rank for fp32 AdamW, written as the paper writes them."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def held_bytes(obj: Any, skip: tuple[str, ...] = ()) -> int:
    """Bytes of every distinct array buffer reachable from `obj`'s attributes (but not
    those named in `skip`), through containers, attrs classes and numesh objects; views
    count once, through the array that owns their memory."""
    seen: set[int] = set()
    owners: dict[int, np.ndarray] = {}

    def walk(x: Any) -> None:
        if id(x) in seen or x is None or isinstance(x, (str, int, float, bool, Mesh)):
            return
        seen.add(id(x))
        if isinstance(x, np.ndarray):
            if x.ndim and not any(x.strides):
                return  # a shape-only placeholder (broadcast scalar): no memory of its own
            while isinstance(x.base, np.ndarray):
                x = x.base
            if x.flags.owndata:
                owners[id(x)] = x
            return
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                walk(v)
        elif attrs.has(type(x)):
            for f in attrs.fields(type(x)):
                walk(getattr(x, f.name))
        elif type(x).__module__.startswith("numesh") and hasattr(x, "__dict__"):
            for v in vars(x).values():
                walk(v)

    for name, value in vars(obj).items():
        if name not in skip:
            walk(value)
    return sum(a.nbytes for a in owners.values())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["dp", "dp2xtp"])
def test_memory_per_rank_follows_the_zero_paper(shared_dataset: Path, shared_tmp: Path, kind: str, stage: int) -> None:
    mesh = mesh_for(kind)
    cfg = small_run_config(shared_dataset, shared_tmp / f"mem-{kind}-{stage}", mesh, zero=stage, dtype="float32")
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()  # memory between steps, after the buffers have been used
    opt, n, k = trainer.opt, trainer.mesh.size("dp"), 4
    # Ψ: this rank's tp-local parameters
    psi = sum(x.size for x in tree_leaves(trainer.params))
    assert psi == sum(u.size for u in opt.units.values())
    if trainer.mesh.size("tp") > 1:
        assert psi < trainer.n_params  # tp-local, not the global count
    padded = sum(u.padded for u in opt.units.values())
    assert 0 <= padded - psi <= len(opt.units) * (n - 1)  # each unit padded to a multiple of dp

    got = opt.memory()
    # memory() measures the buffers, padded to dp; sharded buffers hold 1/dp of them
    shard = padded // n
    assert got["params"] == k * (shard if stage >= 3 else padded)
    assert got["grads"] == k * (shard if stage >= 2 else padded)
    assert got["optimizer"] == 2 * k * (shard if stage >= 1 else padded)
    # ... and it accounts for every array the optimiser holds; the model loop keeps none
    # between steps (no gradient, activation or gathered parameter outlives its step)
    assert held_bytes(opt) == sum(got.values())
    assert held_bytes(trainer.pipeline, skip=("units",)) == 0

    # the paper's formula, within 1 % plus padding (at most dp - 1 values per unit and buffer)
    want = memory_formula(psi, n, stage, k)
    buffers = {"params": 1, "grads": 1, "optimizer": 2}
    for key, count in buffers.items():
        pad_bound = count * len(opt.units) * n * k
        assert abs(got[key] - want[key]) <= 0.01 * want[key] + pad_bound, (key, got[key], want[key])
    total = got["params"] + got["grads"] + got["optimizer"]
    assert sum(want.values()) == pytest.approx(paper_bytes(psi, n, stage), rel=1e-12)
    assert abs(total - paper_bytes(psi, n, stage)) <= 0.01 * paper_bytes(psi, n, stage) + 4 * len(opt.units) * n * k
    # working buffers sit beside the state: AdamW's scratch, one optimiser shard of values,
    # and the decay and norm masks, one byte per value each
    assert got["workspace"] == (k + 2) * (shard if stage >= 1 else padded)


def test_memory_shrinks_with_each_stage(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    totals = []
    for stage in range(4):
        cfg = small_run_config(shared_dataset, shared_tmp / f"mem-order-{stage}", f"dp={n}", zero=stage,
                               dtype="float32")
        mem = Trainer(cfg, WORLD).opt.memory()
        totals.append(mem["params"] + mem["grads"] + mem["optimizer"])
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals


# ---------------------------------------------------------------------------------------
# communication volume per step


def log_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[str, ...], str, int]]:
    """Record every counted collective from now on as (axes, op, payload bytes)."""
    calls: list[tuple[tuple[str, ...], str, int]] = []
    add = ByteCounter.add

    def logged(self: ByteCounter, axes: tuple[str, ...], op: str, nbytes: int, n: int) -> None:
        calls.append((axes, op, nbytes))
        add(self, axes, op, nbytes, n)

    monkeypatch.setattr(ByteCounter, "add", logged)
    return calls


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_step_follow_the_zero_paper(
    shared_dataset: Path, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, stage: int, micro_batches: int
) -> None:
    n = WORLD.Get_size()
    m = micro_batches
    cfg = small_run_config(
        shared_dataset, shared_tmp / f"bytes-{stage}-{m}", f"dp={n}", zero=stage, dtype="float32",
        micro_batches=m, batch_size=max(SMALL_BATCH, n * m),
    )
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    counter = trainer.mesh.counter
    counter.reset()
    calls = log_calls(monkeypatch)
    trainer.train_step()  # one optimiser step: no evaluation, no checkpoint

    k, f = 4, (n - 1) / n
    units = trainer.opt.units
    P = sum(u.padded for u in units.values())  # every unit padded to a multiple of dp
    P_blocks = sum(u.padded for name, u in units.items() if not name.is_outer)
    P_outer = units[OUTER].padded
    plain_dp = 2 * f * P * k  # all-reduce of every gradient once

    # the only other collectives are two scalars: the step's loss over pp x dp, and the
    # gradient norm's partial sums over dp once gradients are sharded (stage >= 1)
    scalars = [c for c in calls if c[2] == 8]
    assert sorted(scalars) == sorted([(("pp", "dp"), "all_reduce", 8)] + [(("dp",), "all_reduce", 8)] * (stage >= 1))
    scalar_bus = 2 * f * 8 * (stage >= 1)
    assert counter.total(("pp", "dp")) == pytest.approx(2 * f * 8, rel=1e-12)
    assert counter.total() == pytest.approx(counter.total("dp") + 2 * f * 8, rel=1e-12)  # nothing on tp or pp

    payload = {op: counter.total("dp", op, kind="payload") for op in ("all_reduce", "reduce_scatter", "all_gather")}
    # stage 2 and 3 reduce-scatter each block's gradient per micro-batch (they keep no full
    # gradient to accumulate into); the embedding/head unit's gradient is summed over
    # micro-batches by the executor and reduced once. Stage 3 gathers every unit once for
    # each micro-batch's forward and once for its backward.
    want = {
        0: {"all_reduce": P * k, "reduce_scatter": 0, "all_gather": 0},
        1: {"all_reduce": 8, "reduce_scatter": P * k, "all_gather": P * k},
        2: {"all_reduce": 8, "reduce_scatter": (m * P_blocks + P_outer) * k, "all_gather": P * k},
        3: {"all_reduce": 8, "reduce_scatter": (m * P_blocks + P_outer) * k, "all_gather": 2 * m * P * k},
    }[stage]
    assert payload == want
    # numesh.perf.formulas (what `numesh report` compares a traced run with) says the same, less the norm's scalar
    formula = dp_bytes(stage, m, P_blocks, P_outer, k)
    assert ({op: want[op] - 8 * (op == "all_reduce" and stage >= 1) for op in want}
            == {op: formula.get(op, 0) for op in want})
    gradient_bus = counter.total("dp") - scalar_bus

    if m == 1:
        ratio = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}[stage]
        assert gradient_bus == pytest.approx(ratio * plain_dp, rel=1e-12)
        # against Ψ (unpadded, tp-local) within 1 % plus padding
        psi = sum(u.size for u in units.values())
        pad = 3 * f * k * (P - psi)
        assert abs(gradient_bus - ratio * 2 * f * psi * k) <= 0.01 * ratio * 2 * f * psi * k + pad
    else:
        # with m micro-batches stage 0/1 still reduce once per step; 2 and 3 pay per micro-batch
        assert gradient_bus == pytest.approx(
            {0: plain_dp, 1: plain_dp, 2: f * k * (m * P_blocks + P_outer + P),
             3: f * k * (2 * m * P + m * P_blocks + P_outer)}[stage],
            rel=1e-12,
        )


@pytest.mark.parametrize("overlap", [True, False])
def test_bucketing_and_overlap_move_the_same_bytes(shared_dataset: Path, shared_tmp: Path, overlap: bool) -> None:
    """One bucket per unit (tiny buckets), with or without overlap: the same all-reduce bytes."""
    n = WORLD.Get_size()
    cfg = small_run_config(shared_dataset, shared_tmp / f"buckets-{overlap}", f"dp={n}", dtype="float32",
                     bucket_mb=1e-6, overlap=overlap)
    trainer = Trainer(cfg, WORLD)
    trainer.mesh.counter.reset()
    trainer.train_step()
    c = trainer.mesh.counter
    P = sum(u.padded for u in trainer.opt.units.values())
    assert c.total("dp", "all_reduce", kind="calls") == len(trainer.opt.units)
    assert c.total("dp", "all_reduce", kind="payload") == P * 4
    assert c.total("dp") == pytest.approx(2 * (n - 1) / n * P * 4, rel=1e-12)


# ---------------------------------------------------------------------------------------
# parity with tensor parallelism and micro-batches


def parity_mesh() -> str:
    n = WORLD.Get_size()
    return {2: "dp=2", 4: "dp=2,tp=2", 8: "dp=4,tp=2"}.get(n, f"dp={n}")


@pytest.mark.parametrize(
    "zero, micro_batches",
    [(0, 1), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2)],
    ids=["zero0", "zero1", "zero2", "zero3", "zero2-mb2", "zero3-mb2"],
)
def test_zero_with_tp_and_micro_batches_matches_one_rank(
    shared_dataset: Path, shared_tmp: Path, zero: int, micro_batches: int
) -> None:
    """dp=2 (2 ranks), dp=2 x tp=2 (4), dp=4 x tp=2 (8), float64, against the plain 1-rank run.
    Cases covered by test_mpi_data_parallel.py (dp=N with one micro-batch, dp=2 x tp=2
    without ZeRO) are skipped."""
    n = WORLD.Get_size()
    mesh = parity_mesh()
    if micro_batches == 1 and (n == 2 or (n == 4 and zero == 0)):
        pytest.skip(f"{mesh} zero={zero} is in test_mpi_data_parallel.py")
    cfg = small_run_config(shared_dataset, shared_tmp / f"parity-{mesh}-{zero}-{micro_batches}", mesh,
                     zero=zero, micro_batches=micro_batches)
    assert_same_run(train_records(cfg, WORLD), serial_reference(attrs.evolve(cfg, zero=0)))


# ---------------------------------------------------------------------------------------
# bad input


def same_error_everywhere(fn: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match) as info:
        fn()
    messages = WORLD.allgather(str(info.value))  # every rank got here: no hang, same message
    assert messages == [messages[0]] * WORLD.Get_size()


@pytest.mark.parametrize("zero", [-1, 4])
def test_zero_stage_outside_0_to_3_fails_on_every_rank(shared_dataset: Path, shared_tmp: Path, zero: int) -> None:
    n = WORLD.Get_size()
    out = shared_tmp / f"bad-zero{zero}"
    same_error_everywhere(lambda: train(small_run_config(shared_dataset, out, f"dp={n}", zero=zero), WORLD),
                          ConfigError, f"--zero must be 0, 1, 2 or 3, got {zero}")
    WORLD.Barrier()
    assert not out.exists()
    # the optimiser itself rejects it before any collective
    mesh = Mesh.create(WORLD, dp=n)
    try:
        cfg = small_run_config(shared_dataset, out, f"dp={n}").model(11)
        params = init_gpt(cfg, mesh, 0, np.float32)
        same_error_everywhere(lambda: ZeroOptimizer(split_units(params), split_units(gpt_specs(cfg)), mesh, stage=zero),
                              ValueError, "ZeRO stage must be 0, 1, 2 or 3")
    finally:
        mesh.free()


@pytest.mark.parametrize("zero", [0, 3])
def test_batch_not_divisible_by_dp_times_micro_batches_fails_on_every_rank(
    shared_dataset: Path, shared_tmp: Path, zero: int
) -> None:
    """Divisible by dp but not by dp x micro-batches (dp alone is in test_mpi_data_parallel.py)."""
    n = WORLD.Get_size()
    out = shared_tmp / f"bad-micro-{zero}"
    cfg = small_run_config(shared_dataset, out, f"dp={n}", zero=zero, batch_size=2 * n, micro_batches=3)
    same_error_everywhere(lambda: train(cfg, WORLD), ConfigError,
                          f"batch_size {2 * n} is not divisible by dp={n} x micro_batches=3: use a multiple of {3 * n}")
    same_error_everywhere(lambda: Trainer(cfg, WORLD), ConfigError, "not divisible")
    WORLD.Barrier()
    assert not out.exists()


def test_mesh_of_wrong_size_fails_on_every_rank(shared_dataset: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    same_error_everywhere(
        lambda: Trainer(small_run_config(shared_dataset, shared_tmp / "bad-mesh", f"dp={n},tp=2", zero=3), WORLD),
        MeshError, f"needs {2 * n} ranks",
    )
