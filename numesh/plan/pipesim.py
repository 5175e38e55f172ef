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


def makespan_and_busy(sched: Schedule, t_f: float, t_b: float, t_w: float, comm: float) -> tuple[float, float]:
    """(makespan, busy time of the busiest rank) of `simulate(sched, t_f, t_b, t_w, comm)`."""
    order, counts = _plan(sched.name, sched.p, sched.m, sched.v)
    cost = (t_f, t_b if sched.split_backward else t_b + t_w, t_w)
    end = [0.0] * len(order)
    free = [0.0] * sched.p
    for i, (r, kind, deps) in enumerate(order):
        start = free[r]
        for d, cross in deps:
            t = end[d] + comm if cross else end[d]
            if t > start:
                start = t
        free[r] = end[i] = start + cost[kind]
    busy = max(f * cost[0] + b * cost[1] + w * cost[2] for f, b, w in counts)
    return (max(free) if sched.p else 0.0), busy
