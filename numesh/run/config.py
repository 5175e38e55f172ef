"""A training run's configuration: `TrainConfig` (every knob of `numesh train`), reading it
from options and a TOML file (`config_from`), and its validation, one pass run identically
on every rank before any collective (`validate`; `check_layout`, its dataset-free half, is
what `numesh plan` asks of each layout it lists).

The CLI's options are the fields, `_` spelled `-`; each field's help is the option's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import ConfigError, check_finite, field_type, option_value
from numesh.base.files import read_user_file
from numesh.base.flags import flag, flag_value
from numesh.checkpoint.format import LATEST, RUN_CKPT
from numesh.checkpoint.hf_llama import conflicts, is_pretrained_dir, model_type, pretrained
from numesh.checkpoint.init_from import check_init_kind, check_not_checkpoint, start_dtype, start_vocab
from numesh.data.dataset import SPLITS, load_split, load_tokenizer
from numesh.host.startup_signals import DEFAULT_SAVE_SIGNALS, parse_signals
from numesh.mesh import parse_mesh
from numesh.nn.gpt import ARCHS, GPTConfig
from numesh.nn.walk import check_recompute
from numesh.observe.inject import faults_from_env
from numesh.optim.lr import DEFAULT_LEARNING_RATE
from numesh.optim.registry import OPTIONS, applies_to, run_optimizer
from numesh.pipeline.schedules import check_shape
from numesh.pipeline.stages import StageLayout

DTYPES = {"float32": np.float32, "float64": np.float64}
RESUME_AUTO = "auto"  # --resume auto: OUT/ckpt/latest if there is one (numesh.run.rundir.latest_checkpoint)
MESH_AUTO = "auto"  # --mesh auto: the planner's layout for the job's ranks (numesh.plan.auto, from the CLI)
# the options that make a layout, which the plan searches over (and each listed command sets)
LAYOUT_OPTIONS = ("mesh", "zero", "schedule", "micro_batches", "virtual_stages", "recompute", "sequence_parallel")
# options that change neither a step nor what metrics.jsonl logs of it: how the job runs and keeps its checkpoints
NOT_SETTINGS = (*LAYOUT_OPTIONS, "bucket_mb", "overlap", "resume", "overwrite", "ckpt_interval", "keep", "ckpt_async",
                "save_on_signal", "collective_timeout", "trace")


def _field(default: Any, help: str) -> Any:
    return attrs.field(default=default, metadata={"help": help})


@attrs.frozen
class TrainConfig:
    """Every knob of a training run; defaults are nanoGPT's Shakespeare-char CPU quick start.

    Each field is a `numesh train` option (`_` spelled `-`) and a key of its `--config` TOML
    file; its default and help text are the field's, and docs/options.md lists them all
    (written from these fields by `numesh.run.options`).
    """

    # model
    n_layer: int = _field(4, "transformer blocks")
    n_head: int = _field(4, "attention heads (divisible by tp)")
    n_embd: int = _field(128, "embedding width (divisible by n_head)")
    block_size: int = _field(64, "context length in tokens")
    dropout: float = _field(0.0, "dropout probability")
    bias: bool = _field(False, "biases in Linear and LayerNorm layers")
    moe_experts: int = _field(
        0, "mixture of experts: E expert MLPs and a router in the MoE blocks, split over the mesh axis ep; 0 = dense")
    moe_every: int = _field(1, "every N-th block is an MoE block (blocks 0, N, 2N, ...)")
    moe_top_k: int = _field(2, "experts per token, their router probabilities renormalised to sum to 1")
    moe_aux_coef: float = _field(1e-2, "coefficient of the Switch/GShard load-balancing loss (per sequence and block)")
    moe_z_coef: float = _field(0.0, "coefficient of the router z-loss (mean squared logsumexp of the router logits)")
    moe_capacity_factor: float = _field(
        0.0, "each expert takes at most ceil(c*T*k/E) token-assignments of each sequence, those of highest router "
        "probability, and drops the rest; 0 = dropless")
    arch: str = _field(
        "gpt2", "model kind: gpt2 (LayerNorm, learned positions, GELU MLP, head tied to the embedding) or llama "
        "(RMSNorm, rotary positions, SwiGLU MLP, untied head); sets --norm, --positions, --mlp and "
        "--tie-embeddings, each unless given")
    norm: str = _field("layernorm", "layernorm or rmsnorm; --arch sets it unless given")
    norm_eps: float = _field(1e-5, "the norm's epsilon (LayerNorm's is 1e-5, fixed by its kernel)")
    positions: str = _field(
        "learned", "learned (a block_size x n_embd table) or rotary (RoPE on q and k, transformers' rotate-half "
        "layout); --arch sets it unless given")
    rope_theta: float = _field(10000.0, "rotary positions' base theta")
    mlp: str = _field(
        "gelu", "gelu, or swiglu: silu(gate) * up, in the dense MLP and every expert; --arch sets it unless given")
    ffn_hidden: int = _field(
        0, "the MLP's (and each expert's) hidden size; 0 = 4*n_embd for gelu, 8*n_embd/3 rounded up to a multiple "
        "of 32 for swiglu")
    n_kv_head: int = _field(
        0, "key/value heads (grouped-query attention; must divide n_head; tp may exceed it when tp is a multiple "
        "of it); 0 = n_head")
    tie_embeddings: bool = _field(
        True, "the LM head is the token embedding, else its own matrix; --arch sets it unless given")
    # optimisation
    batch_size: int = _field(12, "global batch in sequences per optimiser step, whatever the mesh")
    micro_batches: int = _field(1, "gradient-accumulation micro-batches per dp rank and step")
    max_iters: int = _field(2000, "optimiser steps (0: evaluate the starting weights, e.g. --init-from's, and "
                                   "save them as a checkpoint)")
    learning_rate: float = _field(DEFAULT_LEARNING_RATE, "peak learning rate")
    min_lr: float = _field(1e-4, "learning rate at the end of the cosine decay; where not given and "
                                 "--learning-rate is lower, --learning-rate (no decay)")
    warmup_iters: int = _field(100, "linear warmup steps")
    lr_decay_iters: int = _field(
        2000, "step at which the cosine decay reaches min_lr (not before a --warmup-iters given)")
    weight_decay: float = _field(
        0.1, "decoupled weight decay: AdamW's (matrices and embeddings only) and Muon's (its matrices)")
    beta1: float = _field(0.9, "AdamW beta1")
    beta2: float = _field(0.99, "AdamW beta2")
    optimizer: str = _field(
        "adamw", "the optimiser: adamw, or muon (momentum orthogonalised by Newton-Schulz for the blocks' "
        "matrices, AdamW with --learning-rate, --beta1, --beta2 for the other leaves)")
    muon_lr: float = _field(0.0, "Muon's peak learning rate, on --learning-rate's schedule; 0 = --learning-rate")
    muon_momentum: float = _field(0.95, "Muon's momentum")
    muon_nesterov: bool = _field(True, "Muon's Nesterov momentum")
    muon_ns_steps: int = _field(5, "Muon's Newton-Schulz iterations (run in --dtype, not bfloat16 as in PyTorch)")
    muon_adjust_lr: str = _field(
        "match_rms_adamw", "Muon's learning rate per matrix (torch.optim.Muon's adjust_lr_fn): match_rms_adamw "
        "(0.2*sqrt(max(in, out)): AdamW's update size, so --learning-rate fits) or original (sqrt(max(1, out/in)))")
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
        "none", "activation recomputation: none, or full (each block rerun from its input in backward; keeps "
        "only the blocks' inputs)")
    # evaluation and logging
    eval_interval: int = _field(250, "evaluate train/val loss every this many steps")
    eval_iters: int = _field(20, "batches per split and evaluation")
    log_interval: int = _field(1, "write a metrics line every this many steps")
    # run
    data: str = _field("data/shakespeare_char", "dataset directory written by `numesh data`")
    out: str = _field("runs/shakespeare_char", "output directory: config.json, metrics.jsonl, ckpt/")
    mesh: str = _field(
        "", "process mesh over pp, dp, ep, cp, tp, e.g. dp=2,tp=2, cp=2 or ep=2 (omitted axes = 1, one axis may "
        "be -1; none given: every rank on dp); auto: the layout whose memory fits and whose step `numesh plan` "
        "predicts fastest on the job's ranks (options of the layout set to other than their defaults are kept)")
    seed: int = _field(1337, "seed of the initial parameters, data order and dropout")
    dtype: str = _field("float32", "float32 or float64; a resume continues in its checkpoint's unless --dtype "
                        "is given (a --config file's float32, the default every recipe lists, converts nothing)")
    # checkpoints
    ckpt_interval: int = _field(0, "save a checkpoint every N steps; 0 = only at the end")
    keep: int = _field(0, "keep the N newest checkpoints; 0 = all")
    ckpt_async: bool = _field(
        False, "write checkpoints on a background thread while training goes on (each rank copies its blocks "
        "at the step boundary); the next save and the end of the run wait for it, and latest moves only once "
        "every rank's files are written")
    resume: str = _field(
        "", "checkpoint to continue from (written on any mesh), e.g. OUT/ckpt/latest; auto: OUT/ckpt/latest if it "
        "exists, else start fresh, so one command line serves the first attempt and every requeue")
    init_from: str = _field(
        "", "start from these weights, fine-tuning: a Hugging Face transformers directory (Llama, Mistral or "
        "Mixtral: it sets the model options; GPT-2: the options must match it) or a `numesh export` file, with "
        "--data tokenised by its tokenizer")
    save_on_signal: str = _field(
        DEFAULT_SAVE_SIGNALS, "on these signals every rank saves a checkpoint at the next step boundary, whatever "
        "--ckpt-interval, and exits 75 (preempted: rerun with --resume auto); comma-separated names "
        "(HUP, INT, QUIT, TERM, USR1, USR2, XCPU), none = off")
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
        """The model these options describe: every `GPTConfig` field is a `TrainConfig` field of
        the same name (but the vocabulary, which the dataset gives), so a new model option is
        one field in each and nothing here."""
        return GPTConfig(vocab_size=vocab_size, **{f.name: getattr(self, f.name)
                                                   for f in attrs.fields(GPTConfig) if f.name != "vocab_size"})


def setting_differences(recorded: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """What `cfg` sets otherwise than the run whose config.json was `recorded`, as options:
    ["--max-iters 3 (it ran with --max-iters 6)"]; NOT_SETTINGS and keys only one side knows are left out."""
    now = attrs.asdict(cfg)
    return [f"{flag_value(k, now[k])} (it ran with {flag_value(k, v)})" for k, v in recorded.items()
            if k in now and k not in NOT_SETTINGS and v != now[k]]


# where config.json and a checkpoint's meta.json "train" list the hyper-parameters resumes
# changed: [{"step": 200, "learning_rate": [0.001, 0.0001]}, ...] (absent while none did)
CHANGES_KEY = "hyper_parameter_changes"
# the options of the learning-rate schedule and clipping, which every optimiser's steps read
STEP_OPTIONS = ("min_lr", "warmup_iters", "lr_decay_iters", "grad_clip")


def changed_hyper_parameters(recorded: dict[str, Any] | None, cfg: TrainConfig) -> dict[str, list[Any]]:
    """{option: [the checkpoint's run's value, `cfg`'s]} of each hyper-parameter of the
    optimiser's steps (its own options, the schedule's, clipping) that `cfg` changes from
    the run that saved the checkpoint, whose config is `recorded` (its meta.json "train";
    None or a key it lacks, from an older numesh: nothing to compare). A resume may change
    them (a lower rate, say), but says so (`resume_notes`) and records it (`run_record`)."""
    if not isinstance(recorded, dict):
        return {}
    now = attrs.asdict(cfg)
    keys = (*OPTIONS.get(cfg.optimizer, {}), *STEP_OPTIONS)
    return {k: [recorded[k], now[k]] for k in keys if k in recorded and recorded[k] != now[k]}


def run_record(cfg: TrainConfig, recorded: dict[str, Any] | None = None, step: int = 0,
               changed: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """What config.json and every checkpoint's meta.json "train" record of a run: `cfg`'s
    options, and where resumes changed hyper-parameters, each change under CHANGES_KEY with
    the step from which it applies: those the resumed checkpoint's run (`recorded`) had
    listed, then `changed` at `step`. config.json held the last command's values only, as
    if the whole run had trained with them."""
    listed = recorded.get(CHANGES_KEY) if isinstance(recorded, dict) else None
    history = list(listed) if isinstance(listed, list) else []
    if changed:
        history.append({"step": step, **changed})
    return {**attrs.asdict(cfg), **({CHANGES_KEY: history} if history else {})}


def config_from(overrides: dict[str, Any], toml_path: str | Path | None = None,
                preset: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then `preset` (a --model preset's options), then
    `overrides` (None values are ignored); the parts of the model kind `arch` names fill the
    part options none of them gives. The preset's values are not the user's own: no
    `_check_unused` refusal names one (smollm2-135m's rope_theta with --positions learned)."""
    fields = {f.name: f for f in attrs.fields(TrainConfig)}
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # option -> where it was set to a value of its own (`_check_unused`)
    if toml_path is not None:
        path = Path(toml_path)
        spelled: dict[str, str] = {}
        for key, value in read_user_file(path, "config file", "TOML", ConfigError).items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ConfigError(f"unknown config key '{key}' in {path}: the keys are {', '.join(fields)}")
            if name in spelled:
                raise ConfigError(f"config key '{name}' is set twice in {path} (as '{spelled[name]}' and "
                                  f"'{key}'): keep one")
            spelled[name] = key
            values[name] = value
            if value != fields[name].default:  # a recipe lists every key, those it does not use at their defaults
                given[name] = f" (in {path})"
        if _positions_of(values) == "rotary":  # its rope_theta is its own model's, whatever the command line makes it
            given.pop("rope_theta", None)
    file_arch = values.get("arch")  # the --config file's kind, if it names one
    named = {**(preset or {}), **{k: v for k, v in overrides.items() if v is not None}}  # on the command line
    for key in [*(preset or {}), *overrides]:
        if key not in fields:
            raise ConfigError(f"unknown config key '{key}': the keys are {', '.join(fields)}")
    for key, value in named.items():
        values[key] = value
        if overrides.get(key) is not None:
            given[key] = ""
    _from_pretrained(values, {*given, *named}, fields["block_size"].default)  # a preset's block_size is chosen too
    arch = values.get("arch", fields["arch"].default)
    if not isinstance(arch, str) or arch not in ARCHS:  # a TOML list or table is unhashable
        raise ConfigError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    _kind_parts(values, named, file_arch, arch)
    _default_floor(values, given, fields["min_lr"].default)
    for name, value in values.items():
        values[name] = option_value(name, value, field_type(fields[name]))
    if "dtype" not in given:
        _resume_dtype(values, fields["out"].default)
    cfg = TrainConfig(**values)
    _check_unused(cfg, given)
    if "warmup_iters" in given:  # the default warm-up (100) past a short run's --lr-decay-iters is nanoGPT's too
        _check_warmup(cfg)
    return cfg


# model options only a model with experts reads
MOE_OPTIONS = ("moe_every", "moe_top_k", "moe_aux_coef", "moe_z_coef", "moe_capacity_factor")


def check_paths_given(options: dict[str, Any]) -> None:
    """An empty --resume or --init-from on a command line without a --config file (with one,
    '' clears the file's value): an unset shell variable, which trained a random model and
    said it succeeded. One ConfigError line."""
    if options.get("config") is not None:
        return
    for key in ("resume", "init_from"):
        if options.get(key) == "":  # blanks are refused as no path later (`check_options`)
            raise ConfigError(f"{flag(key)} is empty: pass a path (is the shell variable that names it set?), or "
                              f"leave {flag(key)} out to start a fresh run")


def _positions_of(values: dict[str, Any]) -> Any:
    """The positions of the model `values` describe: its own, else its kind's (a kind
    `ARCHS` does not know has none: config_from refuses it)."""
    arch = values.get("arch", attrs.fields(TrainConfig).arch.default)
    return values.get("positions", ARCHS[arch]["positions"] if isinstance(arch, str) and arch in ARCHS else None)


def _check_unused(cfg: TrainConfig, given: dict[str, str]) -> None:
    """A one-line ConfigError for an option given (on the command line, or in the --config
    file at other than its default) that the run would silently ignore: another optimiser's
    (--muon-momentum with AdamW), an MoE option on a model without experts, or --rope-theta
    on a model of learned positions. A --config file's --rope-theta is not held to it where
    the file's own model is rotary: --arch gpt2 over a Llama recipe trains GPT-2's positions."""
    if "rope_theta" in given and cfg.positions != "rotary":
        raise ConfigError(f"--rope-theta{given['rope_theta']} applies to rotary positions, and this model's are "
                          f"{cfg.positions}: pass --positions rotary or drop --rope-theta")
    for name, where in given.items():
        owner = applies_to(cfg.optimizer, name)
        if owner is not None:
            raise ConfigError(f"{flag(name)}{where} applies to --optimizer {owner}, and this run's is "
                              f"{cfg.optimizer}: pass --optimizer {owner} or drop {flag(name)}")
        if name in MOE_OPTIONS and not cfg.moe_experts:
            raise ConfigError(f"{flag(name)}{where} applies to a model with experts, and this one has none: "
                              f"set --moe-experts or drop {flag(name)}")


def _kind_parts(values: dict[str, Any], overrides: dict[str, Any], file_arch: Any, arch: str) -> None:
    """The parts of the model kind `arch` (norm, positions, mlp, tied head) where no option
    names one. A kind named on the command line (--arch, or --model's preset) other than
    the --config file's brings its parts over the file's, which lists every part of its own
    kind: else `--config quickstart.toml --arch llama` trained GPT-2's block under Llama's
    name. The file's own kind named again changes nothing (SmolLM2's recipe stays tied)."""
    other_kind = overrides.get("arch") is not None and file_arch is not None and file_arch != arch
    for name, value in ARCHS[arch].items():
        if other_kind and overrides.get(name) is None:
            values[name] = value
        else:
            values.setdefault(name, value)


def _default_floor(values: dict[str, Any], given: dict[str, str], floor: float) -> None:
    """--min-lr where not given (on the command line, or in the --config file at other than
    its default, as a recipe lists it): its default, or --learning-rate where that is lower.
    A fine-tune's rate (2e-5, say) is below the default floor, and a floor above the peak
    would make the cosine "decay" raise the rate; one the user gives above the peak is
    refused (`check_options`)."""
    lr = values.get("learning_rate")
    if "min_lr" not in given and isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < floor:
        values["min_lr"] = float(lr)


def _resume_dtype(values: dict[str, Any], out: str) -> None:
    """--dtype where not given (on the command line, or in the --config file at other than
    its default): the checkpoint's a resume continues from (`--resume`, or with `auto`
    OUT/ckpt/latest where there is one), which was silently converted to float32. A
    checkpoint that cannot be read leaves the default: resuming it says why."""
    dtype = start_dtype(resume_path(values.get("resume", ""), values.get("out", out)))
    if dtype in DTYPES:
        values["dtype"] = dtype


def resume_path(resume: str, out: str) -> str:
    """The checkpoint `--resume` names before the run starts: `auto` is OUT/ckpt/latest
    (which may not exist: then a fresh start), "" none."""
    return str(Path(out) / RUN_CKPT / LATEST) if resume == RESUME_AUTO else resume


def _llama_dir(init: Any) -> bool:
    """Whether `--init-from` names a transformers Llama-family directory (not GPT-2's)."""
    return isinstance(init, str) and bool(init.strip()) and is_pretrained_dir(init) and model_type(Path(init)) != "gpt2"


def _from_pretrained(values: dict[str, Any], chosen: set[str], block_size: int) -> None:
    """With --init-from a transformers Llama-family directory, the model options its
    config.json fixes, filled in where not given; one given otherwise is a one-line error.
    --block-size, which it only bounds (max_position_embeddings), is where not `chosen` (on
    the command line, by a --model preset, or in the --config file at other than its default) the default
    `block_size` or that bound where lower: the round trip of a run trained at --block-size 32
    (export --format hf, then --init-from) was refused for a default the user never gave. One
    given above the bound stays an error (`init_from._check_pretrained`). (A GPT-2
    directory's shape is given by the options, and checked when it is read.)"""
    init = values.get("init_from")
    if not _llama_dir(init):
        return
    pre = pretrained(init)
    theirs = pre.options
    if "block_size" not in chosen:
        values["block_size"] = min(block_size, pre.max_positions)
    clash = conflicts(theirs, values)
    if clash:
        ours = " and ".join(flag_value(name, value) for name, value, _ in clash)
        its = " and ".join(flag_value(name, want) if isinstance(want, bool) else str(want) for name, _, want in clash)
        one = len(clash) == 1
        raise ConfigError(f"{ours} {'conflicts' if one else 'conflict'} with --init-from {init}, whose model has "
                          f"{its}: leave {'the option' if one else 'them'} out (the directory sets "
                          f"{'it' if one else 'them'})")
    values.update(theirs)


def validate(cfg: TrainConfig, n_ranks: int) -> tuple[dict[str, int], GPTConfig]:
    """Every check that can fail, run identically on every rank before any collective: the
    options, the dataset, the layout (each once)."""
    _check_types(cfg)  # mesh=None is a one-line error, not an AttributeError below
    if cfg.mesh.strip() == MESH_AUTO:
        raise ConfigError("--mesh auto is chosen before training, by `numesh train` "
                          "(numesh.plan.auto.auto_layout): call that first, or name a mesh")
    shape = check_options(cfg, n_ranks)
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ConfigError(f"--out {cfg.out} is a file, not a directory: name a directory for the run")
    if Path(cfg.out).resolve() == Path(cfg.data).resolve():
        raise ConfigError(f"--out {cfg.out} is the dataset directory --data: name another directory for the run")
    tok = load_tokenizer(cfg.data)
    for split in SPLITS:
        n = len(load_split(cfg.data, split))
        if n <= cfg.block_size:
            fix = ("use a --block-size below it, or a larger corpus" if n > 1
                   else "too small for any --block-size: use a larger corpus")  # no --block-size is below 1
            raise ConfigError(f"block_size={cfg.block_size} needs a split of at least {cfg.block_size + 1} tokens "
                              f"(inputs and their next-token targets), the {split} split has {n}: {fix}")
    model = _check_layout(cfg, shape, run_vocab(cfg, tok.vocab_size))
    faults_from_env(n_ranks)  # NUMESH_INJECT: a bad spec is this one-line error on every rank
    return shape, model


def run_vocab(cfg: TrainConfig, entries: int) -> int:
    """The run's vocabulary: its tokenizer's `entries`, or the rows of the weights it starts
    from (`--resume`, else `--init-from`) where they have more: a transformers model padded
    to a multiple of 64, and every run, checkpoint and export after it, keeps those rows,
    whose ids never occur. Fewer rows than entries are refused where they are read."""
    return max(entries, start_vocab(cfg.init_from, resume_path(cfg.resume, cfg.out)) or 0)


def check_options(cfg: TrainConfig, n_ranks: int, mesh_origin: str = "") -> dict[str, int]:
    """The checks of single options (no dataset, no layout); returns the mesh's axis sizes.
    `mesh_origin`: " (in FILE)" where --mesh came from a --config file (`parse_mesh`)."""
    _check_types(cfg)
    _check_values(cfg)
    # --mesh auto: the layout is chosen once the dataset is there (numesh.plan.auto); until then dp over every rank
    shape = parse_mesh("dp=-1" if cfg.mesh.strip() == MESH_AUTO else cfg.mesh, n_ranks, mesh_origin)
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got '{cfg.dtype}'")
    if cfg.max_iters < 0:  # 0: evaluate the starting weights and save them, no step (a --init-from's conversion)
        raise ConfigError(f"max_iters must be >= 0, got {cfg.max_iters}")
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
    for name in ("seed", "warmup_iters", "lr_decay_iters", "min_lr", "weight_decay", "grad_clip",
                 "ckpt_interval", "keep", "max_skips", "collective_timeout"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be >= 0, got {getattr(cfg, name)}")
    if cfg.peak_flops < 0:
        raise ConfigError(f"--peak-flops must be >= 0 (0 = measure it), got {cfg.peak_flops}")
    parse_signals(cfg.save_on_signal)
    if cfg.init_from and cfg.resume and cfg.resume != RESUME_AUTO:  # auto: --init-from starts the first attempt
        raise ConfigError("--init-from and --resume both say where the weights come from: pass one")
    if not cfg.learning_rate > 0:
        raise ConfigError(f"learning_rate must be > 0, got {cfg.learning_rate}")
    if cfg.min_lr > cfg.learning_rate:  # the cosine "decay" would raise the rate from the peak
        peak = flag_value("learning_rate", cfg.learning_rate)
        raise ConfigError(f"{flag_value('min_lr', cfg.min_lr)} is above {peak}, the peak it decays from: "
                          f"set --min-lr to at most {cfg.learning_rate} (or raise --learning-rate)")
    run_optimizer(cfg.optimizer, attrs.asdict(cfg))  # its name and hyper-parameters (betas too)
    return shape


# paths that must name something; "" means "none" for the others
_PATHS_NEEDED = ("data", "out")
_PATHS_OPTIONAL = ("resume", "init_from")


_INT_LIMIT = 2**53  # an integer option beyond this is no count numesh can index or multiply safely


def _check_types(cfg: TrainConfig) -> None:
    """Each option of the type `config_from` requires of it (`option_value`: a bool is no int,
    2.5 no int, '2' no int; an int serves where a float is wanted): a `TrainConfig` built
    directly is not read through `config_from`, and bias='no' trained with biases."""
    for f in attrs.fields(TrainConfig):
        option_value(f.name, getattr(cfg, f.name), field_type(f))


def _check_values(cfg: TrainConfig) -> None:
    """What no option may be: a float that is NaN or infinite (every comparison with NaN is
    False, so range checks alone let it through and it trains silently wrong), or a path
    that is only blanks (Path("") is the current directory: an empty --out would put the
    run there)."""
    for f in attrs.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if field_type(f) is float:
            check_finite(f.name, value)
        if field_type(f) is int and f.name != "seed" and abs(value) >= _INT_LIMIT:  # sizes, counts, indices
            raise ConfigError(f"{flag(f.name)} {value} is out of range: it must be below {_INT_LIMIT:,}")
    for name in _PATHS_NEEDED + _PATHS_OPTIONAL:
        value = getattr(cfg, name)
        if not value.strip() and (value or name in _PATHS_NEEDED):
            what = "a directory for the run" if name == "out" else "a path"
            raise ConfigError(f"{flag(name)} must name {what}, got {value!r}")


def _check_warmup(cfg: TrainConfig) -> None:
    """A --warmup-iters given must end by the step where the cosine decay reaches min_lr:
    past it, the rate climbs towards the peak and then falls to min_lr at once (no decay at
    all). A schedule without decay (min_lr = learning_rate: a flat cosine) has no such step.
    The default warm-up is not held to it: `--max-iters 50 --lr-decay-iters 50` (nanoGPT's
    habit) ran so, and its requeue must run again."""
    if cfg.warmup_iters > cfg.lr_decay_iters and cfg.min_lr != cfg.learning_rate:
        raise ConfigError(f"--warmup-iters {cfg.warmup_iters} ends after --lr-decay-iters {cfg.lr_decay_iters}, "
                          f"the step where the decay reaches --min-lr: use a --lr-decay-iters of at least "
                          f"{cfg.warmup_iters} or fewer --warmup-iters")


def check_layout(cfg: TrainConfig, n_ranks: int, vocab_size: int) -> tuple[dict[str, int], GPTConfig]:
    """The checks of the parallel layout (mesh, micro-batches, model shape, pipeline) for a
    model of `vocab_size` tokens: no dataset needed, so `numesh plan` asks the same."""
    shape = check_options(cfg, n_ranks)
    return shape, _check_layout(cfg, shape, vocab_size)


def _check_layout(cfg: TrainConfig, shape: dict[str, int], vocab_size: int) -> GPTConfig:
    """`check_layout` on options already checked (`shape` is the mesh they name)."""
    if shape["cp"] > 1 and cfg.block_size % (2 * shape["cp"]):
        raise ConfigError(
            f"block_size={cfg.block_size} does not split into 2*cp={2 * shape['cp']} equal chunks "
            f"(context parallelism's load balance): "
            f"use a --block-size that is a multiple of {2 * shape['cp']} or a smaller cp"
        )
    if shape["cp"] > 1 and cfg.sequence_parallel and cfg.block_size % (shape["cp"] * shape["tp"]):
        raise ConfigError(f"--sequence-parallel with cp splits a cp rank's block_size/cp tokens over tp: use a "
                          f"--block-size that is a multiple of cp*tp={shape['cp'] * shape['tp']}")
    _check_batch(cfg, shape)
    if cfg.sequence_parallel and shape["tp"] == 1:
        raise ConfigError("--sequence-parallel splits the sequence over tp, which is 1 in this mesh: "
                          "add tp=N (N > 1) to --mesh or drop --sequence-parallel")
    if cfg.sequence_parallel and cfg.block_size % shape["tp"]:
        raise ConfigError(f"--sequence-parallel splits the block_size={cfg.block_size} tokens over tp={shape['tp']}: "
                          f"use a --block-size divisible by {shape['tp']}")
    model = cfg.model(vocab_size)
    model.validate(1)  # a tp or experts error below says which mesh axis
    if cfg.init_from:
        check_not_checkpoint(cfg.init_from)
    if cfg.init_from and not Path(cfg.init_from).is_dir():  # a directory is judged when it is read
        check_init_kind(model)
    if _llama_dir(cfg.init_from):  # its options came from the directory; a GPT-2 one or a file's are the user's
        _check_mesh_of_fixed_model(model, shape, cfg.virtual_stages, f"--init-from {cfg.init_from}")
    _check_moe(cfg, shape)
    model.validate(shape["tp"])
    StageLayout(model.n_layer, shape["pp"], cfg.virtual_stages)
    check_shape(cfg.schedule, shape["pp"], cfg.micro_batches, cfg.virtual_stages)  # the trainer builds it
    return model


def _check_mesh_of_fixed_model(model: GPTConfig, shape: dict[str, int], v: int, source: str) -> None:
    """A mesh that does not split a model whose weights `source` fixes (a Llama-family
    directory, which sets the model options) is refused naming what the user can change,
    the mesh (and --virtual-stages), never a model option such as --ffn-hidden,
    --moe-experts or --n-layer. A GPT-2 directory's or an export file's model comes from the
    user's options, checked against the weights when they are read: those keep the model
    options' advice."""
    fixed = f"{source} fixes the model"
    model.check_tp_of_fixed_model(shape["tp"], f"{fixed}: use --mesh with tp {{sizes}}")
    ep, experts = shape.get("ep", 1), model.moe_experts
    if ep > 1 and not experts:
        raise ConfigError(f"ep={ep} splits the experts over ranks, but {source}'s model has none: "
                          "drop ep from --mesh")
    if experts % ep:
        raise ConfigError(f"moe_experts={experts} is not divisible by ep={ep}: {fixed}: "
                          f"use --mesh with ep {_either(_divisors(experts))}")
    if model.n_layer % (shape["pp"] * v):
        raise ConfigError(f"n_layer={model.n_layer} is not divisible by pp x virtual stages = {shape['pp']} x {v}: "
                          f"{fixed}: use a pp (--mesh) and --virtual-stages whose product is "
                          f"{_either(_divisors(model.n_layer))}")


def _divisors(n: int) -> list[int]:
    """The sizes of a mesh axis that split `n` evenly, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _either(sizes: list[int]) -> str:
    """Sizes in words: "1", "1 or 2", "1, 2 or 4"."""
    words = [str(s) for s in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _check_batch(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """The global batch's rows split over dp×ep (ep is data parallelism for all but the
    experts), then into micro-batches."""
    dp, ep, m = shape["dp"], shape.get("ep", 1), cfg.micro_batches
    if cfg.batch_size % (dp * ep * m):
        by = f"dp={dp} x ep={ep}" if ep > 1 else f"dp={dp}"
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by {by} x micro_batches={m}: "
                          f"use a multiple of {dp * ep * m}")


def _check_moe(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """The expert-parallel axis against the experts, and what experts do not combine with."""
    ep = shape.get("ep", 1)
    if ep > 1 and not cfg.moe_experts:
        raise ConfigError(f"ep={ep} splits the experts over ranks, but the model has none: "
                          f"set --moe-experts or drop ep from --mesh")
    if not cfg.moe_experts:
        return
    if cfg.moe_experts % ep:
        raise ConfigError(f"--moe-experts {cfg.moe_experts} do not split over ep={ep}: "
                          f"use a multiple of {ep} experts or another ep")



