"""One layout's prediction (`predict`) and every layout's, fastest first (`plan`)."""

from __future__ import annotations

import attrs

from numesh.base.errors import ConfigError
from numesh.plan.hardware import Profile
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.memory import RankMemory, layout_memory
from numesh.plan.search import SCALE_RANKS, least_recompute, valid_layouts
from numesh.plan.timing import StepTime, predict_time
from numesh.run.config import TrainConfig


@attrs.frozen
class Prediction:
    layout: Layout
    memory: RankMemory  # the largest pipeline rank's
    time: StepTime
    fits: bool
    tokens_per_s: float


def predict(model: ModelSpec, layout: Layout, profile: Profile, memory_limit: float, itemsize: int,
            threads: int = 1, bucket_bytes: int = 1 << 20) -> Prediction:
    """Memory and step time of one layout; `memory_limit` bytes per rank (0: no limit)."""
    mem = max(layout_memory(model, layout, itemsize, threads), key=lambda m: m.total)
    t = predict_time(model, layout, profile, bucket_bytes)
    return Prediction(layout, mem, t, memory_limit <= 0 or mem.total <= memory_limit, model.tokens_per_step / t.total)


def plan(base: TrainConfig, model: ModelSpec, ranks: int, profile: Profile, memory_limit: float, itemsize: int,
         threads: int = 1) -> list[Prediction]:
    """Every valid layout's prediction, those that fit first, fastest first (beyond
    SCALE_RANKS ranks, only the least recomputation that fits of each layout)."""
    layouts = valid_layouts(base, model, ranks)
    if not layouts:
        raise ConfigError(no_layout_reason(model, ranks))
    if ranks > SCALE_RANKS:
        layouts = least_recompute(layouts, lambda lay: memory_limit <= 0 or max(
            m.total for m in layout_memory(model, lay, itemsize, threads)) <= memory_limit)
    bucket = int(base.bucket_mb * 2**20)
    # grouped by schedule, so that each schedule's laid-out dependencies are built once
    by_schedule = sorted(layouts, key=lambda lay: (lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages))
    preds = [predict(model, lay, profile, memory_limit, itemsize, threads, bucket) for lay in by_schedule]
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def no_layout_reason(model: ModelSpec, ranks: int) -> str:
    """Why no layout of `model` uses `ranks` ranks, and rank counts that would work."""
    near = set(range(max(1, ranks - 32), ranks + 33)) | {2**k for k in range(0, (4 * ranks).bit_length())}
    good = [n for n in sorted(near) if any(True for _ in _valid_quick(model, n))]
    near = ", ".join(str(n) for n in sorted(good, key=lambda n: (abs(n - ranks), n))[:6])
    return (f"no layout of this model uses {ranks} ranks: dp must divide batch_size={model.batch_size}, tp divide "
            f"n_head={model.n_head}, pp (x virtual stages) divide n_layer={model.n_layer}; "
            f"rank counts that work: {near}") if good else f"no layout of this model uses {ranks} ranks"


def _valid_quick(model: ModelSpec, ranks: int):
    """Meshes (dp, tp, pp) of `ranks` that fit the model's divisibility (no schedule checks)."""
    from numesh.plan.layout import divisors

    for pp in divisors(ranks):
        for tp in divisors(ranks // pp):
            dp = ranks // (pp * tp)
            kv = model.parts.kv_heads or model.n_head  # tp divides the kv heads or is a multiple of them
            if (model.batch_size % dp == 0 and model.n_head % tp == 0 and model.parts.ffn(model.n_embd) % tp == 0
                    and (kv % tp == 0 or tp % kv == 0) and model.n_layer % pp == 0):
                yield dp, tp, pp
