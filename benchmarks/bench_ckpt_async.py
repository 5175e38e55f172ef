#!/usr/bin/env python
"""Step-time overhead of checkpointing every 10 steps: synchronous against `--ckpt-async`.

    python benchmarks/bench_ckpt_async.py                          # default and baby models
    python benchmarks/bench_ckpt_async.py --models default --iters 40 --repeats 5
    mpirun -n 2 python benchmarks/bench_ckpt_async.py --mesh dp=2  # any mesh: the job's ranks

Each repeat trains every mode once, in turn: `none` (no checkpoint during the run), `sync`
(`--ckpt-interval 10`) and `async` (`--ckpt-interval 10 --ckpt-async`). What is timed is the
wall time from the end of step 0 to the end of step iters-1 (no evaluation in between), so it
holds iters-1 steps and the saves after steps 10, 20, ... below iters, each followed by 10
timed steps (an async save's writing overlaps them); start-up and the last save are outside
it. The overhead of a mode is its best time over the repeats against `none`'s (other work on
the cores only ever slows a run down). Beside it, the time a save stops the main thread
(all of it when synchronous; taking the snapshot and the two hand-overs when async), which
other load moves much less.
Checkpoints go to a temporary directory under --root (default: the system's), removed after.
On a shared machine run it several times: other work on the cores moves the numbers.
This is a benchmark script, not a test: it reports numbers and asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_SRC, PRESETS, dataset_dir  # noqa: E402

MODES = {"none": dict(ckpt_interval=0), "sync": dict(ckpt_interval=10),
         "async": dict(ckpt_interval=10, ckpt_async=True)}


def log(msg: str) -> None:
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(msg, file=sys.stderr, flush=True)


class Stalls:
    """The intervals the training loop spends in checkpoint code on the main thread: a
    save's start (sync: all of it) and the async finish at a step boundary."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.spans.append((t0, time.perf_counter() - t0))
        return timed

    def within(self, t0: float, t1: float) -> float:
        return sum(dt for t, dt in self.spans if t0 <= t <= t1)


def timed_run(model: str, mode: str, iters: int, data: str, out: str, mesh: str) -> tuple[float, float]:
    """(seconds from the end of step 0 to the end of step iters-1, seconds of them the main
    thread spent in checkpoint code) of one run."""
    import numesh.run.train as T
    from numesh.checkpoint.background import AsyncCheckpoints
    from numesh.run.config import config_from

    cfg = config_from({**PRESETS[model], **MODES[mode], "max_iters": iters, "eval_interval": 10**9,
                       "eval_iters": 1, "data": data, "out": out, "mesh": mesh, "peak_flops": 1e12,
                       "overwrite": True})
    marks: dict[int, float] = {}
    stalls = Stalls()
    real = T.save_step, AsyncCheckpoints.poll
    T.save_step, AsyncCheckpoints.poll = stalls.wrap(real[0]), stalls.wrap(real[1])
    try:
        T.train(cfg, on_step=lambda step, record: marks.setdefault(step, time.perf_counter()))
    finally:
        T.save_step, AsyncCheckpoints.poll = real
    t0, t1 = marks[0], marks[iters - 1]
    return t1 - t0, stalls.within(t0, t1)


def bench_model(model: str, iters: int, repeats: int, data: str, root: str, mesh: str) -> dict[str, Any]:
    """Per mode over `repeats` rounds (the modes in turn within each round): the best time
    (other work on the cores only ever slows a run) and the median main-thread stall."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    stalls: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(repeats):
        for mode in MODES:
            out = tempfile.mkdtemp(prefix="numesh-ckpt-bench-", dir=root) if MPI.COMM_WORLD.Get_rank() == 0 else None
            out = MPI.COMM_WORLD.bcast(out, root=0)
            try:
                seconds, stall = timed_run(model, mode, iters, data, out, mesh)
            finally:
                MPI.COMM_WORLD.Barrier()
                if MPI.COMM_WORLD.Get_rank() == 0:
                    shutil.rmtree(out, ignore_errors=True)
            times[mode].append(seconds)
            stalls[mode].append(stall)
            log(f"{model} round {r + 1}/{repeats} {mode}: {seconds:.2f} s, {1e3 * stall:.0f} ms in checkpoint code")
    best = {m: min(t) for m, t in times.items()}
    return {"model": model, "steps": iters - 1, "saves": (iters - 1) // 10, "best_s": best, "all_s": times,
            "stall_s": {m: statistics.median(s) for m, s in stalls.items()},
            "overhead": {m: best[m] / best["none"] - 1 for m in ("sync", "async")}}


def ckpt_mib(model: str, vocab: int) -> float:
    """MiB of one checkpoint: parameters and both AdamW moments, in float32."""
    from numesh.base.tree import tree_leaves
    from numesh.nn.gpt import GPTConfig, gpt_global_shapes

    p = PRESETS[model]
    shapes = gpt_global_shapes(GPTConfig(vocab_size=vocab, block_size=p["block_size"], n_layer=p["n_layer"],
                                         n_head=p["n_head"], n_embd=p["n_embd"]), 1)
    return 3 * 4 * sum(math.prod(s) for s in tree_leaves(shapes)) / 2**20


def table(rows: list[dict[str, Any]], vocab: int) -> str:
    lines = ["| model | checkpoint | ms a step, no saves | sync: ms a step (overhead) | async: ms a step (overhead) "
             "| main thread stopped a save: sync / async |", "|---|---|---|---|---|---|"]
    for row in rows:
        best, n, saves = row["best_s"], row["steps"], row["saves"]
        cells = [f"{1e3 * best[m] / n:,.0f} ({100 * row['overhead'][m]:+.1f} %)" for m in ("sync", "async")]
        stall = " / ".join(f"{1e3 * row['stall_s'][m] / saves:,.0f} ms" for m in ("sync", "async"))
        lines.append(f"| {row['model']} | {ckpt_mib(row['model'], vocab):.0f} MiB | {1e3 * best['none'] / n:,.0f} | "
                     f"{cells[0]} | {cells[1]} | {stall} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,baby", help="comma-separated presets of benchmarks/common.py")
    ap.add_argument("--iters", type=int, default=40, help="steps a run (saves every 10; a multiple of 10 times "
                    "every save and the 10 steps after it)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three modes")
    ap.add_argument("--mesh", default="", help="the mesh of every run (the job's ranks)")
    ap.add_argument("--data", default=None, help="a prepared dataset (default: one made from --src)")
    ap.add_argument("--src", default=DEFAULT_SRC, help="text to make the dataset from")
    ap.add_argument("--root", default=None, help="where the checkpoints go (a temporary directory inside)")
    args = ap.parse_args()
    from numesh.data.dataset import load_tokenizer
    from numesh.host.runtime import configure_process

    configure_process()
    comm = MPI.COMM_WORLD
    with dataset_dir(args.data, args.src, comm, log) as data:
        rows = [bench_model(m, args.iters, args.repeats, data, args.root, args.mesh) for m in args.models.split(",")]
        vocab = load_tokenizer(data).vocab_size
    if comm.Get_rank() == 0:
        load = os.getloadavg()[0]
        print(f"{comm.Get_size()} rank(s), mesh {args.mesh or 'dp=1'}, {os.cpu_count()} cores, load {load:.1f}; "
              f"{args.iters - 1} steps timed, saves every 10, the best of {args.repeats} runs")
        print(table(rows, vocab))


if __name__ == "__main__":
    main()
