"""The training loop, as a library function over a `TrainConfig` (numesh/config.py).

Every rank runs the same loop on its shard of the mesh: draw its rows of the step's
global batch (with cp, its two chunks of each row's tokens), accumulate gradients over
micro-batches, sum them over dp and cp, clip by the
true global norm, take an AdamW step. Losses are means over the whole global batch, so
the logged numbers are the same on every mesh.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np
from mpi4py import MPI

from numesh.base.errors import CheckpointError, ConfigError, DataError, Interrupted, Preempted, abort_job
from numesh.base.flags import flag
from numesh.base.tree import tree_leaves, tree_leaves_with_path, tree_map
from numesh.checkpoint import LocalState, TrainState, read_local_state, save_checkpoint, unpad_vocab
from numesh.checkpoint.background import AsyncCheckpoints
from numesh.checkpoint.format import LATEST, RUN_CKPT, step_dir_name
from numesh.checkpoint.hf_source import read_source
from numesh.checkpoint.init_from import initial_shards
from numesh.checkpoint.load import broken_latest
from numesh.data.batches import eval_key, local_batch, train_key
from numesh.data.dataset import Dataset, bits_per_byte, bytes_per_token, open_dataset, verify_dataset
from numesh.data.shards import TokenStream
from numesh.host import kernels, llama_kernels
from numesh.host.interrupt import InterruptWatch
from numesh.host.runtime import dp_hint, host_map, log
from numesh.host.runtime import job_peak_flops as measured_peak_flops
from numesh.host.startup_signals import parse_signals
from numesh.host.threads import threads
from numesh.mesh import AXES, BATCH_AXES, Mesh, pmax, psum, psum_scalar, unshard
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPT, GPTConfig, gpt_global_shapes, gpt_specs, init_gpt
from numesh.nn.moe import moe_metrics, stats_vector
from numesh.nn.units import OUTER, join_units, split_units, tp_partial_leaves
from numesh.observe import attach
from numesh.observe.flight import FlightRecorder
from numesh.observe.inject import FaultInjector, faults_from_env, unshared_out
from numesh.observe.spool import PARTS_DIR
from numesh.observe.trace import Tracer
from numesh.optim import Leaf, clip_scale, cosine_lr
from numesh.optim.registry import describe, run_optimizer
from numesh.optim.zero import ZeroOptimizer
from numesh.perf import formulas
from numesh.pipeline.executor import PipelineExecutor, StepStats
from numesh.pipeline.schedules import make_schedule
from numesh.pipeline.stages import StageLayout, gather_stages, stage_tree
from numesh.run.config import (  # noqa: F401  (re-exported: numesh.run.train's old names)
    DTYPES,
    RESUME_AUTO,
    TrainConfig,
    changed_hyper_parameters,
    check_layout,
    check_options,
    config_from,
    run_record,
    setting_differences,
    validate,
)
from numesh.run.rundir import RunDir, check_shared, latest_checkpoint


class Diverged(ConfigError):
    """A step's loss or gradient norm is not finite (the same on every rank)."""

    def __init__(self, step: int, loss: float, norm: float, skipped: int):
        self.step, self.loss, self.norm, self.skipped = step, loss, norm, skipped
        super().__init__(f"step {step}: loss {loss}, gradient norm {norm}")


def flops_per_token(model: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter a token uses (with experts, only its k of
    each MoE block's E; an untied embedding's rows are looked up, not counted:
    `formulas.counted_params`) plus attention (PaLM's appendix B)."""
    parts = formulas.Parts.of(model)
    active = formulas.active_params(n_params, model.n_embd, model.moe_blocks, model.moe_experts, model.moe_top_k,
                                    model.bias, parts)
    counted = formulas.counted_params(active, model.vocab_size, model.n_embd, parts)
    return formulas.flops_per_token(model.n_layer, model.n_embd, model.block_size, counted)


def open_run_dataset(path: str, comm: MPI.Comm) -> Dataset:
    """The run's dataset (`numesh.data.dataset.open_dataset`), opened on every rank and checked once:
    rank 0 reads every byte (`numesh.data.dataset.verify_dataset`: each file's sha256 against
    meta.json, every id below the vocabulary; 1.7 GB/s, docs/data.md) and all ranks must
    have opened the same meta.json (a rewrite as the job starts could give ranks different
    data). Otherwise the same one-line DataError on every rank. Collective."""
    ds, error = None, None
    try:
        ds = open_dataset(path)
        if comm.Get_rank() == 0:
            verify_dataset(ds)
    except DataError as e:
        error = str(e)
    mine = (error, ds.meta_sha256 if ds is not None else None)
    seen = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    error = next((e for e, _ in seen if e), None)
    if error is None and len({sha for _, sha in seen}) > 1:
        error = f"the ranks opened different versions of {path} (it was rewritten as the job started): start again"
    if error is not None:
        raise DataError(error)
    return ds


def agree_on_vocab(vocab: int, comm: MPI.Comm) -> None:
    """Every rank read the run's vocabulary from the weights it starts from (`run_vocab`):
    one that could not read them has another, which is one line here, not a hang in the
    first collective that sees the models differ. Collective."""
    seen = comm.allgather(vocab) if comm.Get_size() > 1 else [vocab]
    if len(set(seen)) > 1:
        raise ConfigError(f"the ranks read different vocabulary sizes ({sorted(set(seen))}) from the checkpoint or "
                          "--init-from the run starts from: every rank must see those files (a shared filesystem)")


def agree_on_dtype(dtype: str, comm: MPI.Comm) -> None:
    """Every rank runs in one dtype: a resume without --dtype takes its checkpoint's
    (`config_from`), and a rank that could not read the checkpoint kept float32, which is
    one line here, not a hang in the first collective of another byte size. Collective."""
    seen = comm.allgather(dtype) if comm.Get_size() > 1 else [dtype]
    if len(set(seen)) > 1:
        raise ConfigError(f"the ranks chose different dtypes ({', '.join(sorted(set(seen)))}) for the checkpoint the "
                          "run resumes: every rank must see its files (a shared filesystem), or pass --dtype")


class Trainer:
    """The state of one training run on one rank: mesh, model, ZeRO optimiser, data."""

    def __init__(self, cfg: TrainConfig, comm: MPI.Comm | None = None):
        comm = MPI.COMM_WORLD if comm is None else comm
        shape, self.model = validate(cfg, comm.Get_size())
        agree_on_vocab(self.model.vocab_size, comm)
        agree_on_dtype(cfg.dtype, comm)
        self.cfg = cfg
        self.dataset = open_run_dataset(cfg.data, comm)  # what the run reads, whatever happens to cfg.data later
        self.mesh = Mesh(shape, comm, cfg.sequence_parallel)
        self.dtype = DTYPES[cfg.dtype]
        pp_rank = self.mesh.index("pp")
        self.layout = StageLayout(self.model.n_layer, shape["pp"], cfg.virtual_stages)
        self.schedule = make_schedule(cfg.schedule, shape["pp"], cfg.micro_batches, cfg.virtual_stages)
        self.specs = stage_tree(gpt_specs(self.model), self.layout, pp_rank)
        self.optimizer = run_optimizer(cfg.optimizer, attrs.asdict(cfg))
        params = self._initial_params()
        self.source = read_source(cfg.init_from) if cfg.init_from else None  # what the export gives back
        # a tied wte's copy on the last stage: counted on the first rank
        tied_copy = self.model.tie_embeddings and self.layout.holds_tied(pp_rank) and self.layout.is_last(pp_rank)
        units = split_units(params)
        owned = self.layout.owned(pp_rank)  # the global layer of each local block, for the optimiser's rules
        self.opt = ZeroOptimizer(
            units, split_units(self.specs), self.mesh, cfg.zero, self.optimizer,
            bucket_bytes=int(cfg.bucket_mb * 2**20), overlap=cfg.overlap,
            uncounted={(OUTER, "wte")} if tied_copy else (),
            tp_partial=tp_partial_leaves(units, self.mesh),  # norm grads under sp, GQA's k and v
            paths={u: "" if u.is_outer else f"blocks.{owned[u.block]}." for u in units},
        )
        self.opt.check_replicas()
        self.pipeline = PipelineExecutor(self.model, self.mesh, self.layout, self.opt, self.dtype, cfg.recompute)
        self.last_stats: StepStats | None = None
        self.train_data = self.dataset.split("train")
        self.val_data = self.dataset.split("val")
        self.bytes_per_token = bytes_per_token(self.dataset)  # for bits per byte at evaluations
        self.step = 0
        self.skipped = 0  # steps not applied because their loss or gradient was not finite
        self.n_params = sum(math.prod(s) for s in tree_leaves(gpt_global_shapes(self.model)))
        self.trace: Tracer | None = None  # set by `start_trace`
        self.record = run_record(cfg)  # config.json's and each checkpoint's; a resume adds its changes (`restore`)

    def _initial_params(self) -> GPT:
        """This rank's shards of its stage's starting weights: initialised from the seed, or
        those of `--init-from` (sharded like a checkpoint's)."""
        if not self.cfg.init_from:
            return stage_tree(init_gpt(self.model, self.mesh, self.cfg.seed, self.dtype), self.layout,
                              self.mesh.index("pp"))
        return initial_shards(self.cfg.init_from, self.model, self.dataset.tokenizer, self.mesh, self.layout,
                              self.dtype)

    def optimizer_groups(self) -> list[str]:
        """Which of the optimiser's rules updates which of the model's (global) leaves, in words."""
        shapes = dict(tree_leaves_with_path(gpt_global_shapes(self.model)))
        specs = dict(tree_leaves_with_path(gpt_specs(self.model)))
        return describe(self.optimizer, {p: Leaf(p, shapes[p], specs[p]) for p in shapes})

    @property
    def params(self) -> GPT:
        """This rank's tp-local parameter shards (gathered over dp under ZeRO-3)."""
        return join_units(self.opt.local_params())

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.block_size

    def lr(self, step: int) -> float:
        c = self.cfg
        return cosine_lr(step, c.learning_rate, c.min_lr, c.warmup_iters, c.lr_decay_iters)

    def _micro_batches(self, data: TokenStream, key: tuple[int, ...], count: int) -> list:
        c, mesh = self.cfg, self.mesh
        try:
            return local_batch(data, key, c.batch_size, c.block_size, mesh.index(BATCH_AXES), mesh.size(BATCH_AXES),
                                 count, mesh.index("cp"), mesh.size("cp"))
        except DataError as e:  # a file truncated or rewritten under the run, seen by this rank
            if mesh.world.Get_size() > 1:  # alone: the others would wait for it forever
                print(f"error: {e}", file=sys.stderr, flush=True)
                abort_job(mesh.world, 2)
            raise

    def train_step(self) -> tuple[float, float, float]:
        """One optimiser step on the global batch of `self.step`: (loss, grad norm, lr)."""
        c, mesh, tr = self.cfg, self.mesh, self.trace
        t_step = time.perf_counter()
        micro = self._micro_batches(self.train_data, train_key(c.seed, self.step), c.micro_batches)
        if tr is not None:
            tr.step = self.step
            tr.span("data", "data", t_step)
        rows = micro[0][0].shape[0]
        drops = [
            DropoutKey(c.dropout, c.seed, self.step, (mesh.index(BATCH_AXES) * len(micro) + m) * rows, c.batch_size)
            if c.dropout > 0.0 else None
            for m in range(len(micro))
        ]
        self.opt.begin_step(len(micro))
        stats = self.pipeline.run(self.schedule, micro, 1.0 / self.tokens_per_step, drops)
        self.last_stats = stats
        loss = psum_scalar(stats.loss, mesh, formulas.loss_axes(mesh.shape))
        t_opt = time.perf_counter()
        norm = self.opt.global_norm()
        lr = self.lr(self.step)
        if not (math.isfinite(loss) and math.isfinite(norm)):  # the same on every rank: both are global
            self.skipped += 1
            if c.on_nan == "stop" or self.skipped > c.max_skips:
                raise Diverged(self.step, loss, norm, self.skipped)
        else:
            self.opt.step(lr, clip_scale(norm, c.grad_clip))
        if tr is not None:
            tr.span("optimizer", "optimizer", t_opt)
            args = {"step": self.step}
            if self.mesh.shape["ep"] > 1:  # routing-dependent: the report's formula reads it per step
                args["all_to_all_bytes"] = self.all_to_all_bytes()
            tr.span(f"step {self.step}", "step", t_step, None, args)
        self.step += 1
        return loss, norm, lr

    def all_to_all_bytes(self) -> int:
        """Bytes this rank sent over ep in the experts' token all-to-alls of the last step:
        `formulas.moe_step_all_to_all_bytes` of the row counts its MoE layers recorded."""
        stats = self.last_stats.moe if self.last_stats is not None else ()
        return formulas.moe_step_all_to_all_bytes(
            [(s.send, s.recv) for s in stats], self.mesh.index("ep"), self.model.n_embd,
            self.model.moe_experts, np.dtype(self.dtype).itemsize, self.cfg.recompute)

    def evaluate(self) -> dict[str, float]:
        """Mean loss over `eval_iters` fixed batches of each split (the same on every mesh)."""
        c, mesh = self.cfg, self.mesh
        out = {}
        t0 = time.perf_counter()
        for split, data in (("train", self.train_data), ("val", self.val_data)):
            batches = [self._micro_batches(data, eval_key(c.seed, split, i), 1)[0] for i in range(c.eval_iters)]
            total = self.pipeline.forward_losses(batches)
            total = psum_scalar(total, mesh, formulas.loss_axes(mesh.shape))
            out[f"{split}_loss"] = total / (c.eval_iters * self.tokens_per_step)
            out[f"{split}_bpb"] = bits_per_byte(out[f"{split}_loss"], self.bytes_per_token[split])
        if self.trace is not None:
            self.trace.span("evaluate", "eval", t0, None, {"step": self.step})
        return out

    def start_trace(self, peak_flops: float, spool: Path | None = None) -> Tracer:
        """Trace this rank from now on (collective: aligns the clocks of every rank); what
        the report needs to compute the formulas goes in the trace's metadata. With `spool`
        (OUT/trace.parts), the events also go to disk as the run goes, so that a job that
        dies leaves them (numesh/observe/spool.py)."""
        tr = Tracer(self.mesh)
        attach(self.mesh, tr)  # chained after any observer already there (the flight recorder)
        self.trace = self.pipeline.trace = tr
        c, shape = self.cfg, self.mesh.shape
        itemsize = np.dtype(self.dtype).itemsize
        tr.meta = attrs.asdict(self.rank_units())
        self.trace_meta = {
            "mesh": dict(shape), "schedule": c.schedule, "micro_batches": c.micro_batches,
            "virtual_stages": c.virtual_stages, "zero": c.zero, "sequence_parallel": c.sequence_parallel,
            "recompute": c.recompute, "dtype": c.dtype, "itemsize": itemsize, "batch_size": c.batch_size,
            "block_size": c.block_size,
            "n_layer": self.model.n_layer, "n_embd": self.model.n_embd, "n_params": self.n_params,
            "rows_per_micro_batch": c.batch_size // (shape["dp"] * shape["ep"] * c.micro_batches),
            "tokens_per_step": self.tokens_per_step, "flops_per_token": flops_per_token(self.model, self.n_params),
            "peak_flops": peak_flops, "parts": attrs.asdict(formulas.Parts.of(self.model)),
            "moe": None if not self.model.moe_experts else dict(
                experts=self.model.moe_experts, top_k=self.model.moe_top_k, ep=shape["ep"],
                capacity=self.model.moe_capacity_factor > 0),
        }
        if spool is not None:
            tr.start_spool(spool, self.trace_meta)
        return tr

    def rank_units(self) -> formulas.RankUnits:
        """What this rank holds that its step's traffic depends on (`formulas.step_bytes`);
        a trace records it as the rank's metadata for `numesh report`."""
        shape, units = self.mesh.shape, self.opt.units
        tied = self.model.padded_vocab(shape["tp"]) // shape["tp"] * self.model.n_embd * np.dtype(self.dtype).itemsize
        return formulas.RankUnits(
            [formulas.Chunk(len(s.blocks), s.first, s.last, sum(self.model.moe(b) is not None for b, _ in s.blocks))
             for s in self.pipeline.stages],
            sum(u.padded for k, u in units.items() if not k.is_outer), units[OUTER].padded,
            tied if self.model.tie_embeddings and self.layout.holds_tied(self.mesh.index("pp")) else 0,
            self.opt.tp_partial_values, self.opt.ep_replicated_values,
            *self.matrix_exchange_bytes(),
        )

    def matrix_exchange_bytes(self) -> tuple[int, int, int, int]:
        """Bytes this rank moves each step so that each of Muon's matrices is whole on one
        rank (`formulas.matrix_exchange_bytes`; 0 for AdamW): the all-to-all over dp (ZeRO
        >= 1), a gather over tp (0: older runs'), the results' all-gather over dp (ZeRO 0),
        the exchange over ep x cp x tp with the replica that computes each matrix."""
        units = self.opt.units
        index = {k: i for i, k in enumerate(units)}
        slabs = [(index[s.key], s.start, s.size, s.cost, s.view.tp_dim is not None, s.view.experts)
                 for s in self.opt.matrix_slabs]
        out = formulas.matrix_exchange_bytes([u.size for u in units.values()], slabs, self.mesh.shape,
                                             self.mesh.coords, np.dtype(self.dtype).itemsize, self.opt.sync.sharded)
        replicas = sum(n for (axes, op), n in out.items() if op == "all_to_all" and axes != "dp")
        return out.get(("dp", "all_to_all"), 0), 0, out.get(("dp", "all_gather"), 0), replicas

    def gathered_params(self) -> GPT:
        """The global parameters (vocabulary unpadded), gathered on every rank (tests, export)."""
        full = tree_map(lambda x, s: unshard(x, s, self.mesh), self.params, self.specs)
        if self.mesh.size("pp") > 1:
            shapes = gpt_global_shapes(self.model, self.mesh.size("tp"))
            full = gather_stages(full, shapes, self.layout, self.mesh, self.dtype)
        return unpad_vocab(full, self.model)


def train_state(trainer: Trainer) -> TrainState:
    """What a checkpoint of the trainer's current step holds (collective over dp: the
    optimiser's state_trees gathers ZeRO shards)."""
    c = trainer.cfg
    tokenizer = trainer.dataset.tokenizer.to_meta()  # the run's, even if --data was rewritten since
    return TrainState(
        mesh=trainer.mesh, model=trainer.model, layout=trainer.layout,
        trees={g: join_units(t) for g, t in trainer.opt.state_trees().items()},
        step=trainer.step, opt_step=trainer.opt.opt_step, dtype=c.dtype, seed=c.seed,
        optimizer=trainer.optimizer.name,
        run_config=trainer.record, tokenizer=tokenizer, source=trainer.source,
    )


def restore(trainer: Trainer, path: str | Path) -> LocalState:
    """Set the trainer's parameters, optimiser state and steps (and the record of its run's
    `--init-from` directory, if it has one) from a checkpoint written on any mesh
    (collective; on error every rank raises and the trainer is unchanged). A checkpoint
    trained on another vocabulary than the run's dataset, or with another optimiser, is
    refused. The run's record (`run_record`) keeps the hyper-parameter changes of the
    checkpoint's run and adds this one's. Returns what the checkpoint said of itself (its
    dtype, its run's config; the trees, loaded, left out) for `resume_notes`."""
    got = read_local_state(path, trainer.mesh, trainer.model, trainer.layout, trainer.dtype,
                           trainer.dataset.tokenizer, f"dataset {trainer.cfg.data}", trainer.optimizer.name)
    trainer.opt.load_state_trees({g: split_units(t) for g, t in got.trees.items()}, got.opt_step)
    trainer.step = got.step
    if got.source is not None:  # the weights' source, kept by every later checkpoint of the run
        trainer.source = got.source
    trainer.record = run_record(trainer.cfg, got.run_config, got.step,
                                changed_hyper_parameters(got.run_config, trainer.cfg))
    return attrs.evolve(got, trees={})


def resume_notes(path: str | Path, got: LocalState, cfg: TrainConfig) -> list[str]:
    """The `note:` lines a resume starts with where it continues otherwise than the
    checkpoint's run: each hyper-parameter it changes, old -> new (allowed: a lower rate on
    resume is common, but it was silent), and a dtype other than the checkpoint's (given
    --dtype, or a library's TrainConfig: the weights and moments are converted)."""
    notes = []
    if changed := changed_hyper_parameters(got.run_config, cfg):
        said = ", ".join(f"{flag(k)} {_shown(old)} -> {_shown(new)}" for k, (old, new) in changed.items())
        notes.append(f"note: resuming with hyper-parameters changed from the checkpoint's run: {said} "
                     f"(config.json lists each change and its step)")
    if got.dtype != cfg.dtype:
        notes.append(f"note: {path} was saved in {got.dtype}; its weights and moments are converted to "
                     f"{cfg.dtype} (--dtype), in which this run continues")
    return notes


def _shown(value: Any) -> str:
    """An option's value in a note: a boolean as on or off, as the help shows it."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def save_step(trainer: Trainer, out_dir: Path, keep: int = 0, saves: AsyncCheckpoints | None = None) -> Path:
    """Write a sharded checkpoint of the trainer's current step to OUT/ckpt/step_NNNNNN and
    point OUT/ckpt/latest at it (collective; see numesh.checkpoint): the periodic saves, the
    one at the end and the one on Ctrl-C; with `saves`, only start it (--ckpt-async). A state with a
    non-finite value is refused on every rank: it never becomes `latest` or prunes a good one."""
    t0 = time.perf_counter()
    state = train_state(trainer)  # copies: training may go on while `saves` writes them
    if saves is not None:  # its writers check the values are finite, off this thread
        path = saves.start(state, out_dir, keep=keep or None)
    else:
        bad = sum(int(not np.isfinite(x).all()) for t in state.trees.values() for x in tree_leaves(t))
        if psum_scalar(bad, trainer.mesh, AXES):
            raise ConfigError(f"not saving step {trainer.step}: its parameters or optimiser state are not finite")
        path = save_checkpoint(state, out_dir, keep=keep or None)
    if trainer.trace is not None:
        trainer.trace.span("checkpoint", "checkpoint", t0, None, {"step": trainer.step})
    return path


def stop_interrupted(trainer: Trainer, watch: InterruptWatch, signum: int, out: Path, saved_at: int | None,
                     saves: AsyncCheckpoints | None = None) -> None:
    """Some rank got a signal and every rank is here at the same step boundary: on a
    --save-on-signal one, save this step's checkpoint (none at step 0) and raise `Preempted`; otherwise save
    it if the run saves them and raise `Interrupted` (unless just saved; collective). A
    checkpoint still being written (--ckpt-async) is finished first."""
    c, path, why_not = trainer.cfg, None, " (--ckpt-interval is 0)"
    preempted = signum in parse_signals(c.save_on_signal)
    if preempted and trainer.step == 0:  # it came during start-up and nothing has trained: nothing to save
        raise Preempted(0, signum, None)
    if saves is not None:
        with watch.saving():
            saves.wait()
    if c.ckpt_interval or preempted:
        if saved_at == trainer.step:
            path = out / RUN_CKPT / step_dir_name(trainer.step)
        else:
            with watch.saving():  # the watchdog allows the save more time than a step
                path = save_step(trainer, out, c.keep)
    if preempted:
        raise Preempted(trainer.step, signum, str(path))
    raise Interrupted(trainer.step, signum, None if path is None else str(path), why_not)


@attrs.frozen
class TrainResult:
    """What `train` returns when a run ends, so a script can go on from it without reading
    the run directory.

    Attributes:
        steps: optimiser steps this call took (0 when the run was already complete).
        final_loss: the last logged training loss (NaN if none was logged).
        final_val_loss: the last evaluated validation loss, or None.
        seconds: wall-clock time of the call.
        checkpoint: the path of the run's latest checkpoint (OUT/ckpt/latest).
        metrics: the path of the run's metrics (OUT/metrics.jsonl).
    """

    steps: int
    final_loss: float
    final_val_loss: float | None
    seconds: float
    checkpoint: str
    metrics: str


def job_peak_flops(trainer: Trainer) -> tuple[float, str]:
    """MFU's denominator for the whole job and where it came from: --peak-flops, or the cores
    the job uses times one core's matmul peak, the best reading kept per machine
    (numesh.host.runtime.job_peak_flops). Collective."""
    if trainer.cfg.peak_flops > 0:
        return trainer.cfg.peak_flops, "--peak-flops"
    return measured_peak_flops(trainer.mesh.world, threads(), trainer.dtype)


def moe_step_metrics(trainer: Trainer) -> dict[str, float | int]:
    """The last step's routing metrics ({} for a dense model): every rank's stats summed
    over the whole mesh (the MoE layers sit on different pipeline stages). Collective."""
    m = trainer.model
    if not m.moe_experts:
        return {}
    v = stats_vector(trainer.last_stats.moe, m.moe_layers, m.moe_experts)
    return moe_metrics(psum(v, trainer.mesh, AXES))


def _step_record(trainer: Trainer, step: int, peak_flops: float) -> dict[str, Any]:
    """Run step `step` (an evaluation on eval steps, then the optimiser step unless it is the
    last) and return its metrics line ({} when nothing is logged)."""
    c = trainer.cfg
    record: dict[str, Any] = {}
    if step % c.eval_interval == 0 or step == c.max_iters:
        record.update(trainer.evaluate())
    if step < c.max_iters:
        t0 = time.perf_counter()
        loss, norm, lr = trainer.train_step()
        dt = time.perf_counter() - t0
        tps = trainer.tokens_per_step / dt
        if step % c.log_interval == 0 or step == c.max_iters - 1:
            achieved = tps * flops_per_token(trainer.model, trainer.n_params)
            record.update(loss=loss, lr=lr, grad_norm=norm, dt_ms=dt * 1e3, tokens_per_s=tps, flops_per_s=achieved,
                          mfu=formulas.mfu(achieved, peak_flops), **moe_step_metrics(trainer))
    return {"step": step, **record} if record else record


def _last_checkpoint(out: Path) -> str:
    latest = out / RUN_CKPT / LATEST
    return str(latest.resolve()) if latest.exists() else "none (set --ckpt-interval to save during a run)"


def _diverged(d: Diverged, cfg: TrainConfig, out: Path) -> ConfigError:
    if cfg.init_from and d.step == 0:  # before any update: the weights it starts from (--on-nan skip would skip all)
        return ConfigError(f"the loss or gradient is not finite at step 0, before any update (loss {d.loss}, gradient "
                           f"norm {d.norm}): the weights of --init-from {cfg.init_from} hold NaN or inf, or overflow "
                           f"in {cfg.dtype}; `numesh sample {cfg.init_from}` names the first such weight")
    how = "--on-nan skip skips such steps" if cfg.on_nan == "stop" else f"{d.skipped} steps skipped, over --max-skips"
    return ConfigError(
        f"training diverged at step {d.step} (loss {d.loss}, gradient norm {d.norm}; {how}); "
        f"last good checkpoint: {_last_checkpoint(out)}"
    )


def _check_hosts(comm: MPI.Comm, out: Path) -> None:
    """On several ranks, say which run on which host (one line), and check that every rank
    sees the files rank 0 writes under `out` (numesh.run.rundir.check_shared; NUMESH_INJECT's
    `unshared` makes a rank look elsewhere). Collective."""
    if comm.Get_size() > 1:
        log(host_map(comm))
    check_shared(out, comm, unshared_out(comm.Get_rank(), comm.Get_size()))


def _resume_from(cfg: TrainConfig, comm: MPI.Comm) -> str:
    """The checkpoint to continue from: `--resume`, or with `--resume auto` OUT/ckpt/latest
    when there is one ("": start at step 0). The same on every rank."""
    if cfg.resume != RESUME_AUTO:
        return cfg.resume
    latest = latest_checkpoint(Path(cfg.out), comm)
    return "" if latest is None else str(latest)  # "": said once OUT is taken (`_open_run`), or refused


def _resume(trainer: Trainer, cfg: TrainConfig, path: str) -> bool:
    """Continue from `path`, which must be before `max_iters` (a checkpoint is never rewritten
    in place); True when `--resume auto` finds the run already finished (its checkpoint at
    `max_iters`): a requeue of a job that completed is then a success with nothing to do,
    not an error that a scheduler would retry."""
    try:
        got = restore(trainer, path)
    except CheckpointError as e:  # a broken OUT/ckpt/latest of --resume auto names the intact step before it
        if cfg.resume == RESUME_AUTO and (hint := broken_latest(Path(path), e)):
            raise CheckpointError(hint) from None
        raise
    if cfg.resume == RESUME_AUTO and trainer.step == cfg.max_iters:
        log(f"--resume auto: {Path(path).resolve()} is at step {trainer.step} = --max-iters: "
            "the run is already finished, nothing to do")
        return True
    if trainer.step >= cfg.max_iters:
        where = "past" if trainer.step > cfg.max_iters else "already at"
        raise ConfigError(f"checkpoint {path} is at step {trainer.step}, {where} max_iters={cfg.max_iters}: "
                          "raise --max-iters to train further")
    for note in resume_notes(path, got, cfg):
        log(note)
    log(f"continuing from step {trainer.step} ({Path(path).resolve()})")
    return False


def _finished(cfg: TrainConfig, checkpoint: str) -> TrainResult:
    """The result of a run found already finished: no steps, its last logged losses."""
    last: dict[str, Any] = {}
    metrics = Path(cfg.out) / "metrics.jsonl"
    try:
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                last.update({k: v for k, v in json.loads(line).items() if k in ("loss", "val_loss")})
    except OSError:  # metrics are a report only: the checkpoint says the run is done
        pass
    return TrainResult(steps=0, final_loss=float(last.get("loss", math.nan)), final_val_loss=last.get("val_loss"),
                       seconds=0.0, checkpoint=checkpoint, metrics=str(metrics))


def _open_run(trainer: Trainer, cfg: TrainConfig, resume: str) -> RunDir:
    """Lock OUT, refuse to reuse a run unless resuming (from `resume`) or overwriting, check
    room for a checkpoint. `--resume auto` without a checkpoint starts over: what a first
    attempt that died before its first checkpoint left in OUT goes, if it logged no step or
    ran with the same settings (else a one-line refusal naming them)."""
    # params and the most state values any rule keeps per value (AdamW: both moments)
    ckpt_bytes = (1 + max(trainer.optimizer.state_per_value)) * trainer.n_params * np.dtype(trainer.dtype).itemsize
    fresh = cfg.resume == RESUME_AUTO and not resume
    redo = fresh and not cfg.overwrite
    run = RunDir(Path(cfg.out), trainer.mesh.world, resume or None, cfg.overwrite or redo, ckpt_bytes,
                 trainer.record, resume_step=trainer.step,
                 redo=(lambda recorded: setting_differences(recorded, cfg)) if redo else None)
    if fresh:
        log(f"--resume auto: no checkpoint in {Path(cfg.out) / 'ckpt'}, starting at step 0")
    return run


def _attach_observers(trainer: Trainer, out: Path) -> FlightRecorder | FaultInjector | None:
    """The flight recorder (numesh/observe/flight.py; with --collective-timeout on a multi-rank
    mesh) and NUMESH_INJECT's faults for this rank (numesh/observe/inject.py), attached to the
    mesh; None, and nothing attached, when both are off. Collective."""
    mesh, timeout = trainer.mesh, trainer.cfg.collective_timeout
    inject = FaultInjector(faults_from_env(mesh.world.Get_size()), mesh.world.Get_rank(), mesh)
    inject = inject if inject else None
    if timeout > 0 and mesh.world.Get_size() > 1:
        observer = FlightRecorder(mesh, out / "flight", timeout, inject)  # it runs the injector first
    elif inject is not None:
        observer = inject
    else:
        return None
    attach(mesh, observer)
    return observer


def _finish_observing(trainer: Trainer, out: Path, observer: FlightRecorder | FaultInjector | None,
                      observed_before: Any) -> None:
    """A run that ended in order (collective): the trace written (every rank's events to
    rank 0, one file), the observers detached, the flight files removed."""
    if trainer.trace is not None:
        trainer.trace.write(out / "trace.json", trainer.trace_meta)
    trainer.mesh.observer = observed_before
    if observer is not None:
        observer.close()


def train(
    cfg: TrainConfig,
    comm: MPI.Comm | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Train as `cfg` says, from scratch or from `cfg.resume` (a checkpoint of any mesh, or
    `auto`: OUT/ckpt/latest if there is one);
    writes OUT/config.json, OUT/metrics.jsonl and checkpoints OUT/ckpt/step_NNNNNN (every
    `ckpt_interval` steps and at the end) with OUT/ckpt/latest pointing at the newest."""
    trainer = Trainer(cfg, comm)
    kernels.warm_up(trainer.dtype)  # compiled before any collective has a deadline
    if trainer.model.norm == "rmsnorm" or trainer.model.mlp == "swiglu" or trainer.model.positions == "rotary":
        llama_kernels.warm_up(trainer.dtype)  # the Llama parts' kernels, when the model has them
    _check_hosts(trainer.mesh.world, Path(cfg.out))
    if not cfg.mesh and trainer.mesh.world.Get_size() > 1:
        log(f"mesh: dp={trainer.mesh.world.Get_size()} (no --mesh given: every rank on dp)")
    if resume := _resume_from(cfg, trainer.mesh.world):
        if _resume(trainer, cfg, resume):
            return _finished(cfg, resume)
    start = trainer.step
    run = _open_run(trainer, cfg, resume)  # before the peak is measured: a refused --out is said at once, and first
    try:
        peak = _announce(trainer)
        # a run continued from OUT's own checkpoint has its first step saved already: a
        # signal before that step needs no second copy (a checkpoint is never rewritten)
        own = bool(resume) and Path(resume).resolve().parent == (Path(cfg.out) / RUN_CKPT).resolve()
        return _locked_run(trainer, run, start, peak, on_step, start if own else None)
    finally:
        # the lock goes last: until the final checkpoint and trace are written, another run
        # taking OUT (a resume, an --overwrite) would write or remove files under this one
        run.close()


def _agreement(mesh: Mesh) -> Callable[[np.ndarray], None]:
    """The interrupt watch's per-step all-reduce as the mesh's other collectives run it:
    through the flight recorder, so its collective timeout holds there too. A blocking
    Allreduce outside it hung a tp=2 job for good when its peer was kill -STOPped at a step
    boundary (tests/test_flight.py::test_a_stopped_rank_is_named, once in a CI run)."""
    def agree(flag: np.ndarray) -> None:
        pmax(flag.copy(), mesh, AXES, out=flag)

    return agree


def _locked_run(trainer: Trainer, run: RunDir, start: int, peak: float,
                on_step: Callable[[int, dict], None] | None, saved_at: int | None = None) -> TrainResult:
    """`train` from its first step on, in the run directory `run` it holds (`saved_at`:
    `start` when OUT holds that step's checkpoint already)."""
    cfg, out = trainer.cfg, Path(trainer.cfg.out)
    observed_before = trainer.mesh.observer
    observer = _attach_observers(trainer, out)
    if cfg.trace:  # after the flight recorder: its wait, first in the chain, polls with a deadline
        trainer.start_trace(peak, out / PARTS_DIR)
    t_start = time.perf_counter()
    # Ctrl-C or a --save-on-signal signal: every rank stops at one step (numesh/interrupt.py)
    watch = InterruptWatch(trainer.mesh.world, signals=parse_signals(cfg.save_on_signal),
                           agree=_agreement(trainer.mesh)).start()
    saves = AsyncCheckpoints(trainer.mesh.world) if cfg.ckpt_async else None
    try:
        last, saved_at = _run_steps(trainer, start, run, watch, observer, peak, on_step, saves, saved_at)
    except Interrupted:  # any save in flight was finished first (stop_interrupted)
        with watch.saving():  # every rank stopped at the same step: an orderly end, its files as after a clean one
            _finish_observing(trainer, out, observer, observed_before)
        raise
    except BaseException as e:
        if saves is not None:
            saves.abandon()  # no collective while an error unwinds: latest stays where it was
        if isinstance(observer, FlightRecorder) and isinstance(e, Exception):
            observer.after_error(e)  # ends the job with the diagnosis when a collective fault caused the error
        raise
    finally:
        run.close_metrics()
        watch.stop()  # the caller's signal handlers again
    if saves is not None:
        saves.wait()  # the end of the run waits for the save in flight
    if saved_at != trainer.step:
        save_step(trainer, out, cfg.keep)
    _finish_observing(trainer, out, observer, observed_before)
    return TrainResult(
        steps=cfg.max_iters - start,
        final_loss=float(last.get("loss", math.nan)),
        final_val_loss=last.get("val_loss"),
        seconds=time.perf_counter() - t_start,
        checkpoint=str(out / RUN_CKPT / LATEST),
        metrics=str(out / "metrics.jsonl"),
    )


def _announce(trainer: Trainer) -> float:
    """Log the dp hint (when it applies) and MFU's peak, measured here (collective); return the peak."""
    cfg = trainer.cfg
    if hint := dp_hint(trainer.mesh.world.Get_size(), threads(), cfg.batch_size, cfg.micro_batches):
        log(hint)
    for line in trainer.optimizer_groups():  # which rule updates which leaves, declared once by the optimiser
        log(line)
    peak, source = job_peak_flops(trainer)  # MFU's denominator (docs/observability.md)
    log(f"MFU peak: {peak / 1e9:.1f} GFLOP/s ({source})")
    return peak


def _run_steps(trainer: Trainer, start: int, run: RunDir, watch: InterruptWatch,
               observer: FlightRecorder | FaultInjector | None, peak: float,
               on_step: Callable[[int, dict], None] | None,
               saves: AsyncCheckpoints | None = None, saved_at: int | None = None) -> tuple[dict[str, Any], int | None]:
    """Steps `start` .. max_iters (the last one only evaluates), each written to `run`'s
    metrics, with the periodic checkpoints (with `saves`, written in the background and
    finished at the first step boundary every rank's writer is done): (the latest value of
    every metric, the step last saved or None)."""
    cfg, out = trainer.cfg, Path(trainer.cfg.out)
    last: dict[str, Any] = {}
    for step in range(start, cfg.max_iters + 1):
        if signum := watch.requested():  # one-value all-reduce: did any rank get a signal?
            stop_interrupted(trainer, watch, signum, out, saved_at, saves)
        if saves is not None:
            saves.poll()  # latest moves once every rank's files of the save in flight are written
        if observer is not None:
            observer.on_step(step)  # the step the flight records and NUMESH_INJECT's faults wait for
        try:
            with np.errstate(all="ignore"):  # a non-finite step is caught below, with one message
                record = _step_record(trainer, step, peak)
        except Diverged as d:
            run.write({"step": step, "loss": d.loss, "grad_norm": d.norm, "diverged": True})
            raise _diverged(d, cfg, out) from None
        if record:
            last.update(record)
            run.write(record)
            if on_step is not None:
                on_step(step, record)
        if cfg.ckpt_interval and step < cfg.max_iters and trainer.step % cfg.ckpt_interval == 0:
            save_step(trainer, out, cfg.keep, saves)
            saved_at = trainer.step
    return last, saved_at
