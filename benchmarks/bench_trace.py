#!/usr/bin/env python
"""What tracing costs, and the pipeline bubble it measures beside the schedule's theory.

    mpirun -n 2 python benchmarks/bench_trace.py overhead --mesh pp=2      # and --mesh dp=2
    mpirun -n 2 python benchmarks/bench_trace.py bubble                    # pp=2, every schedule
    mpirun -n 4 python benchmarks/bench_trace.py bubble --micro-batches 8  # pp=4
    mpirun -n 2 python benchmarks/bench_trace.py slow --ms 200             # dp=2, rank 1 sleeps

overhead: three Trainers of the same run in one job, bare, with the flight recorder
(`numesh train`'s default on more than one rank: --collective-timeout 300) and with the
recorder and tracing (`Trainer.start_trace`: the mesh observer, executor and loop spans),
take turns step by step (barrier, then `train_step()`), each first in turn, so machine
noise hits all alike; after `--warmup` steps each, `--iters` steps of each are timed and
the slowest rank's median steps are compared: the recorder against bare, tracing against
the recorder; the time spent inside the tracer's recording calls is also summed directly
(a whole step's A/B cannot resolve a fraction of a % here); then the traced one writes its
trace (time reported apart: it happens once, at the end).

bubble: for each schedule (gpipe, 1f1b, interleaved with v=2, zb-h1) a traced run of
`--iters` steps; `numesh.perf.report.pipeline_bubble` of its trace: measured 1 - Σbusy/(p·makespan)
over each step's aligned pipeline spans, beside `simulate` with unit costs (F=B=W) and with
the measured mean F, B, W times, with each stage's own measured F, B, W times (the
first stage also embeds, the last runs the head and loss), and with each step's own
action times (the bubble the schedule implies for the work exactly as it ran; the rest is
overhead: messages and the code between actions).

slow: a traced dp run over every rank in which `--slow-rank` sleeps `--ms` at the start of
every step, as NUMESH_INJECT=slow:rank=R:ms=M makes it (`FaultInjector.on_step`, called
where the training loop calls it); the report's slowest rank and how much slower it is per
step (`numesh.perf.report.slowest_rank`) beside the injected delay. How close the two come
depends on the machine's load (a busy 2-core machine read 224.8 ms for 200), so the test
(tests/test_trace.py) checks only that the rank is named and its delay positive, and this
prints the number.

Every rank gets one BLAS thread. Prints numbers, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS)
from mpi4py import MPI

from numesh.host.runtime import configure_process, guarded
from numesh.observe import attach
from numesh.observe.flight import FlightRecorder
from numesh.observe.inject import Fault, FaultInjector
from numesh.perf import report
from numesh.run.config import config_from
from numesh.run.train import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, dataset_dir  # noqa: E402

MODEL = dict(n_layer=8, n_head=4, n_embd=128, block_size=64, batch_size=16)  # 8 layers: pp=4 with v=2


def config(data: str, out: str, mesh: str, schedule: str, m: int, v: int = 1):
    return config_from(dict(MODEL, data=data, out=out, mesh=mesh, schedule=schedule, micro_batches=m,
                            virtual_stages=v, max_iters=10**6, eval_interval=10**6, warmup_iters=1))


def timed_step(t: Trainer, comm: MPI.Comm) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    t.train_step()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)  # the slowest rank's


def _time_inside(tracer) -> list[float]:
    """Wrap the tracer's recording methods so they sum their own seconds into the returned
    cell: the tracing cost measured directly, which the A/B of whole steps cannot resolve on a
    machine whose steps vary by a few % (the wrapper's two clock reads count in)."""
    cell = [0.0]
    for name in ("begin", "end", "span", "flow_start", "flow_end"):
        def timed(*a, _f=getattr(tracer, name), **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                cell[0] += time.perf_counter() - t0
        setattr(tracer, name, timed)
    return cell


def overhead(args, data: str, comm: MPI.Comm) -> dict:
    """Bare Trainer, one with the flight recorder (what `numesh train` attaches on more than
    one rank by default) and one with the recorder and tracing (`--trace`), in turns."""
    runs = {name: Trainer(config(data, tempfile.mkdtemp(), args.mesh, args.schedule, args.micro_batches), comm)
            for name in ("off", "recorder", "on")}
    for name in ("recorder", "on"):
        t = runs[name]
        attach(t.mesh, FlightRecorder(t.mesh, Path(t.cfg.out) / "flight", t.cfg.collective_timeout))
    inside = _time_inside(runs["on"].start_trace(0.0))
    order = list(runs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.warmup + args.iters):
        for name in order[i % 3:] + order[:i % 3]:  # each goes first in turn
            dt = timed_step(runs[name], comm)
            if i >= args.warmup:
                times[name].append(dt)
    on = runs["on"]
    t0 = time.perf_counter()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    on.trace.write(path, on.trace_meta)
    write_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    inside_ms = comm.allreduce(inside[0], op=MPI.MAX) / (args.warmup + args.iters) * 1e3
    return {"mesh": args.mesh, "tracer_ms": inside_ms, "tracer_pct": 100 * inside_ms / med["on"],
            "schedule": args.schedule, "m": args.micro_batches, "steps": args.iters,
            "off_ms": med["off"], "recorder_ms": med["recorder"], "on_ms": med["on"],
            "recorder_pct": 100 * (med["recorder"] / med["off"] - 1),
            "overhead_pct": 100 * (med["on"] / med["recorder"] - 1),
            "events_per_step": len(on.trace.events) / (args.warmup + args.iters), "write_s": write_s}


def bubble(args, data: str, comm: MPI.Comm) -> list[dict]:
    p = comm.Get_size()
    rows = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        out = tempfile.mkdtemp()
        t = Trainer(config(data, out, f"pp={p}", name, args.micro_batches, v), comm)
        t.start_trace(0.0)
        for _ in range(args.warmup + args.iters):
            t.train_step()
        path = t.trace.write(Path(out) / "trace.json", t.trace_meta)
        if comm.Get_rank() == 0:
            b = report.pipeline_bubble(report.load(path))
            rows.append({"schedule": name, "p": p, "m": args.micro_batches, "v": v, "measured": b["measured"],
                         "theory_unit": b["theory_unit_costs"], "theory_measured_costs": b["theory_measured_costs"],
                         "theory_stage_costs": b["theory_stage_costs"], "theory_action_costs": b["theory_action_costs"],
                         "idle_per_stage": b["measured_idle_per_stage"], "F_B_W_ms": b["mean_action_ms"]})
    return rows


def slow(args, data: str, comm: MPI.Comm) -> dict:
    """Rank `--slow-rank` sleeps `--ms` before every step of a traced dp run: what the report
    says of it."""
    out = tempfile.mkdtemp()
    t = Trainer(config(data, out, f"dp={comm.Get_size()}", "1f1b", 1), comm)
    inject = FaultInjector((Fault("slow", args.slow_rank, 0, args.ms),), comm.Get_rank(), t.mesh)
    attach(t.mesh, inject)
    t.start_trace(0.0)
    for step in range(args.warmup + args.iters):
        inject.on_step(step)
        t.train_step()
    path = t.trace.write(Path(out) / "trace.json", t.trace_meta)
    if comm.Get_rank() != 0:
        return {}
    got = report.slowest_rank(report.load(path))
    return {"ranks": comm.Get_size(), "injected_ms": args.ms, "slow_rank": args.slow_rank, "named": got["rank"],
            "slower_by_ms": got["slower_by_ms"], "ratio": got["slower_by_ms"] / args.ms,
            "waited_ms_per_step": got["waited_ms_per_step"], "steps": args.warmup + args.iters}


def say_overhead(res: dict) -> str:
    return (f"{res['mesh']} {res['schedule']} m={res['m']}: bare {res['off_ms']:.2f} ms, flight recorder "
            f"{res['recorder_ms']:.2f} ms ({res['recorder_pct']:+.2f} %), "
            f"recorder and trace {res['on_ms']:.2f} ms (tracing {res['overhead_pct']:+.2f} % on top; "
            f"measured inside the tracer: {res['tracer_ms']:.3f} ms a step on the busiest rank, "
            f"{res['tracer_pct']:.2f} %; {res['events_per_step']:.0f} events/step/rank; "
            f"writing the trace {res['write_s']:.2f} s)")


def say_slow(res: dict) -> str:
    return (f"dp={res['ranks']}, rank {res['slow_rank']} sleeping {res['injected_ms']} ms a step: the report "
            f"names rank {res['named']}, slower by {res['slower_by_ms']:.1f} ms a step "
            f"({res['ratio']:.3f} x the injected delay; waited per step: "
            + ", ".join(f"rank {r} {v:.1f} ms" for r, v in sorted(res["waited_ms_per_step"].items()))
            + f"; {res['steps']} steps, the first left out)")


def say_bubble(r: dict) -> str:
    return (f"{r['schedule']:>11} p={r['p']} m={r['m']} v={r['v']}: "
            f"measured {100 * r['measured']:5.1f} %, "
            f"theory {100 * r['theory_unit']:5.1f} % (F=B=W), {100 * r['theory_measured_costs']:5.1f} % "
            f"(mean costs F/B/W {r['F_B_W_ms']['F']:.2f}/{r['F_B_W_ms']['B']:.2f}/"
            f"{r['F_B_W_ms']['W']:.2f} ms), "
            f"{100 * r['theory_stage_costs']:5.1f} % (each stage's costs), "
            f"{100 * r['theory_action_costs']:5.1f} % (each action's own time); "
            "idle per stage " + ", ".join(f"{100 * x:.1f}" for x in r["idle_per_stage"]))


# each measurement and its line: overhead and slow give one result, bubble one per schedule
MEASUREMENTS = {"overhead": (overhead, say_overhead), "bubble": (bubble, say_bubble), "slow": (slow, say_slow)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=tuple(MEASUREMENTS))
    ap.add_argument("--mesh", default="pp=2")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--ms", type=int, default=200, help="slow: the injected delay per step")
    ap.add_argument("--slow-rank", type=int, default=1, help="slow: the rank that sleeps")
    ap.add_argument("--data", default=None)
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    configure_process(threads=1)
    measure, say = MEASUREMENTS[args.what]
    with dataset_dir(args.data, args.src, comm) as data:
        res = measure(args, data, comm)
    if comm.Get_rank() == 0:
        for r in res if isinstance(res, list) else [res]:
            print(json.dumps(r) if args.json else say(r))


if __name__ == "__main__":
    guarded(main)
