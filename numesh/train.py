"""The training loop, as a library function over an attrs config.

Every rank runs the same loop on its shard of the mesh: draw its rows of the step's
global batch (with cp, its two chunks of each row's tokens), accumulate gradients over
micro-batches, sum them over dp and cp, clip by the
true global norm, take an AdamW step. Losses are means over the whole global batch, so
the logged numbers are the same on every mesh.
"""

from __future__ import annotations

import functools
import math
import time
import tomllib
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np
from mpi4py import MPI

from numesh import data as D
from numesh import formulas, kernels
from numesh.checkpoint import TrainState, read_local_state, save_checkpoint, unpad_vocab
from numesh.checkpoint.format import step_dir_name
from numesh.errors import ConfigError, Interrupted
from numesh.interrupt import InterruptWatch
from numesh.mesh import Mesh, parse_mesh, psum_scalar, unshard
from numesh.nn.dropout import DropoutKey
from numesh.nn.gpt import GPT, GPTConfig, gpt_global_shapes, gpt_specs, init_gpt
from numesh.nn.units import OUTER, join_units, sequence_partial_leaves, split_units
from numesh.nn.walk import check_recompute
from numesh.observe import attach
from numesh.observe.flight import FlightRecorder
from numesh.observe.inject import FaultInjector, faults_from_env
from numesh.observe.trace import Tracer
from numesh.optim import AdamWConfig, clip_scale, cosine_lr
from numesh.optim.zero import ZeroOptimizer
from numesh.pipeline.executor import PipelineExecutor, StepStats
from numesh.pipeline.schedules import make_schedule
from numesh.pipeline.stages import StageLayout, gather_stages, stage_tree
from numesh.rundir import RunDir
from numesh.runtime import dp_hint, log, rank_peak_flops
from numesh.threads import threads
from numesh.tree import tree_leaves, tree_map

DTYPES = {"float32": np.float32, "float64": np.float64}


def _field(default: Any, help: str) -> Any:
    return attrs.field(default=default, metadata={"help": help})


@attrs.frozen
class TrainConfig:
    """Every knob of a training run; defaults are nanoGPT's Shakespeare-char CPU quick start."""

    # model
    n_layer: int = _field(4, "transformer blocks")
    n_head: int = _field(4, "attention heads (divisible by tp)")
    n_embd: int = _field(128, "embedding width (divisible by n_head)")
    block_size: int = _field(64, "context length in tokens")
    dropout: float = _field(0.0, "dropout probability")
    bias: bool = _field(False, "biases in Linear and LayerNorm layers")
    # optimisation
    batch_size: int = _field(12, "global batch in sequences per optimiser step, whatever the mesh")
    micro_batches: int = _field(1, "gradient-accumulation micro-batches per dp rank and step")
    max_iters: int = _field(2000, "optimiser steps")
    learning_rate: float = _field(1e-3, "peak learning rate")
    min_lr: float = _field(1e-4, "learning rate at the end of the cosine decay")
    warmup_iters: int = _field(100, "linear warmup steps")
    lr_decay_iters: int = _field(2000, "step at which the cosine decay reaches min_lr")
    weight_decay: float = _field(0.1, "AdamW weight decay (matrices and embeddings only)")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: float = _field(0.99, "AdamW beta2")
    grad_clip: float = _field(1.0, "clip gradients to this global norm (0 = off)")
    # data parallelism
    zero: int = _field(0, "ZeRO stage over dp: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters")
    bucket_mb: float = _field(1.0, "MiB per gradient all-reduce bucket (ZeRO 0); reduction starts during backward")
    overlap: bool = _field(True, "overlap gradient reduction with backward (off: reduce each bucket at once)")
    # pipeline parallelism
    schedule: str = _field(
        "1f1b", "pipeline schedule: gpipe, 1f1b, interleaved or zb-h1 (micro-batches = --micro-batches)")
    virtual_stages: int = _field(1, "model chunks per pp rank (interleaved schedule)")
    # tensor parallelism
    sequence_parallel: bool = _field(
        False, "Megatron sequence parallelism: LayerNorm, dropout and the residual stream split over the sequence "
        "across tp (needs tp > 1 and block_size divisible by tp); activations per rank shrink, bytes stay")
    # activation memory
    recompute: str = _field(
        "none", "activation recomputation: none; selective (the attention core's T×T softmax and dropout mask "
        "recomputed in backward); full (each block rerun from its input in backward)")
    # evaluation and logging
    eval_interval: int = _field(250, "evaluate train/val loss every this many steps")
    eval_iters: int = _field(20, "batches per split and evaluation")
    log_interval: int = _field(1, "write a metrics line every this many steps")
    # run
    data: str = _field("data/shakespeare_char", "dataset directory written by `numesh data`")
    out: str = _field("runs/shakespeare_char", "output directory: config.json, metrics.jsonl, ckpt/")
    mesh: str = _field(
        "", "process mesh over pp, dp, cp, tp, e.g. dp=2,tp=2 or cp=2 (omitted axes = 1, one axis may be -1)")
    seed: int = _field(1337, "seed of the initial parameters, data order and dropout")
    dtype: str = _field("float32", "float32 or float64")
    # checkpoints
    ckpt_interval: int = _field(0, "save a checkpoint every N steps; 0 = only at the end")
    keep: int = _field(0, "keep the N newest checkpoints; 0 = all")
    resume: str = _field("", "checkpoint to continue from (written on any mesh), e.g. OUT/ckpt/latest")
    overwrite: bool = _field(False, "replace a run already in --out (its config, metrics and checkpoints)")
    # divergence
    on_nan: str = _field("stop", "a non-finite loss or gradient norm: stop, or skip the step (no update)")
    max_skips: int = _field(10, "with --on-nan skip: stop after this many skipped steps")
    # hangs
    collective_timeout: float = _field(
        300.0, "seconds one collective may wait before the job dumps every rank's recent calls to OUT/flight, "
        "names the stuck rank and exits 3 (multi-rank runs); 0 = off")
    # observability
    trace: bool = _field(
        False, "write OUT/trace.json (Chrome trace events: open in Perfetto) and print `numesh report OUT`")
    peak_flops: float = _field(
        0.0, "peak FLOP/s of all the job's cores together, MFU's denominator; 0 = measure it at start-up "
        "(the model's own GEMM shapes and a large GEMM, on every rank at once)")

    def model(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(
            vocab_size=vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            bias=self.bias,
        )


def config_from(overrides: dict[str, Any], toml_path: str | Path | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then `overrides` (None values are ignored)."""
    fields = {f.name: f for f in attrs.fields(TrainConfig)}
    values: dict[str, Any] = {}
    if toml_path is not None:
        path = Path(toml_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            loaded = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        for key, value in loaded.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"unknown config key '{key}' in {path}: the keys are {', '.join(fields)}")
            values[name] = value
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"unknown config key '{key}': the keys are {', '.join(fields)}")
        if value is not None:
            values[key] = value
    for name, value in values.items():
        want = fields[name].type
        want = {"int": int, "float": float, "bool": bool, "str": str}.get(want, want) if isinstance(want, str) else want
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif not isinstance(values[name], want) or (want is int and isinstance(value, bool)):
            raise ConfigError(f"config key '{name}' must be {want.__name__}, got {value!r}")
    return TrainConfig(**values)


def validate(cfg: TrainConfig, n_ranks: int) -> tuple[dict[str, int], GPTConfig]:
    """Every check that can fail, run identically on every rank before any collective."""
    check_options(cfg, n_ranks)
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ConfigError(f"--out {cfg.out} is a file, not a directory: name a directory for the run")
    tok = D.load_tokenizer(cfg.data)
    for split in D.SPLITS:
        n = len(D.load_split(cfg.data, split))
        if n <= cfg.block_size:
            raise ConfigError(f"block_size={cfg.block_size} is larger than the {n}-token {split} split: "
                              "use a smaller --block-size")
    shape, model = check_layout(cfg, n_ranks, tok.vocab_size)
    faults_from_env(n_ranks)  # NUMESH_INJECT: a bad spec is this one-line error on every rank
    return shape, model


def check_options(cfg: TrainConfig, n_ranks: int) -> None:
    """The checks of single options (no dataset, no layout)."""
    parse_mesh(cfg.mesh, n_ranks)
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got '{cfg.dtype}'")
    for name in ("batch_size", "micro_batches", "eval_interval", "eval_iters", "log_interval"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3, got {cfg.zero}")
    if cfg.bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be > 0, got {cfg.bucket_mb}")
    check_recompute(cfg.recompute)
    if cfg.on_nan not in ("stop", "skip"):
        raise ConfigError(f"--on-nan must be stop or skip, got '{cfg.on_nan}'")
    for name in ("max_iters", "seed", "warmup_iters", "lr_decay_iters", "min_lr", "weight_decay", "grad_clip",
                 "ckpt_interval", "keep", "max_skips", "collective_timeout"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.peak_flops < 0:
        raise ConfigError(f"--peak-flops must be >= 0 (0 = measure it), got {cfg.peak_flops}")
    if not cfg.learning_rate > 0:
        raise ConfigError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {getattr(cfg, name)}")


def check_layout(cfg: TrainConfig, n_ranks: int, vocab_size: int) -> tuple[dict[str, int], GPTConfig]:
    """The checks of the parallel layout (mesh, micro-batches, model shape, pipeline) for a
    model of `vocab_size` tokens: no dataset needed, so `numesh plan` asks the same."""
    check_options(cfg, n_ranks)
    shape = parse_mesh(cfg.mesh, n_ranks)
    if shape["cp"] > 1 and cfg.block_size % (2 * shape["cp"]):
        raise ConfigError(
            f"block_size={cfg.block_size} does not split into 2*cp={2 * shape['cp']} equal chunks "
            f"(context parallelism's load balance): "
            f"use a --block-size that is a multiple of {2 * shape['cp']} or a smaller cp"
        )
    if shape["cp"] > 1 and cfg.sequence_parallel and cfg.block_size % (shape["cp"] * shape["tp"]):
        raise ConfigError(f"--sequence-parallel with cp splits a cp rank's block_size/cp tokens over tp: use a "
                          f"--block-size that is a multiple of cp*tp={shape['cp'] * shape['tp']}")
    if cfg.batch_size % (shape["dp"] * cfg.micro_batches):
        raise ConfigError(
            f"batch_size {cfg.batch_size} is not divisible by dp={shape['dp']} x micro_batches={cfg.micro_batches}: "
            f"use a multiple of {shape['dp'] * cfg.micro_batches}"
        )
    if cfg.sequence_parallel and shape["tp"] == 1:
        raise ConfigError("--sequence-parallel splits the sequence over tp, which is 1 in this mesh: "
                          "add tp=N (N > 1) to --mesh or drop --sequence-parallel")
    if cfg.sequence_parallel and cfg.block_size % shape["tp"]:
        raise ConfigError(f"--sequence-parallel splits the block_size={cfg.block_size} tokens over tp={shape['tp']}: "
                          f"use a --block-size divisible by {shape['tp']}")
    model = cfg.model(vocab_size)
    model.validate(shape["tp"])
    StageLayout(model.n_layer, shape["pp"], cfg.virtual_stages)
    _check_schedule(cfg.schedule, shape["pp"], cfg.micro_batches, cfg.virtual_stages)
    return shape, model


@functools.lru_cache(maxsize=4096)
def _check_schedule(name: str, pp: int, micro_batches: int, virtual_stages: int) -> None:
    """`make_schedule` builds and validates it or raises; remembered when it passes (only that:
    no schedule is kept). `numesh plan` asks about the same shape for every ZeRO stage, cp, sp
    and recompute setting, and rebuilding it each time was a large share of a big plan
    (`python -m cProfile -s cumtime -m numesh_cli.app plan --model gpt3-175b --ranks 1024
    --hardware a100-80gb` shows where a plan's time goes)."""
    make_schedule(name, pp, micro_batches, virtual_stages)


class Diverged(ConfigError):
    """A step's loss or gradient norm is not finite (the same on every rank)."""

    def __init__(self, step: int, loss: float, norm: float, skipped: int):
        self.step, self.loss, self.norm, self.skipped = step, loss, norm, skipped
        super().__init__(f"step {step}: loss {loss}, gradient norm {norm}")


def flops_per_token(model: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention (PaLM's appendix B)."""
    return formulas.flops_per_token(model.n_layer, model.n_embd, model.block_size, n_params)


class Trainer:
    """The state of one training run on one rank: mesh, model, ZeRO optimiser, data."""

    def __init__(self, cfg: TrainConfig, comm: MPI.Comm | None = None):
        comm = MPI.COMM_WORLD if comm is None else comm
        shape, self.model = validate(cfg, comm.Get_size())
        self.cfg = cfg
        self.mesh = Mesh(shape, comm, cfg.sequence_parallel)
        self.dtype = DTYPES[cfg.dtype]
        pp_rank = self.mesh.index("pp")
        self.layout = StageLayout(self.model.n_layer, shape["pp"], cfg.virtual_stages)
        self.schedule = make_schedule(cfg.schedule, shape["pp"], cfg.micro_batches, cfg.virtual_stages)
        self.specs = stage_tree(gpt_specs(self.model), self.layout, pp_rank)
        adamw = AdamWConfig(cfg.beta1, cfg.beta2, 1e-8, cfg.weight_decay)
        params = stage_tree(init_gpt(self.model, self.mesh, cfg.seed, self.dtype), self.layout, pp_rank)
        tied_copy = shape["pp"] > 1 and self.layout.is_last(pp_rank)  # counted on the first rank
        units = split_units(params)
        self.opt = ZeroOptimizer(
            units, split_units(self.specs), self.mesh, cfg.zero, adamw,
            bucket_bytes=int(cfg.bucket_mb * 2**20), overlap=cfg.overlap,
            uncounted={(OUTER, "wte")} if tied_copy else (),
            tp_partial=sequence_partial_leaves(units) if cfg.sequence_parallel else (),  # LayerNorm grads under sp
        )
        self.opt.check_replicas()
        self.pipeline = PipelineExecutor(self.model, self.mesh, self.layout, self.opt, self.dtype, cfg.recompute)
        self.last_stats: StepStats | None = None
        self.train_data = D.load_split(cfg.data, "train")
        self.val_data = D.load_split(cfg.data, "val")
        self.step = 0
        self.skipped = 0  # steps not applied because their loss or gradient was not finite
        self.n_params = sum(math.prod(s) for s in tree_leaves(gpt_global_shapes(self.model)))
        self.trace: Tracer | None = None  # set by `start_trace`

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

    def _micro_batches(self, data: np.ndarray, key: tuple[int, ...], count: int) -> list:
        c, mesh = self.cfg, self.mesh
        return D.local_batch(data, key, c.batch_size, c.block_size, mesh.index("dp"), mesh.size("dp"), count,
                             mesh.index("cp"), mesh.size("cp"))

    def train_step(self) -> tuple[float, float, float]:
        """One optimiser step on the global batch of `self.step`: (loss, grad norm, lr)."""
        c, mesh, tr = self.cfg, self.mesh, self.trace
        t_step = time.perf_counter()
        micro = self._micro_batches(self.train_data, D.train_key(c.seed, self.step), c.micro_batches)
        if tr is not None:
            tr.step = self.step
            tr.span("data", "data", t_step)
        rows = micro[0][0].shape[0]
        drops = [
            DropoutKey(c.dropout, c.seed, self.step, (mesh.index("dp") * len(micro) + m) * rows, c.batch_size)
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
            tr.span(f"step {self.step}", "step", t_step, None, {"step": self.step})
        self.step += 1
        return loss, norm, lr

    def evaluate(self) -> dict[str, float]:
        """Mean loss over `eval_iters` fixed batches of each split (the same on every mesh)."""
        c, mesh = self.cfg, self.mesh
        out = {}
        t0 = time.perf_counter()
        for split, data in (("train", self.train_data), ("val", self.val_data)):
            batches = [self._micro_batches(data, D.eval_key(c.seed, split, i), 1)[0] for i in range(c.eval_iters)]
            total = self.pipeline.forward_losses(batches)
            total = psum_scalar(total, mesh, formulas.loss_axes(mesh.shape))
            out[f"{split}_loss"] = total / (c.eval_iters * self.tokens_per_step)
        if self.trace is not None:
            self.trace.span("evaluate", "eval", t0, None, {"step": self.step})
        return out

    def start_trace(self, peak_flops: float) -> Tracer:
        """Trace this rank from now on (collective: aligns the clocks of every rank); what
        the report needs to compute the formulas goes in the trace's metadata."""
        tr = Tracer(self.mesh)
        attach(self.mesh, tr)  # chained after any observer already there (the flight recorder)
        self.trace = self.pipeline.trace = tr
        c, shape, pp_rank = self.cfg, self.mesh.shape, self.mesh.index("pp")
        units = self.opt.units
        itemsize = np.dtype(self.dtype).itemsize
        holds_tied = shape["pp"] > 1 and pp_rank in (0, shape["pp"] - 1)
        tr.meta = {
            "chunks": [attrs.asdict(formulas.Chunk(len(s.blocks), s.first, s.last)) for s in self.pipeline.stages],
            "padded_blocks": sum(u.padded for k, u in units.items() if not k.is_outer),
            "padded_outer": units[OUTER].padded,
            "tied_bytes": (self.model.padded_vocab(shape["tp"]) // shape["tp"] * self.model.n_embd * itemsize
                           if holds_tied else 0),
            "tp_partial_values": self.opt.tp_partial_values,
        }
        self.trace_meta = {
            "mesh": dict(shape), "schedule": c.schedule, "micro_batches": c.micro_batches,
            "virtual_stages": c.virtual_stages, "zero": c.zero, "sequence_parallel": c.sequence_parallel,
            "recompute": c.recompute, "dtype": c.dtype, "itemsize": itemsize, "batch_size": c.batch_size,
            "block_size": c.block_size,
            "n_layer": self.model.n_layer, "n_embd": self.model.n_embd, "n_params": self.n_params,
            "rows_per_micro_batch": c.batch_size // (shape["dp"] * c.micro_batches),
            "tokens_per_step": self.tokens_per_step, "flops_per_token": flops_per_token(self.model, self.n_params),
            "peak_flops": peak_flops,
        }
        return tr

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
    try:
        tokenizer = D.load_tokenizer(c.data).to_meta()
    except (D.DataError, OSError):
        tokenizer = None
    return TrainState(
        mesh=trainer.mesh, model=trainer.model, layout=trainer.layout,
        trees={g: join_units(t) for g, t in trainer.opt.state_trees().items()},
        step=trainer.step, opt_step=trainer.opt.adam_step, dtype=c.dtype, seed=c.seed,
        run_config=attrs.asdict(c), tokenizer=tokenizer,
    )


def restore(trainer: Trainer, path: str | Path) -> None:
    """Set the trainer's parameters, AdamW moments and steps from a checkpoint written on
    any mesh (collective; on error every rank raises and the trainer is unchanged). A
    checkpoint trained on another vocabulary than the run's dataset is refused."""
    try:
        tokenizer = D.load_tokenizer(trainer.cfg.data)  # read by validate() a moment ago
    except (D.DataError, OSError):
        tokenizer = None  # as in train_state; a rank that cannot check still joins the collective read
    got = read_local_state(path, trainer.mesh, trainer.model, trainer.layout, trainer.dtype,
                           tokenizer, f"dataset {trainer.cfg.data}")
    trainer.opt.load_state_trees({g: split_units(t) for g, t in got.trees.items()}, got.opt_step)
    trainer.step = got.step


def save_final(trainer: Trainer, out_dir: Path, keep: int = 0) -> Path:
    """Write a sharded checkpoint of the trainer's current step to OUT/ckpt/step_NNNNNN and
    point OUT/ckpt/latest at it (collective; see numesh.checkpoint). A state with a
    non-finite value is refused on every rank: it never becomes `latest` or prunes a good one."""
    t0 = time.perf_counter()
    state = train_state(trainer)
    bad = sum(int(not np.isfinite(x).all()) for t in state.trees.values() for x in tree_leaves(t))
    if psum_scalar(bad, trainer.mesh, ("pp", "dp", "cp", "tp")):
        raise ConfigError(f"not saving step {trainer.step}: its parameters or optimiser state are not finite")
    path = save_checkpoint(state, out_dir, keep=keep or None)
    if trainer.trace is not None:
        trainer.trace.span("checkpoint", "checkpoint", t0, None, {"step": trainer.step})
    return path


def stop_interrupted(trainer: Trainer, watch: InterruptWatch, signum: int, out: Path, saved_at: int | None) -> None:
    """Some rank got SIGINT/SIGTERM and every rank is here at the same step boundary: save
    this step's checkpoint if the run saves them (unless it was just saved), then raise
    `Interrupted` (collective)."""
    c, path, why_not = trainer.cfg, None, " (--ckpt-interval is 0)"
    if c.ckpt_interval:
        if saved_at == trainer.step:
            path = out / "ckpt" / step_dir_name(trainer.step)
        else:
            with watch.saving():  # the watchdog allows the save more time than a step
                path = save_final(trainer, out, c.keep)
    raise Interrupted(trainer.step, signum, None if path is None else str(path), why_not)


@attrs.frozen
class TrainResult:
    steps: int
    final_loss: float
    final_val_loss: float | None
    seconds: float
    checkpoint: str
    metrics: str


def job_peak_flops(trainer: Trainer) -> tuple[float, str]:
    """MFU's denominator for the whole job and where it came from: --peak-flops, or the sum
    over ranks of each rank's matmul peak measured with every rank measuring at once (so
    ranks sharing a node share it as in training). Collective."""
    c, mesh = trainer.cfg, trainer.mesh
    if c.peak_flops > 0:
        return c.peak_flops, "--peak-flops"
    tp = mesh.size("tp")
    rows = max(1, c.batch_size // (mesh.size("dp") * c.micro_batches)) * (c.block_size // mesh.size("cp"))
    shapes = formulas.model_gemm_shapes(rows, c.n_embd, trainer.model.padded_vocab(tp) // tp, tp)
    mesh.world.Barrier()
    mine = rank_peak_flops(shapes, trainer.dtype)
    total = psum_scalar(mine["peak"], mesh, ("pp", "dp", "cp", "tp"))
    model = psum_scalar(mine["model"], mesh, ("pp", "dp", "cp", "tp"))
    return total, (f"measured on {mesh.world.Get_size()} rank(s) at once; "
                   f"the model's GEMMs reach {model / 1e9:.1f} GFLOP/s")


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
                          mfu=formulas.mfu(achieved, peak_flops))
    return {"step": step, **record} if record else record


def _last_checkpoint(out: Path) -> str:
    latest = out / "ckpt" / "latest"
    return str(latest.resolve()) if latest.exists() else "none (set --ckpt-interval to save during a run)"


def _diverged(d: Diverged, cfg: TrainConfig, out: Path) -> ConfigError:
    how = "--on-nan skip skips such steps" if cfg.on_nan == "stop" else f"{d.skipped} steps skipped, over --max-skips"
    return ConfigError(
        f"training diverged at step {d.step} (loss {d.loss}, gradient norm {d.norm}; {how}); "
        f"last good checkpoint: {_last_checkpoint(out)}"
    )


def _resume(trainer: Trainer, cfg: TrainConfig) -> None:
    """Continue from `cfg.resume`, which must be before `max_iters` (a checkpoint is never rewritten in place)."""
    restore(trainer, cfg.resume)
    if trainer.step >= cfg.max_iters:
        where = "past" if trainer.step > cfg.max_iters else "already at"
        raise ConfigError(f"checkpoint {cfg.resume} is at step {trainer.step}, {where} max_iters={cfg.max_iters}: "
                          "raise --max-iters to train further")


def _open_run(trainer: Trainer, cfg: TrainConfig) -> RunDir:
    """Lock OUT, refuse to reuse a run unless resuming or overwriting, check room for a checkpoint."""
    ckpt_bytes = 3 * trainer.n_params * np.dtype(trainer.dtype).itemsize  # params and both moments
    return RunDir(Path(cfg.out), trainer.mesh.world, bool(cfg.resume), cfg.overwrite, ckpt_bytes, attrs.asdict(cfg))


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


def train(
    cfg: TrainConfig,
    comm: MPI.Comm | None = None,
    on_step: Callable[[int, dict], None] | None = None,
) -> TrainResult:
    """Train as `cfg` says, from scratch or from `cfg.resume` (a checkpoint of any mesh);
    writes OUT/config.json, OUT/metrics.jsonl and checkpoints OUT/ckpt/step_NNNNNN (every
    `ckpt_interval` steps and at the end) with OUT/ckpt/latest pointing at the newest."""
    trainer = Trainer(cfg, comm)
    kernels.warm_up(trainer.dtype)  # compiled before any collective has a deadline
    if cfg.resume:
        _resume(trainer, cfg)
    start, out = trainer.step, Path(cfg.out)
    if hint := dp_hint(trainer.mesh.world.Get_size(), threads(), cfg.batch_size, cfg.micro_batches):
        log(hint)
    peak, source = job_peak_flops(trainer)  # MFU's denominator (see README)
    log(f"MFU peak: {peak / 1e9:.1f} GFLOP/s ({source})")
    run = _open_run(trainer, cfg)
    observed_before = trainer.mesh.observer
    observer = _attach_observers(trainer, out)
    if cfg.trace:  # after the flight recorder: its wait, first in the chain, polls with a deadline
        trainer.start_trace(peak)
    last: dict[str, Any] = {}
    saved_at = None
    t_start = time.perf_counter()
    watch = InterruptWatch(trainer.mesh.world).start()  # Ctrl-C: every rank stops at one step (numesh/interrupt.py)
    try:
        for step in range(start, cfg.max_iters + 1):
            if signum := watch.requested():  # one-value all-reduce: did any rank get SIGINT/SIGTERM?
                stop_interrupted(trainer, watch, signum, out, saved_at)
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
                save_final(trainer, out, cfg.keep)
                saved_at = trainer.step
    finally:
        run.close()
        watch.stop()  # the caller's signal handlers again
    if saved_at != trainer.step:
        save_final(trainer, out, cfg.keep)
    if trainer.trace is not None:  # every rank's events to rank 0, one file (collective)
        trainer.trace.write(out / "trace.json", trainer.trace_meta)
    trainer.mesh.observer = observed_before
    if observer is not None:
        observer.close()  # a clean end: the flight files go
    return TrainResult(
        steps=cfg.max_iters - start,
        final_loss=float(last.get("loss", math.nan)),
        final_val_loss=last.get("val_loss"),
        seconds=time.perf_counter() - t_start,
        checkpoint=str(out / "ckpt" / "latest"),
        metrics=str(out / "metrics.jsonl"),
    )
