"""`numesh plan --calibrate`: measure this machine into a hardware profile.

Run under `mpirun -n N` to measure what N ranks sharing this machine get: every rank times
the same thing at the same moment (a barrier before each), so the contention of N ranks on
the cores and memory is in the numbers, and the median over ranks is kept. Measured:
* the seconds of each GEMM shape the model's layouts on N ranks run (collected by asking
  the time model which shapes it needs), and a curve of square-ish GEMMs for others;
* numesh's element-wise kernels (LayerNorm, GELU, the softmax's element-wise part, a
  residual add, AdamW) by array size;
* all-reduce on groups of every size dividing N (all groups at once, as a mesh axis
  runs), and a send between pairs, by payload (medians of 3 rounds);
* with a dataset, real training steps: each rank alone at 1 and more micro-batches
  (`fit_steps`: how much slower kernels run inside a step, and the Python per block
  action), then a tp mesh on all N (`fit_sync`: how long blocking calls wait for their
  groups' last members).
Calibrating with 1, 2, 4 and 8 ranks in turn fills one profile (each run adds its count).
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import attrs
import numpy as np
from mpi4py import MPI

from numesh.base.errors import ConfigError
from numesh.host.threads import threads as numesh_threads
from numesh.nn.attention import QUERY_TILE, stripe_passes
from numesh.nn.layers import (
    LayerNorm,
    RMSNorm,
    gelu_bwd,
    gelu_fwd,
    layernorm_bwd,
    layernorm_fwd,
    rmsnorm_bwd,
    rmsnorm_fwd,
    swiglu_bwd,
    swiglu_fwd,
)
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step
from numesh.plan.hardware import Measured, Profile, check_profile_out, load_profile, save_profile
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.search import train_config, valid_layouts
from numesh.plan.timing import Placement, block_cost, blocking_calls, outer_cost, placement, predict_time
from numesh.run.config import TrainConfig

if TYPE_CHECKING:
    from numesh.run.train import Trainer

ELEMENT_SIZES = [4**i for i in range(5, 12)]  # 1 Ki .. 4 Mi values
COMM_SIZES = [8] + [4**i for i in range(3, 13)]  # 8 B .. 16 MiB
GEMM_CURVE = [(64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 1024, 1024)]


class _ShapeRecorder:
    """Stands in for a Profile to collect the GEMM shapes the time model asks for."""

    def __init__(self, itemsize: int):
        self.itemsize, self.measured, self.devices_per_node, self.overlap = itemsize, {0: None}, 1, False
        self.shapes: set[tuple[int, int, int, int]] = set()

    def gemm_time(self, b: int, m: int, k: int, n: int, ranks_on_node: int) -> float:
        self.shapes.add((b, m, k, n))
        return 0.0

    def elementwise_time(self, *args: object) -> float:
        return 0.0

    def comm_time(self, *args: object) -> float:
        return 0.0

    def call_overhead(self, *args: object) -> float:
        return 0.0


def model_gemm_shapes(base: TrainConfig, model: ModelSpec, ranks: int, itemsize: int) -> set[tuple[int, int, int, int]]:
    """Every (batch, m, k, n) matmul the layouts of `model` on `ranks` ranks run."""
    rec = _ShapeRecorder(itemsize)
    for lay in valid_layouts(base, model, ranks):
        place = placement(lay, rec)  # type: ignore[arg-type]
        block_cost(model, lay, rec, place, False)  # type: ignore[arg-type]
        if model.moe_experts:  # the router's and the experts' GEMMs too
            block_cost(model, lay, rec, place, False, moe=True)  # type: ignore[arg-type]
        outer_cost(model, lay, rec, place, True, True)  # type: ignore[arg-type]
    return rec.shapes


def _timed(comm: MPI.Comm, fn: Callable[[], object], min_time: float = 0.1, reps: int = 3) -> float:
    """Seconds of fn() with every rank running it at once: the wall time of a run of repeats
    lasting at least `min_time`, over the repeats (the median over ranks). A mean over a
    long run, not the best of short ones: a rank that shares its core (oversubscribed, or a
    busy machine) is measured with its share, as a training step gets it."""
    fn()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    n = max(reps, min(1000, int(min_time / max(once, 1e-7))))
    n = comm.allreduce(n, op=MPI.MAX)  # the same count everywhere: collectives stay matched
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    mine = (time.perf_counter() - t0) / n
    return statistics.median(comm.allgather(mine))


def _gemm(comm: MPI.Comm, shape: tuple[int, int, int, int], dtype: np.dtype) -> float:
    b, m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((b, m, k) if b > 1 else (m, k)).astype(dtype)
    w = rng.standard_normal((b, k, n) if b > 1 else (k, n)).astype(dtype)
    out = np.empty((b, m, n) if b > 1 else (m, n), dtype)
    return _timed(comm, lambda: np.matmul(a, w, out=out))


def _elementwise(comm: MPI.Comm, kernel: str, n: int, C: int, T: int, dtype: np.dtype) -> float:
    rng = np.random.default_rng(0)
    if kernel.startswith("softmax"):  # the attention kernel's passes over one stripe of scores
        keys = max(1, min(T, n // QUERY_TILE))
        fwd, bwd = stripe_passes(keys, QUERY_TILE, dtype)
        return _timed(comm, fwd if kernel.endswith("fwd") else bwd) * n / (keys * QUERY_TILE)
    if kernel.startswith("layernorm"):
        rows = max(1, n // C)
        x = rng.standard_normal((rows, C)).astype(dtype)
        p = LayerNorm(np.ones(C, dtype))
        y, ctx = layernorm_fwd(p, x)
        fn = (lambda: layernorm_fwd(p, x)) if kernel.endswith("fwd") else (lambda: layernorm_bwd(p, ctx, y))
        return _timed(comm, fn) * n / (rows * C)
    if kernel.startswith("rmsnorm"):
        x = rng.standard_normal((max(1, n // C), C)).astype(dtype)
        q = RMSNorm(np.ones(C, dtype))
        y, ctx = rmsnorm_fwd(q, x, 1e-5)
        fn = (lambda: rmsnorm_fwd(q, x, 1e-5)) if kernel.endswith("fwd") else (lambda: rmsnorm_bwd(q, ctx, y))
        return _timed(comm, fn) * n / x.size
    if kernel.startswith("swiglu"):  # per hidden value: the gate's and up's values together
        gate, up = (rng.standard_normal((max(1, n // (4 * C)), 4 * C)).astype(dtype) for _ in range(2))
        y, ctx = swiglu_fwd(gate, up)
        fn = (lambda: swiglu_fwd(gate, up)) if kernel.endswith("fwd") else (lambda: swiglu_bwd(ctx, y))
        return _timed(comm, fn) * n / gate.size
    if kernel.startswith("gelu"):
        x = rng.standard_normal((max(1, n // (4 * C)), 4 * C)).astype(dtype)
        _, ctx = gelu_fwd(x)
        fn = (lambda: gelu_fwd(x)) if kernel.endswith("fwd") else (lambda: gelu_bwd(ctx, x))
        return _timed(comm, fn) * n / x.size
    if kernel == "copy":
        a, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
        out = np.empty_like(a)
        return _timed(comm, lambda: np.add(a, b, out=out))
    if kernel == "adamw":
        p, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
        state = AdamWState(np.zeros_like(p), np.zeros_like(p))
        decay, scratch = np.ones(n, dtype=bool), np.empty_like(p)
        return _timed(comm, lambda: adamw_step(p, g, state, 1e-4, AdamWConfig(), decay, scratch))
    raise ValueError(kernel)


KERNELS = ("layernorm_fwd", "layernorm_bwd", "gelu_fwd", "gelu_bwd", "softmax_fwd", "softmax_bwd", "copy", "adamw",
           "rmsnorm_fwd", "rmsnorm_bwd", "swiglu_fwd", "swiglu_bwd")


def _collectives(comm: MPI.Comm, dtype: np.dtype, rounds: int = 3) -> dict[str, tuple[tuple[float, float], ...]]:
    """All-reduce on groups of each size dividing N (consecutive ranks, all groups at once)
    and a send between pairs, by payload bytes: the median of `rounds` measurements, each
    round going over every group size and payload once. One round alone moved by 4x from
    one calibration to the next (2 ranks on the 2-core VM, 1 MiB: 124 to 542 us), and tp's
    and dp's predictions with it."""
    n, rank = comm.Get_size(), comm.Get_rank()
    groups = [d for d in range(2, n + 1) if n % d == 0]
    subs = {g: comm.Split(rank // g, rank) for g in groups}
    partner = rank ^ 1 if (rank ^ 1) < n else rank
    bufs = {size: np.ones(max(1, size // 8), np.float64) for size in COMM_SIZES}
    recv = {size: np.empty(max(1, size // 8), np.float64) for size in COMM_SIZES}
    calls: dict[str, Callable[[int], Callable[[], object]]] = {
        f"all_reduce:{g}": (lambda g: lambda size: lambda: subs[g].Allreduce(MPI.IN_PLACE, bufs[size]))(g)
        for g in groups}
    calls["send"] = lambda size: lambda: comm.Sendrecv(bufs[size], partner, 7, recv[size], partner, 7)
    times: dict[str, dict[int, list[float]]] = {k: {size: [] for size in COMM_SIZES} for k in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            for size in COMM_SIZES:
                times[key][size].append(_timed(comm, call(size), 0.05))
    for sub in subs.values():
        sub.Free()
    return {key: tuple((float(bufs[size].nbytes), statistics.median(ts[size])) for size in COMM_SIZES)
            for key, ts in times.items()}


def calibrate(base: TrainConfig, model: ModelSpec, comm: MPI.Comm | None = None,
              log: Callable[[str], None] = lambda s: None) -> Measured:
    """Measure what `comm`'s ranks get on this machine, running at once (collective)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    n = comm.Get_size()
    dtype = np.dtype(base.dtype)
    shapes = sorted(model_gemm_shapes(base, model, n, dtype.itemsize))
    log(f"calibrating {n} rank(s): {len(shapes)} GEMM shapes of the model's layouts")
    gemm = {",".join(map(str, s)): _gemm(comm, s, dtype) for s in shapes}
    curve = tuple((2.0 * m * k * nn, _gemm(comm, (1, m, k, nn), dtype)) for m, k, nn in GEMM_CURVE)
    log("element-wise kernels")
    elementwise = {
        k: tuple((float(s), _elementwise(comm, k, s, model.n_embd, model.block_size, dtype)) for s in ELEMENT_SIZES)
        for k in KERNELS
    }
    log("collectives")
    collectives = _collectives(comm, dtype) if n > 1 else {}
    measured = Measured(n, numesh_threads(), gemm, tuple(sorted(curve)), elementwise, collectives)
    log("training steps")
    return fit_steps(comm, base, model, measured, log)


# a timed run: no flight recorder, no MFU start-up benchmark, no evaluation, no end
QUIET = dict(collective_timeout=0.0, peak_flops=1e12, eval_interval=10**9, max_iters=10**6)


def _alone(base: TrainConfig, rows: int, m: int) -> TrainConfig:
    """`base` on one rank, `rows` sequences a step in `m` micro-batches, nothing else on:
    the step calibration fits kernel times on."""
    return attrs.evolve(base, mesh="dp=1", batch_size=rows, micro_batches=m, zero=0, schedule="1f1b", virtual_stages=1,
                        recompute="none", sequence_parallel=False, **QUIET)


def _kernel_time(model: ModelSpec, measured: Measured, itemsize: int, m: int) -> float:
    """Predicted seconds of a one-rank step of `m` micro-batches from the kernel times
    alone (in_situ 1, no call overhead), with `measured.ranks` ranks sharing the node: the
    planner's own `predict_time`, so that the fit and the predictions count the same work
    (a copy of it here once left out the weight gradients, and every plan came out ~20 %
    slow on 2 ranks)."""
    prof = Profile(name="fit", source="", itemsize=itemsize, cores=os.cpu_count() or 1,
                   measured={measured.ranks: attrs.evolve(measured, in_situ=1.0, call_overhead_s=0.0)})
    place = Placement(measured.ranks, True, True, True, True)
    return predict_time(model, Layout(1, 1, 1, 0, "1f1b", m), prof, place=place).total


def _timed_steps(trainer: Trainer, comm: MPI.Comm, warmup: int, steps: int) -> list[float]:
    """This rank's seconds of `steps` training steps after `warmup`, every rank starting each
    step together (a barrier)."""
    for _ in range(warmup):
        trainer.train_step()
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    return times


def _round(trainer: Trainer, comm: MPI.Comm, first: bool) -> list[float]:
    """One round of a calibration's alternating measurements: this rank's seconds of 3
    steps after a warm-up (2 steps in the first round, 1 after)."""
    return _timed_steps(trainer, comm, 2 if first else 1, 3)


def _round_alone(trainer: Trainer, comm: MPI.Comm, first: bool) -> float:
    """A `_round` of a one-rank trainer on every rank at once: the median over ranks of
    each rank's median step."""
    return statistics.median(comm.allgather(statistics.median(_round(trainer, comm, first))))


def _step_times(comm: MPI.Comm, cfgs: list[TrainConfig], rounds: int = 3) -> list[float]:
    """Seconds of a training step of each of `cfgs` on each rank alone, every rank at once
    (so each gets its share of the cores, as in a run): the configs take turns for `rounds`
    rounds of 3 steps, and each gets the median over its rounds of the median over ranks.
    Taking turns keeps the machine's drift out of their differences: measured one after
    the other, the two steps `fit_steps` solves for moved the fitted overhead per block
    action from 0.9 to 2.8 ms between two calibrations of 8 ranks on the 2-core VM."""
    from numesh.run.train import Trainer  # noqa: PLC0415  (a training run only here)

    with tempfile.TemporaryDirectory() as out:
        trainers = [Trainer(attrs.evolve(cfg, out=f"{out}/{i}"), MPI.COMM_SELF) for i, cfg in enumerate(cfgs)]
        got: list[list[float]] = [[] for _ in cfgs]
        for r in range(rounds):
            for t, mine in zip(trainers, got):
                mine.append(_round_alone(t, comm, r == 0))
    return [statistics.median(mine) for mine in got]


def fit_scale_and_overhead(points: list[tuple[float, int, float]]) -> tuple[float, float]:
    """(in_situ, call overhead) from (kernel-sum prediction K, block actions A, measured T)
    of one or two steps: T = in_situ·K + overhead·A solved exactly for two; one step, or a
    solution with a negative part (noise), gives the overhead 0 and the ratio of the sums."""
    s = sum(t for _, _, t in points) / sum(k for k, _, _ in points)
    if len(points) != 2:
        return s, 0.0
    (k1, a1, t1), (k2, a2, t2) = points
    det = k1 * a2 - k2 * a1
    if det == 0:
        return s, 0.0
    s2, c2 = (t1 * a2 - t2 * a1) / det, (k1 * t2 - k2 * t1) / det
    return (s2, c2) if s2 > 0 and c2 >= 0 else (s, 0.0)


def fit_steps(comm: MPI.Comm, base: TrainConfig, model: ModelSpec, measured: Measured,
              log: Callable[[str], None] = lambda s: None) -> Measured:
    """`measured` with `in_situ` and `call_overhead_s` fitted on real steps: every rank
    trains the model alone on its dp share of the batch with 1 and with more micro-batches;
    measured = in_situ x (the kernel times' prediction) + call_overhead x (block actions).
    Kernels timed in a loop run faster than inside a step (caches, the allocator) and each
    block action pays Python between its kernels: on the 2-core VM the kernel sum alone
    predicted ~35 % less than measured. Without a dataset at `base.data` nothing is fitted."""
    n = comm.Get_size()
    rows = model.batch_size // n
    if rows < 1 or not (Path(base.data) / "meta.json").is_file():
        log(f"no dataset at {base.data}: kernel times used as measured (give --data to fit them on real steps)")
        return measured
    counts = sorted({1, max(d for d in (1, 2, 4, 8) if rows % d == 0)})
    spec = attrs.evolve(model, batch_size=rows)
    steps = _step_times(comm, [_alone(base, rows, m) for m in counts])
    points = [(_kernel_time(spec, measured, np.dtype(base.dtype).itemsize, m), m * 2 * model.n_layer, t)
              for m, t in zip(counts, steps)]
    s, c = fit_scale_and_overhead(points)
    log(f"steps measured {', '.join(f'{t * 1e3:.1f} ms' for _, _, t in points)} against kernel sums "
        f"{', '.join(f'{k * 1e3:.1f} ms' for k, _, _ in points)}: in situ x{s:.3f}, {c * 1e6:.0f} us per block action")
    return fit_sync(comm, base, model, attrs.evolve(measured, in_situ=s, call_overhead_s=c), log)


def sync_layout(model: ModelSpec, ranks: int) -> Layout | None:
    """The mesh `fit_sync` measures on `ranks` ranks: tp as wide as the heads allow (a
    blocking all-reduce after every attention and MLP), the rest dp; without tp, dp alone
    under ZeRO-3 (a gather per block in F and B). None on one rank."""
    if ranks < 2:
        return None
    tp = max(t for t in range(1, ranks + 1) if ranks % t == 0 and model.n_head % t == 0)
    dp = ranks // tp
    if tp > 1:
        return Layout(dp, tp, 1, 0, "1f1b", 1) if model.batch_size % dp == 0 else None
    return Layout(dp, 1, 1, 3, "1f1b", 1) if model.batch_size % dp == 0 else None


def sync_from_step(measured_s: float, predicted_s: float, compute_s: float, calls: float) -> tuple[float, float]:
    """(wait per blocking call, wait per second of predicted compute) from a mesh step
    measured at `measured_s` where the model (its compute `compute_s`, `calls` blocking
    calls) predicts `predicted_s` without waits: whatever the step takes beyond the
    prediction, none if less."""
    extra = max(0.0, measured_s - predicted_s)
    return (extra / calls, extra / compute_s) if calls > 0 and compute_s > 0 else (0.0, 0.0)


def fit_sync(comm: MPI.Comm, base: TrainConfig, model: ModelSpec, measured: Measured,
             log: Callable[[str], None] = lambda s: None, rounds: int = 3) -> Measured:
    """`measured` with `sync_s` and `sync_share` fitted on a real step of `sync_layout`: the
    collectives timed back to back in calibration find every rank already there, while in a
    step the ranks drift apart between calls and each blocking call waits for the last one
    (2-core VM, 2 ranks: a tp=2 step took ~8 % longer than predicted). The step's extra time
    over the prediction is spread over its blocking calls (`sync_s`, the wait of one call
    after a whole block's work) and over its compute (`sync_share`, for layouts whose calls
    come after less work each: with sp, or more micro-batches).

    The mesh step alternates, `rounds` times, with the one-rank step `fit_steps` fitted on,
    and the prediction is scaled by how that one now compares with its fit: the machine's
    speed drifts between the two measurements by as much as the waits (on the 2-core VM the
    fitted wait moved from 0 to 540 us per call between calibrations a minute apart)."""
    from numesh.run.train import Trainer  # noqa: PLC0415  (a training run only here)

    n = comm.Get_size()
    lay = sync_layout(model, n)
    if lay is None:
        return measured
    prof = Profile(name="fit", source="", itemsize=np.dtype(base.dtype).itemsize, cores=os.cpu_count() or 1,
                   measured={n: attrs.evolve(measured, sync_s=0.0, sync_share=0.0)})
    place = Placement(n, True, True, True, True)
    step = predict_time(model, lay, prof, place=place)
    calls = blocking_calls(model, lay, prof, place)
    rows = model.batch_size // n
    alone = predict_time(attrs.evolve(model, batch_size=rows), Layout(1, 1, 1, 0, "1f1b", 1), prof, place=place).total
    out = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None)
    mesh_t, alone_t = [], []
    try:
        mesh = Trainer(attrs.evolve(train_config(base, lay), out=out, **QUIET), comm)
        single = Trainer(attrs.evolve(_alone(base, rows, 1), out=f"{out}/alone-{comm.Get_rank()}"), MPI.COMM_SELF)
        for i in range(rounds):
            mesh_t += [comm.allreduce(t, op=MPI.MAX) for t in _round(mesh, comm, i == 0)]
            alone_t.append(_round_alone(single, comm, i == 0))
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)
    t, drift = statistics.median(mesh_t), statistics.median(alone_t) / alone
    q, r = sync_from_step(t, step.total * drift, step.compute, calls)  # so the profile predicts extra for it
    log(f"a {lay.mesh} step measured {t * 1e3:.1f} ms against {step.total * 1e3:.1f} ms predicted x{drift:.3f} "
        f"(the one-rank step against its fit, alternating): its {calls:.0f} blocking calls waited "
        f"{q * 1e6:.0f} us each ({r * 100:.1f} % of its compute)")
    return attrs.evolve(measured, sync_s=q, sync_share=r)


def merged_profile(path: Path, measured: Measured, dtype: str) -> Profile:
    """The profile at `path` (or a new one) with `measured` added for its rank count."""
    old = load_profile(str(path)) if path.is_file() else None
    if old is not None and old.dtype != dtype:
        old = None  # a calibration of another dtype is replaced, not mixed
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    base = old or Profile(name="local", source="", dtype=dtype, itemsize=np.dtype(dtype).itemsize)
    return attrs.evolve(
        base, source=f"numesh plan --calibrate on {platform.node()} ({os.cpu_count()} cores), {now}",
        # overlap: MPICH progresses nonblocking calls only inside MPI calls
        memory_bytes=float(ram), cores=os.cpu_count() or 1, overlap=False,
        measured={**base.measured, measured.ranks: measured},
    )


def run_calibration(base: TrainConfig, model: ModelSpec, path: Path, log: Callable[[str], None]) -> Path | None:
    """Calibrate on COMM_WORLD and (rank 0) save the merged profile at `path`; a `path` that
    cannot take it is one error on every rank before anything is measured."""
    comm = MPI.COMM_WORLD
    problem = None
    if comm.Get_rank() == 0:
        try:
            check_profile_out(path)
        except ConfigError as e:
            problem = str(e)
    if problem := comm.bcast(problem, root=0):
        raise ConfigError(problem)
    measured = calibrate(base, model, comm, log)
    if comm.Get_rank() == 0:
        return save_profile(merged_profile(path, measured, base.dtype), path)
    return None
