"""`simulate`'s makespan and busiest rank for uniform stage costs, fast: the planner asks it
twice per layout, for thousands of layouts of the same few schedules.

`numesh.pipeline.schedules.simulate` validates the schedule and builds its dependency order
(`ready_order`) on every call. None of that depends on the costs, so it is done once per
schedule shape here (`_plan`: each action of that order as its rank, kind and the positions
of what it waits for); a call is then one pass of additions and maxima. Same numbers as
`simulate` (tests/test_plan.py compares them on every schedule). Calling `simulate` itself
was most of a large plan's time; `python -m cProfile -s cumtime -m numesh.cli.app plan
--model gpt2-xl --ranks 16 --hardware a100-80gb` shows where a plan's time goes.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np

from numesh.host.kernels import HAVE_NUMBA, njit
from numesh.pipeline.schedules import Schedule, ready_order
from numesh.plan.layout import schedule_of

KINDS = {"F": 0, "B": 1, "W": 2}


@functools.lru_cache(maxsize=16)  # `plan` predicts layouts grouped by schedule
def _plan(name: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, int, tuple[tuple[int, bool], ...]], ...],
                                                      tuple[tuple[int, int, int], ...]]:
    """(per action in a dependency order: (rank, kind, ((position of a dependency, on
    another rank?), ...))), per rank: its (F, B, W) counts). Keyed by the schedule's shape,
    not the schedule (hashing 98k actions per call would cost what it saves)."""
    sched = schedule_of(name, pp, m, v)
    order = tuple((st.rank, KINDS[st.action.kind], st.deps) for st in ready_order(sched))
    counts = tuple((c["F"], c["B"], c["W"]) for c in (Counter(a.kind for a in acts) for acts in sched.actions))
    return order, counts


@functools.lru_cache(maxsize=16)
def _arrays(name: str, pp: int, m: int, v: int) -> tuple[np.ndarray, ...]:
    """`_plan`'s order as arrays for `_compiled`: rank, kind, and the dependencies in CSR
    form (first [n + 1], position, on another rank?)."""
    order, _ = _plan(name, pp, m, v)
    first = np.zeros(len(order) + 1, np.int64)
    first[1:] = np.cumsum([len(deps) for _, _, deps in order])
    flat = [d for _, _, deps in order for d in deps]
    return (np.array([r for r, _, _ in order], np.int64), np.array([k for _, k, _ in order], np.int64), first,
            np.array([d for d, _ in flat], np.int64), np.array([c for _, c in flat], np.bool_))


@njit(cache=True)
def _compiled(rank, kind, first, dep, cross, p, cost, comm):  # pragma: no cover (compiled)
    """The makespan loop of `makespan_and_busy` over `_arrays`, compiled: the planner runs it
    for every layout, and in Python a 300k-action schedule took ~2.5 ms a call (most of a
    64-rank plan's time, `python -m cProfile`)."""
    end = np.zeros(rank.shape[0])
    free = np.zeros(p)
    for i in range(rank.shape[0]):
        r = rank[i]
        start = free[r]
        for j in range(first[i], first[i + 1]):
            t = end[dep[j]] + comm if cross[j] else end[dep[j]]
            if t > start:
                start = t
        free[r] = end[i] = start + cost[kind[i]]
    return free.max() if p else 0.0


def makespan_and_busy(sched: Schedule, t_f: float, t_b: float, t_w: float, comm: float) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of `simulate(sched, t_f, t_b, t_w, comm)`."""
    order, counts = _plan(sched.name, sched.p, sched.m, sched.v)
    cost = (t_f, t_b if sched.split_backward else t_b + t_w, t_w)
    busy = max(f * cost[0] + b * cost[1] + w * cost[2] for f, b, w in counts)
    if HAVE_NUMBA and sched.p:  # the same additions and maxima in the same order: the same floats
        return float(_compiled(*_arrays(sched.name, sched.p, sched.m, sched.v), sched.p, np.array(cost),
                               float(comm))), busy
    end = [0.0] * len(order)
    free = [0.0] * sched.p
    for i, (r, kind, deps) in enumerate(order):
        start = free[r]
        for d, cross in deps:
            t = end[d] + comm if cross else end[d]
            if t > start:
                start = t
        free[r] = end[i] = start + cost[kind]
    return (max(free) if sched.p else 0.0), busy
