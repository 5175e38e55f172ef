"""Cost models as pure functions: α-β collectives (ring and tree), and interpolation in
measured tables. Times in seconds, sizes in payload bytes as `numesh.perf.formulas` counts them
(the local buffer a call is given)."""

from __future__ import annotations

import bisect
import math
from typing import Sequence


def ring_time(op: str, payload: float, n: int, alpha: float, beta: float) -> float:
    """A ring collective on n ranks, α seconds per message and β bytes/s per link: an
    all-reduce is a reduce-scatter then an all-gather, 2(n-1) steps of S/n bytes each; an
    all-gather or reduce-scatter half of that, and so an all-to-all (pairwise: n-1 steps,
    each sending S/n of the buffer to one rank and receiving as much); a send one message of S bytes."""
    if n <= 1 and op != "send":
        return 0.0
    if op == "send":
        return alpha + payload / beta
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * alpha + steps * payload / n / beta


def tree_time(op: str, payload: float, n: int, alpha: float, beta: float) -> float:
    """A (double binary) tree all-reduce: a reduce up and a broadcast down, 2·log2(n) latency
    steps, each link carrying the whole payload once each way (NCCL's tree). Other ops ring."""
    if op != "all_reduce" or n <= 1:
        return ring_time(op, payload, n, alpha, beta)
    return 2 * math.ceil(math.log2(n)) * alpha + 2 * payload / beta


def collective_time(op: str, payload: float, n: int, alpha: float, beta: float) -> float:
    """The faster of ring and tree, as NCCL and MPI libraries pick by size."""
    return min(ring_time(op, payload, n, alpha, beta), tree_time(op, payload, n, alpha, beta))


def interp_loglog(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at x from (x, y) points sorted by x, linear in log-log between them and
    proportional (constant y/x) beyond the ends (a rate that no longer grows with size)."""
    if not points:
        raise ValueError("no points to interpolate")
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1] * (x / xs[0]) if x > 0 else 0.0
    if x >= xs[-1]:
        return points[-1][1] * (x / xs[-1])
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    if y0 <= 0 or y1 <= 0:
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def interp_time(points: Sequence[tuple[float, float]], size: float) -> float:
    """Seconds of a call of `size` (bytes or FLOPs) from measured (size, seconds) points:
    log-log between them; below the smallest, its time (a floor: the per-call cost); above
    the largest, its rate."""
    if not points:
        raise ValueError("no measurements to interpolate")
    if size <= points[0][0]:
        return points[0][1]
    return interp_loglog(points, size)


def fit_alpha_beta(points: Sequence[tuple[float, float]], steps: float, volume: float) -> tuple[float, float]:
    """Least-squares (α, β) of t = steps·α + volume·S/β over measured (S, t) points, both
    kept positive (a measured curve with no visible latency gets a tiny α)."""
    n = len(points)
    xs = [volume * s for s, _ in points]
    ts = [t for _, t in points]
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    intercept = max(mt - slope * mx, 1e-9)
    return intercept / steps, 1.0 / slope
