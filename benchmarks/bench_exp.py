"""The float32 exponentials the kernels use, per element, beside NumPy's and torch's.

    python benchmarks/bench_exp.py              # 65,536 elements, 15 rounds
    python benchmarks/bench_exp.py --n 262144 --rounds 30

numesh/host/kernels.py's `exp32` (the whole float32 range) and `exp32_low` (the same bits
for x <= 88: the softmax's and GELU's arguments), each a compiled loop over a flat array
of softmax-like arguments (-20..0, a seventh -inf as masked scores are); NumPy's `np.exp`
and, when installed, torch's `torch.exp` on the same array, into a preallocated output.
One thread (numba's loops are single-threaded; torch is set to 1), interleaved rounds,
the median and the minimum of each in ns an element. Asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from numesh.host import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import describe, machine, ns_per_element, print_ns_table  # noqa: E402


# not cached: numba keys a cache on this file alone, so a changed kernels.py would be timed stale
@K.njit(nogil=True, error_model="numpy")
def _exp_full(x, out):
    for i in range(x.shape[0]):
        out[i] = K.vexp(x[i])


@K.njit(nogil=True, error_model="numpy")
def _exp_low(x, out):
    for i in range(x.shape[0]):
        out[i] = K.vexp_low(x[i])


def _sides(x: np.ndarray, out: np.ndarray) -> dict:
    sides = {"exp32 (kernels.vexp)": lambda: _exp_full(x, out),
             "exp32_low (kernels.vexp_low)": lambda: _exp_low(x, out),
             "np.exp": lambda: np.exp(x, out=out)}
    try:
        import torch
    except ImportError:
        return sides
    torch.set_num_threads(1)
    xt, ot = torch.from_numpy(x), torch.from_numpy(out)
    sides["torch.exp"] = lambda: torch.exp(xt, out=ot)
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65_536, help="elements (default 65,536: in L2)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=50, help="calls per timing")
    args = ap.parse_args()
    if not K.HAVE_NUMBA:
        raise SystemExit("bench_exp: numba is not installed (pip install -e '.[fast]')")
    x = np.random.default_rng(0).uniform(-20.0, 0.0, args.n).astype(np.float32)
    x[::7] = -np.inf
    out = np.empty_like(x)
    sides = _sides(x, out)
    times = ns_per_element(sides, args.n, args.rounds, args.reps)
    print(describe(machine()))
    print(f"float32 exp, {args.n:,} elements, 1 thread, {args.rounds} rounds")
    print_ns_table("exp", times)

if __name__ == "__main__":
    main()
