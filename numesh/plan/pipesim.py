"""`simulate`'s makespan and busiest rank for uniform stage costs, fast: the planner asks it
twice per layout, for thousands of layouts of the same few schedules.

`numesh.pipeline.schedules.simulate` validates the schedule, rebuilds every action's
dependencies and scans the ranks until each action is ready, on every call. None of that
depends on the costs, so it is done once per schedule shape here (`_plan`: the actions in a
dependency order, each with its rank, kind and the positions of what it waits for); a call
is then one pass of additions and maxima. Same numbers as `simulate` (tests/test_plan.py
compares them on every schedule); on gpt2-xl x 16 ranks simulate took 186 of 236 s
(profiled), 20 ms a call on 98k-action schedules.
"""

from __future__ import annotations

import functools
from collections import Counter

from numesh.errors import UserError
from numesh.pipeline.schedules import Schedule
from numesh.plan.layout import schedule_of

KINDS = {"F": 0, "B": 1, "W": 2}


@functools.lru_cache(maxsize=16)  # `plan` predicts layouts grouped by schedule
def _plan(name: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, int, tuple[tuple[int, bool], ...]], ...],
                                                      tuple[tuple[int, int, int], ...]]:
    """(per action in a dependency order: (rank, kind, ((position of a dependency, on
    another rank?), ...))), per rank: its (F, B, W) counts). Keyed by the schedule's shape,
    not the schedule (hashing 98k actions per call would cost what it saves)."""
    sched = schedule_of(name, pp, m, v)
    p = sched.p
    where: dict[tuple[int, int, int], int] = {}  # (kind, mb, global stage) -> position in the order
    order: list[tuple[int, int, tuple[tuple[int, bool], ...]]] = []
    nxt = [0] * p
    last = sched.num_stages - 1
    progress = True
    while progress:
        progress = False
        for r in range(p):
            acts = sched.actions[r]
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                k = sched.stage(r, a.chunk)
                if a.kind == "F":
                    need = [(0, a.mb, k - 1, (k - 1) % p)] if k > 0 else []
                elif a.kind == "B":
                    need = [(0, a.mb, k, r)] + ([(1, a.mb, k + 1, (k + 1) % p)] if k < last else [])
                else:
                    need = [(1, a.mb, k, r)]
                if any((kd, mb, st) not in where for kd, mb, st, _ in need):
                    break
                where[(KINDS[a.kind], a.mb, k)] = len(order)
                order.append((r, KINDS[a.kind], tuple((where[(kd, mb, st)], dr != r) for kd, mb, st, dr in need)))
                nxt[r] += 1
                progress = True
    if any(nxt[r] < len(sched.actions[r]) for r in range(p)):
        raise UserError(f"schedule {sched.name!r} deadlocks")
    counts = tuple((c["F"], c["B"], c["W"]) for c in (Counter(a.kind for a in acts) for acts in sched.actions))
    return tuple(order), counts


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
