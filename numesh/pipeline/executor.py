"""One executor for every pipeline schedule.

It walks this rank's action list in order: F runs a chunk's layers forward (receiving
the activation from the previous model stage, sending its output to the next), B runs
them backward (the full backward, or only the input gradient when the schedule splits
it), W computes the deferred weight gradients. Sends are nonblocking and receives are
blocking, so any schedule whose lists respect the dependencies (which
`schedules.validate`/`simulate` check) runs without deadlock. With pp=1 and 1F1B it is
plain gradient accumulation over micro-batches.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import numpy as np
from mpi4py import MPI

from numesh.mesh import Handle, Mesh, irecv, isend
from numesh.nn.gpt import (
    GPT,
    DropoutKey,
    GPTConfig,
    block_bwd,
    block_bwd_input,
    block_bwd_weight,
    block_fwd,
    embed_bwd,
    embed_fwd,
    head_bwd,
    head_fwd,
)
from numesh.nn.layers import LayerNorm
from numesh.nn.units import OUTER, Unit
from numesh.pipeline.schedules import Action, Schedule
from numesh.pipeline.stages import StageLayout


@attrs.frozen
class StepStats:
    """What one pipeline step did on this rank."""

    loss: float  # sum of this rank's token losses × loss_scale (non-zero on the last stage only)
    busy_s: float  # time spent computing (waits for messages excluded)
    span_s: float  # wall time of the whole schedule
    peak_live: int  # most micro-batch chunks whose activations were held at once
    peak_bytes: int  # the most bytes of saved activations held at once
    timeline: tuple[tuple[str, int, int, float, float], ...]  # (kind, mb, chunk, start, end) from step start

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.busy_s / self.span_s if self.span_s > 0 else 0.0


def _nbytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


class PipelineExecutor:
    """Runs schedules for one rank of the pp axis; parameters come from `units`
    (a `ParamUnits`, e.g. the ZeRO optimiser) by local unit: `OUTER`, `Unit(j)`."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh, layout: StageLayout, units: Any):
        self.cfg, self.mesh, self.layout, self.units = cfg, mesh, layout, units
        self.p, self.rank = mesh.size("pp"), mesh.index("pp")
        self.n_stages = layout.pp * layout.v
        self.local = {layer: j for j, layer in enumerate(layout.owned(self.rank))}
        self.first, self.last = layout.is_first(self.rank), layout.is_last(self.rank)
        self._busy = 0.0
        # the tied embedding lives on the first and the last rank: their wte grads are summed
        self.tied_comm = None
        if self.p > 1:
            color = 0 if (self.first or self.last) else MPI.UNDEFINED
            comm = mesh.comm("pp").Split(color, self.rank)  # collective over pp
            self.tied_comm = comm if comm != MPI.COMM_NULL else None

    # ------------------------------------------------------------------ helpers

    def _where(self, stage: int) -> tuple[int, int]:
        """(pp rank, chunk) of model stage `stage`."""
        return stage % self.p, stage // self.p

    def _tag(self, kind: str, mb: int, stage: int, m: int) -> int:
        return ((0 if kind == "F" else 1) * self.n_stages + stage) * m + mb

    def _blocks(self, chunk: int) -> list[tuple[int, Unit]]:
        return [(layer, Unit(self.local[layer])) for layer in self.layout.layers(self.rank, chunk)]

    # ------------------------------------------------------------------ training step

    def run(
        self,
        schedule: Schedule,
        micro: list[tuple[np.ndarray, np.ndarray]],
        loss_scale: float,
        drops: list[DropoutKey | None],
    ) -> StepStats:
        """Execute this rank's actions for one optimiser step; every block gradient goes to
        `units.grads_ready` as it becomes final, the embedding/head ones once at the end."""
        m = len(micro)
        self.acts: dict[tuple[int, int], tuple] = {}
        self.wctx: dict[tuple[int, int], list] = {}
        self.sends: list[Handle] = []
        self.outer = {"wte": None, "wpe": None, "ln_f": None}
        self.loss = 0.0
        live: set[tuple[int, int]] = set()
        live_bytes: dict[tuple[int, int], int] = {}
        peak_live = peak_bytes = 0
        busy = 0.0
        timeline = []
        start = time.perf_counter()
        self._busy = 0.0
        for a in schedule.actions[self.rank]:
            t0 = time.perf_counter()
            self._busy = 0.0
            key = (a.mb, a.chunk)
            if a.kind == "F":
                self._forward(a, micro, drops, m, loss_scale)
                live.add(key)
                live_bytes[key] = _nbytes(self.acts[key])
            elif a.kind == "B":
                self._backward(a, micro, drops, m, loss_scale, schedule.split_backward)
                if schedule.split_backward:
                    live_bytes[key] = _nbytes(self.wctx[key])
                else:
                    live.discard(key)
                    live_bytes.pop(key, None)
            else:
                self._weight(a)
                live.discard(key)
                live_bytes.pop(key, None)
            peak_live = max(peak_live, len(live))
            peak_bytes = max(peak_bytes, sum(live_bytes.values()))
            busy += self._busy
            timeline.append((a.kind, a.mb, a.chunk, t0 - start, time.perf_counter() - start))
        for h in self.sends:
            h.wait()
        self.sends = []  # nothing of this step (activations, gradients) outlives it
        span = time.perf_counter() - start
        self._finish_outer(m)
        return StepStats(self.loss, busy, span, peak_live, peak_bytes, tuple(timeline))

    def _recv(self, kind: str, mb: int, stage: int, src_stage: int, m: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        src, _ = self._where(src_stage)
        buf = np.empty(shape, dtype=dtype)
        return irecv(buf, self.mesh, "pp", src, self._tag(kind, mb, stage, m)).wait()

    def _send(self, x: np.ndarray, kind: str, mb: int, stage: int, m: int) -> None:
        dest, _ = self._where(stage)
        self.sends.append(isend(x, self.mesh, "pp", dest, self._tag(kind, mb, stage, m)))

    def _forward(self, a: Action, micro: list, drops: list, m: int, loss_scale: float, keep: bool = True) -> None:
        x_ids, targets = micro[a.mb]
        stage = a.chunk * self.p + self.rank
        shape = (*x_ids.shape, self.cfg.n_embd)
        t = time.perf_counter()
        emb_ctx = head_ctx = None
        if stage == 0:
            outer = self.units.get(OUTER)
            x, emb_ctx = embed_fwd(outer, x_ids, self.cfg, self.mesh, drops[a.mb])
            if stage != self.n_stages - 1:  # one stage keeps it for the head: ZeRO-3 gathers it once
                self.units.release(OUTER)
        else:
            dtype = self._dtype()
            self._busy += time.perf_counter() - t
            x = self._recv("F", a.mb, stage, stage - 1, m, shape, dtype)
            t = time.perf_counter()
        ctxs = []
        for layer, name in self._blocks(a.chunk):
            x, ctx = block_fwd(self.units.get(name), x, self.cfg, self.mesh, layer, drops[a.mb])
            self.units.release(name)
            ctxs.append(ctx if keep else None)
        if stage == self.n_stages - 1:
            outer = self.units.get(OUTER)
            loss, head_ctx = head_fwd(outer, x, targets, self.cfg, self.mesh)
            self.units.release(OUTER)
            self.loss += float(loss.sum()) * loss_scale
            self._busy += time.perf_counter() - t
        else:
            self._busy += time.perf_counter() - t
            self._send(x, "F", a.mb, stage + 1, m)
        if keep:
            self.acts[(a.mb, a.chunk)] = (emb_ctx, ctxs, head_ctx)

    def _backward(self, a: Action, micro: list, drops: list, m: int, loss_scale: float, split: bool) -> None:
        stage = a.chunk * self.p + self.rank
        emb_ctx, ctxs, head_ctx = self.acts.pop((a.mb, a.chunk))
        t = time.perf_counter()
        if stage == self.n_stages - 1:
            outer = self.units.get(OUTER)
            dx, dwte, d_lnf = head_bwd(outer, head_ctx, loss_scale, self.mesh)
            if stage != 0:  # one stage keeps it for the embedding: ZeRO-3 gathers it once
                self.units.release(OUTER)
            self._add_outer(wte=dwte, ln_f=d_lnf)
        else:
            x_ids, _ = micro[a.mb]
            shape = (*x_ids.shape, self.cfg.n_embd)
            self._busy += time.perf_counter() - t
            dx = self._recv("B", a.mb, stage, stage + 1, m, shape, self._dtype())
            t = time.perf_counter()
        wlist = []
        for (layer, name), ctx in reversed(list(zip(self._blocks(a.chunk), ctxs))):
            params = self.units.get(name)
            if split:
                dx, w = block_bwd_input(params, ctx, dx, self.cfg, self.mesh)
                wlist.append((name, w))
                self.units.release(name)
            else:
                dx, grads = block_bwd(params, ctx, dx, self.cfg, self.mesh)
                self.units.release(name)
                self.units.grads_ready(name, grads)
        if split:
            self.wctx[(a.mb, a.chunk)] = wlist
        if stage == 0:
            outer = self.units.get(OUTER)
            dwte, dwpe = embed_bwd(outer, emb_ctx, dx)
            self.units.release(OUTER)
            self._add_outer(wte=dwte, wpe=dwpe)
            self._busy += time.perf_counter() - t
        else:
            self._busy += time.perf_counter() - t
            self._send(dx, "B", a.mb, stage - 1, m)

    def _weight(self, a: Action) -> None:
        t = time.perf_counter()
        for name, w in self.wctx.pop((a.mb, a.chunk)):
            grads = block_bwd_weight(self.units.get(name), w)
            self.units.release(name)
            self.units.grads_ready(name, grads)
        self._busy += time.perf_counter() - t

    def _dtype(self):
        return self.units.dtype

    # ------------------------------------------------------------------ embedding and head grads

    def _add_outer(self, **grads: Any) -> None:
        for key, g in grads.items():
            if self.outer[key] is None:
                self.outer[key] = g
            elif isinstance(g, LayerNorm):
                self.outer[key] = LayerNorm(self.outer[key].w + g.w, None if g.b is None else self.outer[key].b + g.b)
            else:
                self.outer[key] += g

    def _finish_outer(self, m: int) -> None:
        """Sum the tied embedding's two gradients (first and last rank), then hand the
        outer unit's gradient to the optimiser as the sum of all `m` micro-batches."""
        o = self.outer
        if self.tied_comm is not None:
            wte = o["wte"]
            self.mesh.counter.add(("pp",), "all_reduce", wte.nbytes, 2)
            self.tied_comm.Allreduce(MPI.IN_PLACE, wte, op=MPI.SUM)
        self.units.grads_ready(OUTER, GPT(wte=o["wte"], wpe=o["wpe"], blocks=(), ln_f=o["ln_f"]), count=m)
        self.outer = dict.fromkeys(o)  # the optimiser has copied them

    # ------------------------------------------------------------------ evaluation

    def forward_losses(self, micro: list[tuple[np.ndarray, np.ndarray]]) -> float:
        """Sum of token losses over `micro` through the pipeline, forward only (on the last rank; 0 elsewhere)."""
        self.sends, self.loss, m = [], 0.0, len(micro)
        for mb in range(m):
            for chunk in range(self.layout.v):
                self._forward(Action("F", mb, chunk), micro, [None] * m, m, 1.0, keep=False)
        for h in self.sends:
            h.wait()
        self.sends = []
        return self.loss
