"""The `numesh` command line: parse options into configs and call the run layer."""

from __future__ import annotations

import sys

import numesh  # noqa: F401  (first: it sets up OpenBLAS before numpy loads it)
from numesh.cli import exit_without_mpi
from numesh.host.startup_signals import catch_for_command

# `numesh train`: a preemption signal during the imports below (numba's kernels, MPI) and the
# rest of start-up is kept for the training loop, not lost (numesh/host/startup_signals.py)
try:
    catch_for_command(sys.argv)  # first: for `numesh train` it loads MPI itself, its handlers around it
    from mpi4py import MPI  # noqa: F401  (every command needs it: without a library, one line)
except RuntimeError as e:
    exit_without_mpi(e)

import inspect  # after the line above, which must run first
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import attrs
import typer
from typer.core import TyperCommand

if TYPE_CHECKING:
    from numesh.run.config import TrainConfig


class _Command(TyperCommand):
    """Usage lines name arguments as CKPT, not typer's {ckpt}."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # plain help: no <bool> beside flags, one [default: ...] style
    context_settings={"max_content_width": 100},
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train GPT models with dp x ep x cp x tp x pp parallelism and ZeRO in NumPy and MPI.",
)
data_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Prepare datasets.")
app.add_typer(data_app, name="data")


def _run(fn):
    from numesh.base.errors import USER_ERRORS
    from numesh.host.runtime import guarded

    return guarded(fn, USER_ERRORS)


def _wrote(summary: dict, out: Path) -> None:
    print(
        f"wrote {summary['out_dir']}: vocab {summary['vocab_size']}, "
        f"{summary['train_tokens']:,} train / {summary['val_tokens']:,} val tokens; "
        f"train on it with `numesh train --data {shlex.quote(str(out))}`",
        file=sys.stderr,
    )


_OVERWRITE_HELP = "replace a dataset already at OUT with different content (runs trained on it will not match it)"


@data_app.command("shakespeare-char")
def data_shakespeare_char(
    src: Optional[Path] = typer.Option(None, help="tiny Shakespeare input.txt; downloaded (sha256-checked) if omitted"),
    out: Path = typer.Option(Path("data/shakespeare_char"), help="output directory"),
    overwrite: bool = typer.Option(False, "--overwrite", help=_OVERWRITE_HELP),
) -> None:
    """Character-level tiny Shakespeare: train.bin / val.bin (uint16, 90/10) and meta.json.

    Without --src the download is cached as OUT/input.txt, so running this again is offline."""
    from numesh.cli.dataset import download_bar
    from numesh.data import write as dw
    from numesh.data.char import file_corpus, prepare_char_dataset, read_source, shakespeare_corpus, shakespeare_text

    def go() -> None:
        dw.target(out)  # a bad --out before the download
        if src is not None:
            text = read_source(src)
            corpus = file_corpus(src, text)
        else:
            with download_bar("tiny Shakespeare") as progress:
                text, _ = shakespeare_text(out, progress)
            corpus = shakespeare_corpus(text)
        _wrote(prepare_char_dataset(text, out, corpus, overwrite), out)

    _run(go)


@data_app.command("char")
def data_char(
    src: Path = typer.Option(..., help="any UTF-8 text file"),
    out: Optional[Path] = typer.Option(None, help="output directory (default: data/<name of SRC without suffix>)"),
    overwrite: bool = typer.Option(False, "--overwrite", help=_OVERWRITE_HELP),
    tokenizer: Optional[Path] = typer.Option(
        None, help="a character model's tokenizer.json, or its `numesh export --format hf` directory holding one: "
                   "use its vocabulary instead of SRC's characters, to fine-tune it with --init-from"),
) -> None:
    """Character-level dataset from any text file: train.bin / val.bin (uint16, 90/10) and meta.json."""
    from numesh.base.errors import DataError
    from numesh.data.char import file_corpus, prepare_char_dataset, read_source
    from numesh.data.tokenizer import CharTokenizer, read_tokenizer_file, tokenizer_file

    def go() -> None:
        vocab = None
        if tokenizer is not None:
            vocab = CharTokenizer.from_hf_json(read_tokenizer_file(tokenizer_file(tokenizer)))
            if vocab is None:
                raise DataError(f"{tokenizer} is not a character vocabulary: tokenise with it into shards, "
                                f"`numesh data tokenize --tokenizer {tokenizer} --src FILE --out DIR`")
        text = read_source(src)
        dest = out if out is not None else Path("data") / src.stem
        corpus = file_corpus(src, text) | ({"tokenizer": str(tokenizer)} if tokenizer is not None else {})
        _wrote(prepare_char_dataset(text, dest, corpus, overwrite, vocab), dest)

    _run(go)


_SRC_HELP = "corpus files (.txt, .jsonl, .parquet), directories or globs; repeat for more"
_VAL_HELP = "share of the corpus's bytes that go to the val split, in whole documents"
_SPLIT_HELP = "cut .txt files into documents at this separator, e.g. $'\\n\\n' (default: a file is one document)"


def _tokenized(summary: dict, out: Path, what: str) -> None:
    docs, vf = summary["documents"], summary["val_fraction"]
    split = (f"one document split {100 * (1 - vf):g}/{100 * vf:g} by position" if summary["split"] == "position"
             else f"{docs['train']:,} train / {docs['val']:,} val documents")
    print(f"{what} {summary['out_dir']}: vocab {summary['vocab_size']:,}, {split}, {summary['train_tokens']:,} / "
          f"{summary['val_tokens']:,} tokens; train on it with `numesh train --data {shlex.quote(str(out))}`",
          file=sys.stderr)
    share = summary["bytes"]["val"] / max(1, sum(summary["bytes"].values()))
    if share < vf / 2 or share > 2 * vf:
        print(f"warning: val holds {100 * share:.2g}% of the corpus's bytes, not the {100 * vf:g}% --val-fraction "
              "asks: its documents are too large to fill it whole (--split-on cuts .txt files into more)",
              file=sys.stderr)


@data_app.command("bpe")
def data_bpe(
    src: list[str] = typer.Option(..., help=_SRC_HELP, metavar="PATH"),
    vocab_size: int = typer.Option(..., help="entries of the byte-level BPE, its end-of-text token included"),
    out: Path = typer.Option(..., help="output directory: tokenizer.json, the token shards, meta.json"),
    split_on: Optional[str] = typer.Option(None, help=_SPLIT_HELP),
    text_field: str = typer.Option("text", help="the field holding the text in .jsonl and .parquet files"),
    val_fraction: float = typer.Option(0.1, help=_VAL_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help=_OVERWRITE_HELP),
) -> None:
    """Train a byte-level BPE on a corpus (deterministic for the same inputs and size), then
    tokenise the corpus with it into token shards: documents end with <|endoftext|>.

    Long text reaches the tokenizer in pieces cut between words, and a run of more than
    1,000 characters without whitespace (minified code, base64) is cut into 1,000-character
    words, so a huge unbroken line costs time and memory in proportion to its length."""
    from numesh.cli.dataset import download_bar
    from numesh.data.corpus import Reading
    from numesh.data.sharded import prepare_bpe
    from numesh.data.tokenizer import ctrl_c_may_exit

    def go() -> None:
        with download_bar("tokenising") as progress, ctrl_c_may_exit():
            summary = prepare_bpe(src, vocab_size, out, Reading(split_on, text_field), val_fraction, progress,
                                  overwrite, say=lambda line: print(line, file=sys.stderr, flush=True),
                                  show_progress=True)
        _tokenized(summary, out, "wrote")

    _run(go)


@data_app.command("tokenize")
def data_tokenize(
    tokenizer: Path = typer.Option(..., help="a Hugging Face tokenizer.json (GPT-2's, or one `numesh data bpe` wrote), "
                                   "or a transformers model's directory holding one (its model's tokenizer)"),
    src: list[str] = typer.Option(..., help=_SRC_HELP, metavar="PATH"),
    out: Path = typer.Option(..., help="output directory: a copy of the tokenizer, the token shards, meta.json"),
    eot: Optional[str] = typer.Option(None, help="the tokenizer's end-of-text token, put after each document",
                                      show_default="a model directory's eos_token, else <|endoftext|>"),
    split_on: Optional[str] = typer.Option(None, help=_SPLIT_HELP),
    text_field: str = typer.Option("text", help="the field holding the text in .jsonl and .parquet files"),
    val_fraction: float = typer.Option(0.1, help=_VAL_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help=_OVERWRITE_HELP),
) -> None:
    """Tokenise a corpus with an existing Hugging Face tokenizer into token shards."""
    from numesh.cli.dataset import download_bar
    from numesh.data.corpus import Reading
    from numesh.data.sharded import prepare_tokenized, rebuild_command
    from numesh.data.tokenizer import HFTokenizer

    def go() -> None:
        tok = HFTokenizer.from_file(tokenizer, eot)
        how = Reading(split_on, text_field)
        again = rebuild_command(src, how, val_fraction, tokenizer=tokenizer, eot=tok.eot)
        with download_bar("tokenising") as progress:
            summary = prepare_tokenized(src, tok, out, how, val_fraction, progress, overwrite, again)
        _tokenized(summary, out, "wrote")

    _run(go)


def _shown(default: Any) -> str:
    """A default as the help shows it: '' as (none), booleans as the flag that is on."""
    if isinstance(default, bool):
        return "on" if default else "off"
    return "(none)" if default == "" else str(default)


def _train_signature() -> inspect.Signature:
    """One option per TrainConfig field (None = not given, so --config values survive)."""
    from numesh.base.flags import flag, flag_value
    from numesh.run.config import TrainConfig, field_type

    params = [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(None, "--config",
                                 help="TOML file of these options (command-line options override it)"),
            annotation=Optional[Path],
        ),
        inspect.Parameter(
            "model_preset",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(None, "--model", "--preset",
                                 help="a model preset's shape, e.g. gpt2 (12 layers x 768, 12 heads, block 1024, "
                                 "biases) or smollm2-135m (Llama: 30 x 576, 9 heads, 3 kv heads, SwiGLU 1536); "
                                 "the vocabulary is --data's, options given override it"),
            annotation=Optional[str],
        ),
    ]
    for f in attrs.fields(TrainConfig):
        typ = field_type(f)
        on = flag(f.name)
        decls = [f"{on}/{flag_value(f.name, False)}"] if typ is bool else [on]
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(None, *decls, help=f"{f.metadata['help']}  [default: {_shown(f.default)}]",
                                     show_default=False),
                annotation=Optional[typ],
            )
        )
    return inspect.Signature(params)


def _preset_shape(name: str | None) -> dict[str, Any]:
    """A preset's model shape, as options (its vocabulary and batch are the planner's: a run
    takes --data's vocabulary and its own batch); none without --model."""
    if name is None:  # --model '' is an unknown preset, not none
        return {}
    from numesh.plan.presets import preset

    return preset(name).model_options()


def train_config(options: dict[str, Any]) -> TrainConfig:
    """The `TrainConfig` of `numesh train`'s parsed options: defaults, then the --config TOML
    file, then --model's preset shape where not given, then the options given (the recipes'
    test reads configs/*.toml through this, as the command does). The preset goes in apart
    from the options: its values are not options the user gave (`config_from`)."""
    from numesh.run.config import check_paths_given, config_from

    check_paths_given(options)
    given = {k: v for k, v in options.items() if k not in ("config", "model_preset")}
    return config_from(given, options.get("config"), preset=_preset_shape(options.get("model_preset")))


def train_cmd(**options: Any) -> None:
    """Train a GPT on a prepared dataset (run under mpirun for a multi-rank --mesh)."""

    def go() -> None:
        from mpi4py import MPI

        from numesh.cli.dataset import ensure_run_dataset
        from numesh.host.runtime import configure_process, is_root, log
        from numesh.host.startup_signals import parse_signals, settle
        from numesh.plan.auto import auto_layout
        from numesh.plan.fits import check_run_fits
        from numesh.run.config import check_options
        from numesh.run.train import train

        configure_process()
        cfg = train_config(options)
        from_file = options.get("config") is not None and options.get("mesh") is None  # the recipe's mesh
        # before a download: bad options are one line at once
        check_options(cfg, MPI.COMM_WORLD.Get_size(), f" (in {options['config']})" if from_file else "")
        settle(parse_signals(cfg.save_on_signal))  # a --config file may name other signals than the command line
        # the default dataset is prepared on rank 0 if missing (download or offline fallback)
        ensure_run_dataset(cfg.data)
        cfg = auto_layout(cfg, log=log)  # --mesh auto: the planner's layout for these ranks
        check_run_fits(cfg)  # the planner's bytes per rank against free memory, before anything is allocated
        with _Progress(cfg.max_iters) as progress:
            result = train(cfg, on_step=progress.update)
        if cfg.trace and is_root():  # the trace was written on rank 0 at the end of train()
            from numesh.perf import report

            print(report.render(report.report_of(cfg.out)), file=sys.stderr)
        log(done_lines(result))

    _run(go)


def done_lines(result: Any) -> str:
    """What `numesh train` says at the end: steps, time, the last losses (n/a where none was
    logged: a --max-iters 0 run evaluates, it takes no step), where the metrics and the
    checkpoint are."""
    loss = f"{result.final_loss:.4f}" if math.isfinite(result.final_loss) else "n/a"
    val = "n/a" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"
    return (f"done: {result.steps} steps in {result.seconds:.1f} s, final loss {loss}, val {val}\n"
            f"metrics: {result.metrics}\ncheckpoint: {result.checkpoint}")


train_cmd.__signature__ = _train_signature()  # type: ignore[attr-defined]
app.command("train", cls=_Command)(train_cmd)


_PLAN_OPTIONS = [
    ("ranks", Optional[int], typer.Option(None, "--ranks",
                                          help="ranks to plan for (every pp x dp x ep x cp x tp layout of them; ep > 1 "
                                               "only for a model with experts)")),
    ("model_preset", Optional[str], typer.Option(None, "--model", "--preset", help="a model preset (gpt2, gpt2-medium, "
     "gpt2-large, gpt2-xl, gpt3-125m, gpt3-1.3b, gpt3-13b, gpt3-175b, megatron-18b, megatron-146b, megatron-1t, "
     "smollm2-135m, llama3-8b, llama3-70b, llama3-405b); options given override it")),
    ("vocab_size", Optional[int], typer.Option(None, "--vocab-size",
                                               help="vocabulary  [default: the preset's, or --data's]")),
    ("memory_per_rank", Optional[str], typer.Option(None, "--memory-per-rank", help="memory of one rank, e.g. 8GiB  "
     "[default: the profile's device memory, or this machine's RAM / ranks]")),
    ("hardware", str, typer.Option("local", "--hardware", help="hardware profile: local (this machine, after "
     "--calibrate), a100-80gb, h100-80gb, or a profile's .json path")),
    ("json_", bool, typer.Option(False, "--json", help="print every layout as a JSON list")),
    ("top", int, typer.Option(15, "--top", help="layouts in the table")),
    ("calibrate", bool, typer.Option(False, "--calibrate", help="measure this machine (run under mpirun -n N for N "
     "ranks) and save the profile")),
    ("profile_out", Optional[Path], typer.Option(None, "--profile-out", help="where --calibrate saves  "
     "[default: ~/.cache/numesh/local.json, or $NUMESH_PROFILE_DIR/local.json]")),
]


def plan_cmd(**options: Any) -> None:
    """Predict memory per rank and step time of every layout of a model on --ranks ranks, fastest first."""

    def go() -> None:
        from numesh.host.runtime import configure_process, is_root, log
        from numesh.plan.command import check_mode, run_calibrate, run_plan

        planning = [name for name, given in (("--hardware", options["hardware"] != "local"),
                                              ("--json", options["json_"]), ("--top", options["top"] != 15)) if given]
        check_mode(options["calibrate"], options["ranks"], options["memory_per_rank"], options["profile_out"],
                   planning)
        plan_keys = {name for name, _, _ in _PLAN_OPTIONS} | {"config"}
        overrides = {k: v for k, v in options.items() if k not in plan_keys}
        if options["calibrate"]:
            configure_process()
            path = run_calibrate(overrides, options.get("config"), options["model_preset"], options["vocab_size"],
                                 options["profile_out"], log)
            if path is not None:
                print(f"saved profile {path}: plan with `numesh plan --ranks N --hardware "
                      f"{'local' if options['profile_out'] is None else path}`")
            return
        out = run_plan(overrides, options.get("config"), options["ranks"], options["model_preset"],
                       options["vocab_size"], options["memory_per_rank"], options["hardware"], options["json_"],
                       options["top"], log)
        if is_root():
            print(out)

    _run(go)


def _plan_signature() -> inspect.Signature:
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=typ)
             for name, typ, opt in _PLAN_OPTIONS]
    train = [p for p in _train_signature().parameters.values() if p.name != "model_preset"]  # plan has its own
    return inspect.Signature(extra + train)


plan_cmd.__signature__ = _plan_signature()  # type: ignore[attr-defined]
app.command("plan", cls=_Command)(plan_cmd)


class _Progress:
    """A rich progress bar on rank 0 (stderr), showing loss, val loss and speed."""

    def __init__(self, total: int):
        from numesh.host.runtime import is_root

        self.total, self.bar, self.task = total, None, None
        if is_root():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), console=Console(stderr=True),
            )
        self.info: dict[str, float] = {}

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.task is not None:  # rich's stop() of a bar never started still prints a newline
            self.bar.stop()

    def update(self, step: int, record: dict) -> None:
        if self.bar is None:
            return
        if self.task is None:  # started on the first step, after validation passed
            self.bar.start()
            self.task = self.bar.add_task("train", total=self.total, info="")
        self.info.update({k: v for k, v in record.items()
                          if k in ("loss", "val_loss", "tokens_per_s", "flops_per_s", "mfu", "moe_aux_loss",
                                   "moe_tokens_min", "moe_tokens_max", "moe_dropped")})
        parts = []
        if "loss" in self.info:
            parts.append(f"loss {self.info['loss']:.4f}")
        if "val_loss" in self.info:
            parts.append(f"val {self.info['val_loss']:.4f}")
        if "tokens_per_s" in self.info:
            parts.append(f"{self.info['tokens_per_s']:,.0f} tok/s")
        if "flops_per_s" in self.info:
            parts.append(f"{self.info['flops_per_s'] / 1e9:.2f} GFLOP/s, MFU {100 * self.info['mfu']:.1f} %")
        if "moe_aux_loss" in self.info:
            parts.append(moe_progress(self.info))
        if "val_loss" in record:
            self.bar.console.print(f"step {step}: train {record['train_loss']:.4f}, val {record['val_loss']:.4f}")
        self.bar.update(self.task, completed=min(step + 1, self.total), info=", ".join(parts))


def moe_progress(info: dict) -> str:
    """The routing part of the progress line: aux loss, the load spread (most / fewest
    token-assignments of any expert) and, with a capacity, the assignments dropped."""
    lo, hi = info["moe_tokens_min"], info["moe_tokens_max"]
    spread = f"{hi / lo:.2f}" if lo else "inf"
    text = f"aux {info['moe_aux_loss']:.4f}, experts {lo}-{hi} tok ({spread}x)"
    return text + (f", {info['moe_dropped']} dropped" if info.get("moe_dropped") else "")


# what an empty or missing CKPT is told to pass (typer made '' the current directory)
_CKPT_HINT = "pass a checkpoint directory such as runs/x/ckpt/latest"


@app.command("sample", cls=_Command)
def sample_cmd(
    path: Optional[str] = typer.Argument(None, metavar="CKPT", show_default=False,
                                         help="the checkpoint, as --ckpt gives it (either form)"),
    ckpt: Optional[str] = typer.Option(
        None, help="checkpoint directory (e.g. runs/x/ckpt/latest), a `numesh export`ed .safetensors file, or a "
        "transformers model directory (Llama, Mistral, Mixtral, GPT-2)", show_default=False,
    ),
    prompt: str = typer.Option("\n", help="text to continue", show_default="a newline"),
    max_new_tokens: int = typer.Option(500, help="tokens to generate"),
    temperature: float = typer.Option(0.8, help="softmax temperature; 0 = greedy"),
    top_k: int = typer.Option(200, help="sample among the k most likely tokens (0 = all)"),
    seed: int = typer.Option(1337, help="random seed of the draws"),
    num_samples: int = typer.Option(1, help="independent samples (seed, seed+1, ...)"),
    mesh: str = typer.Option("", help="tensor-parallel mesh, e.g. tp=2 (run under mpirun -n 2)"),
    kv_cache: bool = typer.Option(True, "--kv-cache/--no-kv-cache", help="reuse keys/values of earlier positions"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="draw all --max-new-tokens tokens, past the "
                                    "end-of-sequence token where a sample otherwise ends (as transformers' "
                                    "generate ends it)"),
) -> None:
    """Generate text from a checkpoint: prints the prompt and its continuation on stdout as
    the tokens come, each sample ending at the model's end-of-sequence token."""

    def go() -> None:
        from numesh.base.errors import ConfigError, check_path
        from numesh.host.runtime import configure_process, is_root
        from numesh.run.sample import SampleConfig, sample

        if (path is None) == (ckpt is None):
            raise ConfigError("name the checkpoint once: `numesh sample CKPT` or `numesh sample --ckpt CKPT`, "
                              "e.g. runs/x/ckpt/latest" + (f" (got {path} and --ckpt {ckpt})" if path else ""))
        name, given = ("CKPT", path) if path is not None else ("--ckpt", ckpt)
        check_path(name, given, hint=_CKPT_HINT)  # typer's Path("") was ".", the current directory
        configure_process()
        cfg = SampleConfig(given, prompt, max_new_tokens, temperature, top_k or None, seed, num_samples,
                           mesh, kv_cache, ignore_eos)
        root = is_root()  # one rank prints; on Ctrl-C what was printed stays
        sample(cfg, show=(lambda text: print(text, end="", flush=True)) if root else None)
        if root:
            print()

    _run(go)


@app.command("reshard", cls=_Command)
def reshard_cmd(
    ckpt: str = typer.Argument(..., help="checkpoint directory, e.g. runs/x/ckpt/latest", metavar="CKPT",
                               show_default=False),
    to: str = typer.Option(..., "--to",
                           help="target mesh, e.g. tp=4, cp=2,tp=2 or ep=2 (axes not named keep their size)"),
    out: Optional[str] = typer.Option(None, help="output directory", show_default="a sibling such as step_000100-tp4"),
) -> None:
    """Rewrite a checkpoint as another mesh's ranks would have written it (one process; any
    mesh can also load any checkpoint directly)."""

    def go() -> None:
        from numesh.base.errors import check_path
        from numesh.checkpoint import reshard

        check_path("CKPT", ckpt, hint=_CKPT_HINT)  # --out '' is the library's own line
        print(reshard(ckpt, to, out, log=lambda line: print(f"note: {line}", file=sys.stderr)))

    _run(go)


@app.command("export", cls=_Command)
def export_cmd(
    ckpt: str = typer.Argument(..., help="checkpoint directory, e.g. runs/x/ckpt/latest", metavar="CKPT",
                               show_default=False),
    out: str = typer.Option(..., help="output: a .safetensors file (nanogpt) or a directory (hf)", metavar="<path>"),
    format: str = typer.Option("nanogpt", "--format", help="nanogpt: one safetensors file with nanoGPT's names; "
                               "hf: a Hugging Face transformers directory (GPT-2, or LlamaForCausalLM / "
                               "MixtralForCausalLM for the Llama kind)"),
    dtype: Optional[str] = typer.Option(None, help="float32 or float64", show_default="the checkpoint's"),
    force: bool = typer.Option(False, "--force", help="overwrite OUT if it exists"),
) -> None:
    """Export the parameters: as one safetensors file with nanoGPT's state-dict names (numesh
    sample --ckpt FILE reads it too), or as a directory transformers loads with
    AutoModelForCausalLM / AutoTokenizer.from_pretrained, offline and without custom code."""

    def go() -> None:
        from numesh.base.errors import ConfigError, check_path
        from numesh.checkpoint import export_hf, export_nanogpt

        check_path("CKPT", ckpt, hint=_CKPT_HINT)
        if format not in ("nanogpt", "hf"):
            raise ConfigError(f"--format must be nanogpt or hf, got {format!r}")
        if not out.strip():  # Path("") is "."; with --force, hf would write into the current directory
            raise ConfigError(f"--out must name a file or directory to write, got {out!r}")
        if format == "hf" and Path(out).resolve() == Path.cwd().resolve():  # its five files among the user's own
            raise ConfigError(f"--out {out} is the current directory: name a directory for the model's files, "
                              "e.g. --out exported")
        print((export_hf if format == "hf" else export_nanogpt)(ckpt, Path(out), dtype, force))

    _run(go)


@app.command("report", cls=_Command)
def report_cmd(
    out: Path = typer.Argument(..., help="a run directory of `numesh train` (or a trace.json)",
                               metavar="OUT", show_default=False),
    json_: bool = typer.Option(False, "--json", help="print the trace's report as JSON"),
) -> None:
    """Why a run stopped and how it spent its time: the flight recorder's diagnosis of a job
    that hung or lost a rank (OUT/flight), and for a `--trace` run theory beside measurement
    (pipeline bubble, bytes per axis, time per category, MFU, slowest rank)."""

    def go() -> None:
        import json

        from numesh.base.errors import ConfigError
        from numesh.checkpoint.format import run_checkpoints
        from numesh.observe.flight import postmortem
        from numesh.perf import report

        path = out / "trace.json" if out.is_dir() else out
        diagnosis = postmortem(out / "flight") if out.is_dir() else None
        # a --trace job that died, or is still going, has its events in OUT/trace.parts
        rebuilt = report.recover(out) if out.is_dir() else None
        if diagnosis and not json_:
            print(diagnosis, end="\n" if path.is_file() or rebuilt else "")
        if rebuilt is None and not path.is_file():
            if diagnosis:  # --json printed nothing for a hung run once
                if json_:
                    print(json.dumps({"diagnosis": diagnosis}, indent=1))
                return
            if out.suffix == ".json":
                raise ConfigError(f"{path} not found: pass a run directory of `numesh train --trace` or its trace.json")
            if run_checkpoints(out):  # a run without --trace: a new run, or the rest of this one, traced
                raise ConfigError(f"{path} not found and no flight record there: the run was not traced; trace a "
                                  "run with `numesh train --trace` and a new --out (or --resume auto for the steps "
                                  "this one has left)")
            raise ConfigError(f"{path} not found and no flight record there: "
                              f"run `numesh train --trace --out {shlex.quote(str(out))}` first")
        rep = report.report_of(path, rebuilt)
        print(json.dumps({**rep, **({"diagnosis": diagnosis} if diagnosis else {})}, indent=1) if json_
              else report.render(rep))

    _run(go)


@app.command("plot")
def plot_cmd(
    runs: list[Path] = typer.Argument(..., help="run directories (each a `numesh train --out`, holding metrics.jsonl)"),
    out: Path = typer.Option(Path("plot.png"), help="output file, .png or .svg"),
) -> None:
    """Plot train/val loss and tokens/s against steps for one or more runs, on one figure."""

    def go() -> None:
        from numesh.run.plot import plot_runs

        path, _ = plot_runs(runs, out)
        print(path)

    _run(go)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
