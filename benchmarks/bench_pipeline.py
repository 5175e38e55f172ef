#!/usr/bin/env python
"""Pipeline schedules side by side: speed, bubble (theory and measured) and activation memory.

    mpirun -n 2 python benchmarks/bench_pipeline.py                      # pp=2, m=8, every schedule
    mpirun -n 2 python benchmarks/bench_pipeline.py --micro-batches 4 --iters 50
    mpirun -n 4 python benchmarks/bench_pipeline.py --preset deep --micro-batches 8
    mpirun -n 2 python benchmarks/bench_pipeline.py --schedules 1f1b zb-h1 --json

Every rank gets one BLAS thread. The mesh is pp = all ranks (or `--mesh`, e.g. dp=2,pp=2).
Each schedule (gpipe, 1f1b, interleaved with `--virtual-stages` chunks per rank, zb-h1)
trains the same model on the same global batch split into `--micro-batches` micro-batches;
after `--warmup` steps, `--iters` steps are timed one by one (barrier, then one
`Trainer.train_step()`: batch draw, the pipeline, gradient norm, AdamW) and the slowest
rank's median is reported. The reference is the plain 1x1x1 run (one micro-batch) on
rank 0 alone with the same thread count, in the same job, while the other ranks wait;
"vs 1 rank" is the speed-up of all the ranks over it (ideal: the number of ranks).

Bubble columns, as idle fractions of the pipeline part of a step:
  theory F=B=W  `schedules.bubble_fraction` of the action lists with F = B = W = 1 (a full
                backward B+W = 2), i.e. (p-1)/(m+p-1) for GPipe and 1F1B;
  theory meas.  `schedules.simulate` of the same lists with this run's measured mean
                compute time per F, B and W (waits for messages excluded; a chunk's time
                for interleaved), no communication cost;
  measured      1 - busy / span of each rank's executor (`StepStats.idle_fraction`:
                time spent waiting for activations and gradients, and for the last sends),
                mean over ranks and timed steps.
The theory assumes every stage costs the same and messages are free; the first stage also
runs the embedding and the last the LM head and loss, and a step ends with waits for the
last sends, so the measured bubble is usually a little above it. Peak live is the most
micro-batch chunks whose activations a stage held at once (`StepStats.peak_live`, which
must equal `schedules.peak_activations`), and peak MB their measured bytes.

This is a benchmark, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from mpi4py import MPI

from numesh.host.runtime import configure_process, guarded
from numesh.mesh import parse_mesh
from numesh.pipeline.schedules import bubble_fraction, peak_activations, simulate
from numesh.run.config import config_from, validate
from numesh.run.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, dataset_dir  # noqa: E402

PRESETS = {
    # nanoGPT's Shakespeare-char CPU quick start, with a batch that 8 micro-batches divide
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16),
    # enough layers for interleaving (v=2) on 4 ranks
    "deep": dict(n_layer=8, n_head=4, n_embd=128, block_size=64, batch_size=16),
    # a few milliseconds a step: for smoke runs
    "tiny": dict(n_layer=4, n_head=2, n_embd=32, block_size=16, batch_size=8),
}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def time_reference(overrides: dict, warmup: int, iters: int) -> dict:
    """The plain 1x1x1 run on this rank alone (MPI.COMM_SELF)."""
    trainer = Trainer(config_from(dict(overrides, mesh="", micro_batches=1, schedule="1f1b", virtual_stages=1)),
                      MPI.COMM_SELF)
    for _ in range(warmup):
        trainer.train_step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "tokens_per_s": trainer.tokens_per_step / ms * 1e3}


def time_schedule(overrides: dict, comm: MPI.Comm, warmup: int, iters: int) -> dict:
    """Time one schedule on `comm`; every rank returns the same summary."""
    trainer = Trainer(config_from(overrides), comm)
    pipe = trainer.pipeline
    waits: dict[tuple[str, int, int], float] = {}
    recv = pipe._recv

    def timed_recv(kind, mb, stage, *args):  # the executor's blocking receive: how long each action waited
        t0 = time.perf_counter()
        out = recv(kind, mb, stage, *args)
        waits[(kind, mb, stage)] = time.perf_counter() - t0
        return out

    pipe._recv = timed_recv
    for _ in range(warmup):
        trainer.train_step()
    p, rank = trainer.mesh.size("pp"), trainer.mesh.index("pp")
    times, idle = [], []
    cost: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    for _ in range(iters):
        waits.clear()
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
        stats = trainer.last_stats
        idle.append(stats.idle_fraction)
        for kind, mb, chunk, start, end in stats.timeline:
            cost[kind].append(end - start - waits.get((kind, mb, chunk * p + rank), 0.0))
    stats = trainer.last_stats
    mine = {
        "pp": rank,
        "ms": statistics.median(times) * 1e3,
        "idle": statistics.fmean(idle),
        "cost_sum": {k: sum(v) for k, v in cost.items()},
        "cost_n": {k: len(v) for k, v in cost.items()},
        "peak_live": stats.peak_live,
        "peak_bytes": stats.peak_bytes,
    }
    every = comm.allgather(mine)
    first_of_pp = {}
    for r in every:  # one row per pp stage (dp/tp replicas of a stage do the same)
        first_of_pp.setdefault(r["pp"], r)
    stages = [first_of_pp[s] for s in range(p)]
    # a step is as slow as its slowest rank
    ms = max(r["ms"] for r in every)
    mean_cost = {}
    for k in ("F", "B", "W"):
        n = sum(r["cost_n"][k] for r in every)
        mean_cost[k] = sum(r["cost_sum"][k] for r in every) / n if n else 0.0
    s = trainer.schedule
    sim = simulate(s, t_f=mean_cost["F"], t_b=mean_cost["B"], t_w=mean_cost["W"] if s.split_backward else 0.0)
    return {
        "schedule": s.name,
        "p": s.p,
        "m": s.m,
        "v": s.v,
        "ms": ms,
        "tokens_per_s": trainer.tokens_per_step / ms * 1e3,
        "bubble_theory_unit": bubble_fraction(s),
        "bubble_theory_measured_costs": sim.bubble_fraction,
        "bubble_measured": statistics.fmean(r["idle"] for r in every),
        "bubble_measured_per_stage": [r["idle"] for r in stages],
        "mean_action_ms": {k: v * 1e3 for k, v in mean_cost.items()},
        "peak_live": [r["peak_live"] for r in stages],
        "peak_live_theory": peak_activations(s),
        "peak_mb": [r["peak_bytes"] / 1e6 for r in stages],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    ap.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches per step (default 8)")
    ap.add_argument("--virtual-stages", "-v", type=int, default=2, help="model chunks per rank for interleaved")
    ap.add_argument("--mesh", default=None, help="default pp=<all ranks>; e.g. dp=2,pp=2")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="global sequences per step (default: the preset's; must divide by dp x micro-batches)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true", help="skip the 1-rank reference run")
    ap.add_argument("--data", default=None, help="a dataset directory written by `numesh data` (default: build one)")
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    configure_process(threads=1)
    mesh = args.mesh or f"pp={world.size}"
    shape = parse_mesh(mesh, world.size)
    with dataset_dir(args.data, args.src, world) as data:  # a temporary one is kept on an error: guarded() aborts
        run(args, world, mesh, shape, data)


def run(args: argparse.Namespace, world: MPI.Comm, mesh: str, shape: dict, data: str) -> None:
    base = dict(PRESETS[args.preset], data=data, mesh=mesh, dtype=args.dtype,
                out=tempfile.gettempdir() + "/numesh-bench-pipeline", micro_batches=args.micro_batches)
    if args.batch_size is not None:
        base["batch_size"] = args.batch_size

    ref = None
    if not args.no_reference:
        if world.rank == 0:
            ref = time_reference(base, args.warmup, args.iters)
        ref = world.bcast(ref, root=0)

    rows, skipped = [], []
    for name in args.schedules:
        v = args.virtual_stages if name == "interleaved" else 1
        cfg = dict(base, schedule=name, virtual_stages=v)
        try:  # the same checks on every rank, before any communication: all skip or none
            validate(config_from(cfg), world.size)
        except ValueError as e:  # ConfigError, ScheduleError: e.g. n_layer not divisible by pp x v
            skipped.append((name, str(e)))
            continue
        rows.append(time_schedule(cfg, world, args.warmup, args.iters))

    if world.rank != 0:
        return
    if args.json:
        print(json.dumps({"reference": ref, "rows": rows, "skipped": dict(skipped), "config": base,
                          "ranks": world.size}, indent=2))
        return
    p = shape["pp"]
    model = ", ".join(f"{k}={v}" for k, v in PRESETS[args.preset].items() if k != "batch_size")
    print(f"preset {args.preset} ({model}), batch {base['batch_size']}, {args.dtype}")
    print(f"mesh {mesh} on {world.size} ranks x 1 BLAS thread, m={args.micro_batches}, "
          f"median of {args.iters} steps after {args.warmup} warm-up")
    if ref is not None:
        print(f"1x1x1 on 1 rank (m=1): {ref['ms']:.1f} ms/step, {ref['tokens_per_s']:,.0f} tokens/s")
    head = (f"{'schedule':<16}{'ms/step':>9}{'tokens/s':>11}{'vs 1 rank':>10}"
            f"{'bubble: theory F=B=W':>22}{'theory meas.':>14}{'measured':>10}   "
            f"{'F/B/W ms':<17}{'peak live/stage':<18}{'peak MB/stage'}")
    print(head)
    for r in rows:
        name = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        speed = f"{r['tokens_per_s'] / ref['tokens_per_s']:>9.2f}x" if ref else f"{'-':>10}"
        c = r["mean_action_ms"]
        fbw = f"{c['F']:.1f}/{c['B']:.1f}/" + (f"{c['W']:.1f}" if r["schedule"] == "zb-h1" else "-")
        live = ",".join(map(str, r["peak_live"]))
        mb = ",".join(f"{x:.1f}" for x in r["peak_mb"])
        print(f"{name:<16}{r['ms']:>9.1f}{r['tokens_per_s']:>11,.0f}{speed}"
              f"{r['bubble_theory_unit']:>22.3f}{r['bubble_theory_measured_costs']:>14.3f}"
              f"{r['bubble_measured']:>10.3f}   {fbw:<17}{live:<18}{mb}")
        if r["peak_live"] != r["peak_live_theory"]:
            print(f"  note: peak live {r['peak_live']} differs from the schedule's {r['peak_live_theory']}")
    for name, why in skipped:
        print(f"{name:<16}skipped: {why}")
    print(f"bubble = idle fraction of the pipeline (see --help); p={p}, m={args.micro_batches}: "
          f"(p-1)/(m+p-1) = {(p - 1) / (args.micro_batches + p - 1):.3f}; F/B/W ms = mean compute per action")


if __name__ == "__main__":
    guarded(main)
