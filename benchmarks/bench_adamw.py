"""The AdamW update per element: numesh's kernel beside the loop it replaced and torch's AdamW.

    python benchmarks/bench_adamw.py                              # 50 k, 800 k and 14.2 M values
    python benchmarks/bench_adamw.py --sizes 800000 --rounds 30

For each size (float32 values on one flat buffer; 800 k is about the default model's
parameters, 14.2 M SmolLM2 cut to 4 layers): numesh.host.kernels.adamw with its scalars in
float32 (as numesh.optim.adamw passes them), the same kernel given Python floats (as it was
called before: numba then compiles the loop in float64, 8 lanes of float64 sqrt and divide), and
torch.optim.AdamW's foreach and fused steps on one tensor of that size. One thread (torch
set to 1), interleaved rounds; the median and minimum of each in ns an element. 50 k values
stay in cache, 14.2 M come from memory. Asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from numesh.host import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, machine, ns_per_element, print_ns_table  # noqa: E402


def _sides(n: int) -> dict:
    rng = np.random.default_rng(0)
    p, g = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    decay = rng.random(n) < 0.9
    lr, wd, b1, b2, eps = 1e-3, 0.1, 0.9, 0.99, 1e-8
    c1, c2 = lr / (1 - b1), 1 / math.sqrt(1 - b2)
    f = np.float32
    sides = {
        "numesh kernel, float32 scalars": lambda: K.adamw(p, g, m, v, decay, f(lr * wd), f(b1), f(1 - b1), f(b2),
                                                          f(1 - b2), f(eps), f(c1), f(c2)),
        # the same kernel as it was called before: Python floats make numba compile it in float64
        "the same loop, float64 scalars": lambda: K.adamw(p, g, m, v, decay, lr * wd, b1, 1 - b1, b2, 1 - b2, eps,
                                                          c1, c2),
    }
    try:
        import torch
    except ImportError:
        return sides
    torch.set_num_threads(1)
    for impl in ("foreach", "fused"):
        tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
        tp.grad = torch.from_numpy(g.copy())
        opt = torch.optim.AdamW([tp], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, **{impl: True})
        sides[f"torch AdamW {impl}"] = opt.step
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="50000,800000,14200000", help="values, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=5, help="calls per timing")
    args = ap.parse_args()
    if not K.HAVE_NUMBA:
        raise SystemExit("bench_adamw: numba is not installed (pip install -e '.[fast]')")
    print(describe(machine()))
    for size in args.sizes.split(","):
        n = int(size)
        times = ns_per_element(_sides(n), n, args.rounds, args.reps)
        print(f"\nAdamW on {n:,} float32 values, 1 thread, {args.rounds} rounds")
        print_ns_table("update", times)


if __name__ == "__main__":
    main()
