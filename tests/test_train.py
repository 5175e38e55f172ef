"""The training loop on one process: it learns, logs, checkpoints and validates its config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import SYNTH_TEXT
from numesh.base.errors import ConfigError, DataError
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import read_meta, read_params_dict
from numesh.mesh import MeshError
from numesh.nn.gpt import GPTConfig
from numesh.run.config import TrainConfig, config_from, validate
from numesh.run.train import Trainer, train

TRAIN_KEYS = {"step", "loss", "lr", "dt_ms", "tokens_per_s", "flops_per_s", "mfu"}


def run_config(data: Path, out: Path, **overrides: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=8, max_iters=20,
        learning_rate=1e-2, min_lr=1e-3, warmup_iters=2, lr_decay_iters=20, grad_clip=1.0,
        eval_interval=10, eval_iters=2, data=str(data), out=str(out), seed=7, dtype="float64",
    )
    base.update(overrides)
    return config_from(base)


def run(cfg: TrainConfig) -> tuple[list[float], dict[str, np.ndarray]]:
    """Train on this process alone: (loss of every step, final parameters from the checkpoint)."""
    losses: list[float] = []
    train(cfg, MPI.COMM_SELF, on_step=lambda step, rec: losses.append(rec["loss"]) if "loss" in rec else None)
    return losses, read_params_dict(Path(cfg.out) / "ckpt" / "latest")


def test_train_learns_logs_and_checkpoints(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = run_config(char_dataset, out)
    records: list[tuple[int, dict]] = []
    result = train(cfg, MPI.COMM_SELF, on_step=lambda s, r: records.append((s, r)))

    # metrics.jsonl: one line per step with the training keys, evaluations at 0, 10 and 20
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for _, r in records] == lines
    train_lines = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train_lines] == list(range(20))
    for r in train_lines:
        assert TRAIN_KEYS <= r.keys(), r
        # signs only: a rate is the machine's (MFU is not clamped; test_mfu.py holds its arithmetic)
        assert r["dt_ms"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] > 0
        assert np.isfinite(r["loss"])
    evals = {r["step"]: r for r in lines if "val_loss" in r}
    assert sorted(evals) == [0, 10, 20]
    assert all("train_loss" in r for r in evals.values())
    assert lines[-1]["step"] == 20 and "loss" not in lines[-1]
    # the schedule: warmup then cosine decay
    lrs = [r["lr"] for r in train_lines]
    assert lrs[0] == pytest.approx(1e-2 / 3) and lrs[2] == pytest.approx(1e-2) and lrs[-1] < lrs[2]

    # it learns
    losses = [r["loss"] for r in train_lines]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    assert evals[20]["val_loss"] < evals[0]["val_loss"] - 0.3
    assert evals[20]["train_loss"] < evals[0]["train_loss"] - 0.3
    assert result.steps == 20
    assert result.final_loss == losses[-1]
    assert result.final_val_loss == evals[20]["val_loss"]

    # run config and checkpoint
    assert json.loads((out / "config.json").read_text()) == attrs.asdict(cfg)
    ckpt = out / "ckpt" / "latest"
    assert Path(result.checkpoint) == ckpt
    assert ckpt.is_symlink() and ckpt.resolve().name == "step_000020"
    meta = read_meta(ckpt)
    assert meta.step == 20 and meta.dtype == "float64"
    vocab = meta.model.vocab_size
    assert meta.tokenizer().vocab_size == vocab
    tensors = read_params_dict(ckpt)
    assert tensors["wte"].shape == (vocab, 16)
    assert tensors["blocks.1.attn.qkv.w"].shape == (16, 3, 16)
    assert all(t.dtype == np.float64 for t in tensors.values())
    assert not any(p.name.startswith(".") for p in (out / "ckpt").iterdir())  # no temp dir left


def test_checkpoint_equals_trainer_params(char_dataset: Path, tmp_path: Path) -> None:
    """The saved tensors are exactly the trainer's parameters after the same steps."""
    cfg = run_config(char_dataset, tmp_path / "a", max_iters=3, eval_interval=100, eval_iters=1)
    _, saved = run(cfg)
    trainer = Trainer(cfg, MPI.COMM_SELF)
    for _ in range(3):
        trainer.train_step()
    leaves = dict(tree_leaves_with_path(trainer.gathered_params()))
    assert leaves.keys() == saved.keys()
    for k in leaves:
        np.testing.assert_array_equal(saved[k], leaves[k], err_msg=k)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_micro_batches_give_the_same_run(char_dataset: Path, tmp_path: Path, dropout: float) -> None:
    common = dict(max_iters=4, eval_interval=100, eval_iters=1, dropout=dropout, bias=True)
    l1, p1 = run(run_config(char_dataset, tmp_path / "mb1", micro_batches=1, **common))
    l2, p2 = run(run_config(char_dataset, tmp_path / "mb2", micro_batches=2, **common))
    l4, p4 = run(run_config(char_dataset, tmp_path / "mb4", micro_batches=4, **common))
    assert len(l1) == 4
    np.testing.assert_allclose(l2, l1, rtol=1e-10)
    np.testing.assert_allclose(l4, l1, rtol=1e-10)
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-10, atol=1e-12, err_msg=k)
        np.testing.assert_allclose(p4[k], p1[k], rtol=1e-10, atol=1e-12, err_msg=k)
    assert not np.array_equal(l1[0], l1[-1])


def test_same_seed_same_run_other_seed_differs(char_dataset: Path, tmp_path: Path) -> None:
    common = dict(max_iters=2, eval_interval=100, eval_iters=1)
    la, pa = run(run_config(char_dataset, tmp_path / "a", **common))
    lb, pb = run(run_config(char_dataset, tmp_path / "b", **common))
    lc, _ = run(run_config(char_dataset, tmp_path / "c", seed=8, **common))
    assert la == lb
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert la != lc


def test_float32_run(char_dataset: Path, tmp_path: Path) -> None:
    losses, params = run(run_config(char_dataset, tmp_path / "f32", dtype="float32", max_iters=3,
                                    eval_interval=100, eval_iters=1))
    assert all(t.dtype == np.float32 for t in params.values())
    assert len(losses) == 3 and all(np.isfinite(losses))


# ---------------------------------------------------------------------------------------
# configuration


def test_config_from_defaults_toml_and_overrides(tmp_path: Path) -> None:
    assert config_from({}) == TrainConfig()
    toml = tmp_path / "run.toml"
    toml.write_text('n-layer = 3\nlearning_rate = 1\nmesh = "dp=2"\nbias = true\n')
    cfg = config_from({"n_layer": 5, "seed": None}, toml)
    assert cfg.n_layer == 5  # overrides win over the file
    assert cfg.learning_rate == 1.0 and isinstance(cfg.learning_rate, float)  # int accepted for float
    assert cfg.mesh == "dp=2" and cfg.bias is True
    assert cfg.seed == TrainConfig().seed  # None overrides are ignored


@pytest.mark.parametrize(
    "text",
    ['n_layers = 3\n', 'foo = "bar"\n'],
)
def test_config_from_rejects_unknown_toml_keys(tmp_path: Path, text: str) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    with pytest.raises(ConfigError, match="unknown config key"):
        config_from({}, toml)


def test_config_from_refuses_a_key_set_twice_in_two_spellings(tmp_path: Path) -> None:
    """`n_layer` and `n-layer` are one option: a file that sets both is refused, not read
    as whichever came last (issue 44)."""
    toml = tmp_path / "twice.toml"
    toml.write_text("n_layer = 2\nn-layer = 3\n")
    with pytest.raises(ConfigError, match=r"'n_layer' is set twice .*\(as 'n_layer' and 'n-layer'\)"):
        config_from({}, toml)


@pytest.mark.parametrize(
    "overrides",
    [{"n_layer": "2"}, {"n_layer": 2.0}, {"n_layer": True}, {"bias": 1}, {"learning_rate": "1e-3"},
     {"mesh": 2}, {"dropout": True}],
)
def test_config_from_rejects_wrong_types(overrides: dict) -> None:
    with pytest.raises(ConfigError, match="must be"):
        config_from(overrides)


def test_config_from_rejects_wrong_types_in_toml(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text('batch_size = "12"\n')
    with pytest.raises(ConfigError, match="batch_size"):
        config_from({}, toml)


def test_config_from_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        config_from({}, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("n_layer = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config_from({}, bad)


def test_config_from_rejects_unknown_override_keys() -> None:
    with pytest.raises(ConfigError):
        config_from({"n_layers": 2})


def test_error_classes_are_value_errors() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(DataError, ValueError)
    assert issubclass(MeshError, ValueError)


@pytest.mark.parametrize(
    "overrides, n_ranks, error, match",
    [
        (dict(n_embd=10, n_head=4), 1, ConfigError, "n_embd=10 is not divisible by n_head=4"),
        (dict(block_size=1000), 1, ConfigError, "block_size=1000 needs a split of at least 1001 tokens"),
        (dict(batch_size=6, micro_batches=4), 1, ConfigError, "batch_size 6 is not divisible"),
        (dict(batch_size=6, mesh="dp=4"), 4, ConfigError, "batch_size 6 is not divisible"),
        (dict(n_head=2, mesh="tp=4"), 4, ConfigError, "n_head=2 is not divisible by tp=4"),
        (dict(n_layer=3, mesh="pp=2"), 2, ConfigError, "n_layer=3 is not divisible by pp x virtual stages"),
        (dict(schedule="pipedream"), 1, ValueError, "unknown pipeline schedule"),
        (dict(n_layer=4, mesh="pp=2", schedule="interleaved", virtual_stages=2, micro_batches=1), 2, ValueError,
         "interleaved"),
        (dict(mesh="dp=2"), 1, MeshError, "needs 2 ranks"),
        (dict(dtype="float16"), 1, ConfigError, "dtype"),
        (dict(dropout=1.0), 1, ConfigError, "dropout"),
        (dict(micro_batches=0), 1, ConfigError, "micro_batches"),
        (dict(max_iters=-1), 1, ConfigError, "max_iters"),
        (dict(sequence_parallel=True), 1, ConfigError, "--sequence-parallel splits the sequence over tp, which is 1"),
        (dict(sequence_parallel=True, mesh="dp=2"), 2, ConfigError, "or drop --sequence-parallel"),
        (dict(sequence_parallel=True, mesh="tp=2", n_head=2, block_size=9), 2, ConfigError,
         "splits the block_size=9 tokens over tp=2: use a --block-size divisible by 2"),
        (dict(sequence_parallel=True, mesh="cp=2,tp=4", n_head=4, block_size=12), 8, ConfigError,
         "splits a cp rank's block_size/cp tokens over tp: use a --block-size that is a multiple of cp\\*tp=8"),
        (dict(mesh="cp=2", block_size=6), 2, ConfigError, "does not split into 2\\*cp=4 equal chunks"),
        (dict(sequence_parallel=True, mesh="dp=2,cp=2"), 4, ConfigError,
         "--sequence-parallel splits the sequence over tp, which is 1 in this mesh: add tp=N"),
        (dict(mesh="cp=2,pp=2", schedule="interleaved", virtual_stages=2, micro_batches=1, n_layer=4), 4, ValueError,
         "interleaved needs micro-batches m=1 to be a multiple of pp=2"),
        (dict(peak_flops=-1.0), 1, ConfigError, "--peak-flops must be >= 0"),
        (dict(recompute="attention"), 1, ConfigError,
         "--recompute must be one of none, full, got 'attention'"),
    ],
)
def test_validate_errors(char_dataset: Path, tmp_path: Path, overrides: dict, n_ranks: int,
                         error: type, match: str) -> None:
    cfg = run_config(char_dataset, tmp_path / "out", **overrides)
    with pytest.raises(error, match=match):
        validate(cfg, n_ranks)


def test_validate_does_not_advise_a_block_size_below_one(char_dataset: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A val split of 1 token (`numesh data char` wrote them from a 3-character text) was
    told "use a --block-size below it": below 1."""
    import numesh.run.config as run_cfg

    real = run_cfg.load_split
    monkeypatch.setattr(run_cfg, "load_split", lambda d, s: real(d, s)[:1] if s == "val" else real(d, s))
    with pytest.raises(ConfigError) as e:
        validate(run_config(char_dataset, tmp_path / "out", block_size=1), 1)
    assert str(e.value).endswith("the val split has 1: too small for any --block-size: use a larger corpus")


def test_validate_missing_dataset(tmp_path: Path) -> None:
    cfg = run_config(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(DataError, match="no dataset"):
        validate(cfg, 1)


def test_validate_ok_returns_mesh_and_model(char_dataset: Path, tmp_path: Path) -> None:
    cfg = run_config(char_dataset, tmp_path / "out", mesh="dp=-1,tp=2", n_head=2)
    shape, model = validate(cfg, 4)
    assert shape == {"pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 2}
    assert model.n_embd == 16 and model.vocab_size == len(set(SYNTH_TEXT))


def test_train_raises_before_writing_anything(char_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "never"
    with pytest.raises(ConfigError):
        train(run_config(char_dataset, out, n_embd=10, n_head=4), MPI.COMM_SELF)
    assert not out.exists()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data", "{tmp}/nothing"], "no dataset at"),
        (["--mesh", "dp=2,xx=3"], "unknown mesh axis 'xx'"),
        (["--mesh", "dp=2"], "needs 2 ranks"),
        (["--n-embd", "10"], "n_embd=10 is not divisible by n_head"),
        (["--block-size", "100000"], "block_size=100000 needs a split of at least 100001 tokens"),
        (["--config", "{tmp}/bad.toml"], "unknown config key 'n_layers'"),
        (["--zero", "5"], "--zero must be 0, 1, 2 or 3"),
        (["--schedule", "pipedream"], "unknown pipeline schedule 'pipedream'"),
        (["--sequence-parallel"], "--sequence-parallel splits the sequence over tp, which is 1 in this mesh"),
        (["--recompute", "some"], "--recompute must be one of none, full, got 'some'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(char_dataset: Path, tmp_path: Path, args: list[str],
                                              match: str) -> None:
    from typer.testing import CliRunner

    from numesh.cli.app import app

    (tmp_path / "bad.toml").write_text("n_layers = 2\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    res = CliRunner().invoke(app, ["train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), *args])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], res.stderr
    assert not (tmp_path / "o").exists()


def test_every_model_field_is_a_run_option_of_the_same_name() -> None:
    """TrainConfig.model copies GPTConfig's fields by name: a model field without its run
    option would fail there, so it fails here first, naming it."""
    run = {f.name for f in attrs.fields(TrainConfig)}
    missing = [f.name for f in attrs.fields(GPTConfig) if f.name != "vocab_size" and f.name not in run]
    assert not missing, f"GPTConfig fields with no TrainConfig option: {missing}"
    cfg = TrainConfig(n_layer=3, moe_experts=4, moe_top_k=1, dropout=0.1)
    assert cfg.model(99) == GPTConfig(vocab_size=99, n_layer=3, moe_experts=4, moe_top_k=1, dropout=0.1)
