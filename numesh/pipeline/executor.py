"""One executor for every pipeline schedule.

It walks this rank's action list in order: F runs a model stage forward (receiving the
activation from the previous stage, sending its output to the next), B runs it backward
(the full backward, or only the input gradient when the schedule splits it), W computes
the deferred weight gradients. The stage math is `numesh.nn.walk`, the same walk a
single process uses. Sends are nonblocking and receives blocking, so any schedule whose
lists respect the dependencies (which `schedules.validate`/`simulate` check) runs without
deadlock. With pp=1 and 1F1B it is plain gradient accumulation over micro-batches.

Tracing: when `trace` is a `numesh.observe.trace.Tracer` (None by default, costing one test
per action), each action becomes a span named as the schedule prints it ("F3", "B3.1"),
from the start of its computation to the issue of its send, the whole schedule a
"pipeline" span, and each message a flow arrow from the send to the receive.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np

from numesh.base.tree import held_buffers
from numesh.host.kernels import float_dtype
from numesh.mesh import Handle, Mesh, irecv, isend, psum
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPT, GPTConfig, empty_outer
from numesh.nn.units import OUTER
from numesh.nn.walk import (
    ParamUnits,
    StageCtx,
    activation_shape,
    add_outer,
    stage_backward,
    stage_forward,
    stage_weight,
)
from numesh.pipeline.schedules import Action, Schedule
from numesh.pipeline.stages import StageLayout

Micro = tuple[np.ndarray, np.ndarray]  # (token ids [B, T], targets [B, T]) of one micro-batch


@attrs.frozen
class StepStats:
    """What one pipeline step did on this rank."""

    loss: float  # sum of this rank's token losses × loss_scale (non-zero on the last stage only)
    busy_s: float  # time spent computing (waits for messages excluded)
    span_s: float  # wall time of the whole schedule
    peak_live: int  # most micro-batch chunks whose activations were held at once
    peak_bytes: int  # the most bytes of saved activations held at once, between actions (`held_bytes`)
    timeline: tuple[tuple[str, int, int, float, float], ...]  # (kind, mb, chunk, start, end) from step start
    moe: tuple = ()  # RoutingStats of every MoE block's forward on this rank (numesh/nn/moe.py)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.span_s if self.span_s > 0 else 0.0


@attrs.define
class _Step:
    """The state of one step while its actions run."""

    micro: list[Micro]
    drops: list[DropoutKey | None]
    loss_scale: float
    acts: dict[tuple[int, int], StageCtx] = attrs.Factory(dict)  # (mb, chunk) -> saved forward state
    deferred: dict[tuple[int, int], list] = attrs.Factory(dict)  # (mb, chunk) -> weight halves (zero-bubble)
    sends: list[Handle] = attrs.Factory(list)
    outer: GPT | None = None  # this rank's outer-unit grads, summed over micro-batches
    loss: float = 0.0
    busy: float = 0.0
    moe: list = attrs.Factory(list)  # RoutingStats of the MoE blocks run forward

    def finish_sends(self) -> None:
        for h in self.sends:
            h.wait()
        self.sends = []  # nothing of this step (activations, gradients) outlives it


class PipelineExecutor:
    """Runs schedules for one rank of the pp axis; parameters come from `units`
    (a `ParamUnits`, e.g. the ZeRO optimiser, keyed by `numesh.nn.units.Unit`)."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh, layout: StageLayout, units: ParamUnits, dtype: Any,
                 recompute: str = "none"):
        self.cfg, self.mesh, self.layout, self.units, self.dtype = cfg, mesh, layout, units, float_dtype(dtype)
        self.recompute = recompute  # "none" or "full" (numesh.nn.walk)
        self.p, self.rank = mesh.size("pp"), mesh.index("pp")
        self.n_stages = layout.pp * layout.v
        self.stages = [layout.stage(self.rank, c) for c in range(layout.v)]
        # the tied embedding lives on the first and the last rank: their wte grads are summed
        self.tied = mesh.group("pp", (0, self.p - 1)) if self.p > 1 else None
        self.holds_tied = cfg.tie_embeddings and layout.holds_tied(self.rank)
        self.trace = None  # a numesh.observe.trace.Tracer while tracing
        self._runs = 0  # schedules run so far (the same count on every rank): part of flow ids

    # ------------------------------------------------------------------ messages

    def _tag(self, kind: str, mb: int, stage: int, m: int) -> int:
        return ((0 if kind == "F" else 1) * self.n_stages + stage) * m + mb

    def _recv(self, kind: str, mb: int, stage: int, src_stage: int, st: _Step) -> np.ndarray:
        buf = np.empty(activation_shape(*st.micro[mb][0].shape, self.cfg, self.mesh), dtype=self.dtype)
        tag, tr = self._tag(kind, mb, stage, len(st.micro)), self.trace
        if tr is None:
            return irecv(buf, self.mesh, "pp", src_stage % self.p, tag).wait()
        t0 = tr.now()
        out = irecv(buf, self.mesh, "pp", src_stage % self.p, tag).wait()
        tr.flow_end((self._runs << 24) + tag, (t0 + tr.now()) / 2, kind)  # inside the receive's span
        return out

    def _send(self, x: np.ndarray, kind: str, mb: int, stage: int, st: _Step) -> None:
        tag = self._tag(kind, mb, stage, len(st.micro))
        st.sends.append(isend(x, self.mesh, "pp", stage % self.p, tag))
        if self.trace is not None:
            self.trace.flow_start((self._runs << 24) + tag, kind)

    # ------------------------------------------------------------------ actions

    def _forward(self, a: Action, st: _Step, keep: bool = True) -> None:
        ids, targets = st.micro[a.mb]
        stage, k = self.stages[a.chunk], a.chunk * self.p + self.rank
        inp = ids if stage.first else self._recv("F", a.mb, k, k - 1, st)
        t = time.perf_counter()
        out, ctx = stage_forward(self.units, stage, inp, targets, self.cfg, self.mesh, st.drops[a.mb], keep,
                                 self.recompute)
        st.busy += time.perf_counter() - t
        if stage.last:
            st.loss += float(out.sum()) * st.loss_scale
        else:
            self._send(out, "F", a.mb, k + 1, st)
        if keep:
            st.acts[(a.mb, a.chunk)] = ctx
            st.moe.extend(ctx.moe)
        if self.trace is not None:
            self.trace.span(str(a), "compute", t, None, {"kind": "F", "mb": a.mb, "chunk": a.chunk, "stage": k})

    def _backward(self, a: Action, st: _Step, split: bool) -> None:
        stage, k = self.stages[a.chunk], a.chunk * self.p + self.rank
        dy = st.loss_scale if stage.last else self._recv("B", a.mb, k, k + 1, st)
        t = time.perf_counter()
        dx, outer, deferred = stage_backward(self.units, stage, st.acts.pop((a.mb, a.chunk)), dy, self.cfg, self.mesh,
                                             split, st.loss_scale)
        if stage.first or stage.last:
            st.outer = add_outer(st.outer, outer)
        if split:
            st.deferred[(a.mb, a.chunk)] = deferred
        st.busy += time.perf_counter() - t
        if not stage.first:
            self._send(dx, "B", a.mb, k - 1, st)
        if self.trace is not None:
            self.trace.span(str(a), "compute", t, None, {"kind": "B", "mb": a.mb, "chunk": a.chunk, "stage": k})

    def _weight(self, a: Action, st: _Step) -> None:
        t = time.perf_counter()
        stage_weight(self.units, st.deferred.pop((a.mb, a.chunk)))
        st.busy += time.perf_counter() - t
        if self.trace is not None:
            k = a.chunk * self.p + self.rank
            self.trace.span(str(a), "compute", t, None, {"kind": "W", "mb": a.mb, "chunk": a.chunk, "stage": k})

    # ------------------------------------------------------------------ a training step

    def run(self, schedule: Schedule, micro: list[Micro], loss_scale: float,
            drops: list[DropoutKey | None]) -> StepStats:
        """Execute this rank's actions for one optimiser step; every block gradient goes to
        `units.grads_ready` as it becomes final, the outer unit's once at the end."""
        st = _Step(micro, drops, loss_scale)
        # (mb, chunk) -> the buffers its saved forward state (or its deferred W halves) holds,
        # walked once when stored: walking all 8 live contexts of GPipe at m=8 (8 layers of
        # the default width) at every action took ~6 ms per action, merging these dicts 0.03 ms
        live: dict[tuple[int, int], dict[int, int]] = {}
        peak_live = peak_bytes = 0
        timeline = []
        self._runs += 1
        start = time.perf_counter()
        for a in schedule.actions[self.rank]:
            t0 = time.perf_counter()
            key = (a.mb, a.chunk)
            if a.kind == "F":
                self._forward(a, st)
                live[key] = held_buffers(st.acts[key])
            elif a.kind == "B":
                self._backward(a, st, schedule.split_backward)
                if schedule.split_backward:
                    live[key] = held_buffers(st.deferred[key])
                else:
                    live.pop(key, None)
            else:
                self._weight(a, st)
                live.pop(key, None)
            # every buffer once, however many contexts hold it (measured, not assumed: the
            # formula numesh.perf.formulas.activation_bytes is tested against it)
            held: dict[int, int] = {}
            for buffers in live.values():
                held.update(buffers)
            peak_live, peak_bytes = max(peak_live, len(live)), max(peak_bytes, sum(held.values()))
            timeline.append((a.kind, a.mb, a.chunk, t0 - start, time.perf_counter() - start))
        st.finish_sends()
        span = time.perf_counter() - start
        if self.trace is not None:
            self.trace.span("pipeline", "pipeline", start, start + span, {"schedule": schedule.name})
        self._finish_outer(st)
        return StepStats(st.loss, st.busy, span, peak_live, peak_bytes, tuple(timeline), tuple(st.moe))

    def _finish_outer(self, st: _Step) -> None:
        """Sum the tied embedding's two gradients (first and last rank), then hand the outer
        unit's gradient, the sum over all micro-batches, to the optimiser (an empty one on
        middle stages: the optimiser waits for every unit)."""
        if st.outer is None:
            st.outer = empty_outer()
        if self.holds_tied:
            psum(st.outer.wte, self.mesh, self.tied, inplace=True)
        self.units.grads_ready(OUTER, st.outer, count=len(st.micro))

    # ------------------------------------------------------------------ evaluation

    def forward_losses(self, micro: list[Micro]) -> float:
        """Sum of token losses over `micro` through the pipeline, forward only (on the last rank; 0 elsewhere)."""
        st = _Step(micro, [None] * len(micro), 1.0)
        self._runs += 1
        for mb in range(len(micro)):
            for chunk in range(self.layout.v):
                self._forward(Action("F", mb, chunk), st, keep=False)
        st.finish_sends()
        return st.loss
