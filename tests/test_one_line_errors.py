"""Nothing silently wrong: options and environment variables that used to be ignored or to
produce nonsense (a NaN temperature, an empty --out, NUMESH_KERNELS=cuda, OMP_NUM_THREADS=abc,
--max-iters 0), and the retired --recompute selective, are one `error:` line and exit
status 2, and that line is the first one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

from conftest import cli, one_error_line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-0.5"])
def test_sample_refuses_a_temperature_that_is_not_a_finite_number_ge_0(value: str) -> None:
    line = one_error_line(cli("sample", "--ckpt", "nowhere", "--temperature", value))
    assert "--temperature must be >= 0 and finite" in line


def test_generate_refuses_a_nan_temperature_too() -> None:
    from numesh.base.errors import ConfigError
    from numesh.run.sample import SampleConfig

    with pytest.raises(ConfigError, match="temperature must be >= 0 and finite"):
        SampleConfig("nowhere", temperature=float("nan")).validate()


@pytest.mark.parametrize("kv, says", [
    (dict(max_new_tokens="5"), "--max-new-tokens must be an integer, got '5'"),  # was a TypeError
    (dict(top_k=2.5), "--top-k must be an integer, got 2.5"),  # was accepted
    (dict(temperature="0.5"), "--temperature must be a number, got '0.5'"),
    (dict(num_samples=1.5), "--num-samples must be an integer, got 1.5"),
])
def test_a_sample_config_of_the_wrong_type_is_one_line(kv: dict, says: str) -> None:
    from numesh.base.errors import ConfigError
    from numesh.run.sample import SampleConfig

    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        SampleConfig("nowhere", **kv).validate()
    SampleConfig("nowhere", top_k=np.int64(3), max_new_tokens=np.int32(2), temperature=np.float32(0.5)).validate()


@pytest.mark.parametrize("seed, says", [(-1, "seed must be >= 0, got -1"), (None, "seed must be an integer, got None"),
                                        ("1", "seed must be an integer, got '1'")])
def test_init_gpt_refuses_a_seed_that_is_no_integer_ge_0(seed: object, says: str) -> None:
    """seed=-1 was NumPy's ValueError, None a TypeError, and "1" was accepted."""
    from numesh.base.errors import ConfigError
    from numesh.mesh import Mesh
    from numesh.nn.gpt import GPTConfig, init_gpt

    cfg = GPTConfig(vocab_size=17, n_layer=1, n_head=2, n_embd=16, block_size=8)
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        init_gpt(cfg, Mesh.create(), seed=seed)
    init_gpt(cfg, Mesh.create(), seed=np.int64(1))


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_an_error_not_the_current_directory(char_dataset: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, out: str) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", out, "--max-iters", "1"))
    assert "--out must name a directory" in line
    assert list(work.iterdir()) == []  # no lock, config, metrics or ckpt/ here


def test_recompute_selective_is_retired_in_one_line(char_dataset: Path, tmp_path: Path) -> None:
    """The fused attention keeps nothing T×T, so selective recomputation is gone: asking for
    it is one line saying so, before anything is written."""
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "1",
                              "--recompute", "selective"))
    assert "--recompute selective is retired" in line
    assert not (tmp_path / "o").exists()


def test_negative_max_iters_is_refused(char_dataset: Path, tmp_path: Path) -> None:
    """(0 evaluates the starting weights and saves them: tests/test_hf_llama.py)"""
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "-1"))
    assert "max_iters must be >= 0, got -1" in line


@pytest.mark.parametrize("args, min_lr, lr", [(["--min-lr", "0.01"], "0.01", "0.001"),  # the default peak
                                               (["--learning-rate", "5e-05", "--min-lr", "1e-4"], "0.0001", "5e-05")])
def test_a_min_lr_above_the_learning_rate_is_one_line_naming_both(char_dataset: Path, tmp_path: Path, args: list[str],
                                                                  min_lr: str, lr: str) -> None:
    """The cosine decay would raise the rate from its peak to --min-lr (it trained so silently)."""
    tiny = ("--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8", "--max-iters", "1")
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), *tiny, *args))
    assert f"--min-lr {min_lr} is above --learning-rate {lr}, the peak it decays from: " \
           f"set --min-lr to at most {lr}" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("var, value", [("OMP_NUM_THREADS", "abc"), ("OPENBLAS_NUM_THREADS", "0"),
                                        ("OMP_NUM_THREADS", "-2"), ("MKL_NUM_THREADS", "abc")])
def test_a_bad_thread_variable_is_one_line_naming_it(char_dataset: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    """Also when an earlier one is good: MKL_NUM_THREADS=abc beside OMP_NUM_THREADS=1 was ignored."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    if var != "OMP_NUM_THREADS":
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(var, value)
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "1"))
    assert f"{var}='{value}' must be a whole number >= 1" in line


def test_thread_variables_that_are_numbers_or_empty_still_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from numesh.host.runtime import env_threads

    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert env_threads() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert env_threads() == 3


def test_an_unknown_numesh_kernels_is_one_line_at_start_up(char_dataset: Path, tmp_path: Path) -> None:
    """Read when numesh.host.kernels is imported, so the CLI runs in a fresh process: importing
    still works, and `numesh train` stops with one line naming the values it accepts."""
    env = {**os.environ, "NUMESH_KERNELS": "cuda"}
    code = ("import sys; import numesh.host.kernels; from numesh.cli.app import main; "
            "sys.argv = ['numesh', *sys.argv[1:]]; main()")
    res = subprocess.run([sys.executable, "-c", code, "train", "--data", str(char_dataset), "--out",
                          str(tmp_path / "o"), "--max-iters", "1"], env=env, capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    assert res.stderr.splitlines() == ["error: NUMESH_KERNELS='cuda' is not one of numba, numpy "
                                       "(or unset/empty for numba when installed)"], res.stderr
    assert not (tmp_path / "o").exists()


def test_a_ctrl_c_during_the_commands_imports_is_one_line() -> None:
    """The console script's `numesh.cli.main` imports the app (numba, MPI: a moment); a
    KeyboardInterrupt there, raised here by an import hook at the app's import, exits 130
    with one line, as a Ctrl-C does once a command runs, not with a traceback."""
    code = ("import sys\n"
            "class Stop:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'numesh.cli.app':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Stop())\n"
            "import numesh.cli\n"
            "numesh.cli.main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stderr) == (130, "interrupted\n")


@pytest.mark.parametrize("mode", ["numba", "numpy", "", " NumPy "])
def test_the_numesh_kernels_values_it_accepts_pass(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    import numesh.host.kernels as K

    monkeypatch.setattr(K, "_MODE", mode.strip().lower())
    K.check_mode()


def test_a_train_error_is_the_first_line_not_after_a_blank_one(char_dataset: Path, tmp_path: Path) -> None:
    """The progress bar, never started, printed a newline when it closed (rich's Progress.stop
    on a non-terminal), before the error line."""
    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--mesh", "tp=3")
    one_error_line(res)
    assert res.stderr.startswith("error: mesh pp=1,dp=1,ep=1,cp=1,tp=3 needs 3 ranks"), repr(res.stderr)


def _float_options() -> list[str]:
    import attrs

    from numesh.run.config import TrainConfig, field_type

    return [f.name for f in attrs.fields(TrainConfig) if field_type(f) is float]


@pytest.mark.parametrize("name", _float_options())
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_no_float_option_of_train_or_plan_takes_nan_or_inf(name: str, value: float) -> None:
    """Range checks compare, and NaN compares False: --weight-decay nan, --grad-clip nan,
    --min-lr inf, --peak-flops inf, --collective-timeout nan used to be accepted (and
    --bucket-mb nan was a traceback in `numesh plan`)."""
    from numesh.base.errors import ConfigError
    from numesh.run.config import check_options, config_from

    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be a finite number, got {value}"):
        check_options(config_from({name: value}), 1)


def test_a_nan_in_the_toml_config_is_one_line_too(char_dataset: Path, tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("weight_decay = nan\n")
    line = one_error_line(cli("train", "--config", str(toml), "--data", str(char_dataset), "--out",
                              str(tmp_path / "o")))
    assert line == "error: --weight-decay must be a finite number, got nan"
    assert not (tmp_path / "o").exists()


def test_a_recipes_mesh_for_other_ranks_names_the_file(char_dataset: Path, tmp_path: Path) -> None:
    """Was "... or change --mesh", an option the user never passed; --mesh on the command line
    is still told to change it."""
    toml = tmp_path / "run.toml"
    toml.write_text('mesh = "dp=2,tp=2"\n')
    run = ["train", "--config", str(toml), "--data", str(char_dataset), "--out", str(tmp_path / "o")]
    assert one_error_line(cli(*run)) == (f"error: mesh pp=1,dp=2,ep=1,cp=1,tp=2 (in {toml}) needs 4 ranks but the job "
                                         f"has 1: run with mpirun -n 4 or pass --mesh")
    assert one_error_line(cli(*run, "--mesh", "dp=2")).endswith("needs 2 ranks but the job has 1: run with mpirun "
                                                                "-n 2 or change --mesh")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, says", [
    (["--muon-momentum", "2"], "--muon-momentum applies to --optimizer muon, and this run's is adamw"),
    (["--optimizer", "adamw", "--muon-ns-steps", "-1"], "--muon-ns-steps applies to --optimizer muon"),
    (["--moe-top-k", "3"], "--moe-top-k applies to a model with experts, and this one has none"),
    (["--moe-capacity-factor", "2"], "--moe-capacity-factor applies to a model with experts"),
    (["--rope-theta", "500000"], "--rope-theta applies to rotary positions, and this model's are learned: pass "
                                 "--positions rotary or drop --rope-theta"),
    (["--arch", "llama", "--positions", "learned", "--rope-theta", "5e5"], "--rope-theta applies to rotary"),
])
def test_an_option_the_run_would_ignore_is_one_line(char_dataset: Path, tmp_path: Path, args: list[str],
                                                    says: str) -> None:
    """Another optimiser's option, or an MoE option on a dense model, used to train as if
    it were not there."""
    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "1", "--n-layer", "1",
              "--n-embd", "8", "--block-size", "8", "--eval-iters", "1", "--peak-flops", "1e12", *args)
    line = one_error_line(res)
    assert line.startswith(f"error: {says}"), line
    assert not (tmp_path / "o").exists()


def test_a_config_file_sets_an_unused_option_only_at_its_default(tmp_path: Path) -> None:
    """A recipe lists every key, those it does not use at their defaults (configs/*.toml);
    one set to another value is the command line's error, naming the file."""
    from numesh.base.errors import ConfigError
    from numesh.run.config import config_from

    toml = tmp_path / "run.toml"
    toml.write_text('optimizer = "adamw"\nmuon_momentum = 0.95\nmoe_experts = 0\nmoe_top_k = 2\n')
    assert config_from({}, toml).muon_momentum == 0.95
    toml.write_text('optimizer = "adamw"\nmuon_momentum = 0.9\n')
    with pytest.raises(ConfigError, match=f"--muon-momentum \\(in {toml}\\) applies to --optimizer muon"):
        config_from({}, toml)
    assert config_from({"optimizer": "muon"}, toml).muon_momentum == 0.9


def test_rope_theta_is_refused_only_where_the_user_gave_it_to_learned_positions(tmp_path: Path) -> None:
    """--rope-theta on a model of learned positions trained as if it were not there. A
    preset's theta is not the user's (--model smollm2-135m --positions learned fills it), nor
    a rotary recipe's under another kind named on the command line; a file that sets it for
    its own learned positions is refused, naming the file."""
    from numesh.base.errors import ConfigError
    from numesh.cli.app import train_config
    from numesh.plan.command import base_config
    from numesh.run.config import config_from

    options = {"model_preset": "smollm2-135m", "positions": "learned"}
    assert train_config(options).positions == "learned"
    assert base_config({"positions": "learned"}, None, "smollm2-135m").positions == "learned"
    with pytest.raises(ConfigError, match="--rope-theta applies to rotary positions"):
        train_config({**options, "rope_theta": 1e6})
    recipe = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m.toml"
    for kind in ({"arch": "gpt2"}, {"positions": "learned"}):
        assert config_from(kind, recipe).positions == "learned"
    assert config_from({"arch": "llama", "rope_theta": 5e5}).rope_theta == 5e5
    toml = tmp_path / "run.toml"
    toml.write_text('arch = "gpt2"\nrope_theta = 10000.0\n')  # a recipe's key at its default
    assert config_from({}, toml).positions == "learned"
    toml.write_text('arch = "llama"\npositions = "learned"\nrope_theta = 5e5\n')
    with pytest.raises(ConfigError, match=f"--rope-theta \\(in {toml}\\) applies to rotary positions"):
        config_from({}, toml)
    assert config_from({"positions": "rotary"}, toml).rope_theta == 5e5


def test_a_warmup_past_the_decay_point_is_one_line(char_dataset: Path, tmp_path: Path) -> None:
    """--warmup-iters 10 --lr-decay-iters 2 used to train: the rate climbed to step 10 and
    then fell to --min-lr at once. Without decay (--min-lr at --learning-rate) it may."""
    from numesh.run.config import check_options, config_from

    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--warmup-iters", "10",
              "--lr-decay-iters", "2", "--max-iters", "1", "--n-layer", "1", "--n-embd", "8", "--block-size", "8",
              "--eval-iters", "1", "--peak-flops", "1e12")
    assert one_error_line(res) == ("error: --warmup-iters 10 ends after --lr-decay-iters 2, the step where the decay "
                                   "reaches --min-lr: use a --lr-decay-iters of at least 10 or fewer --warmup-iters")
    assert not (tmp_path / "o").exists()
    check_options(config_from(dict(warmup_iters=10, lr_decay_iters=10)), 1)
    check_options(config_from(dict(warmup_iters=10, lr_decay_iters=0, learning_rate=1e-3, min_lr=1e-3)), 1)
    # the default warm-up (100) past --lr-decay-iters 50 of a 50-step run: nanoGPT's habit, and
    # such a run's requeue with its own command, are not refused for a warm-up nobody set
    check_options(config_from(dict(max_iters=50, lr_decay_iters=50)), 1)


@pytest.mark.parametrize("option, value", [("--data", ""), ("--data", " "), ("--resume", " "), ("--init-from", "\t")])
def test_a_blank_path_option_is_one_line(char_dataset: Path, tmp_path: Path, option: str, value: str) -> None:
    """A blank --data or --resume once read as the directory '' ("no checkpoint at  :")."""
    args = ["--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "1", option, value]
    line = one_error_line(cli("train", *args))
    assert line == f"error: {option} must name a path, got {value!r}"


def test_an_empty_model_preset_is_unknown_not_none(char_dataset: Path, tmp_path: Path) -> None:
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--model", ""))
    assert "unknown model preset ''" in line


def test_a_run_that_cannot_fit_in_memory_is_refused_at_once(char_dataset: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--block-size 100000` once allocated for 99 s and died in a 59-line _ArrayMemoryError:
    the planner's bytes per rank are now checked against free memory before anything is
    allocated (here a batch of 10^8 sequences, terabytes on any machine). "At once" is held
    by order, not by a clock: the one line comes before any Trainer is built (one built here
    would fail the test) and before the run directory is made."""
    import numesh.run.train

    def no_trainer(*_a: object, **_k: object) -> None:
        raise AssertionError("a Trainer was built before the memory check refused the run")

    monkeypatch.setattr(numesh.run.train, "Trainer", no_trainer)
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"),
                              "--batch-size", str(10**8)))
    assert line.startswith("error: this run needs ~") and " TiB per rank (" in line and " is free here" in line
    assert "--block-size" in line and "numesh plan --ranks N" in line
    assert not (tmp_path / "o").exists()


def test_a_model_of_too_many_layers_is_one_line_in_train_and_plan(char_dataset: Path, tmp_path: Path) -> None:
    """`--n-layer 1000000000` (up to 2**53) was a MemoryError traceback: the memory check,
    and the plan, listed every block of a rank before weighing any. The blocks' own bytes
    are now weighed first, without listing them."""
    n = str(10**15)  # a list of that many blocks fails at once; 10**9's took gigabytes first
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--n-layer", n))
    assert line.startswith("error: this run's 1,000,000,000,000,000 blocks need at least "), line
    assert " is free here" in line and "smaller --n-layer" in line
    assert " EiB per rank " in line, line  # not a 10-digit count of TiB
    assert not (tmp_path / "o").exists()
    line = one_error_line(cli("plan", "--n-layer", n, "--ranks", "2", "--vocab-size", "100", "--hardware",
                              "a100-80gb"))
    assert line.startswith("error: no layout of this model fits in 80.0 GiB per rank on 2 ranks: even --mesh "), line
    assert "blocks' parameters and gradients alone; use a smaller --n-layer" in line


def test_the_memory_check_names_both_numbers_and_leaves_the_readmes_runs_alone() -> None:
    from numesh.base.errors import ConfigError
    from numesh.plan.fits import check_fits, run_memory
    from numesh.plan.memory import RankMemory
    from numesh.run.config import config_from

    need = RankMemory(params=2**30, grads=2**30, optimizer=2**31, workspace=0, activations=4 * 2**30, comm_buffers=0)
    with pytest.raises(ConfigError, match=r"needs ~8.0 GiB per rank \(4.0 GiB of it activations\) but 4.0 GiB of "
                                          r"memory is free here, 1.0 GiB for each of 4 ranks: "):
        check_fits(need, 2**30, 4)
    check_fits(need, 8 * 2**30, 1)
    one = {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1}
    assert run_memory(config_from({}), one, 65, 16).total < 100 * 2**20  # the quick start: tens of MiB
    gpt2 = config_from({"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "bias": True,
                        "batch_size": 4})
    assert run_memory(gpt2, one, 8192, 2).total < 6 * 2**30  # the README's GPT-2 step: 5.4 GiB peak RSS measured


# ---------------------------------------------------------------------------------------
# files a command cannot write or read: one line, whatever the filesystem says


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import make_dataset

    root = tmp_path_factory.mktemp("run")
    data = make_dataset(root / "data")
    res = cli("train", "--data", str(data), "--out", str(root / "run"), "--n-layer", "1", "--n-head", "2",
              "--n-embd", "16", "--block-size", "8", "--batch-size", "4", "--max-iters", "2", "--eval-iters", "1",
              "--peak-flops", "1e12")
    assert res.exit_code == 0, res.output
    return root / "run"


def _in_the_way(tmp_path: Path) -> Path:
    """A file where a directory must be: writing under it fails for root too (a read-only
    directory does not stop root, who runs these tests in some containers)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker


@pytest.mark.parametrize("command", [
    ["reshard", "{ckpt}", "--to", "tp=2", "--out", "{bad}/x"],  # was a 12-line OSError
    ["export", "{ckpt}", "--out", "{bad}/m.safetensors"],  # was "exists: pass --force to overwrite"
    ["export", "{ckpt}", "--out", "{bad}/hf", "--format", "hf"],
    ["plot", "{run}", "--out", "{bad}/loss.png"],  # was "(File exists)"
    ["train", "--data", "{data}", "--out", "{bad}/run", "--max-iters", "1"],  # said after measuring the MFU peak
    # a traceback, after calibrating
    ["plan", "--calibrate", "--data", "{data}", "--profile-out", "{bad}/local.json"],
])
def test_an_output_under_a_file_is_one_line_naming_the_file(tiny_run: Path, tmp_path: Path,
                                                            command: list[str]) -> None:
    bad = _in_the_way(tmp_path)
    names = {"ckpt": str(tiny_run / "ckpt" / "latest"), "run": str(tiny_run), "bad": str(bad),
             "data": str(tiny_run.parent / "data")}
    line = one_error_line(cli(*[part.format(**names) for part in command]))
    assert f"{bad} is a file, not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_reshard_into_a_read_only_directory_is_one_line(tiny_run: Path, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = one_error_line(cli("reshard", str(tiny_run / "ckpt" / "latest"), "--to", "tp=2", "--out",
                                  str(ro / "x")))
    finally:
        ro.chmod(0o755)
    assert line == f"error: cannot write --out {ro / 'x'}: Permission denied: choose another --out"


@pytest.mark.parametrize("text, says", [
    ('{"traceEvents": [{"ph": "X", "pid"', "cannot be read as a trace (Expecting"),  # cut off mid-write
    ("", "cannot be read as a trace (Expecting value"),
    ("{}", "is not a numesh trace (no traceEvents or no otherData.numesh)"),
    ("[]", "is not a numesh trace"),
    ('{"traceEvents": [], "otherData": {"numesh": {"mesh": {}}}}', "is not a complete numesh trace (ValueError"),
])
def test_report_on_a_broken_trace_is_one_line(tmp_path: Path, text: str, says: str) -> None:
    """A truncated or `{}` trace.json was a 17–20-line traceback."""
    path = tmp_path / "trace.json"
    path.write_text(text)
    for target in (path, tmp_path):  # the file, or the run directory holding it
        line = one_error_line(cli("report", str(target)))
        assert line.startswith(f"error: {path} ") and says in line
        assert line.endswith("write a new one with `numesh train --trace --out OUT`")


def test_report_on_a_flight_directory_it_cannot_read_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "meta-0.json").write_text("{}")
    line = one_error_line(cli("report", str(tmp_path)))
    assert "not found and no flight record there" in line


@pytest.mark.parametrize("what", ["a directory", "a run directory", "a text file", "a cut-off export"])
def test_sample_from_something_that_is_not_a_checkpoint_is_one_line(tiny_run: Path, tmp_path: Path,
                                                                    what: str) -> None:
    ckpt = {"a directory": tmp_path, "a run directory": tiny_run, "a text file": tiny_run / "config.json"}.get(what)
    if what == "a cut-off export":
        whole = tmp_path / "m.safetensors"
        assert cli("export", str(tiny_run / "ckpt" / "latest"), "--out", str(whole)).exit_code == 0
        ckpt = tmp_path / "cut.safetensors"
        ckpt.write_bytes(whole.read_bytes()[:100])
    line = one_error_line(cli("sample", "--ckpt", str(ckpt), "--max-new-tokens", "2"))
    assert str(ckpt) in line


@pytest.mark.parametrize("what", ["a transformers directory", "an export file", "a dataset"])
def test_a_checkpoint_reader_given_another_kind_of_input_says_what_it_is(tiny_run: Path, tmp_path: Path,
                                                                         what: str) -> None:
    """reshard (export, --resume) of a transformers directory said its meta.json was missing,
    of an export file that it was no checkpoint directory, and sample of a dataset that its
    meta.json's format was None: each names what it is and the command that reads it."""
    ckpt = str(tiny_run / "ckpt" / "latest")
    if what == "a dataset":
        src = tiny_run.parent / "data"
        says = (f"is a dataset (`numesh data` wrote it), not a checkpoint: `numesh train --data {src}` trains on "
                "it; pass a checkpoint directory such as RUN/ckpt/latest")
    elif what == "an export file":
        src = tmp_path / "m.safetensors"
        assert cli("export", ckpt, "--out", str(src)).exit_code == 0
        says = (f"is a file (an exported model?), not a checkpoint directory: `numesh train --init-from {src}` "
                f"starts a run from a `numesh export` file's weights and `numesh sample {src}` samples from it; pass "
                "a checkpoint directory such as RUN/ckpt/latest")
    else:
        src = tmp_path / "hf"
        assert cli("export", ckpt, "--format", "hf", "--out", str(src)).exit_code == 0
        says = (f"is a transformers model directory (model_type 'gpt2'), not a numesh checkpoint: `numesh train "
                f"--init-from {src}` starts a run from its weights and `numesh sample {src}` samples from it")
    commands = [["reshard", str(src), "--to", "tp=2"], ["export", str(src), "--out", str(tmp_path / "x.safetensors")],
                ["train", "--data", str(tiny_run.parent / "data"), "--resume", str(src), "--out", str(tmp_path / "r"),
                 "--max-iters", "1"]]
    if what == "a dataset":
        commands.append(["sample", str(src), "--max-new-tokens", "2"])
    else:  # what the line says reads it does
        assert cli("sample", str(src), "--max-new-tokens", "2").exit_code == 0
    for command in commands:
        assert one_error_line(cli(*command)) == f"error: {src} {says}", command


def test_sample_takes_the_checkpoint_as_an_argument_or_an_option_once(tiny_run: Path) -> None:
    """`numesh sample CKPT`, as export and reshard take theirs, or `--ckpt CKPT`: the same
    text; neither or both is one line."""
    ckpt = str(tiny_run / "ckpt" / "latest")
    args = ("--max-new-tokens", "8", "--temperature", "0")
    texts = [cli("sample", ckpt, *args), cli("sample", "--ckpt", ckpt, *args)]
    assert all(t.exit_code == 0 for t in texts) and texts[0].stdout == texts[1].stdout
    for given in ((), (ckpt, "--ckpt", ckpt)):
        assert "name the checkpoint once" in one_error_line(cli("sample", *given, *args))


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-30])
def test_a_tiny_temperature_samples_the_most_likely_token_not_token_0(temperature: float) -> None:
    """Dividing by 1e-320 before subtracting the largest logit made inf - inf = NaN and every
    draw token 0: a newline, like the NaN temperature the issue found."""
    import numpy as np

    from numesh.run.sample import pick

    logits = np.array([[1.0, 3.0, 2.0], [5.0, -1.0, 4.5]], dtype=np.float32)
    for top_k in (None, 2):
        got = pick(logits, temperature, top_k, np.random.default_rng(0))
        np.testing.assert_array_equal(got, [1, 0])


def test_the_run_never_lands_in_its_dataset_directory(char_dataset: Path) -> None:
    """--out equal to --data wrote config.json, metrics.jsonl and ckpt/ among the token files."""
    before = sorted(p.name for p in char_dataset.iterdir())
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(char_dataset / "." / ""),
                              "--max-iters", "1"))
    assert line == f"error: --out {char_dataset} is the dataset directory --data: name another directory for the run"
    assert sorted(p.name for p in char_dataset.iterdir()) == before


def test_export_to_an_empty_out_is_refused_not_the_current_directory(tiny_run: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out ""` (an unset shell variable) is Path("."): with --format hf --force the export
    landed among the current directory's files."""
    monkeypatch.chdir(tmp_path)
    for fmt in ("hf", "nanogpt"):
        line = one_error_line(cli("export", str(tiny_run / "ckpt" / "latest"), "--out", "", "--format", fmt, "--force"))
        assert line == "error: --out must name a file or directory to write, got ''"
    assert list(tmp_path.iterdir()) == []
    for out in (".", str(tmp_path)):  # the current directory spelled out: the same files among the user's own
        line = one_error_line(cli("export", str(tiny_run / "ckpt" / "latest"), "--out", out, "--format", "hf",
                                  "--force"))
        assert line == f"error: --out {out} is the current directory: name a directory for the model's files, " \
                       "e.g. --out exported"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, name", [
    (["sample", "", "--max-new-tokens", "2"], "CKPT"),
    (["sample", "--ckpt", "", "--max-new-tokens", "2"], "--ckpt"),
    (["reshard", "", "--to", "tp=2", "--out", "{tmp}/r"], "CKPT"),
    (["export", "", "--out", "{tmp}/m.safetensors"], "CKPT"),
    (["export", "", "--out", "{tmp}/hf", "--format", "hf"], "CKPT"),
    (["reshard", "{ckpt}", "--to", "tp=2", "--out", ""], "--out"),
])
def test_an_empty_path_is_refused_not_the_current_directory(tiny_run: Path, tmp_path: Path, command: list[str],
                                                            name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """typer made '' Path("."): run inside a checkpoint, `numesh sample ''` sampled it and
    reshard and export read it; `reshard --out ''` wrote into the current directory."""
    ckpt = (tiny_run / "ckpt" / "latest").resolve()
    monkeypatch.chdir(ckpt if name != "--out" else tmp_path)
    line = one_error_line(cli(*[part.format(tmp=tmp_path, ckpt=ckpt) for part in command]))
    assert line.startswith(f"error: {name} must name a file or directory, got ''"), line
    assert list(tmp_path.iterdir()) == []


NO_PATHS = {  # id: the call, given a checkpoint directory for the argument that is not the one tested
    "read_global(None)": lambda c, ck: c.read_global(None),
    "read_global('')": lambda c, ck: c.read_global(""),
    "read_global_params(None)": lambda c, ck: c.read_global_params(None),
    "read_state(None)": lambda c, ck: c.read_state(None),
    "read_meta(None)": lambda c, ck: c.read_meta(None),
    "read_params_dict(None)": lambda c, ck: c.read_params_dict(None),
    "reshard(None)": lambda c, ck: c.reshard(None, "tp=2"),
    "reshard(out='')": lambda c, ck: c.reshard(ck, "tp=2", ""),
    "export_hf(None)": lambda c, ck: c.export_hf(None, "x"),
    "export_hf(out=None)": lambda c, ck: c.export_hf(ck, None),
    "export_nanogpt(None)": lambda c, ck: c.export_nanogpt(None, "x.safetensors"),
    "export_nanogpt(out=None)": lambda c, ck: c.export_nanogpt(ck, None),
    "import_nanogpt(None)": lambda c, ck: c.import_nanogpt(None),
    "import_nanogpt('')": lambda c, ck: c.import_nanogpt(""),
}


@pytest.mark.parametrize("call", NO_PATHS)
def test_a_checkpoint_function_given_no_path_is_one_line(tiny_run: Path, call: str) -> None:
    """None (or '', the current directory) for a path was a TypeError's traceback, or read
    the current directory: one CheckpointError line naming the path."""
    from numesh import checkpoint
    from numesh.base.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"^(the checkpoint path|--out|the export file path) must name a file "
                                              r"or directory, got (None|'')") as e:
        NO_PATHS[call](checkpoint, str(tiny_run / "ckpt" / "latest"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt, name, says", [
    ("nanogpt", "m.bin", "names a PyTorch pickle (.bin) but --format nanogpt writes safetensors: name it {stem}"
                         ".safetensors"),
    ("nanogpt", "m.PT", "names a PyTorch pickle (.pt) but --format nanogpt writes safetensors"),
    ("hf", "m.safetensors", "names a file (.safetensors) but --format hf writes a directory: name a directory "
                            "such as {stem}"),
])
def test_export_refuses_an_out_named_for_another_format(tiny_run: Path, tmp_path: Path, fmt: str, name: str,
                                                        says: str) -> None:
    """`--out m.bin` wrote safetensors under a PyTorch pickle's name (torch.load fails on it)."""
    out = tmp_path / name
    line = one_error_line(cli("export", str(tiny_run / "ckpt" / "latest"), "--format", fmt, "--out", str(out)))
    assert f"--out {out} {says.format(stem=tmp_path / 'm')}" in line
    assert not out.exists()


def test_a_config_file_that_is_not_utf8_toml_is_one_line(char_dataset: Path, tmp_path: Path) -> None:
    """A binary or Latin-1 --config file was a UnicodeDecodeError traceback."""
    toml = tmp_path / "run.toml"
    toml.write_bytes(b"seed = 1 # \xe9t\xe9\n")
    line = one_error_line(cli("train", "--config", str(toml), "--data", str(char_dataset), "--out",
                              str(tmp_path / "o")))
    assert line.startswith(f"error: config file {toml} is not valid TOML: 'utf-8' codec can't decode")


# ---------------------------------------------------------------------------------------
# the expert-parallel axis: refused in one line on the ranks it names, before anything is written

EP_ERRORS = [
    (["--mesh", "ep=2"], "error: ep=2 splits the experts over ranks, but the model has none: set --moe-experts or "
                         "drop ep from --mesh"),
    (["--mesh", "ep=2", "--moe-experts", "3"], "error: --moe-experts 3 do not split over ep=2: use a multiple of 2 "
                                               "experts or another ep"),
    (["--mesh", "ep=2", "--moe-experts", "4", "--batch-size", "5"],
     "error: batch_size 5 is not divisible by dp=1 x ep=2 x micro_batches=1: use a multiple of 2"),
    (["--mesh", "ep=2", "--moe-experts", "2", "--moe-top-k", "1", "--init-from", "gpt2"],
     "error: --init-from gpt2 does not exist: pass a transformers directory or a `numesh export` file"),
]


@pytest.mark.parametrize("args, want", EP_ERRORS, ids=["no-experts", "experts-not-divisible", "batch", "init-from"])
def test_an_ep_mesh_error_is_one_line_and_exit_2(char_dataset: Path, tmp_path: Path, args: list[str],
                                                 want: str) -> None:
    """`mpiexec -n 2 numesh train --mesh ep=2 ...`: the job exits 2 with one error line (the
    checks need the ranks the mesh names, so this runs a real two-rank job)."""
    from test_mpi_suites import clean_env, launcher

    found = launcher()
    if found is None:
        pytest.skip("no mpiexec")
    code = "import sys; from numesh.cli.app import main; sys.argv = ['numesh', *sys.argv[1:]]; main()"
    res = subprocess.run([found[0], "-n", "2", sys.executable, "-c", code, "train", "--data", str(char_dataset),
                          "--out", str(tmp_path / "o"), "--max-iters", "1", *args],
                         env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert [line for line in res.stderr.splitlines() if line.strip()] == [want], res.stderr
    assert not (tmp_path / "o").exists()


def test_a_model_that_does_not_split_over_tp_names_what_each_command_can_change() -> None:
    """Six heads and an MLP 100 wide split over tp 1 or 2 only. Training may change the MLP
    (--ffn-hidden); sampling and resharding a checkpoint cannot, so they name the tp sizes
    that fit instead (`mpiexec -n 3 numesh sample CKPT --mesh tp=3` once said --ffn-hidden)."""
    from numesh.base.errors import ConfigError
    from numesh.nn.gpt import GPTConfig
    from numesh.run.sample import check_split

    model = GPTConfig(n_head=6, n_embd=48, mlp="swiglu", ffn_hidden=100)
    assert model.tp_sizes() == "1 or 2" and GPTConfig(n_head=1, n_embd=16).tp_sizes() == "1"
    with pytest.raises(ConfigError, match="hidden size 100 is not divisible by tp=3: use a tp that divides it or "
                                          "set --ffn-hidden"):
        model.validate(3)  # train's words
    with pytest.raises(ConfigError) as e:
        check_split(model, 3)
    assert str(e.value) == ("the MLP's hidden size 100 is not divisible by tp=3: sample on another mesh, --mesh tp=N "
                            "with N 1 or 2 (and as many ranks)")
    check_split(model, 2)


def test_output_piped_into_a_reader_that_stops_early_exits_quietly() -> None:
    """`numesh ... | head`: the closed pipe is exit 141 (128 + SIGPIPE), no traceback."""
    code = ("from numesh.host.runtime import guarded\n"
            "guarded(lambda: [print('y' * 1000, flush=True) for _ in range(100000)])\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.read(10) == b"y" * 10
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err, err


def test_commands_that_cannot_change_the_model_suggest_what_they_can(char_dataset: Path, tmp_path: Path) -> None:
    """sample refuses a non-tp mesh before counting ranks (which said `mpirun -n 2`, then
    refused the mesh); reshard names the pp sizes the checkpoint's layers split over (not
    another n_layer); a run's directory, or its ckpt/, given for a checkpoint names its
    ckpt/latest; report
    on a run that was not traced does not suggest a command the run directory refuses."""
    out = tmp_path / "run"
    res = cli("train", "--data", str(char_dataset), "--out", str(out), "--n-layer", "2", "--n-head", "2",
              "--n-embd", "16", "--block-size", "8", "--batch-size", "2", "--max-iters", "1", "--eval-iters", "1",
              "--peak-flops", "1e12")
    assert res.exit_code == 0, res.stderr
    ckpt = str(out / "ckpt" / "latest")
    assert "sampling runs on a tensor-parallel mesh only" in one_error_line(cli("sample", ckpt, "--mesh", "dp=2"))
    assert "reshard --to another pp, one of 1, 2" in one_error_line(cli("reshard", ckpt, "--to", "pp=3"))
    assert f"pass one of its checkpoints, such as {out / 'ckpt' / 'latest'}" in one_error_line(cli("sample", str(out)))
    line = one_error_line(cli("sample", str(out / "ckpt")))  # the folder of its checkpoints: not "incomplete"
    assert f"holds a run's checkpoints, it is not one: pass one of them, such as {out / 'ckpt' / 'latest'}" in line
    line = one_error_line(cli("report", str(out)))
    assert "the run was not traced" in line and "a new --out" in line


def test_a_fine_tunes_learning_rate_below_the_default_floor_is_its_own_floor() -> None:
    """--learning-rate 2e-5 alone (a fine-tune's) is not refused for the default --min-lr
    above it: the floor is the rate, so the rate stays at its peak; a floor given is kept."""
    from numesh.run.config import check_options, config_from

    cfg = config_from({"learning_rate": 2e-5})
    assert cfg.min_lr == 2e-5
    check_options(cfg, 1)
    assert config_from({"learning_rate": 2e-5, "min_lr": 1e-6}).min_lr == 1e-6
    assert config_from({"learning_rate": 6e-4}).min_lr == 1e-4  # above the floor: the default, as before
    assert config_from({}).min_lr == 1e-4
    # a recipe lists min_lr at its default: not a floor the user set (configs/smollm2-135m.toml's fine-tune)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m.toml"
    cfg = config_from({"learning_rate": 2e-5}, recipe)
    assert cfg.min_lr == 2e-5
    check_options(cfg, 1)


@pytest.mark.parametrize("args", [["--n-layer", "99999999999999999999"], ["--eval-iters", str(2**63)]])
def test_an_integer_option_beyond_int64_is_one_line(char_dataset: Path, tmp_path: Path, args: list[str]) -> None:
    """It was an OverflowError traceback from deep in the memory check (numpy's int64). A
    seed is no count: any non-negative one is numpy's (a nanosecond clock's, 1.7e18)."""
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), *args))
    assert f"{args[0]} {args[1]} is out of range: it must be below 9,007,199,254,740,992" in line
    from numesh.run.config import check_options, config_from

    check_options(config_from({"seed": 2**64 - 1}), 1)


def test_a_transformers_directory_of_a_type_numesh_cannot_read_is_not_offered_to_train(tmp_path: Path) -> None:
    """read_meta named `train --init-from` and `sample` for any transformers directory; for
    a model type numesh does not read (qwen2) both would refuse it, so the line says that."""
    from numesh.base.errors import CheckpointError
    from numesh.checkpoint.common import read_meta

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(CheckpointError) as e:
        read_meta(tmp_path)
    assert "model_type 'qwen2'" in str(e.value) and "not of a type numesh reads (llama, mistral, mixtral and gpt2)" \
        in str(e.value) and "--init-from" not in str(e.value)


def test_a_suggested_checkpoint_path_is_quoted_for_the_shell(tmp_path: Path) -> None:
    """'such as /a b/run/ckpt/latest' broke when pasted into a shell: the path is quoted."""
    from numesh.base.errors import CheckpointError
    from numesh.checkpoint.common import read_meta

    run = tmp_path / "sp ace" / "run dir"
    (run / "ckpt").mkdir(parents=True)
    with pytest.raises(CheckpointError) as e:
        read_meta(run)
    assert str(e.value).endswith(f"such as '{run}/ckpt/latest'"), str(e.value)


@pytest.mark.parametrize("value", ['["llama"]', "{ kind = 1 }", "5"])
def test_a_recipe_arch_that_is_not_a_name_is_one_line(tmp_path: Path, value: str) -> None:
    """A TOML list or table as `arch` raised TypeError (unhashable) from the ARCHS lookup."""
    from numesh.base.errors import ConfigError
    from numesh.run.config import config_from

    toml = tmp_path / "run.toml"
    toml.write_text(f"arch = {value}\n")
    with pytest.raises(ConfigError, match="--arch must be one of gpt2, llama, got"):
        config_from({}, toml)


@pytest.mark.parametrize("kv, says", [
    (dict(bias="no"), "config key 'bias' must be bool, got 'no'"),
    (dict(batch_size=2.0), "config key 'batch_size' must be int, got 2.0"),
    (dict(max_iters=1.5), "config key 'max_iters' must be int, got 1.5"),
    (dict(n_layer="2"), "config key 'n_layer' must be int, got '2'"),
    (dict(n_layer=1.5), "config key 'n_layer' must be int, got 1.5"),
    (dict(mesh=None), "config key 'mesh' must be str, got None"),
])
def test_a_trainconfig_built_directly_is_checked_as_config_from_checks_options(char_dataset: Path, tmp_path: Path,
                                                                               kv: dict, says: str) -> None:
    """train(TrainConfig(...)), as docs/api/index.md shows, skipped config_from's type checks:
    bias='no' trained with biases, 2.0 sequences were a NumPy TypeError. (Which options a
    direct config *gave* is unknown, so options another optimiser or kind would read are
    refused only through config_from.)"""
    from numesh.base.errors import ConfigError
    from numesh.run.config import TrainConfig, validate

    cfg = TrainConfig(data=str(char_dataset), out=str(tmp_path / "o"), n_layer=1, n_head=2, n_embd=16, block_size=8,
                      batch_size=2, max_iters=1, eval_iters=1, peak_flops=1e9)
    validate(cfg, 1)
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}"):
        validate(attrs.evolve(cfg, **kv), 1)
    validate(attrs.evolve(cfg, optimizer="muon", muon_momentum=0.5, learning_rate=1), 1)  # an int rate is a float


def test_a_preset_value_config_from_let_through_is_not_refused_by_the_run(char_dataset: Path, tmp_path: Path) -> None:
    """config_from knows which values the user gave: smollm2-135m's rope_theta under
    --positions learned is the preset's, and the run's checks (of a layout evolved from it
    too) keep it."""
    from numesh.cli.app import train_config
    from numesh.run.config import check_options

    cfg = train_config({"model_preset": "smollm2-135m", "positions": "learned", "data": str(char_dataset),
                        "out": str(tmp_path / "o")})
    check_options(cfg, 1)
    check_options(attrs.evolve(cfg, mesh="dp=1", out=str(tmp_path / "p")), 1)


@pytest.mark.parametrize("kv, says", [
    (dict(n_layer=2.0), "n_layer must be an integer, got 2.0"),
    (dict(n_embd="16"), "n_embd must be an integer, got '16'"),
    (dict(n_kv_head=None), "n_kv_head must be an integer, got None"),
    (dict(dropout="0.1"), "dropout must be a finite number, got '0.1'"),
    (dict(ffn_hidden=1.5), "ffn_hidden must be an integer, got 1.5"),  # it blamed tp
    (dict(moe_experts=1.5), "moe_experts must be an integer, got 1.5"),  # it blamed moe_top_k
    (dict(bias="no"), "bias must be True or False, got 'no'"),  # truthy: biases on
    (dict(moe_experts=2, moe_aux_coef=float("inf")), "moe_aux_coef must be a finite number, got inf"),  # NaN grads
])
def test_a_gpt_config_of_the_wrong_type_is_one_line_naming_the_field(kv: dict, says: str) -> None:
    from numesh.base.errors import ConfigError
    from numesh.nn.gpt import GPTConfig

    base = dict(vocab_size=17, n_layer=1, n_head=2, n_embd=16, block_size=8)
    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        GPTConfig(**{**base, **kv}).validate()
    GPTConfig(**{**base, "n_layer": np.int64(2), "moe_experts": np.int32(2), "dropout": np.float32(0.5)}).validate()


@pytest.mark.parametrize("tp, says", [(0, "tp must be >= 1, got 0"), (1.5, "tp must be an integer, got 1.5")])
def test_a_gpt_config_validated_for_no_tp_is_one_line(tp: object, says: str) -> None:
    """validate(tp=0) was a ZeroDivisionError."""
    from numesh.base.errors import ConfigError
    from numesh.nn.gpt import GPTConfig

    with pytest.raises(ConfigError, match=f"^{re.escape(says)}$"):
        GPTConfig().validate(tp)


@pytest.mark.parametrize("command, message", [
    (["export", "{ckpt}", "--out", "{step}/params/extra.safetensors", "--force"], "is inside the checkpoint"),
    (["export", "{ckpt}", "--format", "hf", "--out", "{step}", "--force"], "is the checkpoint"),
    (["export", "{ckpt}", "--format", "hf", "--out", "{run}", "--force"], "holds the checkpoint"),  # its config.json
    (["reshard", "{ckpt}", "--to", "tp=2", "--out", "{step}/x"], "is inside the checkpoint"),
])
def test_an_output_on_its_own_checkpoint_is_refused(tiny_run: Path, command: list[str], message: str) -> None:
    """`export --force` into the checkpoint it exported replaced its files (its next read
    failed the checksums), into the run its config.json; reshard nested a checkpoint in its
    source. Each is one line, and nothing of the run changes."""
    step = (tiny_run / "ckpt" / "latest").resolve()
    before = {p: p.read_bytes() for p in tiny_run.rglob("*") if p.is_file() and p.name != ".lock"}
    names = {"ckpt": str(tiny_run / "ckpt" / "latest"), "step": str(step), "run": str(tiny_run)}
    line = one_error_line(cli(*[part.format(**names) for part in command]))
    assert message in line and str(step) in line
    assert {p: p.read_bytes() for p in tiny_run.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_an_output_through_a_symlink_loop_is_left_to_the_write_and_a_link_into_the_source_refused(
        tmp_path: Path) -> None:
    """check_apart cannot say where a loop leads, so it leaves it to the read or write that
    follows; a link that leads into the checkpoint is still seen for what it is."""
    from numesh.base.errors import CheckpointError
    from numesh.checkpoint.common import check_apart

    (tmp_path / "loop-a").symlink_to("loop-b")
    (tmp_path / "loop-b").symlink_to("loop-a")
    (tmp_path / "step").mkdir()
    (tmp_path / "into").symlink_to("step")
    check_apart(tmp_path / "loop-a", tmp_path / "step")
    check_apart(tmp_path / "out", tmp_path / "loop-a")
    with pytest.raises(CheckpointError, match="is inside the checkpoint it is made from"):
        check_apart(tmp_path / "into" / "x", tmp_path / "step")


def test_exports_refuse_a_force_that_is_not_a_bool(tiny_run: Path, tmp_path: Path) -> None:
    """force="no" is truthy: the library overwrote the file it named."""
    from numesh.base.errors import ConfigError
    from numesh.checkpoint import export_nanogpt

    kept = tmp_path / "precious.safetensors"
    kept.write_text("mine")
    with pytest.raises(ConfigError, match="force must be True or False, got 'no'"):
        export_nanogpt(tiny_run / "ckpt" / "latest", kept, force="no")
    assert kept.read_text() == "mine"


@pytest.mark.parametrize("option", ["--init-from", "--resume"])
def test_an_empty_init_from_or_resume_is_refused(tiny_run: Path, tmp_path: Path, option: str) -> None:
    """`--init-from "$MODEL_DIR"` with the variable unset trained a random model from scratch
    and said it succeeded."""
    line = one_error_line(cli("train", "--data", str(tiny_run.parent / "data"), "--out", str(tmp_path / "r"),
                              option, "", "--max-iters", "1"))
    assert f"{option} is empty: pass a path" in line
    assert not (tmp_path / "r").exists()
