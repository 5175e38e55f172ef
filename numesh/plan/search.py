"""Every layout of a model on N ranks that `numesh train` accepts.

Candidates are all pp x dp x ep x cp x tp = N (ep > 1 only for a model with experts, and
only where it divides them: the batch splits over dp x ep), ZeRO stages (0 only when dp = 1: the others are
the same then), micro-batch counts dividing the per-rank batch, and schedules (pp = 1 runs
one stage, where every schedule is gradient accumulation: 1F1B, which holds one
micro-batch's activations, is the one listed), with virtual stages for the interleaved one;
each with sequence parallelism off and (when tp > 1) on, and activation recomputation none
and full. cp runs over the divisors of N that split block_size into 2·cp chunks.
Each is kept only if `numesh.run.config.check_layout` accepts it: the planner never lists a
layout that training would refuse.

Beyond `SCALE_RANKS` ranks the search keeps to seconds by trying micro-batch counts that
are powers of two (and the largest, one sequence per micro-batch) and 2 or 4 virtual stages,
and cp only while every rank keeps at least `CP_MIN_TOKENS` tokens of a sequence: ring
attention hides each K/V hop behind the attention of one chunk pair, (T/cp)² work against
T/cp tokens sent, so short chunks leave the hops exposed, and below ~1k tokens a sequence's
activations are too small for splitting them to be what makes a model fit (Megatron-LM
turns cp on from 8k-token contexts). On gpt3-175b (2048 tokens) that keeps cp = 1 and 2.
Sequence parallelism is tried off and on at every scale: it holds a block's activations
1/tp but gathers each LayerNorm's slice again in backward (about 25 % more tp bytes), so
neither dominates. `numesh.plan.plan` keeps, of the layouts that differ
only in recomputation, the least recomputation that fits (`least_recompute`).
"""

from __future__ import annotations

from typing import Callable, Iterator

import attrs

from numesh.base.errors import UserError
from numesh.plan.layout import Layout, ModelSpec, divisors
from numesh.run.config import TrainConfig, check_layout

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "full")
SCALE_RANKS = 64
CP_MIN_TOKENS = 1024


def _micro_batch_counts(per_rank_batch: int, ranks: int) -> list[int]:
    counts = divisors(per_rank_batch)
    if ranks <= SCALE_RANKS:
        return counts
    return [m for m in counts if m & (m - 1) == 0 or m == per_rank_batch]


def _virtual_stages(layers_per_rank: int, ranks: int) -> list[int]:
    vs = [v for v in divisors(layers_per_rank) if v > 1]
    return vs if ranks <= SCALE_RANKS else [v for v in vs if v in (2, 4)]


def _cp_sizes(model: ModelSpec, rest: int, ranks: int) -> list[int]:
    """cp sizes to try on the `rest` ranks a pipeline stage has (of `ranks`): those that
    split block_size into 2·cp equal chunks (ring attention's load balance)."""
    sizes = [c for c in divisors(rest) if c == 1 or model.block_size % (2 * c) == 0]
    return sizes if ranks <= SCALE_RANKS else [c for c in sizes if c == 1 or model.block_size // c >= CP_MIN_TOKENS]


def candidates(model: ModelSpec, ranks: int) -> Iterator[Layout]:
    """Layouts to try (some invalid: check_layout decides)."""
    sp_choices = (False, True)
    for layout in _meshes_and_schedules(model, ranks):
        for sp in (sp_choices if layout.tp > 1 else (False,)):
            for r in RECOMPUTE:
                yield attrs.evolve(layout, recompute=r, sp=sp)


def _ep_sizes(model: ModelSpec, rest: int) -> list[int]:
    """ep sizes to try on the `rest` ranks a cp group leaves: 1, and for a model with experts
    the divisors of `rest` that divide the experts (each ep rank holds E/ep of them)."""
    return [e for e in divisors(rest) if e == 1 or (model.moe_experts and model.moe_experts % e == 0)]


def _meshes(model: ModelSpec, ranks: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(pp, cp, ep, tp, dp) of `ranks` whose dp x ep splits the batch."""
    for pp in divisors(ranks):
        for cp in _cp_sizes(model, ranks // pp, ranks):
            for ep in _ep_sizes(model, ranks // (pp * cp)):
                for tp in divisors(ranks // (pp * cp * ep)):
                    dp = ranks // (pp * cp * ep * tp)
                    if model.batch_size % (dp * ep) == 0:
                        yield pp, cp, ep, tp, dp


def _meshes_and_schedules(model: ModelSpec, ranks: int) -> Iterator[Layout]:
    for pp, cp, ep, tp, dp in _meshes(model, ranks):
        for m in _micro_batch_counts(model.batch_size // (dp * ep), ranks):
            for zero in ((0,) if dp == 1 else (0, 1, 2, 3)):
                if pp == 1:
                    yield Layout(dp, tp, pp, zero, "1f1b", m, cp=cp, ep=ep)
                    continue
                for sched in PIPELINE_SCHEDULES:
                    if sched != "interleaved":
                        yield Layout(dp, tp, pp, zero, sched, m, cp=cp, ep=ep)
                        continue
                    for v in _virtual_stages(model.n_layer // pp, ranks) if model.n_layer % pp == 0 else ():
                        yield Layout(dp, tp, pp, zero, sched, m, v, cp=cp, ep=ep)


def train_config(base: TrainConfig, layout: Layout) -> TrainConfig:
    """`base` with the layout's options."""
    return attrs.evolve(base, mesh=layout.mesh, zero=layout.zero, schedule=layout.schedule,
                        micro_batches=layout.micro_batches, virtual_stages=layout.virtual_stages,
                        recompute=layout.recompute, sequence_parallel=layout.sp)


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


def least_recompute(layouts: list[Layout], fits: Callable[[Layout], bool]) -> list[Layout]:
    """Of each group of layouts that differ only in recomputation, the first of none, full
    that `fits` (the last, the smallest, when none does). Each step down that list trades
    step time for memory, so a layout that already fits gains nothing from more
    recomputation."""
    groups: dict[Layout, list[Layout]] = {}
    for lay in layouts:
        groups.setdefault(attrs.evolve(lay, recompute="none"), []).append(lay)
    out = []
    for group in groups.values():
        group.sort(key=lambda lay: RECOMPUTE.index(lay.recompute))
        first = next((lay for lay in group if fits(lay)), None)
        out.append(first if first is not None else group[-1])
    return out
