"""`numesh train --mesh auto`: the layout for the ranks a job got, picked with the planner's model.

A requeued job may come back on another number of ranks. With `--mesh auto` the same
command line picks, for whatever world size it starts on, the layout whose memory fits and
whose predicted step is fastest (`numesh.plan.plan`); since every layout computes the same
thing, `--resume auto` then continues the same run. The layout options the run sets to
other than their defaults (`KEPT`: --zero, --schedule, ...) are kept: only layouts with
those values are considered.

The profile is this machine's calibration (`numesh plan --calibrate`) when there is one
in the run's dtype that can time the job (one calibrated on a single rank times no
communication, so it plans only single-rank jobs), else `cpu_profile`: a spec-sheet
profile of this CPU from the matmul peak numesh measures for MFU and assumed memory and
link speeds; the chosen line says why a calibration was left aside. Rank 0 decides and every
rank gets its answer (or its one-line error), so the ranks never disagree on a mesh.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import numpy as np
from mpi4py import MPI

from numesh.base.errors import ConfigError, ScheduleError, UserError
from numesh.base.flags import flag_value
from numesh.host.runtime import core_peak_flops, ranks_per_node
from numesh.host.threads import threads
from numesh.pipeline.schedules import check_shape
from numesh.plan.command import model_spec
from numesh.plan.fits import available_memory
from numesh.plan.hardware import Link, Profile, load_profile, local_profile_path
from numesh.plan.predict import Prediction, plan, predict
from numesh.plan.render import human_bytes, human_seconds
from numesh.plan.search import train_config
from numesh.run.config import MESH_AUTO, TrainConfig

# the options a layout sets besides --mesh; those a run gives other values than the defaults are kept
KEPT = ("zero", "schedule", "micro_batches", "virtual_stages", "recompute", "sequence_parallel")
# Assumed for an uncalibrated CPU (orders of magnitude, not measured): the memory bandwidth
# one core streams, and MPI within a node (shared memory) and between nodes (a 100 Gb/s
# fabric). They weigh element-wise work and collectives against the GEMMs, whose rate is measured.
CORE_MEM_BANDWIDTH = 5e9
# predictions this close (relative) are one step time: the fewest micro-batches then wins, since
# each costs Python calls that a spec-sheet profile does not count
TIE = 1e-6
INTRA_NODE = Link(latency_s=2e-6, bandwidth=5e9)
INTER_NODE = Link(latency_s=1e-5, bandwidth=1.25e10)


def kept_options(cfg: TrainConfig) -> dict[str, Any]:
    """The layout options `cfg` sets to other than their defaults: what auto keeps."""
    fields = attrs.fields_dict(TrainConfig)
    return {name: getattr(cfg, name) for name in KEPT if getattr(cfg, name) != fields[name].default}


def choose(preds: list[Prediction], base: TrainConfig, kept: dict[str, Any]) -> tuple[Prediction, Prediction | None]:
    """The first of `preds` (best first, as `plan` sorts them) that fits and keeps `kept`
    (of those predicted as fast, the one with the fewest micro-batches), and the runner-up:
    the best such prediction on another mesh (None if there is none)."""
    keeping = [p for p in preds if all(getattr(train_config(base, p.layout), k) == v for k, v in kept.items())]
    ok = [p for p in keeping if p.fits]
    if not ok:
        given = " ".join(flag_value(k, v) for k, v in kept.items())
        if preds and not keeping:  # not memory: no layout on these ranks takes them (--zero 2 on one rank ...)
            raise ConfigError(f"--mesh auto: no layout of this model on these ranks runs with {given}: leave "
                              f"{'it' if len(kept) == 1 else 'them'} out, or name a --mesh that does")
        raise ConfigError(f"--mesh auto: no layout of this model on these ranks fits in memory"
                          f"{' with ' + given if given else ''}: run `numesh plan` (without "
                          "layout options) to see them all")
    tied = [p for p in ok if p.time.total <= ok[0].time.total * (1 + TIE)]
    best = min(tied, key=lambda p: p.layout.micro_batches * p.layout.virtual_stages)  # the first of equals
    runner_up = next((p for p in ok if p.layout.mesh != best.layout.mesh), None)
    return best, runner_up


def _schedule_kept(p: Prediction, schedule: str | None, again: Callable[[Any], Prediction]) -> Prediction:
    """p predicted `again` with the run's --schedule where its pp = 1 runs it: one stage,
    where every schedule `numesh train` takes is gradient accumulation and the planner lists
    1F1B alone (so `--schedule gpipe` on one rank was refused by auto and trained with --mesh
    pp=1). Predicted again, not relabelled: GPipe's one stage holds every micro-batch's
    activations at once, 1F1B's one."""
    lay = p.layout
    if schedule is None or lay.pp != 1 or lay.schedule == schedule:
        return p
    try:
        check_shape(schedule, 1, lay.micro_batches, lay.virtual_stages)
    except ScheduleError:
        return p
    return again(attrs.evolve(lay, schedule=schedule))


def cpu_profile(dtype: str, core_flops: float, rank_threads: int, ranks_on_node: int, node_memory: float) -> Profile:
    """A spec-sheet profile of one rank of this CPU: `rank_threads` cores' matmul peak, an
    equal share of the node's memory, the assumed bandwidths above."""
    return Profile(
        name="this-cpu-uncalibrated", source="numesh's matmul peak of one core; memory and links assumed",
        dtype=dtype, itemsize=np.dtype(dtype).itemsize, memory_bytes=node_memory / max(1, ranks_on_node),
        devices_per_node=ranks_on_node, peak_flops=core_flops * rank_threads,
        mem_bandwidth=CORE_MEM_BANDWIDTH * rank_threads, intra=INTRA_NODE, inter=INTER_NODE, overlap=False)


def node_memory() -> float:
    """Bytes of memory this node has free (`numesh.plan.fits.available_memory`, what
    `numesh train` checks the run against); 0 if unknown (then everything fits)."""
    free = available_memory()
    return 0.0 if free is None else float(free)


def _profile(cfg: TrainConfig, world: int, ranks_on_node: int) -> tuple[Profile, str]:
    """This machine's calibrated profile in the run's dtype, else `cpu_profile` (the job's
    --peak-flops shared by its cores, or one core's measured peak); and, when a calibration
    exists but cannot plan this job, why it was left aside (else ""). A calibration that
    timed no communication (one rank) cannot price a multi-rank job: that job is planned as
    if there were none, never refused (a requeued job must not fail on the user's cache)."""
    path, why = local_profile_path(), ""
    if path.is_file():
        try:
            prof = load_profile("local")
            if not prof.measured:
                why = f"{path} holds no measurements"
            elif prof.dtype != cfg.dtype:
                why = f"{path} was calibrated in {prof.dtype}, not {cfg.dtype}"
            elif world > 1 and not prof.times_communication():
                why = (f"{path} was calibrated on one rank, which times no communication; `mpirun -n "
                       f"{min(world, 8)} numesh plan --calibrate` measures it")
            else:
                return prof, ""
        except UserError as e:
            why = f"unreadable ({e})"  # a broken calibration file: plan without it
    cores = world * threads()
    core = cfg.peak_flops / cores if cfg.peak_flops > 0 else core_peak_flops(np.dtype(cfg.dtype))[0]
    return cpu_profile(cfg.dtype, core, threads(), ranks_on_node, node_memory()), why


def pick(cfg: TrainConfig, world: int, ranks_on_node: int) -> tuple[TrainConfig, str]:
    """(`cfg` with the chosen layout, the one line saying what was chosen and the runner-up)."""
    base = attrs.evolve(cfg, mesh="")
    model = model_spec(base, None, None)  # the vocabulary of --data
    prof, set_aside = _profile(base, world, ranks_on_node)
    limit = prof.memory_bytes if not prof.measured else prof.memory_bytes / max(1, ranks_on_node)
    tpr = max(1, (prof.cores or 1) // ranks_on_node) if prof.measured else threads()
    itemsize, kept = np.dtype(cfg.dtype).itemsize, kept_options(cfg)
    preds = plan(base, model, world, prof, limit, itemsize, tpr).fitting

    def again(lay: Any) -> Prediction:
        return predict(model, lay, prof, limit, itemsize, tpr, int(base.bucket_mb * 2**20))

    best, second = choose([_schedule_kept(p, kept.get("schedule"), again) for p in preds], base, kept)

    def said(p: Prediction) -> str:
        return f"{p.layout.train_flags()} ({human_seconds(p.time.total)} a step, {human_bytes(p.memory.total)} a rank)"

    uncalibrated = f" (this machine's calibration is not used: {set_aside})" if set_aside else ""
    line = (f"--mesh auto on {world} rank{'s' if world > 1 else ''}, profile {prof.name}{uncalibrated}: {said(best)}; "
            "runner-up: " + (said(second) if second else "none"))
    return train_config(cfg, best.layout), line


def auto_layout(cfg: TrainConfig, comm: MPI.Comm | None = None,
                log: Callable[[str], None] = lambda line: None) -> TrainConfig:
    """`cfg` unchanged unless its mesh is `auto`; then with the layout `pick` chooses for
    `comm`'s ranks, logged in one line. Collective over `comm`: rank 0 decides."""
    if cfg.mesh.strip() != MESH_AUTO:
        return cfg
    comm = MPI.COMM_WORLD if comm is None else comm
    on_node = ranks_per_node(comm)
    result = None
    if comm.Get_rank() == 0:
        try:
            result = ("ok", pick(cfg, comm.Get_size(), on_node))
        except UserError as e:
            result = ("error", str(e))
    status, value = comm.bcast(result, root=0)
    if status != "ok":
        raise ConfigError(value)
    chosen, line = value
    log(line)
    return chosen
