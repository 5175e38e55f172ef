#!/usr/bin/env python
"""One node's training speed: numesh's thread sweep, dp weak scaling and baby-model meshes,
beside PyTorch eager on the same model, in one command.

    python benchmarks/bench_node.py                         # every section, every core
    python benchmarks/bench_node.py --cores 16 --launcher "mpirun --allow-run-as-root"
    python benchmarks/bench_node.py --sections threads,weak --no-torch --json

Sections (each measurement is a fresh process, so its peak RSS is its own):
  threads  the default model (4 layers, 128 wide, block 64, batch 12) in one process at
           1, 2, 4, ... cores threads: numesh and torch eager (torch.set_num_threads).
  weak     dp = 1, 2, 4, ... cores ranks at one thread each, batch 12 per rank (launched
           with --launcher, default $NUMESH_MPIRUN, else the mpirun beside this Python, else
           mpirun on PATH; Open MPI gets --bind-to none so a rank's threads are not pinned
           to one core): tokens/s and efficiency = tokens/s / (dp × tokens/s at dp=1).
  baby     the baby model (6 layers, 384 wide, 6 heads, block 256, batch 64) on every
           dp×tp×pp mesh with ranks × threads = cores that the model divides (pp runs 1F1B
           with 2·pp micro-batches), and torch eager on all cores.

Every row reports the median step time over --iters timed steps after --warmup, tokens/s,
and the peak RSS of each rank (the largest over ranks). Ratios are tokens/s over torch's.
torch is optional: without it the torch columns say so. This is a benchmark: it asserts
nothing. docs/benchmarks.md ("Speed on one node") holds its output for the machines we ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    DEFAULT_SRC,
    PRESETS,
    dataset_dir,
    describe,
    log,
    machine,
    peak_rss_mb,
    run_json,
    step_clock,
    timed_steps,
    venv_tool,
    worker_env,
)

BABY = dict(PRESETS["baby"], batch_size=64)  # the issue's baby run: batch 64


def logged(result: dict[str, Any]) -> dict[str, Any]:
    """`result`, also written to stderr at once: a long run cut short keeps what it measured."""
    log(f"  -> {json.dumps(result)}")
    return result


# --------------------------------------------------------------------------------------
# workers: one measurement each, printing one JSON line on rank 0


def import_numesh_from(checkout: str) -> None:
    """Import numesh from `checkout` (a directory holding numesh/) rather than the installed
    one: its path first, and the import hooks of an editable install (which outrank
    sys.path) removed; an error if numesh was imported already or comes from elsewhere."""
    if "numesh" in sys.modules:
        raise SystemExit("--numesh-from: numesh is imported already")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, checkout)
    import numesh

    if not Path(numesh.__file__).resolve().is_relative_to(Path(checkout).resolve()):
        raise SystemExit(f"--numesh-from {checkout}: numesh came from {numesh.__file__}")


def worker_numesh(args: argparse.Namespace) -> None:
    import numesh  # noqa: F401  # isort: skip  (before numpy: it sets up OpenBLAS, see numesh/__init__.py)
    from mpi4py import MPI

    from numesh.host.runtime import configure_process
    from numesh.run.config import config_from
    from numesh.run.train import Trainer

    comm = MPI.COMM_WORLD
    threads = configure_process(args.threads, comm)
    model = json.loads(args.model)
    cfg = config_from({**model, "data": args.data, "dtype": "float32", "seed": 1337, "dropout": 0.0, "bias": False,
                       "mesh": args.mesh, "micro_batches": args.micro_batches,
                       "schedule": "1f1b"})
    trainer = Trainer(cfg, comm)
    for _ in range(args.warmup):
        trainer.train_step()
    comm.Barrier()
    times, _ = timed_steps(lambda _i: trainer.train_step(), 0, args.iters, step_clock(args.clock))
    slowest = comm.allreduce(statistics.median(times), op=MPI.MAX)
    rss = comm.gather(peak_rss_mb(), root=0)
    if comm.Get_rank() == 0:
        print(json.dumps({"ms": slowest * 1e3, "tokens_per_s": trainer.tokens_per_step / slowest,
                          "rss_mb": max(rss), "ranks": comm.Get_size(), "threads": threads}), flush=True)


def worker_torch(args: argparse.Namespace) -> None:
    import numesh  # noqa: F401  # isort: skip  (before torch, which loads numpy: OpenBLAS set-up)
    import torch

    from bench_train import torch_trainer
    from numesh.data.dataset import load_split
    from numesh.run.config import config_from

    torch.set_num_threads(args.threads)
    model = json.loads(args.model)
    tc = config_from({**model, "data": args.data, "dtype": "float32", "seed": 1337, "dropout": 0.0, "bias": False})
    train_data = load_split(args.data, "train")
    vocab = json.loads((Path(args.data) / "meta.json").read_text())["vocab_size"]
    _m, _p, step, _losses = torch_trainer(torch, tc, vocab, train_data, "sdpa", "default")
    times, _ = timed_steps(step, args.warmup, args.iters, step_clock(args.clock))
    med = statistics.median(times)
    print(json.dumps({"ms": med * 1e3, "tokens_per_s": tc.batch_size * tc.block_size / med, "rss_mb": peak_rss_mb(),
                      "ranks": 1, "threads": args.threads, "torch": torch.__version__}), flush=True)


# --------------------------------------------------------------------------------------
# the driver


def default_launcher() -> list[str]:
    """$NUMESH_MPIRUN, else the mpirun beside this Python (the venv's MPICH), else PATH's;
    Open MPI gets --bind-to none (it pins each rank to a core by default)."""
    env = os.environ.get("NUMESH_MPIRUN")
    if env:
        return shlex.split(env)
    return with_binding([venv_tool("mpirun")])


def with_binding(launcher: list[str]) -> list[str]:
    try:
        version = subprocess.run([launcher[0], "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return launcher
    if "Open MPI" in version or "OpenRTE" in version:
        return [*launcher, "--bind-to", "none"]
    return launcher


def run_worker(kind: str, model: dict, data: str, threads: int, iters: int, warmup: int, ranks: int = 1,
               mesh: str = "", micro_batches: int = 1, launcher: list[str] | None = None,
               timeout: float = 3600, clock: str = "wall", numesh_from: str | None = None) -> dict[str, Any]:
    """One measurement in a fresh process (under the launcher when ranks > 1): its JSON, or
    {"error": ...}. clock "cpu" times steps by the process's CPU time (one thread only);
    `numesh_from` a checkout whose numesh the worker imports instead of this one (before and
    after a change, in the same rounds)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--threads", str(threads),
           "--iters", str(iters), "--warmup", str(warmup), "--data", data, "--model", json.dumps(model),
           "--mesh", mesh, "--micro-batches", str(micro_batches), "--clock", clock]
    if numesh_from:
        cmd += ["--numesh-from", str(Path(numesh_from).resolve())]
    if ranks > 1:
        cmd = [*(launcher or default_launcher()), "-n", str(ranks), *cmd]
    return run_json(cmd, worker_env(), timeout)


def powers_up_to(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


def baby_meshes(cores: int, model: dict) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp·tp·pp dividing `cores` (threads = cores / ranks) that the baby
    model divides: tp | n_head, pp | n_layer, dp·2pp | batch (pp runs 2·pp micro-batches)."""
    out = []
    for ranks in range(1, cores + 1):
        if cores % ranks:
            continue
        for tp in range(1, ranks + 1):
            for pp in range(1, ranks // tp + 1):
                if ranks % (tp * pp):
                    continue
                dp = ranks // (tp * pp)
                mb = 2 * pp if pp > 1 else 1
                if model["n_head"] % tp or model["n_layer"] % pp or model["batch_size"] % (dp * mb):
                    continue
                out.append((dp, tp, pp))
    return out


def _fmt(r: dict | None, key: str, spec: str) -> str:
    if not r or "error" in r:
        return "-"
    return format(r[key], spec)


def _ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or "error" in a or "error" in b:
        return "-"
    return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}"


def print_report(rep: dict[str, Any]) -> None:
    m = rep["machine"]
    print(f"machine: {describe(m)} (at start); mpi4py {m['mpi4py']}")
    print(f"cores used: {rep['cores']}; {rep['iters']} timed steps after {rep['warmup']} "
          f"(baby: {rep['baby_iters']} after 1); ms = median step; RSS = peak resident MB of the largest rank")
    if "threads" in rep:
        print("\n== thread sweep: default model (4x128, block 64, batch 12), one process ==")
        print(f"{'threads':>7} {'numesh ms':>10} {'tok/s':>9} {'RSS MB':>7} | "
              f"{'torch ms':>9} {'tok/s':>9} {'RSS MB':>7} | {'numesh/torch':>12}")
        for row in rep["threads"]:
            n, t = row["numesh"], row.get("torch")
            print(f"{row['threads']:>7} {_fmt(n, 'ms', '10.1f')} {_fmt(n, 'tokens_per_s', '9,.0f')} "
                  f"{_fmt(n, 'rss_mb', '7.0f')} | {_fmt(t, 'ms', '9.1f')} {_fmt(t, 'tokens_per_s', '9,.0f')} "
                  f"{_fmt(t, 'rss_mb', '7.0f')} | {_ratio(n, t):>12}")
            for r in (n, t):
                if r and "error" in r:
                    print(f"        error: {r['error']}")
    if "weak" in rep:
        print("\n== weak scaling: dp ranks x 1 thread, batch 12 per rank (default model) ==")
        print(f"{'dp':>4} {'step ms':>8} {'tok/s':>9} {'efficiency':>10} {'RSS MB/rank':>11}")
        base = rep["weak"][0]["numesh"] if rep["weak"] else None
        for row in rep["weak"]:
            n = row["numesh"]
            eff = "-" if not base or "error" in base or "error" in n else \
                f"{n['tokens_per_s'] / (row['dp'] * base['tokens_per_s']):.2f}"
            print(f"{row['dp']:>4} {_fmt(n, 'ms', '8.1f')} {_fmt(n, 'tokens_per_s', '9,.0f')} {eff:>10} "
                  f"{_fmt(n, 'rss_mb', '11.0f')}")
            if "error" in n:
                print(f"     error: {n['error']}")
    if "baby" in rep:
        b = rep["baby"]
        t = b.get("torch")
        print(f"\n== baby model (6x384, 6 heads, block 256, batch 64): meshes with ranks x threads = {rep['cores']} ==")
        print(f"{'mesh':>16} {'ranks x thr':>11} {'step ms':>9} {'tok/s':>8} {'RSS MB/rank':>11} {'vs torch':>8}")
        for row in b["meshes"]:
            n = row["numesh"]
            print(f"{row['mesh']:>16} {row['ranks']:>5} x {row['threads']:<3} {_fmt(n, 'ms', '9.0f')} "
                  f"{_fmt(n, 'tokens_per_s', '8,.0f')} {_fmt(n, 'rss_mb', '11.0f')} {_ratio(n, t):>8}")
            if "error" in n:
                print(f"     error: {n['error']}")
        if t is not None:
            print(f"{'torch eager':>16} {1:>5} x {rep['cores']:<3} {_fmt(t, 'ms', '9.0f')} "
                  f"{_fmt(t, 'tokens_per_s', '8,.0f')} {_fmt(t, 'rss_mb', '11.0f')} "
                  f"{'1.00' if 'error' not in t else '-':>8}")
            if "error" in t:
                print(f"     error: {t['error']}")
    print("\nratios: numesh tokens/s over torch eager's (> 1: numesh faster)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores to use (default: all)")
    ap.add_argument("--sections", default="threads,weak,baby", help="comma-separated: threads, weak, baby")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per measurement (default 20)")
    # torch eager in a fresh process needs more than 3 steps to settle: on the 2-core VM its
    # 2-thread step read 53.0 ms after 3 warm-up steps and 41.4 ms after 10 (numesh: 49.4, 40.1)
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    ap.add_argument("--baby-iters", type=int, default=3, help="timed steps per baby-model measurement (default 3)")
    ap.add_argument("--launcher", default=None, help="MPI launcher command (default $NUMESH_MPIRUN or mpirun)")
    ap.add_argument("--no-torch", action="store_true", help="measure numesh only")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take (default 1800)")
    ap.add_argument("--data", default=None, help="dataset dir from `numesh data` (default: a temporary one)")
    ap.add_argument("--src", default=DEFAULT_SRC, help="text for the temporary dataset")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    # worker mode (internal)
    ap.add_argument("--worker", choices=("numesh", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--mesh", default="", help=argparse.SUPPRESS)
    ap.add_argument("--micro-batches", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help=argparse.SUPPRESS)
    ap.add_argument("--numesh-from", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.numesh_from:
        import_numesh_from(args.numesh_from)
    if args.worker == "numesh":
        worker_numesh(args)
        return 0
    if args.worker == "torch":
        worker_torch(args)
        return 0
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections <= {"threads", "weak", "baby"} or args.cores < 1 or args.iters < 1:
        ap.error("--sections takes threads, weak, baby; --cores and --iters must be >= 1")
    launcher = with_binding(shlex.split(args.launcher)) if args.launcher else default_launcher()
    try:
        import torch  # noqa: F401

        have_torch = not args.no_torch
    except ImportError:
        have_torch = False
        if not args.no_torch:
            log("torch is not installed: numesh only (pip install torch to compare)")
    rep: dict[str, Any] = {"machine": machine(), "cores": args.cores, "iters": args.iters, "warmup": args.warmup,
                           "baby_iters": args.baby_iters, "launcher": launcher}
    default = dict(PRESETS["default"])
    with dataset_dir(args.data, args.src, log=log) as data:
        if "threads" in sections:
            rep["threads"] = []
            for n in powers_up_to(args.cores):
                log(f"threads={n} ...")
                row: dict[str, Any] = {"threads": n,
                                       "numesh": logged(run_worker("numesh", default, data, n, args.iters,
                                                                          args.warmup, timeout=args.timeout))}
                if have_torch:
                    row["torch"] = logged(run_worker("torch", default, data, n, args.iters, args.warmup,
                                                     timeout=args.timeout))
                rep["threads"].append(row)
        if "weak" in sections:
            rep["weak"] = []
            for dp in powers_up_to(args.cores):
                log(f"weak scaling dp={dp} ...")
                model = dict(default, batch_size=default["batch_size"] * dp)
                rep["weak"].append({"dp": dp, "numesh": logged(run_worker(
                    "numesh", model, data, 1, args.iters, args.warmup, ranks=dp, mesh=f"dp={dp}",
                    launcher=launcher, timeout=args.timeout))})
        if "baby" in sections:
            meshes = []
            for dp, tp, pp in baby_meshes(args.cores, BABY):
                ranks = dp * tp * pp
                name = f"dp={dp},tp={tp},pp={pp}"
                log(f"baby {name} x {args.cores // ranks} threads ...")
                meshes.append({"mesh": name, "ranks": ranks, "threads": args.cores // ranks,
                               "numesh": logged(run_worker("numesh", BABY, data, args.cores // ranks,
                                                           args.baby_iters, 1, ranks=ranks,
                                                           mesh=name if ranks > 1 else "",
                                                           micro_batches=2 * pp if pp > 1 else 1,
                                                           launcher=launcher, timeout=args.timeout))})
            rep["baby"] = {"meshes": meshes}
            if have_torch:
                log("baby torch eager ...")
                rep["baby"]["torch"] = logged(run_worker("torch", BABY, data, args.cores, args.baby_iters, 1,
                                                         timeout=args.timeout))
    if args.json:
        print(json.dumps(rep))
    else:
        print_report(rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
