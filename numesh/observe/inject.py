"""Fault injection for testing how a job fails: `NUMESH_INJECT`, read once at start-up.

    NUMESH_INJECT='hang:rank=3:step=5'                 several faults: separated by ';'
    hang:rank=R:step=S       rank R sleeps forever before its next collective from step S
    skip:rank=R:step=S       rank R skips its next collective from step S (returns without MPI)
    crash:rank=R:step=S      rank R exits at once (os._exit(1)) before its next collective from step S
    mismatch:rank=R:step=S   rank R issues its next collective from step S with another size
                             (an all-reduce of a different length over the same axes)
    slow:rank=R:ms=M         rank R sleeps M ms at the start of every step (from step=S, default 0)
    unshared:rank=R          rank R's start-up check of --out looks in a directory of its own, as
                             if --out were on a disk local to its node (numesh.run.rundir.check_shared)

`hang` and `crash` act before any call through the mesh (p2p sends and receives too);
`skip` and `mismatch` wait for the next true collective (all-reduce, all-gather,
reduce-scatter, broadcast): a skipped small send or receive is often absorbed by MPI's
eager protocol and the job runs on with shifted data instead of failing. `parse_faults` checks a spec
completely (ranks against the world size), so a bad one is the same one-line
`ConfigError` on every rank before the first collective. `FaultInjector` is an
`Observer` (numesh/mesh/hook.py): its `begin` hangs, crashes or raises `SkipCall`;
`on_step(step)`, called by the training loop at each step start, tells it the step and
does the `slow` sleep. With `NUMESH_INJECT` unset nothing is made and nothing is
attached: it costs nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import ConfigError
from numesh.mesh.collectives import psum
from numesh.mesh.hook import Observer, SkipCall
from numesh.mesh.mesh import AxisNames, Group, axis_names

ENV = "NUMESH_INJECT"
KINDS = {  # kind -> (required keys, optional keys with defaults)
    "hang": (("rank", "step"), {}),
    "skip": (("rank", "step"), {}),
    "crash": (("rank", "step"), {}),
    "mismatch": (("rank", "step"), {}),
    "slow": (("rank", "ms"), {"step": 0}),
    "unshared": (("rank",), {}),
}
COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"})
SYNTAX = ("the syntax is KIND:rank=R:step=S with KIND hang, skip, crash or mismatch, slow:rank=R:ms=M, or "
          "unshared:rank=R; several separated by ';'")


@attrs.frozen
class Fault:
    """One injected fault of `NUMESH_INJECT`, as `parse_faults` reads it (the module's
    docstring lists the kinds); `str` writes it back in the same syntax.

    Attributes:
        kind: hang, skip, crash, mismatch, slow or unshared.
        rank: the world rank it acts on.
        step: the step it acts from.
        ms: for slow, the sleep at the start of every step, in milliseconds.
    """

    kind: str
    rank: int
    step: int = 0
    ms: int = 0

    def __str__(self) -> str:
        if self.kind == "slow":
            return f"slow:rank={self.rank}:ms={self.ms}" + (f":step={self.step}" if self.step else "")
        if self.kind == "unshared":
            return f"unshared:rank={self.rank}"
        return f"{self.kind}:rank={self.rank}:step={self.step}"


def parse_faults(text: str | None, world_size: int) -> tuple[Fault, ...]:
    """The faults of a `NUMESH_INJECT` value ('' or None: none); a `ConfigError` naming the bad part otherwise."""
    faults = []
    for part in (text or "").split(";"):
        part = part.strip()
        if not part:
            continue
        faults.append(_parse_one(part, world_size))
    return tuple(faults)


def _parse_one(part: str, world_size: int) -> Fault:
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{ENV}: bad fault '{part}': {why}; {SYNTAX}")

    kind, *fields = part.split(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise bad(f"unknown kind '{kind}'")
    required, optional = KINDS[kind]
    values: dict[str, int] = dict(optional)
    seen = set()
    for f in fields:
        key, eq, value = f.partition("=")
        key = key.strip().lower()
        if not eq:
            raise bad(f"'{f}' is not key=value")
        if key not in required and key not in optional:
            raise bad(f"unknown key '{key}' for {kind} (it takes {', '.join([*required, *optional])})")
        if key in seen:
            raise bad(f"'{key}' given twice")
        seen.add(key)
        try:
            values[key] = int(value.strip())
        except ValueError:
            raise bad(f"{key} must be an integer, got '{value.strip()}'") from None
    missing = [k for k in required if k not in seen]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    if not 0 <= values["rank"] < world_size:
        raise bad(f"rank {values['rank']} is not a rank of this {world_size}-rank job")
    if values.get("step", 0) < 0:
        raise bad("step must be >= 0")
    if kind == "slow" and values["ms"] <= 0:
        raise bad("ms must be > 0")
    return Fault(kind, values["rank"], values.get("step", 0), values.get("ms", 0))


def faults_from_env(world_size: int) -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(ENV), world_size)


def unshared_out(rank: int, world_size: int) -> bool:
    """Whether NUMESH_INJECT makes `rank`'s check of --out look in a directory of its own."""
    return any(f.kind == "unshared" and f.rank == rank for f in faults_from_env(world_size))


def _where(op: str, axes: AxisNames) -> str:
    if isinstance(axes, Group):
        return f"{op} over {axes.axis}{list(axes.members)}"
    return f"{op} over {','.join(axis_names(axes))}"


class FaultInjector(Observer):
    """The faults of one rank, fired from `begin` (and `on_step` for `slow`).

    `mesh` is needed only by `mismatch`, which issues its wrong-sized all-reduce through
    the mesh (so an observer records it as what this rank really called). `fired` lists
    what has fired, for the flight recorder's diagnosis."""

    def __init__(self, faults: tuple[Fault, ...], rank: int, mesh: Any = None):
        self.rank, self.mesh = rank, mesh
        self.pending = [f for f in faults if f.rank == rank and f.kind not in ("slow", "unshared")]
        self.slow = [f for f in faults if f.rank == rank and f.kind == "slow"]
        self.step = 0
        self.fired: list[tuple[Fault, str]] = []  # (fault, the call it hit)
        self.on_fire: Any = None  # called with one line before a fault acts (the flight recorder's note)
        self.on_exit: Any = None  # called just before a crash exits (the flight recorder marks the exit its own)

    def __bool__(self) -> bool:
        return bool(self.pending or self.slow)

    def on_step(self, step: int) -> None:
        self.step = step
        for f in self.slow:
            if step >= f.step:
                if step == f.step:
                    self._say(f, f"sleeping {f.ms} ms in every step from now")
                time.sleep(f.ms / 1e3)

    def close(self) -> None:
        pass

    def _say(self, fault: Fault, what: str) -> None:
        print(f"[rank {self.rank}] {ENV}: {fault} fires at step {self.step}: {what}", file=sys.stderr, flush=True)

    def begin(self, op: str, axes: AxisNames, nbytes: int) -> None:
        if not self.pending:
            return None
        for f in self.pending:
            if self.step >= f.step and (f.kind in ("hang", "crash") or op in COLLECTIVE_OPS):
                break
        else:
            return None
        self.pending.remove(f)
        where = _where(op, axes)
        self.fired.append((f, where))
        if self.on_fire is not None:
            self.on_fire(f"{f} at step {self.step}, before {where}")
        if f.kind == "hang":
            self._say(f, f"sleeping forever before {where}")
            while True:
                time.sleep(3600)
        if f.kind == "crash":
            self._say(f, f"exiting before {where}")
            if self.on_exit is not None:
                self.on_exit()
            os._exit(1)
        if f.kind == "skip":
            self._say(f, f"skipping {where}")
            raise SkipCall
        # mismatch: an all-reduce of another length over the same axes, instead of the real call.
        # Longer, not shorter: MPICH completed a shorter one silently (the peers' extra data
        # dropped), while a longer one overruns the peers' buffers, which MPI detects.
        wrong = np.zeros(2 * max(1, nbytes // 8) + 3, dtype=np.float64)
        self._say(f, f"calling all_reduce of {wrong.nbytes} B instead of {where} of {nbytes} B")
        psum(wrong, self.mesh, axes, inplace=True)
        raise SkipCall
