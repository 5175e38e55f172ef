"""The recipes in configs/: complete `numesh train --config FILE` run files (issue 39).

Each recipe's header comment names the command that runs it (`# run:`, whose `mpirun -n N`
is its rank count, 1 without one) and the command-line run it is (`# same as:`). Every
recipe, found by globbing the folder, is read the way `numesh train --config` reads it
(the train command's own option parsing, then `numesh.cli.app.train_config`), must set
every option, comment each group of options, be the run its header says, and pass the
one-rank layout validation (`check_layout`) for its rank count. Then each is trained
briefly where that is cheap: a one-rank recipe for one step through the `numesh` command
in a subprocess, a multi-rank one for one step of a shrunk model in the MPI suite of its
rank count, against the one-rank run; the recipes in MODEL_ONLY (too large to train in the
suite) have their model built and counted instead.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest
import typer

from conftest import WORLD, assert_same_run, serial_reference, train_records
from numesh.base.tree import tree_leaves
from numesh.cli.app import app, train_config
from numesh.nn.gpt import gpt_global_shapes
from numesh.plan.presets import preset
from numesh.run.config import TrainConfig, check_layout
from test_mpi_suites import SIZES

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
RECIPES = sorted(CONFIGS.glob("*.toml"))
CHAR_VOCAB = 65  # tiny Shakespeare's characters: the vocabulary of a recipe whose data is character-level
# recipes validated and their model built, but not trained here, and why
MODEL_ONLY = {"gpt2": "92 M parameters, ~15 s a step on two cores",
              "smollm2-135m": "30 Llama blocks 576 wide at block 512: tens of seconds a step on two cores"}
GPT2_MILLIONS = 92  # the README's count of --model gpt2 with an 8,192-entry BPE
# what shrinks a multi-rank recipe's model for the MPI suite; its mesh, micro-batches, schedule,
# ZeRO stage and experts stay the recipe's (float64, so every mesh matches one rank to 1e-10)
SHRINK = ["--n-layer", "2", "--n-embd", "16", "--block-size", "8", "--max-iters", "1", "--warmup-iters", "1",
          "--lr-decay-iters", "1", "--eval-interval", "1", "--eval-iters", "1", "--dtype", "float64",
          "--peak-flops", "1e12"]
_COMMAND = re.compile(r"^(?:mpirun -n (\d+) )?numesh train(?: (.*))?$")


def _id(path: Path) -> str:
    return path.stem


def header(path: Path) -> list[str]:
    """The recipe's leading comment lines, without their `#`."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def header_field(path: Path, label: str) -> str:
    """The text after `label:` in the header, which must say it once."""
    found = [line[len(label) + 1:].strip() for line in header(path) if line.startswith(label + ":")]
    assert len(found) == 1, f"{path.name}: its header must say `# {label}: ...` once, found {len(found)}"
    return found[0]


def command(text: str) -> tuple[int, list[str]]:
    """(ranks, the options) of a `[mpirun -n N ]numesh train ...` command line."""
    m = _COMMAND.match(text)
    assert m, f"not a `[mpirun -n N ]numesh train ...` command: {text!r}"
    return int(m.group(1) or 1), shlex.split(m.group(2) or "")


def config_of(argv: list[str]) -> TrainConfig:
    """The TrainConfig `numesh train ARGV` would run, read by the command's own option parsing."""
    train = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    with train.make_context("train", list(argv)) as ctx:
        return train_config(ctx.params)


def run_of(path: Path) -> tuple[int, list[str]]:
    """(ranks, options) of the recipe's `# run:` command, its --config made absolute."""
    ranks, argv = command(header_field(path, "run"))
    assert argv[:2] == ["--config", f"configs/{path.name}"], (
        f"{path.name}: `# run:` must start `numesh train --config configs/{path.name}`, got {argv}")
    return ranks, [argv[0], str(ROOT / argv[1]), *argv[2:]]


def vocab_of(path: Path) -> int:
    """The vocabulary of the recipe's data: the `--vocab-size` of its `# data:` command, else
    character-level tiny Shakespeare's."""
    m = re.search(r"--vocab-size (\d+)", "\n".join(header(path)))
    return int(m.group(1)) if m else CHAR_VOCAB


def multi_rank_recipes() -> list[Path]:
    return [p for p in RECIPES if run_of(p)[0] > 1]


def one_rank_trained_recipes() -> list[Path]:
    return [p for p in RECIPES if run_of(p)[0] == 1 and p.stem not in MODEL_ONLY]


def test_every_recipe_is_exercised() -> None:
    """A recipe added to configs/ is picked up by the glob: a multi-rank one must have a rank
    count that an MPI suite runs, and every name MODEL_ONLY keeps from training must exist."""
    assert RECIPES, f"no recipes in {CONFIGS}"
    assert {"quickstart", "gpt2", "3d-8ranks", "moe"} <= {p.stem for p in RECIPES}
    for path in multi_rank_recipes():
        ranks = run_of(path)[0]
        assert ranks in SIZES, (f"{path.name} runs on {ranks} ranks, but the MPI suites run on {SIZES}: "
                                "no suite would train it")
    missing = set(MODEL_ONLY) - {p.stem for p in RECIPES}
    assert not missing, f"MODEL_ONLY names recipes that configs/ does not hold: {sorted(missing)}"
    assert {p.stem for p in one_rank_trained_recipes()} >= {"quickstart"}


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_sets_every_option_in_commented_groups(path: Path) -> None:
    """Complete: every `numesh train` option is written out, in groups of lines (separated by
    blank lines) that each start with a comment saying what the group does."""
    keys = {k.replace("-", "_") for k in tomllib.loads(path.read_text(encoding="utf-8"))}
    missing = [f.name for f in attrs.fields(TrainConfig) if f.name not in keys]
    assert not missing, f"{path.name} leaves out {missing}: a recipe writes out every option (add them)"
    body = path.read_text(encoding="utf-8").split("\n\n")[1:]  # after the header
    for group in filter(str.strip, body):
        first = group.strip().splitlines()[0]
        assert first.startswith("#"), f"{path.name}: the group starting {first!r} has no comment saying what it does"


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_is_the_run_its_header_says(path: Path) -> None:
    ranks, argv = run_of(path)
    same_ranks, same_argv = command(header_field(path, "same as"))
    assert same_ranks == ranks, f"{path.name}: `# run:` uses {ranks} ranks, `# same as:` {same_ranks}"
    got, want = attrs.asdict(config_of(argv)), attrs.asdict(config_of(same_argv))
    differ = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    assert not differ, f"{path.name} is not `{header_field(path, 'same as')}`: (recipe, command) differ in {differ}"


@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_passes_the_layout_validation_on_its_ranks(path: Path) -> None:
    ranks, argv = run_of(path)
    cfg = config_of(argv)
    shape, model = check_layout(cfg, ranks, vocab_of(path))
    assert math.prod(shape.values()) == ranks
    assert model.vocab_size == vocab_of(path) and model.n_layer == cfg.n_layer
    # a command-line option overrides the file, as the header says
    assert config_of([*argv, "--max-iters", "7", "--out", "elsewhere"]) == attrs.evolve(cfg, max_iters=7,
                                                                                         out="elsewhere")


@pytest.mark.parametrize("recipe, kind, want", [
    ("quickstart.toml", ["--arch", "llama"], ("rmsnorm", "rotary", "swiglu", False)),
    ("quickstart.toml", ["--model", "smollm2-135m"], ("rmsnorm", "rotary", "swiglu", True)),
    ("smollm2-135m.toml", ["--arch", "gpt2"], ("layernorm", "learned", "gelu", True)),
    ("smollm2-135m.toml", ["--model", "gpt2"], ("layernorm", "learned", "gelu", True)),
    ("quickstart.toml", ["--arch", "llama", "--norm", "layernorm"], ("layernorm", "rotary", "swiglu", False)),
    ("smollm2-135m.toml", ["--arch", "llama"], ("rmsnorm", "rotary", "swiglu", True)),  # its own kind: the file's
])
def test_a_kind_on_the_command_line_brings_its_parts_over_the_recipes(recipe: str, kind: list[str],
                                                                      want: tuple) -> None:
    """A recipe lists every part of its own kind; --arch or --model on the command line
    trained the file's parts under the other kind's name (GPT-2's block labelled llama).
    A part also given on the command line still wins."""
    cfg = config_of(["--config", str(CONFIGS / recipe), *kind])
    assert (cfg.norm, cfg.positions, cfg.mlp, cfg.tie_embeddings) == want


def test_a_gpt2_preset_over_a_llama_recipe_is_gpt2_in_train_and_plan() -> None:
    """--model gpt2 over configs/smollm2-135m.toml kept the file's 3 kv heads and SwiGLU
    width (GQA with a 1536-wide MLP under gpt2's name), and plan, which fills the preset
    itself, planned the file's Llama parts."""
    from numesh.plan.command import base_config

    recipe = CONFIGS / "smollm2-135m.toml"
    for cfg in (config_of(["--config", str(recipe), "--model", "gpt2"]), base_config({}, recipe, "gpt2")):
        model = cfg.model(50257)
        assert (cfg.arch, cfg.norm, cfg.mlp, model.kv_heads, model.hidden) == ("gpt2", "layernorm", "gelu", 12,
                                                                               4 * 768)


def test_gpt2_recipe_builds_gpt2s_model() -> None:
    """Not trained in the suite: its model is --model gpt2's shape with 92 M parameters."""
    path = CONFIGS / "gpt2.toml"
    cfg = config_of(run_of(path)[1])
    p = preset("gpt2")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.bias) == (
        p.n_layer, p.n_head, p.n_embd, p.block_size, True)
    model = cfg.model(vocab_of(path))
    model.validate(1)
    n_params = sum(math.prod(s) for s in tree_leaves(gpt_global_shapes(model)))
    assert round(n_params / 1e6) == GPT2_MILLIONS, n_params


@pytest.mark.parametrize("path", one_rank_trained_recipes(), ids=_id)
def test_one_rank_recipe_trains_one_step(path: Path, char_dataset: Path, tmp_path: Path) -> None:
    """`numesh train --config RECIPE` for one step on a tiny dataset, in a subprocess run
    from a scratch directory (nothing is written into the repository)."""
    _, argv = run_of(path)
    out = tmp_path / "run"
    more = ["--data", str(char_dataset), "--out", str(out), "--max-iters", "1", "--eval-iters", "1",
            "--peak-flops", "1e12"]
    proc = subprocess.run([sys.executable, "-m", "numesh.cli.app", "train", *argv, *more], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((out / "config.json").read_text())
    assert written == attrs.asdict(config_of([*argv, *more]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0]  # one step, then the final evaluation
    assert [r["step"] for r in records if "val_loss" in r] == [0, 1]
    assert all(math.isfinite(r[k]) for r in records for k in ("loss", "val_loss") if k in r)
    assert (out / "ckpt" / "step_000001").is_dir()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", multi_rank_recipes(), ids=_id)
def test_multi_rank_recipe_trains_on_its_ranks(path: Path, shared_dataset: Path, shared_tmp: Path) -> None:
    """One step of the recipe with a shrunk model on its own rank count: its mesh, schedule,
    ZeRO stage and experts compute what one rank computes (every logged loss and every
    updated parameter)."""
    ranks, argv = run_of(path)
    if WORLD.Get_size() != ranks:
        pytest.skip(f"{path.name} runs on {ranks} ranks: the {ranks}-rank MPI suite trains it")
    cfg: Any = config_of([*argv, *SHRINK, "--data", str(shared_dataset), "--out", str(shared_tmp / path.stem)])
    recipe = config_of(argv)
    kept = ("mesh", "micro_batches", "schedule", "virtual_stages", "zero", "moe_experts", "moe_top_k", "batch_size")
    assert all(getattr(cfg, k) == getattr(recipe, k) for k in kept)
    got = train_records(cfg, WORLD)
    assert [r["step"] for r in got[0] if "loss" in r] == [0]  # one step (then the final evaluation)
    assert_same_run(got, serial_reference(cfg))
