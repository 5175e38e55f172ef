"""The command line's help texts and bad values, as a user meets them (issue #18, points 4 and 11)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import cli, one_error_line
from numesh.cli.app import app

COMMANDS = (["train"], ["sample"], ["reshard"], ["export"], ["data", "shakespeare-char"])


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_help_is_plain_and_consistent(cmd: list[str]) -> None:
    out = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    text = out.output
    assert "<bool>" not in text  # flags take no value
    assert "{" not in text.splitlines()[0]  # usage names arguments CKPT, not {ckpt}
    assert "(default:" not in text  # one style: [default: ...]
    flat = " ".join(text.split())  # click wraps long lines; compare the words
    assert "[default: ]" not in flat  # a default that is a line break once broke the layout


def test_sample_prompt_default_is_named() -> None:
    text = " ".join(CliRunner().invoke(app, ["sample", "--help"]).output.split())
    assert "text to continue [default: (a newline)]" in text


def test_plan_help_names_every_axis_the_search_covers() -> None:
    """--ranks said "every dp x cp x tp x pp layout"; the search covers ep too (for experts)."""
    text = " ".join(CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "100"}).output.split())
    assert "every pp x dp x ep x cp x tp layout of them; ep > 1 only for a model with experts" in text


def test_train_help_shows_every_default_in_brackets() -> None:
    text = " ".join(CliRunner().invoke(app, ["train", "--help"]).output.split())
    assert ("--max-iters <int> optimiser steps (0: evaluate the starting weights, e.g. --init-from's, and save "
            "them as a checkpoint) [default: 2000]") in text
    assert "[default: off]" in text  # --bias


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 0"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--mesh", "cp=2"], "sampling does not run with context parallelism: use a mesh without cp"),
    ],
)
def test_sample_bad_values_are_one_line(args: list[str], message: str) -> None:
    assert message in one_error_line(cli("sample", "--ckpt", "nowhere", *args))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "seed must be >= 0"),
        (["--learning-rate", "-1"], "learning_rate must be > 0"),
        (["--beta2", "1.5"], "beta2 must be in [0, 1)"),
        (["--out", "{file}"], "is a file, not a directory"),
    ],
)
def test_train_bad_values_are_one_line(char_dataset, tmp_path, args: list[str], message: str) -> None:
    (tmp_path / "afile").write_text("x")
    args = [a.replace("{file}", str(tmp_path / "afile")) for a in args]
    assert message in one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), *args))


def test_train_model_preset_fills_the_shape_options_not_given() -> None:
    from numesh.cli.app import _preset_shape, train_config

    assert _preset_shape(None) == {}
    assert _preset_shape("gpt2") == {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "bias": True,
                                     "arch": "gpt2", "n_kv_head": 0, "ffn_hidden": 0}  # its kind whole
    cfg = train_config({"n_layer": 2, "n_head": None, "batch_size": 4, "model_preset": "gpt2"})
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.bias, cfg.batch_size) == (2, 12, 768, 1024,
                                                                                                True, 4)


def test_train_unknown_model_preset_is_one_line(tmp_path) -> None:
    from conftest import cli, one_error_line

    line = one_error_line(cli("train", "--model", "gpt5", "--out", str(tmp_path / "o"), "--max-iters", "1"))
    assert "unknown model preset 'gpt5'" in line


def test_preset_is_another_name_for_model(tmp_path) -> None:
    from conftest import cli, one_error_line

    line = one_error_line(cli("train", "--preset", "gpt5", "--out", str(tmp_path / "o"), "--max-iters", "1"))
    assert "unknown model preset 'gpt5'" in line
    line = one_error_line(cli("plan", "--preset", "gpt5", "--ranks", "4", "--hardware", "a100-80gb"))
    assert "unknown model preset 'gpt5'" in line


@pytest.mark.parametrize("args", [["--help"], ["train", "--max-iters", "1"]], ids=["help", "train"])
def test_no_mpi_library_is_one_line(tmp_path, args: list[str]) -> None:
    """A machine without an MPI library (numesh installed without the mpich wheel or a system
    MPI): every command says so in one line with what to install, not mpi4py's traceback.
    MPI4PY_LIBMPI pointing nowhere makes mpi4py fail to load one, as it does there. `train`
    loads MPI inside its start-up signal guard (numesh/host/startup_signals.py), the others
    just after it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so")}
    res = subprocess.run([sys.executable, "-m", "numesh.cli.app", *args], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: mpi4py finds no MPI library"), res.stderr
    assert "pip install mpich" in lines[0]
