"""Pipeline parallelism reproduces the 1-rank training run, and the executor does what the
schedules say.

Whole `numesh.run.train.train` runs in float64 (dropout 0.1, biases on): losses, gradient norms,
evaluation losses and final parameters equal to 1e-10 relative to the plain
dp=1,tp=1,pp=1 run (one micro-batch, no ZeRO). Adapts to the world size N:

* pp=N with every schedule (gpipe, 1f1b, interleaved with v=2, zb-h1) at micro-batch
  counts m in {N/2, N, 2N} that divide the batch (interleaved: multiples of N only), so
  m < p, m = p and m > p are all covered where the batch allows;
* every other mesh with dp·tp·pp = N and pp > 1 (on 4 ranks pp=2 with dp=2 or tp=2; on 8
  pp=4 with dp=2 or tp=2, pp=2 with dp=4 or tp=4, and dp=2,tp=2,pp=2), each schedule
  once, the ZeRO stage rotating over the schedules on meshes with dp > 1 so that every
  stage meets the pipeline;
* measured activation memory (`StepStats.peak_live`, `peak_bytes`) against
  `schedules.peak_activations`, and GPipe against 1F1B;
* the measured timeline and idle fraction against the action lists (no timing asserted);
* bad pipeline configurations fail on every rank, before any communication, with a
  message that says what to change.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from conftest import WORLD, assert_same_run, serial_reference, train_records
from numesh.base.errors import ConfigError
from numesh.pipeline.schedules import ScheduleError, bubble_fraction, peak_activations, simulate
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer, train

pytestmark = pytest.mark.mpi(min_size=2)

N = max(WORLD.Get_size(), 2)  # plain `pytest` collects the 2-rank cases (pytest-mpi skips them)
BATCH = 8
N_HEAD = 4
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved" else 1


def n_layer_for(pp: int, v: int) -> int:
    """The smallest multiple of pp·v that is at least 4 (several layers per stage on small meshes)."""
    k = pp * v
    return k * -(-4 // k)


def run_config(data: Path, out: Path, mesh: str, pp: int, schedule: str, **kw: object) -> TrainConfig:
    v = chunks(schedule)
    base: dict = dict(
        n_layer=n_layer_for(pp, v), n_head=N_HEAD, n_embd=16, block_size=8, batch_size=BATCH, max_iters=3,
        dropout=0.1, bias=True, learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=3,
        grad_clip=0.5, eval_interval=2, eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=11,
        dtype="float64", schedule=schedule, virtual_stages=v,
        peak_flops=1e12,  # MFU's denominator given: parity ignores MFU, and measuring it took a third of a run
    )
    base.update(kw)
    return config_from(base)


def plain_reference(cfg: TrainConfig):
    """The dp=1,tp=1,pp=1 run with one micro-batch and no ZeRO: the strictest reference."""
    return serial_reference(attrs.evolve(cfg, schedule="1f1b", virtual_stages=1, micro_batches=1, zero=0))


# ---------------------------------------------------------------------------------------
# parity with the 1-rank run


def pure_pipeline_cases(n: int) -> list:
    cases = []
    for schedule in SCHEDULES:
        for m in sorted({n // 2, n, 2 * n}):
            if m < 1 or BATCH % m or (schedule == "interleaved" and m % n):
                continue
            cases.append(pytest.param(f"pp={n}", n, schedule, m, 0, id=f"pp{n}-{schedule}-m{m}"))
    return cases


def mixed_meshes(n: int) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) with pp·dp·tp = n, pp > 1 and dp·tp > 1 (tp at most n_head)."""
    out = []
    for pp in range(2, n):
        for dp in range(1, n + 1):
            if n % (pp * dp):
                continue
            tp = n // (pp * dp)
            if dp * tp > 1 and N_HEAD % tp == 0:
                out.append((pp, dp, tp))
    return out


def mixed_cases(n: int) -> list:
    cases = []
    dp_meshes = 0
    for pp, dp, tp in mixed_meshes(n):
        mesh = ",".join(f"{a}={s}" for a, s in (("dp", dp), ("tp", tp), ("pp", pp)) if s > 1)
        for i, schedule in enumerate(SCHEDULES):
            # with dp > 1 the ZeRO stage rotates over the schedules, shifted from mesh to mesh
            zero = (i + 1 + dp_meshes) % 4 if dp > 1 else 0
            m = pp  # a multiple of pp (interleaved) that divides the per-dp batch
            if (BATCH // dp) % m:
                continue
            cases.append(pytest.param(mesh, pp, schedule, m, zero, id=f"{mesh}-{schedule}-m{m}-zero{zero}"))
        dp_meshes += dp > 1
    return cases


@pytest.mark.parametrize("mesh, pp, schedule, m, zero", pure_pipeline_cases(N) + mixed_cases(N))
def test_pipeline_matches_one_rank(
    shared_dataset: Path, shared_tmp: Path, mesh: str, pp: int, schedule: str, m: int, zero: int
) -> None:
    cfg = run_config(shared_dataset, shared_tmp / f"{mesh}-{schedule}-m{m}-z{zero}", mesh, pp, schedule,
                     micro_batches=m, zero=zero)
    assert_same_run(train_records(cfg, WORLD), plain_reference(cfg))


def test_mixed_meshes_cover_every_factorisation() -> None:
    """The cases above are every dp·tp·pp = N mesh with pp > 1, each with every schedule,
    and together they meet every ZeRO stage: nothing the world size allows is dropped."""
    n = WORLD.Get_size()
    want = {(pp, dp, n // (pp * dp)) for pp in range(2, n + 1) for dp in range(1, n + 1) if n % (pp * dp) == 0}
    assert {(n, 1, 1)} | set(mixed_meshes(n)) == want
    if n in (2, 4, 8):
        pure = {(c.values[2], c.values[3]) for c in pure_pipeline_cases(n)}
        assert {(s, m) for s in SCHEDULES for m in (n, n // 2) if s != "interleaved"} <= pure  # m = p, m < p
        assert ("interleaved", n) in pure
        assert len(mixed_cases(n)) == 4 * len(mixed_meshes(n))  # every mixed mesh with every schedule
    if n in (4, 8):
        assert {c.values[4] for c in mixed_cases(n)} == {0, 1, 2, 3}
    if n == 8:
        assert {c.values[4] for c in mixed_cases(n) if c.values[0] == "dp=2,tp=2,pp=2"} == {0, 1, 2, 3}


# ---------------------------------------------------------------------------------------
# activation memory and the measured timeline


def one_step(data: Path, out: Path, schedule: str, m: int) -> Trainer:
    """A trainer on the pp=N mesh after one step with m micro-batches of one sequence each."""
    n = WORLD.Get_size()
    cfg = run_config(data, out, f"pp={n}", n, schedule, micro_batches=m, batch_size=m, max_iters=1, dropout=0.0)
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    return trainer


def memory_m(n: int) -> int:
    return 2 * n  # more micro-batches than stages, and a multiple of p for interleaved


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_peak_activations_follow_the_schedule(shared_dataset: Path, shared_tmp: Path, schedule: str) -> None:
    """The executor's count of live micro-batch chunks is the one the action list predicts."""
    n = WORLD.Get_size()
    m = memory_m(n)
    trainer = one_step(shared_dataset, shared_tmp / f"mem-{schedule}", schedule, m)
    rank, stats, s = trainer.mesh.index("pp"), trainer.last_stats, trainer.schedule
    want = peak_activations(s)
    assert stats.peak_live == want[rank]
    assert stats.peak_bytes > 0
    if schedule == "gpipe":
        assert want == [m] * n
    elif schedule == "1f1b":
        assert want == [n - r for r in range(n)]  # <= p everywhere, p on the first stage
    elif schedule == "zb-h1":
        assert want == [n] * n  # each W a little later than 1F1B's full B, still never more than p
    else:  # Megatron's warm-up plus one, in chunks (each 1/v of a stage)
        assert want == [min(2 * (n - r - 1) + (s.v - 1) * n + 1, s.v * m) for r in range(n)]
        assert max(want) < s.v * m


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_step_leaves_no_reference_cycles(shared_dataset: Path, shared_tmp: Path, schedule: str) -> None:
    """A pipeline step makes no garbage that only Python's cyclic collector frees: arrays in
    a cycle live until it runs (a walk written as a closure calling itself held a step's
    gradients that way)."""
    import gc

    trainer = one_step(shared_dataset, shared_tmp / f"cycles-{schedule}", schedule, memory_m(WORLD.Get_size()))
    gc.collect()
    was, flags = gc.isenabled(), gc.get_debug()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        trainer.train_step()
        found = gc.collect()
        kinds = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert WORLD.allgather((found, kinds)) == [(0, [])] * WORLD.Get_size()  # every rank fails alike


def test_gpipe_holds_m_micro_batches_and_1f1b_p(shared_dataset: Path, shared_tmp: Path) -> None:
    """GPipe holds all m micro-batches' activations on every stage, 1F1B at most p (p - s on
    stage s); every micro-batch saves the same arrays, so the measured peak bytes of the
    first stage differ by exactly m / p."""
    n = WORLD.Get_size()
    m = memory_m(n)
    g = one_step(shared_dataset, shared_tmp / "mem-g", "gpipe", m)
    f = one_step(shared_dataset, shared_tmp / "mem-f", "1f1b", m)
    mine = (g.mesh.index("pp"), g.last_stats.peak_live, f.last_stats.peak_live,
            g.last_stats.peak_bytes, f.last_stats.peak_bytes)
    by_stage = {r[0]: r[1:] for r in WORLD.allgather(mine)}
    assert sorted(by_stage) == list(range(n))
    for stage, (g_live, f_live, g_bytes, f_bytes) in by_stage.items():
        assert g_live == m
        assert f_live == n - stage <= n
        assert g_bytes > f_bytes
    g_live, f_live, g_bytes, f_bytes = by_stage[0]
    assert f_live == n
    assert g_bytes == pytest.approx(f_bytes * m / n, rel=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_timeline_and_idle_fraction(shared_dataset: Path, shared_tmp: Path, schedule: str) -> None:
    """The executor ran exactly this rank's action list in order; its measured idle
    fraction is a fraction; the theoretical bubble of the list is the closed form."""
    n = WORLD.Get_size()
    m = memory_m(n)
    trainer = one_step(shared_dataset, shared_tmp / f"tl-{schedule}", schedule, m)
    s, stats = trainer.schedule, trainer.last_stats
    rank = trainer.mesh.index("pp")
    acts = s.actions[rank]
    assert [(k, mb, c) for k, mb, c, _, _ in stats.timeline] == [(a.kind, a.mb, a.chunk) for a in acts]
    prev_end = 0.0
    for _, _, _, t0, t1 in stats.timeline:
        assert prev_end <= t0 <= t1 <= stats.span_s
        prev_end = t1
    assert 0.0 < stats.busy_s <= sum(t1 - t0 for *_, t0, t1 in stats.timeline) + 1e-9  # waits excluded
    assert stats.busy_s <= stats.span_s
    assert 0.0 <= stats.idle_fraction < 1.0

    p, v = s.p, s.v
    closed = {
        "gpipe": (p - 1) / (m + p - 1),
        "1f1b": (p - 1) / (m + p - 1),
        "interleaved": (p - 1) / (v * m + p - 1),  # a chunk costs 1/v of a stage
        "zb-h1": (p - 1) / (3 * m + p - 1),  # t_f = t_b = t_w: idle (p-1)(t_f + t_b - t_w)
    }[schedule]
    t = 1.0 / v
    assert bubble_fraction(s, t_f=t, t_b=t, t_w=t) == pytest.approx(closed, rel=1e-12)

    # the list simulated with this rank's measured mean action times is a valid fraction too
    mean = {}
    for kind in ("F", "B", "W"):
        d = [t1 - t0 for k, _, _, t0, t1 in stats.timeline if k == kind]
        mean[kind] = sum(d) / len(d) if d else 0.0
    t_w = mean["W"] if s.split_backward else 0.0
    sim = simulate(s, t_f=mean["F"], t_b=mean["B"], t_w=t_w)
    assert 0.0 <= sim.bubble_fraction < 1.0


# ---------------------------------------------------------------------------------------
# bad configurations


def bad_cases() -> list:
    """(overrides as a function of N, error class, what went wrong, what to change)."""
    return [
        pytest.param(lambda n: dict(schedule="interleaved", n_layer=2 * n + 2), ConfigError,
                     r"n_layer={l} is not divisible by pp x virtual stages = {p} x 2", r"multiple of {pv}",
                     id="layers-not-divisible-by-pp-v"),
        pytest.param(lambda n: dict(schedule="1f1b", n_layer=n + 1), ConfigError,
                     r"n_layer={l} is not divisible by pp x virtual stages = {p} x 1", r"multiple of {p}\b",
                     id="layers-not-divisible-by-pp"),
        pytest.param(lambda n: dict(schedule="interleaved", micro_batches=1), ScheduleError,
                     r"interleaved needs micro-batches m=1 to be a multiple of pp={p}", r"\(e\.g\. m={p}\)$",
                     id="interleaved-m-less-than-p"),
        pytest.param(lambda n: dict(schedule="interleaved", micro_batches=3 * n // 2, batch_size=3 * n // 2),
                     ScheduleError, r"interleaved needs micro-batches m={m} to be a multiple of pp={p}",
                     r"e\.g\. m={p} or m={p2}\)", id="interleaved-m-more-than-p-not-multiple"),
        pytest.param(lambda n: dict(schedule="pipedream"), ScheduleError, r"unknown pipeline schedule 'pipedream'",
                     r"choose one of: gpipe, 1f1b, interleaved, zb-h1", id="unknown-schedule"),
        pytest.param(lambda n: dict(schedule="1f1b", virtual_stages=2, n_layer=n_layer_for(n, 2)), ScheduleError,
                     r"schedule '1f1b' runs one model chunk per rank, got v=2", r"use v=1 or 'interleaved'",
                     id="virtual-stages-without-interleaved"),
        pytest.param(lambda n: dict(schedule="interleaved", virtual_stages=1), ScheduleError,
                     r"interleaved needs v >= 2 model chunks per rank, got v=1", r"use 1f1b",
                     id="interleaved-with-one-chunk"),
        pytest.param(lambda n: dict(schedule="gpipe", micro_batches=3), ConfigError,
                     r"batch_size 8 is not divisible by dp=1 x micro_batches=3", r"use a multiple of 3",
                     id="batch-not-divisible-by-micro-batches"),
    ]


@pytest.mark.parametrize("make, error, what, fix", bad_cases())
def test_bad_pipeline_config_fails_on_every_rank(
    shared_dataset: Path, shared_tmp: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
    make, error: type, what: str, fix: str,
) -> None:
    """`train` raises the same one-line error on every rank before any collective (a
    collective on some ranks only would hang), naming the bad value and what to use."""
    import numesh.run.train

    n = WORLD.Get_size()
    kw = make(n)
    schedule = kw.pop("schedule")
    kw.setdefault("micro_batches", n)
    out = shared_tmp / ("bad-" + request.node.callspec.id)
    cfg = run_config(shared_dataset, out, f"pp={n}", n, schedule, **kw)

    def no_mesh(*args: object, **kwargs: object) -> None:  # the mesh is the trainer's first collective
        raise AssertionError("the mesh was built before the configuration was rejected")

    monkeypatch.setattr(numesh.run.train, "Mesh", no_mesh)
    with pytest.raises(error) as info:
        train(cfg, WORLD)
    msg = str(info.value)
    # only the ranks that raised get here: a hang would be a timeout, not this gather
    everyone = WORLD.allgather((type(info.value).__name__, msg))
    assert len(set(everyone)) == 1, everyone
    assert type(info.value) is error
    fmt = dict(p=n, p2=2 * n, pv=2 * n, l=cfg.n_layer, m=cfg.micro_batches)
    assert re.search(what.format(**fmt), msg), msg
    assert re.search(fix.format(**fmt), msg), msg
    assert "\n" not in msg
    WORLD.Barrier()
    assert not out.exists()  # nothing written before the error
