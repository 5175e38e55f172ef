"""What the fixed tiles of numesh.host.threads cost on one thread (numesh/threads.py "Fixed tiles").

Two tables, each measured in turns (rounds of every variant, medians) in this one process,
BLAS on one thread:

1. matmul: one BLAS call on all rows against `threads.matmul`'s fixed row tiles at a few
   tile sizes, for the products a step makes (forward, input grad, the weight grad's xᵀ·dy).
2. a transformer block's forward and backward: whole against cut into 2, 4, ... pieces of
   its sequences (numesh.nn.walk.block_pieces; what a run on one thread pays for pieces).

    python benchmarks/bench_tiles.py                # the default model's shapes
    python benchmarks/bench_tiles.py --n-embd 384 --n-head 6 --block-size 256 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import numpy as np
from threadpoolctl import threadpool_limits

from numesh.host import threads
from numesh.host.runtime import keep_freed_memory
from numesh.mesh import Mesh
from numesh.nn.gpt import GPTConfig, init_gpt
from numesh.nn.walk import run_block_bwd, run_block_fwd


def timed(fns: dict[str, Callable[[], None]], rounds: int, reps: int) -> dict[str, float]:
    """Median ms of each function over `rounds` rounds of `reps` calls, the functions in turns."""
    for fn in fns.values():
        fn()
    got: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            got[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: statistics.median(v) for k, v in got.items()}


def matmul_table(tokens: int, c: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    print("== matmul, float32, one thread: one BLAS call vs fixed row tiles (ms; ratio to one call)")
    for what, (m, k, n) in {"qkv forward": (tokens, c, 3 * c), "mlp-down input grad": (tokens, c, 4 * c),
                            "mlp-up weight grad (xT dy)": (c, tokens, 4 * c)}.items():
        a = rng.standard_normal((m, k) if "weight" not in what else (k, m)).astype(np.float32)
        a = a if "weight" not in what else a.T  # xᵀ: a strided view, as linear_bwd_weight passes it
        b = rng.standard_normal((k, n)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        fns: dict[str, Callable[[], None]] = {"one call": lambda: np.matmul(a, b, out=out)}
        for rows in (64, 128, 256, 512):
            def tiled(rows: int = rows) -> None:
                threads.TILE_ROWS = rows
                threads.matmul(a, b)
            fns[f"tiles of {rows}"] = tiled
        ms = timed(fns, rounds, max(1, int(2e8 // (2 * m * k * n))))
        base = ms["one call"]
        print(f"  {what:28s} [{m}x{k}]@[{k}x{n}]  one call {base:7.3f} ms  " +
              "  ".join(f"{name.split()[-1]}: {v / base:5.3f}" for name, v in ms.items() if name != "one call"))


def block_table(args: argparse.Namespace) -> None:
    cfg = GPTConfig(vocab_size=65, block_size=args.block_size, n_layer=1, n_head=args.n_head, n_embd=args.n_embd,
                    dropout=0.0, bias=False)
    mesh = Mesh.parse("")
    p = init_gpt(cfg, mesh, seed=0, dtype=np.float32).blocks[0]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.block_size, args.n_embd)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    import numesh.nn.walk as walk

    fns = {}
    for pieces in (1, 2, 4, 8, 16):
        if pieces > args.batch:
            break

        def run(pieces: int = pieces) -> None:
            walk.PIECE_TOKENS = args.batch // pieces * args.block_size if pieces > 1 else 1 << 40
            _, ctx = run_block_fwd(p, x, cfg, mesh, 0)
            run_block_bwd(p, ctx, dy, cfg, mesh)
        fns[pieces] = run
    ms = timed(fns, args.rounds, 3)
    print(f"== one block forward+backward, float32, one thread: [{args.batch}, {args.block_size}, {args.n_embd}] "
          "whole vs cut into pieces (its matmuls piece by piece, its weight gradients summed over the pieces)")
    for k, v in ms.items():
        print(f"  {k:2d} piece{'s' if k > 1 else ' '}  {v:8.2f} ms  {v / ms[1]:5.3f} of whole")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    keep_freed_memory()  # as a training rank runs: freed blocks reused, not returned to the OS
    threads.set_threads(1)
    threads.set_cores(1 << 10)  # tiles and pieces as fine as asked, as if this rank had the cores
    with threadpool_limits(limits=1, user_api="blas"):
        matmul_table(args.batch * args.block_size, args.n_embd, args.rounds)
        block_table(args)


if __name__ == "__main__":
    main()
