"""Every layout of a model on N ranks that `numesh train` accepts.

Candidates are all dp x tp x pp = N, ZeRO stages (0 only when dp = 1: the others are the
same then), micro-batch counts dividing the per-rank batch, and schedules (pp = 1 runs one
stage, where every schedule is gradient accumulation: 1F1B, which holds one micro-batch's
activations, is the one listed), with virtual stages for the interleaved one. Each is kept
only if `numesh.train.check_layout` accepts it: the planner never lists a layout that
training would refuse.

Activation recomputation is tried ("none" and "full") once TrainConfig has a `recompute`
option; until then every layout keeps all activations, as numesh does.

Beyond `SCALE_RANKS` ranks the search keeps to seconds by trying micro-batch counts that
are powers of two (and the largest, one sequence per micro-batch) and 2 or 4 virtual stages.
"""

from __future__ import annotations

from typing import Iterator

import attrs

from numesh.errors import UserError
from numesh.plan.layout import Layout, ModelSpec, divisors
from numesh.train import TrainConfig, check_layout

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
SCALE_RANKS = 64


def _micro_batch_counts(per_rank_batch: int, ranks: int) -> list[int]:
    counts = divisors(per_rank_batch)
    if ranks <= SCALE_RANKS:
        return counts
    return [m for m in counts if m & (m - 1) == 0 or m == per_rank_batch]


def _virtual_stages(layers_per_rank: int, ranks: int) -> list[int]:
    vs = [v for v in divisors(layers_per_rank) if v > 1]
    return vs if ranks <= SCALE_RANKS else [v for v in vs if v in (2, 4)]


def recompute_choices() -> tuple[str, ...]:
    """Recomputation settings to try: the ones the time model knows, if training has the option."""
    return ("none", "full") if "recompute" in attrs.fields_dict(TrainConfig) else ("none",)


def candidates(model: ModelSpec, ranks: int) -> Iterator[Layout]:
    """Layouts to try (some invalid: check_layout decides)."""
    for layout in _meshes_and_schedules(model, ranks):
        for r in recompute_choices():
            yield attrs.evolve(layout, recompute=r)


def _meshes_and_schedules(model: ModelSpec, ranks: int) -> Iterator[Layout]:
    for pp in divisors(ranks):
        for tp in divisors(ranks // pp):
            dp = ranks // (pp * tp)
            if model.batch_size % dp:
                continue
            for m in _micro_batch_counts(model.batch_size // dp, ranks):
                for zero in ((0,) if dp == 1 else (0, 1, 2, 3)):
                    if pp == 1:
                        yield Layout(dp, tp, pp, zero, "1f1b", m)
                        continue
                    for sched in PIPELINE_SCHEDULES:
                        if sched != "interleaved":
                            yield Layout(dp, tp, pp, zero, sched, m)
                            continue
                        for v in _virtual_stages(model.n_layer // pp, ranks) if model.n_layer % pp == 0 else ():
                            yield Layout(dp, tp, pp, zero, sched, m, v)


def train_config(base: TrainConfig, layout: Layout) -> TrainConfig:
    """`base` with the layout's options."""
    extra = {"recompute": layout.recompute} if "recompute" in attrs.fields_dict(TrainConfig) else {}
    return attrs.evolve(base, mesh=layout.mesh, zero=layout.zero, schedule=layout.schedule,
                        micro_batches=layout.micro_batches, virtual_stages=layout.virtual_stages, **extra)


def valid_layouts(base: TrainConfig, model: ModelSpec, ranks: int) -> list[Layout]:
    """Every candidate that `check_layout` accepts for `ranks` ranks."""
    out = []
    for layout in candidates(model, ranks):
        try:
            check_layout(train_config(base, layout), ranks, model.vocab_size)
        except UserError:
            continue
        out.append(layout)
    return out
