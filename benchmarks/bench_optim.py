#!/usr/bin/env python
"""Muon against AdamW on tiny Shakespeare with the default model, at equal steps and at
equal wall-clock, and the Newton–Schulz share of a Muon step on 1 rank, on dp=2 (ZeRO 0, 1) and on tp=2.

    python benchmarks/bench_optim.py                              # 2000 steps each, curves to optim.png
    python benchmarks/bench_optim.py --steps 500 --muon-lr 2e-3 --plot optim.svg
    python benchmarks/bench_optim.py --share-only                 # only the Newton–Schulz share

Prepares tiny Shakespeare (--src) as a character dataset, then trains the default model
(4 layers x 128, block 64, batch 12, `numesh train` defaults: lr 1e-3 with warmup and cosine
decay) three times, each a fresh `numesh train` process: AdamW for --steps steps, Muon for
--steps steps (equal steps), and Muon for as many steps as AdamW's measured step time
allows in AdamW's training time (equal wall-clock: the median step times of the two
equal-step runs, evaluation excluded). Prints each run's val loss at every evaluation and
both comparisons; `--plot` draws the runs with `numesh plot` (loss, val loss, tokens/s).

The Newton–Schulz share: a Muon step's time in the iteration itself
(`ZeroOptimizer.matrix_seconds`) over the whole step's, the medians of --share-steps steps
after a warm-up, on one rank, on dp=2 with ZeRO 0 and with ZeRO 1, and on tp=2 (this script's worker
under the mpiexec beside this Python), where each rank iterates on about half the matrices
(under ZeRO 0 too: the results are all-gathered; over tp too, numesh/optim/matrices.py).
The worker alone, for before/after pairs on any mesh (options after it set the model):

    mpiexec -n 2 python benchmarks/bench_optim.py --worker DATA OUT ep=2 40 0 moe_experts=4

A benchmark: it asserts nothing. Its times need a quiet machine; docs/benchmarks.md holds runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import DEFAULT_SRC, PRESETS, log, metrics, numesh_cli, run_json, venv_tool, work_dir  # noqa: E402


def step_ms(run: Path) -> float:
    """Median training step time of a run (evaluations are not in dt_ms)."""
    return statistics.median(r["dt_ms"] for r in metrics(run) if "dt_ms" in r)


def train(data: Path, out: Path, optimizer: str, steps: int, every: int, extra: list[str]) -> float:
    """One `numesh train` run; its wall-clock seconds."""
    log(f"training {out.name}: {optimizer}, {steps} steps")
    return numesh_cli("train", "--data", str(data), "--out", str(out), "--optimizer", optimizer, "--max-iters",
                      str(steps), "--lr-decay-iters", str(steps), "--warmup-iters", str(min(100, steps)),  # train
                      "--eval-interval", str(every), "--overwrite", *extra)[0]  # refuses a warm-up past the decay


def compare(root: Path, args: argparse.Namespace) -> None:
    data = root / "data"
    numesh_cli("data", "char", "--src", args.src, "--out", str(data))
    extra = ["--muon-lr", str(args.muon_lr)] if args.muon_lr else []
    runs = {"adamw": root / "run-adamw", "muon": root / "run-muon", "muon-clock": root / "run-muon-clock"}
    train(data, runs["adamw"], "adamw", args.steps, args.eval_interval, [])
    train(data, runs["muon"], "muon", args.steps, args.eval_interval, extra)
    a_ms, m_ms = step_ms(runs["adamw"]), step_ms(runs["muon"])
    clock_steps = max(1, round(args.steps * a_ms / m_ms))
    train(data, runs["muon-clock"], "muon", clock_steps, max(1, round(args.eval_interval * a_ms / m_ms)), extra)
    print(f"median step: AdamW {a_ms:.1f} ms, Muon {m_ms:.1f} ms ({m_ms / a_ms:.2f}x); "
          f"equal wall-clock: Muon {clock_steps} steps for AdamW's {args.steps}")
    print("| run | step | train loss | val loss |")
    print("|---|---|---|---|")
    for name, run in runs.items():
        for r in metrics(run):
            if "val_loss" in r:
                print(f"| {name} | {r['step']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} |")
    if args.plot:
        numesh_cli("plot", *map(str, runs.values()), "--out", args.plot)
        print(f"curves: {args.plot}")


def worker(data: str, out: str, mesh: str, steps: int, zero: int, **options: int) -> None:
    """Under mpiexec (or alone): Muon steps of the default model (with `options`, e.g.
    moe_experts=4 for ep); rank 0 prints the medians of the step time and of the time in
    the Newton–Schulz iteration, as JSON."""
    from mpi4py import MPI

    from numesh.host.runtime import configure_process
    from numesh.run.config import config_from
    from numesh.run.train import Trainer

    configure_process()  # BLAS on one thread, numesh's threads over the rank's cores, as `numesh train` runs
    cfg = config_from(dict(PRESETS["default"], data=data, out=out, mesh=mesh, zero=zero,
                           optimizer="muon", peak_flops=1e12, **options))
    trainer = Trainer(cfg, MPI.COMM_WORLD)
    step, ns = [], []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        trainer.train_step()
        if i >= 3:  # after the warm-up (kernels compiled, buffers allocated)
            step.append(time.perf_counter() - t0)
            ns.append(trainer.opt.matrix_seconds)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"step_ms": 1e3 * statistics.median(step), "ns_ms": 1e3 * statistics.median(ns)}))


def share(root: Path, args: argparse.Namespace) -> None:
    data = root / "data"
    if not data.exists():
        numesh_cli("data", "char", "--src", args.src, "--out", str(data))
    for ranks, mesh, zero in ((1, "", 0), (2, "dp=2", 0), (2, "dp=2", 1), (2, "tp=2", 0)):
        cmd = [sys.executable, __file__, "--worker", str(data), str(root / f"share-{mesh or 'one'}-{zero}"), mesh,
               str(args.share_steps), str(zero)]
        if ranks > 1:
            cmd = [venv_tool("mpiexec"), "-n", str(ranks), *cmd]
        got = run_json(cmd, timeout=None)
        if "error" in got:
            raise SystemExit(f"{' '.join(cmd)} failed: {got['error']}")
        where = "1 rank" if ranks == 1 else f"{mesh} ZeRO-{zero}"
        print(f"Newton-Schulz share of a Muon step, {where}: {got['ns_ms']:.1f} of {got['step_ms']:.1f} ms "
              f"({100 * got['ns_ms'] / got['step_ms']:.1f} %)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        data, out, mesh, steps, zero = argv[1:6]
        worker(data, out, mesh, int(steps), int(zero), **{k: int(v) for k, v in (a.split("=") for a in argv[6:])})
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=DEFAULT_SRC, help="the text (default: tiny Shakespeare beside the repository)")
    ap.add_argument("--steps", type=int, default=2000, help="steps of the equal-step runs (default 2000)")
    ap.add_argument("--eval-interval", type=int, default=250, help="steps between evaluations")
    ap.add_argument("--muon-lr", type=float, default=0.0, help="Muon's --muon-lr (0: the run's learning rate)")
    ap.add_argument("--share-steps", type=int, default=20, help="Muon steps timed for the Newton-Schulz share")
    ap.add_argument("--share-only", action="store_true", help="only the Newton-Schulz share")
    ap.add_argument("--plot", default="optim.png", help="write the runs' curves here (.png or .svg; '' = none)")
    ap.add_argument("--keep", default=None, help="keep the dataset and runs in this directory")
    args = ap.parse_args(argv)
    with work_dir(args.keep, "numesh-optim-") as root:
        if not args.share_only:
            compare(root, args)
        share(root, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
