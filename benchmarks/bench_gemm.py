#!/usr/bin/env python
"""numesh's GEMM shapes on each BLAS it can use, beside PyTorch's: one thread, float32.

    python benchmarks/bench_gemm.py                 # the GEMMs, 5 rounds
    python benchmarks/bench_gemm.py --rounds 9
    python benchmarks/bench_gemm.py --steps default:64x12,default:2048x1,smollm2-4:512x4 --pairs 20

A training step's GEMMs are one-thread calls on fixed tiles (numesh.host.threads) and the
attention's stripe GEMMs (numesh.host.attention_kernels). This times those shapes with
numpy's own BLAS (`np.matmul`, OpenBLAS in pip's wheels), with MKL as numesh calls it
(`numesh.host.blas.matmul_into` under NUMESH_BLAS=mkl: pip's `mkl`, `numesh[mkl]`) and with
`torch.mm` (MKL or oneDNN inside torch), interleaved round by round in this process, and
prints each one's median GFLOP/s and MKL's and torch's speed over numpy's. What
numesh.host.blas's default (MKL on Intel CPUs where installed) rests on. A side that is
not installed is "—".

`--steps` times whole training steps instead (2 threads, float32, one process per row):
numesh on numpy's BLAS, numesh on MKL (`numesh.host.blas.using`) and PyTorch eager (SDPA,
AdamW, the same batches: nanoGPT's model for the nanoGPT presets, bench_train.torch_trainer;
transformers' LlamaForCausalLM for the Llama ones, bench_llama.hf_training) take steps in
turn, in a rotating order, and the report is the median over the rounds of each round's
ratio. A host whose speed drifts by tens of percent over seconds (a busy cloud VM, where
fresh-process rounds disagree) slows the steps of one round alike, so these ratios hold
where separate runs do not; peak memory needs separate processes (bench_long_context.py,
bench_llama.py). This is a benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
os.environ["NUMESH_BLAS"] = "mkl" if os.environ.get("NUMESH_BLAS", "") == "" else os.environ["NUMESH_BLAS"]

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

from common import describe, machine  # noqa: E402

# (what, m, k, n, layout): C[m, n] = op(A)[m, k] · op(B)[k, n]; T marks a transposed operand
SHAPES = [
    ("default 64x12: qkv, a thread's 384 rows", 384, 128, 384, "NN"),
    ("default 64x12: mlp fc", 384, 128, 512, "NN"),
    ("default 64x12: mlp proj", 384, 512, 128, "NN"),
    ("default 64x12: fc's dx = dy·Wᵀ", 384, 512, 128, "NT"),
    ("default 64x12: fc's dW = xᵀ·dy", 128, 384, 512, "TN"),
    ("default 2048x1: fc, a 256-row tile", 256, 128, 512, "NN"),
    ("smollm2: mlp up, a 256-row tile", 256, 576, 1536, "NN"),
    ("smollm2: mlp down's dx", 256, 1536, 576, "NT"),
    ("smollm2: mlp up's dW, 512 rows", 576, 512, 1536, "TN"),
    ("attention hs64: S = K·Qᵀ", 2048, 64, 128, "NT"),
    ("attention hs64: Y = Sᵀ·V", 128, 2048, 64, "TN"),
    ("attention hs32: S = K·Qᵀ", 2048, 32, 128, "NT"),
    ("a small product: the call's own cost shows", 64, 64, 64, "NN"),
]


def operands(m: int, k: int, n: int, layout: str, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = rng.standard_normal((k, m)).astype(np.float32).T if layout[0] == "T" else \
        rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32).T if layout[1] == "T" else \
        rng.standard_normal((k, n)).astype(np.float32)
    return a, b, np.empty((m, n), np.float32)


def per_call(fn: Callable[[], object], seconds: float) -> float:
    """Mean seconds a call over at least `seconds` of calls, after one untimed."""
    fn()
    t0, count = time.perf_counter(), 0
    while True:
        fn()
        count += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return dt / count


def sides(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> dict[str, Callable[[], object] | None]:
    from numesh.host import blas

    out: dict[str, Callable[[], object] | None] = {"numpy": lambda: np.matmul(a, b, out=c)}
    out["mkl"] = (lambda: blas.matmul_into(a, b, c)) if blas.name() == "mkl" else None
    try:
        import torch
    except ImportError:
        out["torch"] = None
    else:
        ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c)
        out["torch"] = lambda: torch.mm(ta, tb, out=tc)
    return out


def _torch_step(preset: str, T: int, B: int, data: str) -> Callable[[int], None] | None:
    """The same model's step in PyTorch eager on 2 threads (SDPA, AdamW, numesh's batches):
    nanoGPT's for the nanoGPT presets (bench_train.torch_trainer), transformers'
    LlamaForCausalLM for the Llama ones (bench_llama.hf_training); None without torch (or
    transformers, for Llama)."""
    from bench_train import preset_config, torch_trainer
    from common import PRESETS

    try:
        import torch
    except ImportError:
        return None
    from numesh.data.dataset import load_split
    from numesh.run.config import config_from

    torch.set_num_threads(2)
    train = load_split(data, "train")
    if preset not in PRESETS:
        try:
            import transformers
        except ImportError:
            return None
        from bench_llama import hf_training, train_config

        return hf_training(torch, transformers, train_config(preset_config(preset, B, T), data), train)[1]
    tc = config_from({**preset_config(preset, B, T), "data": data, "dtype": "float32", "seed": 1337, "dropout": 0.0,
                      "bias": False})
    vocab = json.loads((Path(data) / "meta.json").read_text())["vocab_size"]
    return torch_trainer(torch, tc, vocab, train, "sdpa", "default")[2]


def steps_row(spec: str, pairs: int, data: str) -> str:
    """One table row: the model `spec` ("preset:TxB") trained for `pairs` rounds of steps, the
    sides in a rotating order, a pause between steps so that no side's waiting threads
    still spin into the next (numesh's spin up to 10 ms, numesh.host.spin)."""
    from bench_train import make_trainer, preset_config
    from numesh.host import blas

    preset, shape = spec.split(":")
    T, B = (int(x) for x in shape.split("x"))
    trainer = make_trainer(preset_config(preset, B, T), data, "float32")
    steps: dict[str, Callable[[int], object]] = {"numpy": lambda i: trainer.train_step(),
                                                 "mkl": lambda i: trainer.train_step()}
    torch_step = _torch_step(preset, T, B, data)
    if torch_step is not None:
        steps["torch"] = torch_step
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(pairs + 2):  # the first two rounds warm up
        for side in names[i % len(names):] + names[:i % len(names)]:
            time.sleep(0.03)
            with blas.using("numpy" if side == "torch" else side):
                t0 = time.perf_counter()
                steps[side](i)
                if i >= 2:
                    times[side].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}

    def paired(a: str, b: str) -> str:
        r = [x / y for x, y in zip(times[a], times[b])]
        q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
        return f"**{statistics.median(r):.3f}×** ({q[0]:.3f}–{q[2]:.3f})"

    versus = (f"{med['torch']:.1f} | {paired('torch', 'numpy')} | {paired('torch', 'mkl')}" if "torch" in med
              else "— | — | —")
    return (f"| {preset} | {T} × {B} | {med['numpy']:.1f} | {med['mkl']:.1f} | {paired('numpy', 'mkl')} | {versus} "
            f"| {pairs} |")


def steps_section(rows: str, pairs: int, data: str | None) -> None:
    import subprocess

    from common import DEFAULT_SRC, dataset_dir, log
    from numesh.host import blas

    if blas.name() != "mkl":
        raise SystemExit("--steps compares numpy's BLAS with MKL: pip install 'numesh[mkl]' first")
    print("training steps, 2 threads, float32: numesh on numpy's BLAS, numesh on MKL and PyTorch eager "
          "(nanoGPT's model, or transformers' Llama), in turn step by step in one process per row; "
          "speed ratios are medians over the rounds (quartiles)\n")
    print("| model | T × B | numesh, numpy's BLAS ms | numesh, MKL ms | MKL / numpy's BLAS | torch ms "
          "| numesh (numpy's BLAS) / torch | numesh (MKL) / torch | rounds |")
    print("|---|---|---|---|---|---|---|---|---|")
    with dataset_dir(data, DEFAULT_SRC, log=log) as d:
        for spec in rows.split(","):
            res = subprocess.run([sys.executable, __file__, "--steps-worker", spec, "--pairs", str(pairs),
                                  "--data", str(d)], capture_output=True, text=True)
            print(res.stdout.strip() if res.returncode == 0 else f"| {spec} | failed: {res.stderr.strip()[-300:]} |",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--seconds", type=float, default=0.1, help="seconds of calls a measurement (default 0.1)")
    ap.add_argument("--steps", default=None, help="preset:TxB,... : time training steps instead (see above)")
    ap.add_argument("--pairs", type=int, default=20, help="--steps: pairs of steps a row (default 20)")
    ap.add_argument("--data", default=None, help="--steps: dataset dir from `numesh data` (default: a temporary one)")
    ap.add_argument("--steps-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps_worker:
        from numesh.host.runtime import keep_freed_memory, set_blas_threads

        set_blas_threads(2)
        keep_freed_memory()
        print(steps_row(args.steps_worker, args.pairs, args.data))
        return 0
    if args.steps:
        print(f"machine: {describe(machine())}")
        steps_section(args.steps, args.pairs, args.data)
        return 0
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    from numesh.host import blas

    print(f"machine: {describe(machine())}")
    if blas.name() != "mkl":
        print("MKL: not installed here (pip install 'numesh[mkl]'), so only numpy's BLAS and torch")
    print(f"one thread, float32, median GFLOP/s of {args.rounds} interleaved rounds\n")
    print("| GEMM | m × k × n | numpy's BLAS | MKL (numesh) | torch.mm | MKL / numpy | torch / numpy |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=1, user_api="blas"):
        for what, m, k, n, layout in SHAPES:
            fns = sides(*operands(m, k, n, layout, rng))
            rates: dict[str, list[float]] = {s: [] for s, f in fns.items() if f is not None}
            for _ in range(args.rounds):
                for s in rates:
                    rates[s].append(2.0 * m * k * n / per_call(fns[s], args.seconds) / 1e9)
            med = {s: statistics.median(r) for s, r in rates.items()}
            cell = [f"{med[s]:.1f}" if s in med else "—" for s in ("numpy", "mkl", "torch")]
            ratio = [f"{med[s] / med['numpy']:.2f}×" if s in med else "—" for s in ("mkl", "torch")]
            print(f"| {what} ({layout}) | {m} × {k} × {n} | {' | '.join(cell)} | {' | '.join(ratio)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
