"""Whether a training run fits this machine's memory, asked before `numesh train` allocates
anything: the planner's bytes per rank (`layout_memory`, what `ZeroOptimizer.memory()` and
`StepStats.peak_bytes` measure) against the memory the machine has free.

Without it, `--block-size 100000` ran for minutes and then died in a 59-line
`_ArrayMemoryError`; now it is one line, in well under a second, naming both numbers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from mpi4py import MPI

from numesh.base.errors import ConfigError
from numesh.host.runtime import ranks_per_node
from numesh.host.threads import threads
from numesh.plan.layout import Layout, ModelSpec
from numesh.plan.memory import RankMemory, blocks_floor, layout_memory
from numesh.plan.render import human_bytes
from numesh.run.config import TrainConfig, validate

_CGROUP_LIMITS = (  # (limit, usage): cgroup v2, then v1; "max" or a huge number is no limit
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_memory() -> int | None:
    """Bytes this machine can still give a new process: /proc/meminfo's MemAvailable, or
    less under a container's memory limit; without /proc (macOS) its physical memory, so a
    run that cannot fit in the whole machine is still one line, not a swap storm. None
    where even that is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return _physical_memory()
    for limit, usage in _CGROUP_LIMITS:
        try:
            cap = int(Path(limit).read_text()) - int(Path(usage).read_text())
        except (OSError, ValueError):  # absent, or "max"
            continue
        free = min(free, max(cap, 0))
    return free


def _physical_memory() -> int | None:
    """The machine's RAM in bytes (sysconf), or None where sysconf does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def run_layout(cfg: TrainConfig, shape: dict[str, int]) -> Layout:
    """The planner's `Layout` of a run's options on the mesh `shape`."""
    return Layout(dp=shape["dp"], tp=shape["tp"], pp=shape["pp"], zero=cfg.zero, schedule=cfg.schedule,
                  micro_batches=cfg.micro_batches, virtual_stages=cfg.virtual_stages, recompute=cfg.recompute,
                  cp=shape["cp"], sp=cfg.sequence_parallel, ep=shape.get("ep", 1))


def run_memory(cfg: TrainConfig, shape: dict[str, int], vocab_size: int, n_threads: int) -> RankMemory:
    """Predicted bytes of the run's heaviest rank (checked options: `validate` passed)."""
    model = ModelSpec.of(cfg, vocab_size)  # its experts too: E/ep of them on each ep rank
    itemsize = np.dtype(cfg.dtype).itemsize
    return max(layout_memory(model, run_layout(cfg, shape), itemsize, n_threads), key=lambda m: m.total)


def check_fits(need: RankMemory, per_rank: float, ranks_here: int) -> None:
    """A ConfigError when a rank needs more than its share of the free memory, `per_rank`
    bytes (`ranks_here` ranks sharing the machine), with both numbers and what to change."""
    if need.total <= per_rank:
        return
    share = f", {human_bytes(per_rank)} for each of {ranks_here} ranks" if ranks_here > 1 else ""
    raise ConfigError(
        f"this run needs ~{human_bytes(need.total)} per rank ({human_bytes(need.activations)} of it activations) "
        f"but {human_bytes(per_rank * ranks_here)} of memory is free here{share}: use a smaller --block-size or "
        "--batch-size, more --micro-batches, --recompute full, or more ranks (`numesh plan --ranks N` lists the "
        "layouts that fit)")


def check_blocks_fit(cfg: TrainConfig, shape: dict[str, int], vocab_size: int, per_rank: float,
                     ranks_here: int) -> None:
    """`check_fits` of the blocks alone (`blocks_floor`), asked before `run_memory`, which
    lists every block of a rank: `--n-layer 1000000000` was a MemoryError in that list, not
    this one line saying what to change."""
    floor = blocks_floor(ModelSpec.of(cfg, vocab_size), run_layout(cfg, shape), np.dtype(cfg.dtype).itemsize)
    if floor <= per_rank:
        return
    share = f", {human_bytes(per_rank)} for each of {ranks_here} ranks" if ranks_here > 1 else ""
    raise ConfigError(
        f"this run's {cfg.n_layer:,} blocks need at least {human_bytes(floor)} per rank for their parameters and "
        f"gradients alone but {human_bytes(per_rank * ranks_here)} of memory is free here{share}: use a smaller "
        "--n-layer or --n-embd, or more ranks (`numesh plan --ranks N` lists the layouts that fit)")


def check_run_fits(cfg: TrainConfig, comm: MPI.Comm | None = None) -> None:
    """`validate` the run, then `check_blocks_fit` and `check_fits` on every rank with the
    same numbers: the least free memory per rank of any node (collective, so every rank
    raises or none does)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    shape, model = validate(cfg, comm.Get_size())
    here = ranks_per_node(comm)
    free = available_memory()
    per_rank = comm.allreduce(math.inf if free is None else free / here, op=MPI.MIN)
    if math.isfinite(per_rank):
        check_blocks_fit(cfg, shape, model.vocab_size, per_rank, here)
        check_fits(run_memory(cfg, shape, model.vocab_size, threads()), per_rank, here)
