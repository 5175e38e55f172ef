"""Pipeline schedules as plain data, and the arithmetic you can do on them.

A schedule is, per pipeline rank, the ordered list of actions that rank executes:
``F(mb, chunk)`` (forward), ``B(mb, chunk)`` (backward) and, for schedules that split the
backward, ``W(mb, chunk)`` (weight gradient). Nothing here knows about MPI or the model;
the executor turns the lists into computation and point-to-point messages, and the same
lists give the bubble and peak activation memory without running anything.

Stage numbering. With ``v`` chunks (virtual stages) per rank, chunk ``c`` of rank ``s``
is global model stage ``k = c*p + s`` (Megatron's interleaved layout); data flows
``k -> k+1``. Dependencies used by :func:`simulate`:

* ``F(mb, k)`` needs ``F(mb, k-1)`` (on rank ``(k-1) % p``; the same rank at a chunk
  boundary when ``p == 1``);
* ``B(mb, k)`` needs ``F(mb, k)`` (same rank) and ``B(mb, k+1)``;
* ``W(mb, k)`` needs ``B(mb, k)`` (same rank).

When ``split_backward`` is False, ``B`` is the full backward (input and weight grads) and
costs ``t_b + t_w`` in :func:`simulate`; when True, ``B`` is the input grad only
(``t_b``) and ``W`` the weight grad (``t_w``).

Schedules built here:

* :func:`gpipe` -- every forward, then every backward, backwards in micro-batch order
  ``0..m-1`` (the same order as 1F1B's backwards, so gradients accumulate in the same
  order under every schedule). Peak activations: ``m`` on every rank.
* :func:`one_f_one_b` -- PipeDream-Flush / Megatron 1F1B: rank ``s`` runs
  ``min(p-s-1, m)`` warm-up forwards, alternates one forward / one backward, then drains
  the remaining backwards. Peak activations on rank ``s``: ``min(p-s, m)``.
* :func:`interleaved` -- Megatron's interleaved 1F1B (Narayanan et al. 2021), the
  classic version that requires ``m % p == 0``: forwards go through micro-batches in
  groups of ``p``, chunk 0 first, then chunk 1, ...; backwards the same with chunks
  reversed; rank ``s`` warms up with ``min(2*(p-s-1) + (v-1)*p, m*v)`` forwards.
  Megatron also forces all-warmup on every rank when ``m == p``; we do not: the bubble
  is the same and later ranks hold fewer activations. Bubble/compute = ``(p-1)/(v*m)``
  when a chunk costs ``1/v`` of a full stage.
* :func:`zb_h1` -- Zero Bubble H1 (Qi et al. 2023): 1F1B's order of F and B, with the
  backward split into B and W. Rank ``s`` delays each W by ``s`` backwards (W of mb
  ``i - s`` right after B of mb ``i``), and runs the last ``s`` W's after its final B, so
  every rank keeps at most ``min(p, m)`` micro-batches in flight (F done, W not done):
  the same maximum as 1F1B (whose rank 0 holds ``p``), while the W's fill the cool-down
  bubble. With ``t_f = t_b = t_w`` and ``m >= p`` the idle time per rank is
  ``(p-1)(t_f + t_b - t_w)``, a third of 1F1B's ``(p-1)(t_f + t_b + t_w)``.
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Callable, Iterable, Mapping

import attrs

from numesh.base.errors import ScheduleError

__all__ = [
    "Action",
    "F",
    "B",
    "W",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zb_h1",
    "make_schedule",
    "check_shape",
    "simulate",
    "bubble_fraction",
    "peak_activations",
    "validate",
]


_KINDS = ("F", "B", "W")


@attrs.frozen
class Action:
    """One step of one rank: ``kind`` is "F", "B" or "W"; ``chunk`` is the rank's model chunk."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" if self.chunk == 0 else f"{self.kind}{self.mb}.{self.chunk}"


def F(mb: int, chunk: int = 0) -> Action:
    """Forward of micro-batch ``mb`` through this rank's chunk ``chunk``."""
    return Action("F", mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    """Backward (input grad when the schedule splits the backward, else the full backward)."""
    return Action("B", mb, chunk)


def W(mb: int, chunk: int = 0) -> Action:
    """Weight-gradient half of a split backward."""
    return Action("W", mb, chunk)


@attrs.frozen
class Schedule:
    """Per rank ``0..p-1``, the ordered actions it executes."""

    name: str
    p: int
    m: int
    v: int
    split_backward: bool
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        """Number of model stages: ``p * v``."""
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        """Global model stage held by ``rank`` as ``chunk``: ``chunk * p + rank``."""
        return chunk * self.p + rank

    def rank_chunk(self, stage: int) -> tuple[int, int]:
        """Inverse of :meth:`stage`: ``(rank, chunk)`` holding global model stage ``stage``."""
        return stage % self.p, stage // self.p

    def describe(self) -> str:
        """The action lists as text, one rank per line (``F3`` = F of mb 3, ``B3.1`` = chunk 1)."""
        head = f"{self.name} p={self.p} m={self.m} v={self.v}"
        rows = [f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *rows])


# ---------------------------------------------------------------------------------------
# argument checks


def _count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ScheduleError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ScheduleError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ScheduleError(f"{name} must be an integer >= {minimum}, got {n}")
    return n


def _pm(p: Any, m: Any) -> tuple[int, int]:
    return _count("pipeline stages p (pp)", p), _count("micro-batches m", m)


def _interleaved_shape(p: Any, m: Any, v: Any) -> tuple[int, int, int]:
    """(p, m, v) checked as `interleaved` needs them, or ScheduleError saying what to change."""
    p, m = _pm(p, m)
    v = _count("model chunks per rank v", v)
    if v < 2:
        raise ScheduleError(
            f"interleaved needs v >= 2 model chunks per rank, got v={v}; use 1f1b for one chunk per rank"
        )
    if m % p != 0:
        near = sorted({max(p, (m // p) * p), (m // p + 1) * p})  # m < p would suggest p twice
        raise ScheduleError(
            f"interleaved needs micro-batches m={m} to be a multiple of pp={p} "
            f"(e.g. {' or '.join(f'm={x}' for x in near)})"
        )
    return p, m, v


def _build(name: str, p: int, m: int, v: int, split: bool, lists: Iterable[Iterable[Action]]) -> Schedule:
    sched = Schedule(name=name, p=p, m=m, v=v, split_backward=split, actions=tuple(tuple(a) for a in lists))
    validate(sched)
    return sched


# ---------------------------------------------------------------------------------------
# the schedules


def _one_f_one_b_order(p: int, m: int, s: int) -> list[Action]:
    """1F1B's F/B order for rank ``s`` (one chunk)."""
    warm = min(p - s - 1, m)
    out = [F(i) for i in range(warm)]
    for i in range(m - warm):
        out += [F(warm + i), B(i)]
    out += [B(i) for i in range(m - warm, m)]
    return out


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: all ``m`` forwards, then all ``m`` backwards in micro-batch order 0..m-1."""
    p, m = _pm(p, m)
    return _build("gpipe", p, m, 1, False, ([F(i) for i in range(m)] + [B(i) for i in range(m)] for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``min(p-s-1, m)`` warm-up forwards on rank ``s``, then 1F1B, then cool-down."""
    p, m = _pm(p, m)
    return _build("1f1b", p, m, 1, False, (_one_f_one_b_order(p, m, s) for s in range(p)))


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``v`` chunks per rank (rank ``s``, chunk ``c`` = stage ``c*p+s``)."""
    p, m, v = _interleaved_shape(p, m, v)
    total = m * v
    group = p * v

    def fwd(k: int) -> Action:
        g, r = divmod(k, group)
        return F(g * p + r % p, r // p)

    def bwd(k: int) -> Action:
        g, r = divmod(k, group)
        return B(g * p + r % p, v - 1 - r // p)

    lists = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        acts = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            acts += [fwd(warm + i), bwd(i)]
        acts += [bwd(k) for k in range(total - warm, total)]
        lists.append(acts)
    return _build("interleaved", p, m, v, False, lists)


def zb_h1(p: int, m: int) -> Schedule:
    """Zero Bubble H1: 1F1B's F/B order, backward split into B and W, rank ``s`` delays W by ``s``."""
    p, m = _pm(p, m)
    lists = []
    for s in range(p):
        acts: list[Action] = []
        next_w = 0
        for a in _one_f_one_b_order(p, m, s):
            acts.append(a)
            if a.kind == "B" and a.mb - s >= 0:
                acts.append(W(a.mb - s))
                next_w = a.mb - s + 1
        acts += [W(i) for i in range(next_w, m)]
        lists.append(acts)
    return _build("zb-h1", p, m, 1, True, lists)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a schedule by name: "gpipe", "1f1b", "interleaved" (needs ``v >= 2``) or "zb-h1".

    Names are matched case-insensitively with ``_`` read as ``-``.
    """
    key = check_shape(name, p, m, v)
    return interleaved(p, m, v) if key == "interleaved" else SCHEDULES[key](p, m)


def check_shape(name: str, p: int, m: int, v: int = 1) -> str:
    """The schedule's key in SCHEDULES if `make_schedule(name, p, m, v)` builds one, else the
    ScheduleError it raises, without building it: the shape decides (the schedules built
    here are valid by construction, and `make_schedule` still validates each one it builds).
    `numesh train`'s checks and `numesh plan`'s search ask this of thousands of shapes, some
    of them 300k actions long."""
    key = str(name).strip().lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if key == "interleaved":
        _interleaved_shape(p, m, v)
        return key
    if _count("model chunks per rank v", v) != 1:
        raise ScheduleError(f"schedule {key!r} runs one model chunk per rank, got v={v}; use v=1 or 'interleaved'")
    _pm(p, m)
    return key


# ---------------------------------------------------------------------------------------
# checks and accounting


def validate(s: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``s`` is well formed.

    Every rank holds exactly one F and one B (and one W when ``split_backward``, none
    otherwise) for every (micro-batch, chunk), and on each rank a micro-batch-chunk's F
    comes before its B, and its B before its W. Cross-rank ordering is checked by
    :func:`simulate` (a deadlock raises).
    """
    p, m, v = (_count(n, x) for n, x in (("p", s.p), ("m", s.m), ("v", s.v)))
    if len(s.actions) != p:
        raise ScheduleError(f"schedule {s.name!r} has action lists for {len(s.actions)} ranks, expected p={p}")
    kinds = _KINDS if s.split_backward else _KINDS[:2]
    want = {(k, mb, c) for k in kinds for mb in range(m) for c in range(v)}
    for rank, acts in enumerate(s.actions):
        seen: Counter[tuple[str, int, int]] = Counter()
        pos: dict[tuple[str, int, int], int] = {}
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"schedule {s.name!r} rank {rank} entry {i} is {a!r}, not an Action")
            key = (a.kind, a.mb, a.chunk)
            if key not in want:
                if a.kind == "W" and not s.split_backward:
                    why = "W actions need split_backward=True"
                elif a.kind not in _KINDS:
                    why = "kind must be F, B or W"
                else:
                    why = f"mb must be in 0..{m - 1} and chunk in 0..{v - 1}"
                raise ScheduleError(f"schedule {s.name!r} rank {rank} has invalid action {a!r}: {why}")
            seen[key] += 1
            pos.setdefault(key, i)
        dup = sorted(k for k, n in seen.items() if n > 1)
        if dup:
            k = dup[0]
            raise ScheduleError(f"schedule {s.name!r} rank {rank} runs {Action(*k)} {seen[k]} times; "
                                "each action runs once")
        missing = sorted(want - set(seen))
        if missing:
            raise ScheduleError(
                f"schedule {s.name!r} rank {rank} is missing {len(missing)} action(s), first {Action(*missing[0])}"
            )
        for mb in range(m):
            for c in range(v):
                for a_kind, b_kind in zip(kinds, kinds[1:]):
                    if pos[(a_kind, mb, c)] > pos[(b_kind, mb, c)]:
                        raise ScheduleError(
                            f"schedule {s.name!r} rank {rank} runs {Action(b_kind, mb, c)} before "
                            f"{Action(a_kind, mb, c)}; move it after"
                        )


@attrs.frozen
class Timeline:
    """Result of :func:`simulate`: ``intervals[rank][i]`` is ``(start, end)`` of ``schedule.actions[rank][i]``."""

    schedule: Schedule
    intervals: tuple[tuple[tuple[float, float], ...], ...]
    makespan: float

    def busy(self, rank: int) -> float:
        """Time rank ``rank`` spends computing."""
        return sum(e - b for b, e in self.intervals[rank])

    def idle(self, rank: int) -> float:
        """Time rank ``rank`` waits within the makespan."""
        return self.makespan - self.busy(rank)

    @property
    def bubble_fraction(self) -> float:
        """``1 - total busy / (p * makespan)`` (0 for an empty timeline)."""
        if self.makespan <= 0:
            return 0.0
        busy = sum(self.busy(r) for r in range(self.schedule.p))
        return 1.0 - busy / (self.schedule.p * self.makespan)

    def span(self, rank: int, action: Action) -> tuple[float, float]:
        """``(start, end)`` of ``action`` on ``rank``."""
        return self.intervals[rank][self.schedule.actions[rank].index(action)]


def _costs(**kw: float) -> dict[str, float]:
    out = {}
    for name, x in kw.items():
        x = float(x)
        if not x >= 0.0:
            raise ScheduleError(f"cost {name} must be a number >= 0, got {x}")
        out[name] = x
    return out


def simulate(s: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0, comm: float = 0.0,
             stage_costs: Mapping[tuple[str, int], float] | None = None,
             action_costs: Mapping[tuple[str, int, int], float] | None = None) -> Timeline:
    """Run ``s`` on an idealised machine and return when each action starts and ends.

    Each rank executes its list in order; an action starts as soon as the rank is free
    and its dependencies (module docstring) have finished, plus ``comm`` for a dependency
    on another rank. Costs are per action (for interleaved schedules pass the cost of one
    chunk, e.g. ``t_f = 1/v`` of a full stage). When ``split_backward`` is False, B costs
    ``t_b + t_w``. ``stage_costs`` overrides the cost of ("F"|"B"|"W", global stage) where
    stages differ (the first holds the embedding, the last the head and loss; a B given
    there is the whole cost of that B); ``action_costs`` overrides the cost of one action,
    (kind, micro-batch, global stage), e.g. each one's measured duration in one step.
    Raises :class:`ScheduleError` when the lists deadlock.
    """
    validate(s)
    c = _costs(t_f=t_f, t_b=t_b, t_w=t_w, comm=comm)
    base = {"F": c["t_f"], "B": c["t_b"] if s.split_backward else c["t_b"] + c["t_w"], "W": c["t_w"]}
    over = {k: _costs(cost=v)["cost"] for k, v in (stage_costs or {}).items()}
    each = {k: _costs(cost=v)["cost"] for k, v in (action_costs or {}).items()}

    def cost_of(kind: str, mb: int, stage: int) -> float:
        return each.get((kind, mb, stage), over.get((kind, stage), base[kind]))

    p = s.p
    order = ready_order(s)
    end = [0.0] * len(order)
    free = [0.0] * p
    spans: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    for i, st in enumerate(order):
        start = max([free[st.rank]] + [end[d] + (c["comm"] if cross else 0.0) for d, cross in st.deps])
        end[i] = start + cost_of(st.action.kind, st.action.mb, st.stage)
        spans[st.rank].append((start, end[i]))
        free[st.rank] = end[i]
    makespan = max(free) if p else 0.0
    return Timeline(schedule=s, intervals=tuple(tuple(x) for x in spans), makespan=makespan)


@attrs.frozen
class ReadyAction:
    """One action of `ready_order`: where it runs and the positions it waits for."""

    rank: int
    action: Action
    stage: int  # global stage
    deps: tuple[tuple[int, bool], ...]  # (position in the order of a dependency, on another rank?)


def ready_order(s: Schedule) -> tuple[ReadyAction, ...]:
    """Every action of `s` once, each after its rank's previous one and after what it waits
    for (module docstring): the order `simulate` runs them in. It does not depend on the
    costs, so a caller simulating one schedule many times (the planner) builds it once.
    Raises :class:`ScheduleError` naming what each stuck rank waits for when the lists deadlock."""
    where: dict[tuple[str, int, int], int] = {}  # (kind, mb, global stage) -> position in the order
    order: list[ReadyAction] = []
    nxt = [0] * s.p
    progress = True
    while progress:
        progress = False
        for r in range(s.p):
            acts = s.actions[r]
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                ds = _deps(s, r, a)
                if any(key not in where for key, _ in ds):
                    break
                k = s.stage(r, a.chunk)
                where[(a.kind, a.mb, k)] = len(order)
                order.append(ReadyAction(r, a, k, tuple((where[key], dr != r) for key, dr in ds)))
                nxt[r] += 1
                progress = True
    _raise_if_stuck(s, nxt, where)
    return tuple(order)


def _deps(s: Schedule, rank: int, a: Action) -> list[tuple[tuple[str, int, int], int]]:
    """What action `a` on `rank` waits for: ((kind, mb, global stage), rank that runs it)."""
    k = s.stage(rank, a.chunk)
    if a.kind == "F":
        return [(("F", a.mb, k - 1), (k - 1) % s.p)] if k > 0 else []
    if a.kind == "B":
        out = [(("F", a.mb, k), rank)]
        if k < s.num_stages - 1:
            out.append((("B", a.mb, k + 1), (k + 1) % s.p))
        return out
    return [(("B", a.mb, k), rank)]


def _raise_if_stuck(s: Schedule, nxt: list[int], done: dict) -> None:
    """A ScheduleError naming what each unfinished rank waits for, if any is unfinished."""
    stuck = [r for r in range(s.p) if nxt[r] < len(s.actions[r])]
    if not stuck:
        return
    waits = []
    for r in stuck:
        a = s.actions[r][nxt[r]]
        need = [f"{Action(kd, mb, s.rank_chunk(k)[1])} on rank {s.rank_chunk(k)[0]}"
                for (kd, mb, k), _ in _deps(s, r, a) if (kd, mb, k) not in done]
        waits.append(f"rank {r} at {a} waits for {' and '.join(need)}")
    raise ScheduleError(f"schedule {s.name!r} deadlocks: " + "; ".join(waits) + "; reorder the action lists")


def bubble_fraction(s: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle fraction ``1 - total busy / (p * makespan)`` of :func:`simulate` (no comm cost)."""
    return simulate(s, t_f=t_f, t_b=t_b, t_w=t_w).bubble_fraction


def peak_activations(s: Schedule) -> list[int]:
    """Per rank, the most micro-batch-chunks whose activations are held at once.

    An activation is live from its F until the action that last needs the layer inputs:
    the (full) B when the backward is not split, the W when it is (the weight gradient
    still reads the stored inputs). Counted along each rank's list, so it does not
    depend on timing.
    """
    validate(s)
    free_kind = "W" if s.split_backward else "B"
    out = []
    for acts in s.actions:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == free_kind:
                live -= 1
        out.append(peak)
    return out
