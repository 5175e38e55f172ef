"""Training with experts on the 1-rank mesh, on tiny Shakespeare: `numesh train
--moe-experts 4` learns and logs the routing, a stopped run resumes exactly, and what
experts do not combine with yet is a one-line error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import cli, one_error_line
from numesh.base.errors import CheckpointError, ConfigError
from numesh.checkpoint import read_meta, read_params_dict
from numesh.run.config import check_layout, config_from
from numesh.run.train import train

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")
pytestmark = pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} is not here")


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare_char"
    done = cli("data", "shakespeare-char", "--src", str(SHAKESPEARE), "--out", str(out))
    assert done.exit_code == 0, done.output
    return out


def test_numesh_train_with_experts_learns_and_logs_routing(shakespeare: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = cli("train", "--data", str(shakespeare), "--out", str(out), "--moe-experts", "4", "--max-iters", "20",
               "--eval-interval", "20", "--eval-iters", "2", "--log-interval", "1", "--peak-flops", "1e12")
    assert done.exit_code == 0, done.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 20
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    for r in steps:
        assert 0 < r["moe_aux_loss"] and r["moe_z_loss"] == 0.0
        assert 0 <= r["moe_tokens_min"] <= r["moe_tokens_max"] <= 12 * 64  # one block's tokens at most
        assert r["moe_dropped"] == 0  # dropless by default, reported all the same
    params = read_params_dict(out / "ckpt" / "latest")
    assert params["blocks.0.mlp.fc.w"].shape == (4, 128, 512)  # experts saved whole, [E, ...]
    assert params["blocks.3.mlp.router.w"].shape == (128, 4)
    texts = [cli("sample", "--ckpt", str(out / "ckpt" / "latest"), "--max-new-tokens", "30", "--temperature", "0",
                 "--num-samples", "1", flag) for flag in ("--kv-cache", "--no-kv-cache")]
    assert all(t.exit_code == 0 for t in texts) and texts[0].stdout == texts[1].stdout  # KV cache through the experts
    line = one_error_line(cli("export", str(out / "ckpt" / "latest"), "--out", str(tmp_path / "x.safetensors")))
    assert "mixture of experts (4 experts), which nanoGPT's format cannot hold" in line
    line = one_error_line(cli("export", str(out / "ckpt" / "latest"), "--format", "hf", "--out", str(tmp_path / "hf")))
    assert "transformers has no model class for it" in line
    line = one_error_line(cli("train", "--data", str(shakespeare), "--out", str(tmp_path / "r2"), "--moe-experts", "4",
                              "--moe-top-k", "5"))
    assert "moe_top_k must be between 1 and moe_experts=4" in line


def _config(data: Path, out: Path, **overrides):
    base = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, max_iters=8, learning_rate=3e-3,
                warmup_iters=2, lr_decay_iters=8, eval_interval=100, eval_iters=1, data=str(data), out=str(out),
                seed=5, dtype="float64", moe_experts=4, moe_top_k=2, moe_z_coef=1e-3, ckpt_interval=4)
    base.update(overrides)
    if not base["moe_experts"]:  # a dense model takes no MoE option (config_from refuses one given)
        base = {k: v for k, v in base.items() if k == "moe_experts" or not k.startswith("moe_")}
    return config_from(base)


def _run(cfg) -> dict[int, dict]:
    records: dict[int, dict] = {}
    train(cfg, MPI.COMM_SELF, on_step=lambda step, rec: records.__setitem__(step, rec))
    return records


def test_a_stopped_run_resumes_exactly(shakespeare: Path, tmp_path: Path) -> None:
    whole = _run(_config(shakespeare, tmp_path / "whole"))
    _run(_config(shakespeare, tmp_path / "part", max_iters=4))
    resumed = _run(_config(shakespeare, tmp_path / "resumed", resume=str(tmp_path / "part" / "ckpt" / "step_000004")))
    for step in range(4, 8):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_tokens_min", "moe_tokens_max",
                    "moe_dropped"):
            assert resumed[step][key] == whole[step][key], (step, key)
    a = read_params_dict(tmp_path / "whole" / "ckpt" / "latest")
    b = read_params_dict(tmp_path / "resumed" / "ckpt" / "latest")
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_a_resume_keeps_the_experts_per_token_and_may_change_the_capacity(shakespeare: Path, tmp_path: Path) -> None:
    """--moe-top-k changes what the weights compute (like --rope-theta): resuming with
    another was accepted and meta.json rewritten. The capacity factor only drops
    assignments while training: a resume may change it, as it may the learning rate."""
    _run(_config(shakespeare, tmp_path / "part", max_iters=4))
    resume = str(tmp_path / "part" / "ckpt" / "step_000004")
    with pytest.raises(CheckpointError, match="the checkpoint's model has moe_top_k=2 but this run has moe_top_k=1: "
                                              "resume with the same model config \\(--moe-top-k 2\\)"):
        _run(_config(shakespeare, tmp_path / "k1", resume=resume, moe_top_k=1))
    _run(_config(shakespeare, tmp_path / "cap", resume=resume, max_iters=5, moe_capacity_factor=1.0))
    assert read_meta(tmp_path / "cap" / "ckpt" / "latest").model.moe_capacity_factor == 1.0


@pytest.mark.parametrize("overrides, n_ranks, match", [
    (dict(mesh="ep=2", moe_experts=0), 2, "ep=2 splits the experts over ranks, but the model has none: "
                                          "set --moe-experts or drop ep from --mesh"),
    (dict(mesh="ep=4", moe_experts=6), 4, "--moe-experts 6 do not split over ep=4"),
    (dict(mesh="dp=2,ep=2", batch_size=6), 4, "batch_size 6 is not divisible by dp=2 x ep=2 x micro_batches=1: "
                                              "use a multiple of 4"),
    (dict(mesh="ep=2", micro_batches=2, batch_size=6), 2, "not divisible by dp=1 x ep=2 x micro_batches=2"),
    (dict(moe_top_k=5), 1, "moe_top_k must be between 1 and moe_experts=4"),
    (dict(moe_experts=-2), 1, "moe_experts must be >= 0"),
    (dict(moe_every=0), 1, "moe_every must be >= 1"),
    (dict(moe_capacity_factor=-0.5), 1, "moe_capacity_factor must be finite and >= 0"),
])
def test_what_experts_do_not_combine_with_is_one_line(overrides: dict, n_ranks: int, match: str,
                                                      tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        check_layout(_config(tmp_path, tmp_path / "out", **overrides), n_ranks, 65)
    assert "\n" not in str(e.value)


def test_a_capacity_drops_and_is_saved_with_the_model(shakespeare: Path, tmp_path: Path) -> None:
    """--moe-capacity-factor 0.5 drops assignments every step (moe_dropped, of at most
    2 blocks x 4 sequences x 32 tokens x 2 choices); the factor is in the checkpoint's model
    config, and a checkpoint written before it existed reads as dropless."""
    out = tmp_path / "cap"
    steps = _run(_config(shakespeare, out, max_iters=3, moe_capacity_factor=0.5))
    assert all(0 < steps[s]["moe_dropped"] < 2 * 4 * 32 * 2 for s in range(3))
    assert read_meta(out / "ckpt" / "latest").model.moe_capacity_factor == 0.5
    # sampling runs dropless: the KV cache (one token at a time) and the full forward agree
    texts = [cli("sample", "--ckpt", str(out / "ckpt" / "latest"), "--max-new-tokens", "40", "--temperature", "0",
                 "--prompt", "ROMEO:\nWhat say you, my lord? I ", flag) for flag in ("--kv-cache", "--no-kv-cache")]
    assert all(t.exit_code == 0 for t in texts) and texts[0].stdout == texts[1].stdout
    meta_path = out / "ckpt" / "latest" / "meta.json"
    raw = json.loads(meta_path.read_text())
    del raw["model"]["moe_capacity_factor"]
    meta_path.write_text(json.dumps(raw))
    assert read_meta(out / "ckpt" / "latest").model.moe_capacity_factor == 0.0


@pytest.mark.parametrize("overrides, n_ranks", [
    (dict(mesh="dp=2"), 2), (dict(mesh="ep=2"), 2), (dict(mesh="dp=2,ep=2"), 4), (dict(mesh="ep=4"), 4),
    (dict(mesh="cp=2"), 2), (dict(mesh="ep=2,cp=2"), 4), (dict(micro_batches=2), 1),
    (dict(mesh="ep=2", micro_batches=2), 2), (dict(mesh="tp=2"), 2), (dict(mesh="ep=2,tp=2"), 4),
    (dict(mesh="ep=2,pp=2", n_layer=2), 4), (dict(mesh="pp=2,cp=2", n_layer=2), 4),
])
def test_experts_combine_with_dp_ep_cp_and_micro_batches(overrides: dict, n_ranks: int, tmp_path: Path) -> None:
    """ep is data parallelism for all but the experts, tp splits each expert, pipelines hold
    MoE blocks; the per-sequence load-balancing loss makes micro-batches exact: these
    layouts pass the checks."""
    shape, model = check_layout(_config(tmp_path, tmp_path / "out", **overrides), n_ranks, 65)
    assert model.moe_experts == 4 and math.prod(shape.values()) == n_ranks


def test_dense_runs_ignore_the_expert_settings(shakespeare: Path, tmp_path: Path) -> None:
    """moe_experts=0 is the dense model whatever the other moe_* say: the same bits (its
    bits against main's dense model were compared once, by hand: equal, see docs/moe.md).
    A TrainConfig built in Python may say them; the command line and --config refuse them
    (tests/test_one_line_errors.py)."""
    a = _run(_config(shakespeare, tmp_path / "a", moe_experts=0, max_iters=3))
    b = _run(attrs.evolve(_config(shakespeare, tmp_path / "b", moe_experts=0, max_iters=3), moe_top_k=9,
                          moe_every=3, moe_aux_coef=0.5, moe_z_coef=0.5))
    assert [a[s]["loss"] for s in range(3)] == [b[s]["loss"] for s in range(3)]
    assert "moe_aux_loss" not in a[0]
    pa, pb = read_params_dict(tmp_path / "a" / "ckpt" / "latest"), read_params_dict(tmp_path / "b" / "ckpt" / "latest")
    assert all(np.array_equal(pa[k], pb[k]) for k in pa) and not any(".router." in k for k in pa)


def test_the_progress_line_shows_the_routing() -> None:
    from numesh.cli.app import moe_progress

    assert moe_progress({"moe_aux_loss": 0.0102, "moe_tokens_min": 40, "moe_tokens_max": 90}) == (
        "aux 0.0102, experts 40-90 tok (2.25x)")
    assert moe_progress({"moe_aux_loss": 0.02, "moe_tokens_min": 0, "moe_tokens_max": 9, "moe_dropped": 3}) == (
        "aux 0.0200, experts 0-9 tok (infx), 3 dropped")


def test_a_dense_models_moe_every_is_not_a_setting_to_resume_with() -> None:
    """An older dense run recorded --moe-every 2 (nothing reads it without experts): resume
    and --init-from asked for `--moe-every 2`, which a dense run now refuses, a loop."""
    from numesh.checkpoint.model import model_value
    from numesh.nn.gpt import GPTConfig

    dense = GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=16, block_size=8, moe_every=2)
    assert model_value(dense, "moe_every") is None and model_value(dense, "moe_top_k") is None
    moe = attrs.evolve(dense, moe_experts=4)
    assert model_value(moe, "moe_every") == 2
