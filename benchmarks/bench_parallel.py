"""Throughput of parallel meshes against one rank, in the same run.

    mpirun -n 2 python benchmarks/bench_parallel.py --meshes tp=2 dp=2 --preset default

Every rank gets one BLAS thread. The reference is the 1x1x1 mesh on rank 0 alone with
the same thread count (the other ranks wait), timed in the same job. For dp meshes the
batch is weak-scaled (batch × dp), so efficiency = tokens/s(mesh) / (ranks × tokens/s(1)).
For tp meshes the batch is the same (strong scaling): speed-up = tokens/s(mesh) / tokens/s(1).
It also prints the saved activations each rank held at the peak of a step (MiB, the most
over the ranks: `StepStats.peak_bytes`, measured from the buffers, see
`numesh.perf.formulas.activation_bytes`), bytes moved per step per axis (bus bytes, as
NCCL-tests count them) and the bytes each rank holds for parameters, gradients, optimiser
state and workspace (`ZeroOptimizer.memory()`, measured from its buffers).

    mpirun -n 2 python benchmarks/bench_parallel.py --meshes tp=2 --recompute none full

runs every mesh with each activation recomputation mode.

    mpirun -n 2 python benchmarks/bench_parallel.py --meshes dp=2 --no-overlap --zero 0 1 2 3

runs every dp mesh with and without overlap and at each ZeRO stage, side by side.

    mpirun -n 2 python benchmarks/bench_parallel.py --meshes tp=2 --sequence-parallel --rounds 5

runs every tp mesh without and with Megatron sequence parallelism. Every variant of a mesh
(sp, ZeRO stage, overlap, recomputation) runs in turn, `--rounds` times alternating (each
round a fresh trainer and the median of `--iters` steps; the table shows the median over
rounds), so drift on a shared machine hits them alike.

    mpirun -n 4 python benchmarks/bench_parallel.py --meshes cp=4 --block-size 2048 --batch-size 1

a long context on a cp mesh (the 1-rank reference runs the same context on one rank).
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

from numesh.host.runtime import configure_process
from numesh.mesh import parse_mesh
from numesh.run.config import config_from
from numesh.run.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, PRESETS, dataset_dir  # noqa: E402


def time_steps(overrides: dict, comm: MPI.Comm, warmup: int, iters: int) -> dict:
    trainer = Trainer(config_from(overrides), comm)
    for _ in range(warmup):
        trainer.train_step()
    trainer.mesh.counter.reset()
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = trainer.tokens_per_step
    act = comm.allreduce(trainer.last_stats.peak_bytes, op=MPI.MAX)
    bus = {
        "/".join(axes) + ":" + op: v / iters
        for (axes, op), v in sorted(trainer.mesh.counter.bus.items())
    }
    payload = {"/".join(axes) + ":" + op: v / iters for (axes, op), v in sorted(trainer.mesh.counter.payload.items())}
    return {"ms": ms, "tokens_per_s": tokens / ms * 1e3, "bus_bytes_per_step": bus, "payload_bytes_per_step": payload,
            "memory": trainer.opt.memory(), "activation_bytes": act, "activation_mib": act / 2**20}


def median_of_rounds(results: list[dict]) -> dict:
    """One row from several rounds of `time_steps`: median ms (and tokens/s from it), the
    rest (bytes, memory: the same every round) from the first."""
    ms = statistics.median(r["ms"] for r in results)
    return {**results[0], "ms": ms, "tokens_per_s": results[0]["tokens_per_s"] * results[0]["ms"] / ms,
            "ms_rounds": [r["ms"] for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshes", nargs="+", default=["tp=2", "dp=2"], help="meshes using every rank, e.g. tp=2 dp=2")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--zero", type=int, nargs="+", default=[0], help="ZeRO stages to run each dp mesh at")
    ap.add_argument("--no-overlap", action="store_true", help="also run each dp mesh with overlap off")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="run each tp mesh without and with --sequence-parallel, alternating (see --rounds)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds over every variant of a mesh (sp, ZeRO, overlap, recompute), alternating; "
                         "median over them")
    ap.add_argument("--block-size", type=int, default=None, help="context length (default: the preset's)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="sequences per step on one rank (default: the preset's)")
    ap.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "full"],
                    help="activation recomputation modes to run each mesh at")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--data", default=None)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    configure_process(threads=1)
    with dataset_dir(args.data, args.src, world) as data:
        run(args, world, data)


def run(args: argparse.Namespace, world: MPI.Comm, data: str) -> None:
    base = dict(PRESETS[args.preset], data=data, out=tempfile.gettempdir() + "/numesh-bench-run")
    base.update({k: v for k, v in (("block_size", args.block_size), ("batch_size", args.batch_size)) if v})

    rows = []
    ref = None
    if world.rank == 0:
        ref = time_steps(dict(base), MPI.COMM_SELF, args.warmup, args.iters)
    ref = world.bcast(ref, root=0)
    rows.append(("1x1x1 (1 rank)", ref, 1.0))
    for mesh in args.meshes:
        shape = parse_mesh(mesh, world.size)
        variants = []  # (row name, config) of every run of this mesh
        sps = [False, True] if args.sequence_parallel and shape["tp"] > 1 else [False]
        overlaps = [True, False] if args.no_overlap and shape["dp"] > 1 else [True]
        for zero in args.zero if shape["dp"] > 1 else [0]:
            for overlap in overlaps:
                for sp in sps:
                    for rc in args.recompute:
                        name = (mesh + (f" zero{zero}" if shape["dp"] > 1 else "") + ("" if overlap else " no-overlap")
                                + (" sp" if sp else "") + ("" if rc == "none" else f" rc={rc}"))
                        variants.append((name, dict(base, mesh=mesh, zero=zero, overlap=overlap, sequence_parallel=sp,
                                                    recompute=rc, batch_size=base["batch_size"] * shape["dp"])))
        results: dict[str, list[dict]] = {name: [] for name, _ in variants}
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits every variant alike
            for name, cfg in variants:
                results[name].append(time_steps(cfg, world, args.warmup, args.iters))
        for name, _ in variants:
            res = median_of_rounds(results[name])
            eff = res["tokens_per_s"] / (ref["tokens_per_s"] * (world.size if shape["dp"] > 1 else 1))
            rows.append((name, res, eff))
    if world.rank != 0:
        return
    if args.json:
        print(json.dumps([{"mesh": m, **r, "efficiency": e} for m, r, e in rows], indent=2))
        return
    print(f"preset {args.preset} (block size {base['block_size']}, batch {base['batch_size']} per dp rank), "
          f"{world.size} ranks x 1 BLAS thread, median of {args.iters} steps"
          + (f", median over {args.rounds} alternating rounds" if args.rounds > 1 else ""))
    print(f"{'mesh':<28}{'ms/step':>10}{'tokens/s':>12}{'vs 1 rank':>11}{'act MiB':>9}   bus bytes/step by axis")
    for mesh, r, eff in rows:
        bus = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["bus_bytes_per_step"].items()) or "-"
        print(f"{mesh:<28}{r['ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{eff:>10.2f}x{r['activation_mib']:>9.2f}   {bus}")
    print("vs 1 rank: tp = speed-up at the same batch; dp = weak-scaling efficiency (batch x dp)")
    print("act MiB: saved activations per rank at the step's peak (the most over ranks), measured from the buffers")
    keys = list(rows[0][1]["memory"])
    print("\nmemory per rank, MB (ZeroOptimizer.memory())")
    print(f"{'mesh':<28}" + "".join(f"{k:>12}" for k in keys) + f"{'total':>12}")
    for mesh, r, _ in rows:
        mem = r["memory"]
        print(f"{mesh:<28}" + "".join(f"{mem[k] / 1e6:>12.3f}" for k in keys) + f"{sum(mem.values()) / 1e6:>12.3f}")
    print("\npeak saved activations per rank (the most over ranks), MB, and payload bytes per step by axis and op")
    for mesh, r, _ in rows:
        pay = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["payload_bytes_per_step"].items()) or "-"
        rounds = " ms per round " + " ".join(f"{x:.1f}" for x in r["ms_rounds"]) if "ms_rounds" in r else ""
        print(f"{mesh:<28}{r['activation_bytes'] / 1e6:>10.3f}   {pay}{rounds}")


if __name__ == "__main__":
    main()
