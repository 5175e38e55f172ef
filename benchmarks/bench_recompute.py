"""What activation recomputation costs in throughput and saves in memory.

    python benchmarks/bench_recompute.py --preset default --block-size 64 256
    mpirun -n 2 python benchmarks/bench_recompute.py --mesh tp=2

For each context length, one trainer per `--recompute` mode (none, full) is built in the
same process; after warm-up their steps alternate (none, full, none, ...), so that load
from other processes falls on every mode alike, and the median step time of each is
reported with tokens/s, the cost against none, and the activation bytes each rank held at
the peak of a step (`StepStats.peak_bytes`, measured from the buffers) beside
`numesh.perf.formulas.activation_bytes`'s prediction. Last, one more step of
each mode runs under `tracemalloc` (untimed): the most bytes NumPy had allocated at once
during it, above what was allocated when it began ("step peak"): the saved activations
plus everything transient (the block being computed, a rerun block's whole context,
gradients, communication buffers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from mpi4py import MPI

from numesh.host.runtime import configure_process
from numesh.perf import formulas
from numesh.run.config import config_from
from numesh.run.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, PRESETS, dataset_dir  # noqa: E402

MODES = ("none", "full")


def predicted_peak(trainer: Trainer) -> int:
    """The formula's peak activation bytes of this rank for one step."""
    c, model, mesh = trainer.cfg, trainer.model, trainer.mesh
    rows = c.batch_size // (mesh.size("dp") * c.micro_batches)
    itemsize = trainer.pipeline.dtype.itemsize
    stages = trainer.pipeline.stages
    shape = formulas.ActivationShape(rows, c.block_size, model.n_embd, model.n_head, tp=mesh.size("tp"),
                                     recompute=c.recompute, itemsize=itemsize)

    def saved(chunk: int) -> int:
        s = stages[chunk]
        return formulas.activation_bytes(shape, formulas.Chunk(len(s.blocks), s.first, s.last), model.vocab_size)

    def deferred(chunk: int) -> int:
        return formulas.weight_ctx_bytes(shape, len(stages[chunk].blocks), bias=c.bias)

    return formulas.peak_activation_bytes(trainer.schedule, mesh.index("pp"), saved, deferred)


def traced_step_peak(trainer: Trainer) -> int:
    """Bytes allocated at the peak of one step above those allocated when it began."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        trainer.train_step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def bench(base: dict, comm: MPI.Comm, warmup: int, rounds: int) -> dict[str, dict]:
    trainers = {m: Trainer(config_from(dict(base, recompute=m)), comm) for m in MODES}
    for t in trainers.values():
        for _ in range(warmup):
            t.train_step()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for m, t in trainers.items():  # alternating: none, full, none, ...
            comm.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            t.train_step()
            times[m].append(time.perf_counter() - t0)
            cpu[m].append(time.process_time() - c0)
    step_peak = {m: traced_step_peak(t) for m, t in trainers.items()}
    out = {}
    for m, t in trainers.items():
        ms = statistics.median(times[m]) * 1e3
        peak = comm.allreduce(t.last_stats.peak_bytes, op=MPI.MAX)
        cpu_ms = statistics.median(cpu[m]) * 1e3
        out[m] = {"ms": ms, "tokens_per_s": t.tokens_per_step / ms * 1e3, "cpu_ms": cpu_ms,
                  "tokens_per_cpu_s": t.tokens_per_step / cpu_ms * 1e3, "act_mib": peak / 2**20,
                  "act_mib_formula": comm.allreduce(predicted_peak(t), op=MPI.MAX) / 2**20,
                  "step_peak_mib": comm.allreduce(step_peak[m], op=MPI.MAX) / 2**20}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--block-size", type=int, nargs="+", default=[64, 256], help="context lengths to run")
    ap.add_argument("--mesh", default="", help="e.g. tp=2 (the ranks of the job)")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds (one step per mode each)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default: cores / ranks)")
    ap.add_argument("--data", default=None)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    configure_process(threads=args.threads)
    results = []
    with dataset_dir(args.data, args.src, world) as data:
        for T in args.block_size:
            base = dict(PRESETS[args.preset], block_size=T, mesh=args.mesh, dropout=args.dropout, data=data,
                        out=tempfile.gettempdir() + "/numesh-bench-recompute")
            results.append((T, bench(base, world, args.warmup, args.rounds)))
    if world.rank != 0:
        return
    if args.json:
        print(json.dumps([{"block_size": T, **r} for T, r in results], indent=2))
        return
    print(f"preset {args.preset}, mesh {args.mesh or '1x1x1'}, {world.size} rank(s), median of {args.rounds} "
          "alternating steps per mode")
    print(f"{'T':>5} {'recompute':<10}{'ms/step':>9}{'tokens/s':>10}{'cost':>8}{'cpu ms':>9}{'cpu cost':>9}"
          f"{'act MiB/rank':>14}{'formula':>9}{'step peak':>11}")
    for T, r in results:
        for m in MODES:
            cost = 1.0 - r[m]["tokens_per_s"] / r["none"]["tokens_per_s"]
            cpu_cost = 1.0 - r[m]["tokens_per_cpu_s"] / r["none"]["tokens_per_cpu_s"]
            print(f"{T:>5} {m:<10}{r[m]['ms']:>9.1f}{r[m]['tokens_per_s']:>10,.0f}{cost:>8.1%}{r[m]['cpu_ms']:>9.1f}"
                  f"{cpu_cost:>9.1%}{r[m]['act_mib']:>14.2f}{r[m]['act_mib_formula']:>9.2f}{r[m]['step_peak_mib']:>11.2f}")
    print("cost = throughput lost against none, by wall time and by this process's CPU time (all its threads: less\n"
          "sensitive to other processes on the machine); act = saved activations at the step's peak (measured, and\n"
          "formula); step peak = MiB NumPy allocated at once during a step, above the step's start (tracemalloc)")


if __name__ == "__main__":
    main()
