"""One layout's prediction (`predict`) and every layout's, fastest first (`plan`)."""

from __future__ import annotations

import math
import time
from typing import Callable

import attrs

from numesh.base.errors import ConfigError
from numesh.base.flags import n_ranks
from numesh.plan.hardware import Profile
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.memory import RankMemory, blocks_floor, layout_memory, memory_floor
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


@attrs.frozen
class Plan:
    """What `plan` found: the layouts that fit, predicted and fastest first; how many layouts
    it weighed (each one `numesh train` accepts; beyond SCALE_RANKS ranks, the least
    recomputation that fits of each); and when none fits, the one that needs the least
    memory, with its bytes per rank."""

    fitting: list[Prediction]
    layouts: int
    smallest: Layout | None = None
    smallest_bytes: int = 0
    at_least: bool = False  # smallest_bytes is the floor of its blocks alone (`blocks_floor`), not its prediction


PROGRESS_S = 10.0  # a plan that takes longer says how far it is, this often
# a rank's blocks that a plan lists one by one (real models have a few hundred); a layout of more is weighed by
# its `blocks_floor` first, and not listed where that is over the limit: 10^9 of them were a MemoryError
LISTED_BLOCKS = 1 << 16


def plan(base: TrainConfig, model: ModelSpec, ranks: int, profile: Profile, memory_limit: float, itemsize: int,
         threads: int = 1, progress: Callable[[str], None] | None = None) -> Plan:
    """Every valid layout weighed against `memory_limit` bytes per rank (0: no limit); those
    that fit predicted. A layout whose `memory_floor` is over the limit is dropped before its
    schedule is built (one whose `blocks_floor` is, before its blocks are listed): on few
    ranks a big model's layouts mostly cannot fit, and building, walking and simulating their
    schedules (up to 300k actions each) was all of a plan that printed nothing for a quarter
    of an hour. `progress` gets a line every PROGRESS_S seconds of predicting."""
    layouts = valid_layouts(base, model, ranks)
    if not layouts:
        raise ConfigError(no_layout_reason(model, ranks))
    floors: dict[Layout, int] = {}
    unlisted: dict[Layout, int] = {}  # layouts of too many blocks a rank to list, whose blocks alone do not fit
    if memory_limit > 0:
        for lay in layouts:
            if model.n_layer // lay.pp > LISTED_BLOCKS and (b := blocks_floor(model, lay, itemsize)) > memory_limit:
                unlisted[lay] = b
        floors = {lay: unlisted[lay] if lay in unlisted else memory_floor(model, lay, itemsize) for lay in layouts}

    def fits(lay: Layout) -> bool:
        return memory_limit <= 0 or (floors[lay] <= memory_limit and _total(model, lay, itemsize, threads)
                                     <= memory_limit)

    if ranks > SCALE_RANKS:
        layouts = least_recompute(layouts, fits)
    bucket = int(base.bucket_mb * 2**20)
    maybe = [lay for lay in layouts if memory_limit <= 0 or floors[lay] <= memory_limit]
    # grouped by schedule, so that each schedule's laid-out dependencies are built once
    by_schedule = sorted(maybe, key=lambda lay: (lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages))
    preds, said = [], time.monotonic()
    for i, lay in enumerate(by_schedule):
        if progress is not None and time.monotonic() - said > PROGRESS_S:
            progress(f"predicted {i:,} of {len(by_schedule):,} layouts that may fit ({len(layouts):,} in all)")
            said = time.monotonic()
        preds.append(predict(model, lay, profile, memory_limit, itemsize, threads, bucket))
    fitting = sorted((p for p in preds if p.fits), key=lambda p: -p.tokens_per_s)
    if fitting:
        return Plan(fitting, len(layouts))
    least = min(layouts, key=floors.__getitem__)
    if least in unlisted:  # --n-layer 1000000000: not even its blocks fit, and listing them took all the memory
        return Plan([], len(layouts), least, unlisted[least], at_least=True)
    smallest, size = _smallest(model, [lay for lay in layouts if lay not in unlisted], floors, itemsize, threads)
    return Plan([], len(layouts), smallest, size)


def _total(model: ModelSpec, layout: Layout, itemsize: int, threads: int) -> int:
    """The largest rank's predicted bytes (`predict`'s memory)."""
    return max(m.total for m in layout_memory(model, layout, itemsize, threads))


def _smallest(model: ModelSpec, layouts: list[Layout], floors: dict[Layout, int], itemsize: int,
              threads: int) -> tuple[Layout, int]:
    """The layout that needs the least memory, and its bytes: predicted in the order of their
    floors until the next floor is no less than the best found (none after it can be
    smaller), so a few schedules are built, not all. `layouts` holds none whose blocks are
    too many to list (`plan`'s `unlisted`): `_total` would list them."""
    best, size = layouts[0], math.inf
    for lay in sorted(layouts, key=floors.__getitem__):
        if floors[lay] >= size:
            break
        total = _total(model, lay, itemsize, threads)
        if total < size:
            best, size = lay, total
    return best, int(size)


def no_layout_reason(model: ModelSpec, ranks: int) -> str:
    """Why no layout of `model` uses `ranks` ranks, and rank counts that would work."""
    near = set(range(max(1, ranks - 32), ranks + 33)) | {2**k for k in range(0, (4 * ranks).bit_length())}
    good = [n for n in sorted(near) if any(True for _ in _valid_quick(model, n))]
    near = ", ".join(str(n) for n in sorted(good, key=lambda n: (abs(n - ranks), n))[:6])
    return (f"no layout of this model uses {n_ranks(ranks)}: dp must divide batch_size={model.batch_size}, tp divide "
            f"n_head={model.n_head}, pp (x virtual stages) divide n_layer={model.n_layer}; "
            f"rank counts that work: {near}") if good else f"no layout of this model uses {n_ranks(ranks)}"


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
