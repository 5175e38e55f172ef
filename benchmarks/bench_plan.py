"""Validate `numesh plan`: predicted vs measured memory and step time, layout by layout.

    python benchmarks/bench_plan.py                       # 2, 4 and 8 ranks, calibrating first
    python benchmarks/bench_plan.py --ranks 2 --profile /tmp/p.json --no-calibrate

For each rank count it (1) calibrates this machine with that many ranks into a profile
(`numesh plan --calibrate` under mpirun; skipped with --no-calibrate), (2) picks layouts of a
small model that `numesh plan` lists (every mesh, ZeRO stage and schedule, one or two
micro-batch counts each), (3) runs them all in one mpirun job (a worker mode of this script:
a Trainer per layout, warm-up steps, then timed steps; the step's time is the slowest rank's,
the median over steps), measuring memory the way numesh does (`ZeroOptimizer.memory()` plus
the executor's `peak_bytes`, the largest rank's), and (4) prints predicted vs measured with
the errors, the MAPE of step time, and whether plan's first choice among them is within 5 %
of the fastest measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numesh  # noqa: F401,I001  (before numpy: it sets up OpenBLAS)

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
from common import DEFAULT_SRC  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=16)


def worker(layouts_file: str, data: str, warmup: int, steps: int) -> None:
    """Run every layout of the file on COMM_WORLD; rank 0 prints one JSON line per layout."""
    from mpi4py import MPI

    from numesh.runtime import configure_process
    from numesh.train import TrainConfig, Trainer

    configure_process()
    comm = MPI.COMM_WORLD
    for spec in json.loads(Path(layouts_file).read_text()):
        cfg = TrainConfig(**MODEL, data=data, out=tempfile.gettempdir() + "/bench-plan-unused", mesh=spec["mesh"],
                          zero=spec["zero"], schedule=spec["schedule"], micro_batches=spec["micro_batches"],
                          virtual_stages=spec["virtual_stages"], max_iters=warmup + steps, collective_timeout=0.0)
        trainer = Trainer(cfg, comm)
        times, peak = [], 0
        for i in range(warmup + steps):
            comm.Barrier()
            t0 = time.perf_counter()
            trainer.train_step()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= warmup:
                times.append(dt)
            peak = max(peak, trainer.last_stats.peak_bytes)
        mem = trainer.opt.memory()
        mine = sum(mem.values()) + peak
        rows = comm.gather({"total": mine, **mem, "activations": peak}, root=0)
        if comm.Get_rank() == 0:
            biggest = max(rows, key=lambda r: r["total"])
            print(json.dumps({"spec": spec, "step_s": statistics.median(times), "memory": biggest}), flush=True)
        del trainer


def pick_layouts(preds: list, per_ranks: int) -> list:
    """One or two micro-batch counts of every (mesh, ZeRO stage, schedule, v), up to `per_ranks`."""
    groups: dict[tuple, list] = {}
    for p in preds:
        lay = p.layout
        groups.setdefault((lay.mesh, lay.zero, lay.schedule, lay.virtual_stages), []).append(p)
    chosen, spare = [], []
    for key in sorted(groups):
        ps = sorted(groups[key], key=lambda p: p.layout.micro_batches)
        want = 2 * p.layout.pp if (p := ps[0]).layout.pp > 1 else 2
        ps.sort(key=lambda p: (abs(p.layout.micro_batches - want), p.layout.micro_batches))
        chosen.append(ps[0])
        spare += ps[1:2]
    if len(chosen) > per_ranks:
        step = len(chosen) / per_ranks
        chosen = [chosen[int(i * step)] for i in range(per_ranks)]
    chosen += spare[: max(0, per_ranks - len(chosen))]
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--per-ranks", type=int, default=12, help="layouts per rank count")
    ap.add_argument("--profile", default=None, help="profile file (default: a temporary one)")
    ap.add_argument("--no-calibrate", action="store_true", help="use --profile as it is")
    ap.add_argument("--data", default=None, help="prepared dataset (default: one made from --src)")
    ap.add_argument("--src", default=DEFAULT_SRC)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.data, args.warmup, args.steps)
        return

    from numesh import data as D
    from numesh.plan import predict
    from numesh.plan.hardware import load_profile
    from numesh.plan.layout import ModelSpec
    from numesh.plan.search import valid_layouts
    from numesh.train import TrainConfig

    bindir = Path(sys.executable).parent
    mpirun = str(bindir / "mpirun") if (bindir / "mpirun").exists() else "mpirun"
    tmp = Path(tempfile.mkdtemp(prefix="bench-plan-"))
    data = args.data
    if data is None:
        data = str(tmp / "data")
        D.prepare_char_dataset(D.read_source(args.src), data)
    profile_path = Path(args.profile) if args.profile else tmp / "profile.json"
    base = TrainConfig(**MODEL, data=data)
    vocab = D.load_tokenizer(data).vocab_size
    model = ModelSpec(base.n_layer, base.n_head, base.n_embd, base.block_size, vocab, base.batch_size)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()]
    results = []
    for n in args.ranks:
        if not args.no_calibrate:
            t0 = time.perf_counter()
            subprocess.run([mpirun, "-n", str(n), str(bindir / "numesh"), "plan", "--calibrate", "--data", data,
                            "--profile-out", str(profile_path), *flags], check=True, stdout=subprocess.DEVNULL)
            print(f"calibrated {n} ranks in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        profile = load_profile(str(profile_path))
        threads = max(1, (profile.cores or 1) // n)
        preds = [predict(model, lay, profile, 0, 4, threads) for lay in valid_layouts(base, model, n)]
        chosen = pick_layouts(preds, args.per_ranks)
        spec_file = tmp / f"layouts-{n}.json"
        spec_file.write_text(json.dumps([{"mesh": p.layout.mesh, "zero": p.layout.zero, "schedule": p.layout.schedule,
                                          "micro_batches": p.layout.micro_batches,
                                          "virtual_stages": p.layout.virtual_stages} for p in chosen]))
        t0 = time.perf_counter()
        out = subprocess.run([mpirun, "-n", str(n), sys.executable, str(HERE), "--worker", str(spec_file), "--data", data,
                              "--warmup", str(args.warmup), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        print(f"ran {len(chosen)} layouts on {n} ranks in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        measured = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for p, m in zip(chosen, measured):
            results.append((n, p, m))
    report(results)


def report(results: list) -> None:
    head = f"{'n':>2} {'layout':<58} {'mem pred':>10} {'mem meas':>10} {'err':>6} {'step pred':>10} {'step meas':>10} {'err':>7}"
    print(head)
    errs_t, errs_m = [], []
    by_n: dict[int, list] = {}
    for n, p, m in results:
        pm = p.memory.measured_parts
        mm = m["memory"]["total"]
        em = (pm - mm) / mm * 100
        et = (p.time.total - m["step_s"]) / m["step_s"] * 100
        errs_t.append(abs(et))
        errs_m.append(abs(em))
        exact = all(getattr(p.memory, k) == m["memory"][k] for k in ("params", "grads", "optimizer"))
        lay = p.layout
        name = f"{lay.mesh} z{lay.zero} {lay.schedule} m={lay.micro_batches}" + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        print(f"{n:>2} {name:<58} {pm / 2**20:>8.2f}Mi {mm / 2**20:>8.2f}Mi {em:>+5.1f}% {p.time.total * 1e3:>8.1f}ms "
              f"{m['step_s'] * 1e3:>8.1f}ms {et:>+6.1f}%{'' if exact else '  params/grads/optimizer NOT exact'}")
        by_n.setdefault(n, []).append((p, m))
    print(f"\n{len(results)} layouts: memory max |error| {max(errs_m):.2f} %, step time MAPE {statistics.mean(errs_t):.1f} % "
          f"(median {statistics.median(errs_t):.1f} %, max {max(errs_t):.1f} %)")
    for n, rows in sorted(by_n.items()):
        first = max(rows, key=lambda r: r[0].tokens_per_s)
        fastest = min(rows, key=lambda r: r[1]["step_s"])
        gap = (first[1]["step_s"] - fastest[1]["step_s"]) / fastest[1]["step_s"] * 100
        lay = first[0].layout
        print(f"{n} ranks: plan's first choice {lay.mesh} z{lay.zero} {lay.schedule} m={lay.micro_batches} measured "
              f"{first[1]['step_s'] * 1e3:.1f} ms, fastest measured {fastest[1]['step_s'] * 1e3:.1f} ms "
              f"({fastest[0].layout.mesh} z{fastest[0].layout.zero} {fastest[0].layout.schedule} m={fastest[0].layout.micro_batches}): "
              f"{gap:+.1f} % ({'within' if gap <= 5 else 'NOT within'} 5 %)")


if __name__ == "__main__":
    main()
