"""The norms' kernels and their float64 row reductions, per element, beside torch's norms.

    python benchmarks/bench_rows.py                       # 2048 x 128 and 2048 x 576, 15 rounds
    python benchmarks/bench_rows.py --shapes 4096x128 --rounds 30

For each shape (rows x width, float32): numesh's LayerNorm and RMSNorm kernels
(numesh/host/kernels.py, llama_kernels.py), forward and backward, and torch's
`layer_norm`/`rms_norm` forward and autograd backward on the same arrays; then the row
reductions alone: numesh.host.lanes' vector `row_sum`/`row_dot` against the four-chain
scalar loops they replaced (written out below for the comparison). One thread (the
kernels are single-threaded, torch is set to 1), interleaved rounds; the median and the
minimum of each, in ns an element. Asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from numesh.host import kernels as K
from numesh.host import llama_kernels as LK
from numesh.host.lanes import row_dot, row_sum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, machine, ns_per_element, print_ns_table  # noqa: E402


# not cached: numba keys a cache on this file alone, so a changed lanes.py would be timed stale
@K.njit(nogil=True, error_model="numpy")
def _lanes(a, out):
    for i in range(a.shape[0]):
        out[i] = row_sum(a, i, a.shape[1]) + row_dot(a, a, i, a.shape[1])


@K.njit(nogil=True, error_model="numpy")
def _four_chains(a, out):
    """The loops lanes.py replaced: four scalar float64 chains, a float32 product."""
    n = a.shape[1]
    for i in range(a.shape[0]):
        s0 = s1 = s2 = s3 = 0.0
        d0 = d1 = d2 = d3 = 0.0
        j = 0
        while j + 4 <= n:
            s0 += a[i, j]
            s1 += a[i, j + 1]
            s2 += a[i, j + 2]
            s3 += a[i, j + 3]
            j += 4
        while j < n:
            s0 += a[i, j]
            j += 1
        j = 0
        while j + 4 <= n:
            d0 += a[i, j] * a[i, j]
            d1 += a[i, j + 1] * a[i, j + 1]
            d2 += a[i, j + 2] * a[i, j + 2]
            d3 += a[i, j + 3] * a[i, j + 3]
            j += 4
        while j < n:
            d0 += a[i, j] * a[i, j]
            j += 1
        out[i] = (s0 + s1) + (s2 + s3) + (d0 + d1) + (d2 + d3)


def _sides(n: int, c: int) -> dict:
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((n, c)).astype(np.float32) for _ in range(2))
    w, b = rng.standard_normal(c).astype(np.float32), np.zeros(c, np.float32)
    y, xhat, dx = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    rstd, out = np.empty(n, np.float32), np.empty(n)
    dw, db = np.empty(c), np.empty(c)
    sides = {
        "numesh LayerNorm fwd": lambda: K.layernorm_fwd(x, w, b, False, y, xhat, rstd),
        "numesh LayerNorm bwd": lambda: K.layernorm_bwd(dy, xhat, rstd, w, dx, dw, db),
        "numesh RMSNorm fwd": lambda: LK.rmsnorm_fwd(x, w, 1e-5, y, xhat, rstd),
        "numesh RMSNorm bwd": lambda: LK.rmsnorm_bwd(dy, xhat, rstd, w, dx, dw),
        "row_sum + row_dot (lanes)": lambda: _lanes(x, out),
        "row sum + dot (four chains)": lambda: _four_chains(x, out),
    }
    try:
        import torch
    except ImportError:
        return sides
    torch.set_num_threads(1)
    tx, tw, tdy = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_(), torch.from_numpy(dy)
    ln = torch.nn.functional.layer_norm(tx, (c,), tw, None)
    rms = torch.nn.functional.rms_norm(tx, (c,), tw, 1e-5)
    sides["torch layer_norm fwd"] = lambda: torch.nn.functional.layer_norm(tx, (c,), tw, None)
    sides["torch layer_norm bwd"] = lambda: torch.autograd.grad(ln, (tx, tw), tdy, retain_graph=True)
    sides["torch rms_norm fwd"] = lambda: torch.nn.functional.rms_norm(tx, (c,), tw, 1e-5)
    sides["torch rms_norm bwd"] = lambda: torch.autograd.grad(rms, (tx, tw), tdy, retain_graph=True)
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x128,2048x576", help="rows x width, comma-separated")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20, help="calls per timing")
    args = ap.parse_args()
    if not K.HAVE_NUMBA:
        raise SystemExit("bench_rows: numba is not installed (pip install -e '.[fast]')")
    print(describe(machine()))
    for shape in args.shapes.split(","):
        n, c = (int(v) for v in shape.split("x"))
        times = ns_per_element(_sides(n, c), n * c, args.rounds, args.reps)
        print(f"\nfloat32 rows {n} x {c}, 1 thread, {args.rounds} rounds")
        print_ns_table("kernel", times)

if __name__ == "__main__":
    main()
