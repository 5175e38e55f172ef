"""What `numesh plan` does, as library functions the CLI calls with its parsed options."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from numesh.base.errors import ConfigError, UserError
from numesh.base.flags import flag, flag_value, n_ranks
from numesh.data.dataset import load_tokenizer
from numesh.plan.hardware import Profile, load_profile, local_profile_path
from numesh.plan.layout import ModelSpec
from numesh.plan.predict import Plan, plan
from numesh.plan.presets import preset
from numesh.plan.render import as_json, command, human_bytes, table
from numesh.run.config import LAYOUT_OPTIONS, TrainConfig, check_options, config_from, run_vocab

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15, "eb": 10**18,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "eib": 2**60}  # human_bytes' too


def parse_bytes(text: str) -> float:
    """'8GiB', '512 MB', '1e9' -> bytes: a finite size > 0 (0 would read as "no limit")."""
    bad = ConfigError(f"--memory-per-rank {text!r} is not a finite size > 0: a number, alone (bytes) or with one "
                      "of the units B, KB, MB, GB, TB, PB, EB, KiB, MiB, GiB, TiB, PiB, EiB, e.g. 8GiB, 512MiB or 16GB")
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise bad
    try:
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:
        raise bad from None
    if not (math.isfinite(size) and size > 0):
        raise bad
    return size


def check_mode(calibrate: bool, ranks: int | None, memory: str | None, profile_out: Path | None,
               planning: Sequence[str] = ()) -> None:
    """Options that belong to the other mode of `numesh plan` were silently ignored:
    --profile-out without --calibrate, --ranks, --memory-per-rank or the other `planning`
    options given (--hardware, --json, --top) with it."""
    if calibrate and ranks is not None:
        raise ConfigError("--calibrate measures the ranks of its own job (`mpirun -n N numesh plan --calibrate`): "
                          "drop --ranks, then plan with `numesh plan --ranks N`")
    if calibrate and memory is not None:
        raise ConfigError("--memory-per-rank is a limit for planning, not for --calibrate: drop one of them")
    if not calibrate and profile_out is not None:
        raise ConfigError("--profile-out is where --calibrate saves: pass --calibrate, or plan from a saved "
                          "profile with --hardware PATH")
    if calibrate and planning:
        raise ConfigError(f"{', '.join(planning)} {'is' if len(planning) == 1 else 'are'} for planning, not for "
                          "--calibrate (which measures this machine): drop one or the other")


def base_config(overrides: dict[str, Any], toml: Path | None, model_preset: str | None) -> TrainConfig:
    """TrainConfig defaults, then the preset's model and batch, then the options given."""
    values = {}
    if model_preset is not None:  # '' is an unknown preset, not none
        p = preset(model_preset)
        values = {**p.model_options(), "batch_size": p.batch_size}
    return config_from(overrides, toml, preset=values)


def model_spec(cfg: TrainConfig, vocab_size: int | None, model_preset: str | None) -> ModelSpec:
    """The model's sizes: the vocabulary from --vocab-size, the preset, or the dataset (as
    the run has it: a padded --init-from model's rows, `run_vocab`)."""
    if vocab_size is None and model_preset:
        vocab_size = preset(model_preset).vocab_size
    if vocab_size is None:
        try:
            vocab_size = run_vocab(cfg, load_tokenizer(cfg.data).vocab_size)
        except (UserError, OSError):
            raise ConfigError(f"no dataset at --data {cfg.data} to take the vocabulary from: pass --vocab-size, "
                              "--model PRESET or the --data of a prepared dataset") from None
    if vocab_size < 1:
        raise ConfigError(f"--vocab-size must be >= 1, got {vocab_size}")
    cfg.model(vocab_size).validate()  # a model no layout can run is said as such, not as "no layout uses N ranks"
    return ModelSpec.of(cfg, vocab_size)


def _itemsize(cfg: TrainConfig, profile: Profile) -> int:
    """Bytes per value: numesh's --dtype on a measured profile (which must be calibrated in
    it), the profile's training dtype on a spec-sheet one."""
    if not profile.measured:
        return profile.itemsize
    if profile.dtype != cfg.dtype:
        raise ConfigError(f"profile {profile.name} was calibrated in {profile.dtype}, not --dtype {cfg.dtype}: "
                          f"run `numesh plan --calibrate --dtype {cfg.dtype}`")
    return np.dtype(cfg.dtype).itemsize


def memory_limit(profile: Profile, ranks: int, given: str | None) -> float:
    """Bytes per rank: --memory-per-rank, else a device's memory, or a measured machine's RAM shared by its ranks."""
    if given is not None:
        return parse_bytes(given)
    if profile.measured:
        return profile.memory_bytes / max(1, ranks)
    return profile.memory_bytes


MAX_RANKS = 2**20  # well past any machine's rank count; the search's divisor scans stay quick


def run_plan(overrides: dict[str, Any], toml: Path | None, ranks: int | None, model_preset: str | None,
             vocab_size: int | None, memory: str | None, hardware: str, as_json_out: bool, top: int,
             log: Callable[[str], None]) -> str:
    """`numesh plan`'s output (the table or the JSON list); `log` gets a note when a measured
    profile's numbers for `ranks` come from another rank count's measurements."""
    if ranks is None or ranks < 1:
        raise ConfigError("give --ranks N (the ranks to plan for, >= 1), or --calibrate to measure this machine")
    if ranks > MAX_RANKS:  # 1e18 ranks searched their neighbours' divisors for minutes, silently
        raise ConfigError(f"--ranks {ranks:,} is more than numesh plans for: give at most {MAX_RANKS:,}")
    if top < 1:
        raise ConfigError(f"--top must be >= 1 (layouts in the table), got {top}")
    searched = [flag(k) for k in LAYOUT_OPTIONS
                if overrides.get(k) is not None and (k, overrides[k]) != ("mesh", "auto")]
    if searched:  # given on the command line (a --config recipe's own layout is read, and searched over)
        raise ConfigError(f"numesh plan searches the layout over every value of {', '.join(searched)}: leave "
                          f"{'it' if len(searched) == 1 else 'them'} out (each listed layout's command names its own)")
    if overrides.get("overlap") is False:  # accepted, ignored and echoed on the best: line once
        raise ConfigError("numesh plan times the gradient reduction overlapped with backward where the hardware "
                          "progresses it (train's default, --overlap): leave --no-overlap out")
    cfg = base_config(overrides, toml, model_preset)
    check_options(attrs.evolve(cfg, mesh=""), 1)
    model = model_spec(cfg, vocab_size, model_preset)
    profile = load_profile(hardware)
    if note := profile.extrapolation(ranks):
        log(note)
    itemsize = _itemsize(cfg, profile)
    limit = memory_limit(profile, ranks, memory)
    threads = max(1, (profile.cores or 1) // ranks) if profile.measured else 1
    found = plan(cfg, model, ranks, profile, limit, itemsize, threads, log)
    if not found.fitting:
        raise ConfigError(_fits_nowhere(found, ranks, limit))
    extra = _train_options(overrides, toml, model_preset, cfg)
    if as_json_out:  # each row's command, the best: line's for its layout (train_flags alone trained another model)
        return json.dumps([{**as_json(p, ranks), "command": command(p, ranks, extra, toml is not None)}
                           for p in found.fitting], indent=1)
    return table(found, ranks, top, limit, profile.name, extra, recipe=toml is not None)


def _train_options(overrides: dict[str, Any], toml: Path | None, model_preset: str | None, cfg: TrainConfig) -> str:
    """The `numesh train` options, besides the layout's, that run the model planned: those
    given, the --config recipe, a preset's shape."""
    extra = " ".join(flag_value(k, v) for k, v in overrides.items() if v is not None and k not in LAYOUT_OPTIONS)
    if toml is not None:  # the recipe's model (its experts, its kind) is what was planned: train reads it too
        extra = f"--config {shlex.quote(str(toml))} {extra}".strip()
    if model_preset:
        p = preset(model_preset)
        # the preset's kind and its biases (GPT-2's and GPT-3's: --bias, off by default in train); its rotary
        # base only for rotary positions (train refuses --rope-theta with --positions learned); an option the
        # command line gave is said once, as given
        shape = {"n_layer": p.n_layer, "n_head": p.n_head, "n_embd": p.n_embd, "block_size": p.block_size,
                 **{k: v for k, v in p.parts.items()
                    if (k != "bias" or v) and (k != "rope_theta" or cfg.positions == "rotary")},
                 "batch_size": cfg.batch_size}
        extra = " ".join([*(flag_value(k, v) for k, v in shape.items() if overrides.get(k) is None), extra]).strip()
    return extra


def _fits_nowhere(found: Plan, ranks: int, limit: float) -> str:
    assert found.smallest is not None  # plan names it whenever nothing fits
    if found.at_least:
        return (f"no layout of this model fits in {human_bytes(limit)} per rank on {n_ranks(ranks)}: even "
                f"{found.smallest.train_flags()} needs at least {human_bytes(found.smallest_bytes)} per rank, its "
                "blocks' parameters and gradients alone; use a smaller --n-layer or --n-embd, more ranks, or "
                "--memory-per-rank above that")
    return (f"no layout of this model fits in {human_bytes(limit)} per rank on {n_ranks(ranks)}: the smallest, "
            f"{found.smallest.train_flags()}, needs {human_bytes(found.smallest_bytes)}; give more ranks, "
            f"--memory-per-rank of at least that, or a smaller model or --batch-size")


def run_calibrate(overrides: dict[str, Any], toml: Path | None, model_preset: str | None, vocab_size: int | None,
                  out: Path | None, log: Callable[[str], None]) -> Path | None:
    """Measure this machine with the ranks of COMM_WORLD; save (rank 0) and return the profile's path."""
    from numesh.plan.calibrate import run_calibration

    if overrides.get("overlap") is False:  # accepted, ignored and echoed on the best: line once
        raise ConfigError("numesh plan times the gradient reduction overlapped with backward where the hardware "
                          "progresses it (train's default, --overlap): leave --no-overlap out")
    cfg = base_config(overrides, toml, model_preset)
    check_options(attrs.evolve(cfg, mesh=""), 1)
    model = model_spec(cfg, vocab_size, model_preset)
    return run_calibration(cfg, model, out or local_profile_path(), log)
