"""Sharded checkpoints on one process: round trip, bit-exact resume, every way a checkpoint
can be broken, atomic saves, pruning, resharding and the nanoGPT export."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import cli
from numesh.base.errors import ConfigError
from numesh.base.tree import tree_leaves, tree_leaves_with_path, tree_map_with_path
from numesh.checkpoint import (
    CheckpointError,
    export_nanogpt,
    global_path,
    gpt_leaves,
    read_global_params,
    read_meta,
    read_params_dict,
    read_state,
    reshard,
    save_checkpoint,
)
from numesh.checkpoint import save as save_mod
from numesh.checkpoint.format import block_region, leaf_blocks, shard_suffix, writes_leaf
from numesh.data.char import prepare_char_dataset
from numesh.mesh import AXES, MeshError, P, local_slices
from numesh.nn.gpt import gpt_specs
from numesh.nn.units import join_units
from numesh.pipeline.stages import StageLayout, stage_tree
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer, restore, train, train_state

# 11 distinct characters, so tp=4 pads the vocabulary to 12
TEXT = "".join("abcdefghij"[i % 10 :] + "abcdefghij"[: i % 10] + "\n" for i in range(60))
KEYS = ("loss", "grad_norm", "lr", "train_loss", "val_loss")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckdata")
    prepare_char_dataset(TEXT, out)
    return out


def config(data: Path, out: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=4, dropout=0.1, bias=True,
        learning_rate=1e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=8, eval_interval=2, eval_iters=1,
        data=str(data), out=str(out), seed=5, dtype="float64",
    )
    base.update(kw)
    return config_from(base)


def run(cfg: TrainConfig) -> list[dict]:
    records: list[dict] = []
    train(cfg, MPI.COMM_SELF, on_step=lambda s, r: records.append({"step": s, **{k: r[k] for k in KEYS if k in r}}))
    return records


def trainer_after(cfg: TrainConfig, steps: int) -> Trainer:
    t = Trainer(cfg, MPI.COMM_SELF)
    for _ in range(steps):
        t.train_step()
    return t


def assert_trees_equal(a: Any, b: Any) -> None:
    la, lb = tree_leaves_with_path(a), tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(x, y, err_msg=p)


def state_trees(trainer: Trainer) -> dict:
    """The optimiser's state trees, units joined back into model trees."""
    return {g: join_units(t) for g, t in trainer.opt.state_trees().items()}


def assert_states_equal(a: dict, b: dict) -> None:
    for g in ("params", "m", "v"):
        assert_trees_equal(a[g], b[g])


@pytest.fixture(scope="module")
def saved(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint after 3 steps (the module's pristine copy: tests copy it before breaking it)."""
    out = tmp_path_factory.mktemp("saved")
    save_checkpoint(train_state(trainer_after(config(data, out), 3)), out)
    return out / "ckpt" / "step_000003"


@pytest.fixture
def broken(saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt" / saved.name
    shutil.copytree(saved, dst)
    return dst


@pytest.fixture(scope="module")
def fresh(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return Trainer(config(data, tmp_path_factory.mktemp("fresh")), MPI.COMM_SELF)


# ---------------------------------------------------------------------------------------
# geometry (pure functions)


class FakeMesh:
    """Just enough of a Mesh for local_slices, at any coordinates."""

    def __init__(self, shape: dict[str, int], coords: dict[str, int]):
        self.shape, self.coords = shape, coords

    def size(self, axes: Any) -> int:
        names = (axes,) if isinstance(axes, str) else axes
        return int(np.prod([self.shape[a] for a in names]))

    def index(self, axes: Any) -> int:
        names = (axes,) if isinstance(axes, str) else axes
        i = 0
        for a in AXES:
            if a in names:
                i = i * self.shape[a] + self.coords[a]
        return i


@pytest.mark.parametrize("sizes", [dict(pp=1, dp=1, ep=1, cp=1, tp=1), dict(pp=2, dp=2, ep=1, cp=1, tp=2),
                                   dict(pp=1, dp=3, ep=1, cp=1, tp=4), dict(pp=1, dp=2, ep=1, cp=2, tp=2),
                                   dict(pp=1, dp=2, ep=2, cp=1, tp=1), dict(pp=1, dp=1, ep=4, cp=2, tp=1)])
def test_block_region_is_local_slices_and_blocks_tile(sizes: dict[str, int]) -> None:
    """On every mesh, a dense block's and an MoE block's leaves (experts split over ep)."""
    from numesh.nn.gpt import GPTConfig

    model = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True, moe_experts=4,
                      moe_every=2)
    for path, leaf in gpt_leaves(model).items():
        shape, spec, padded = leaf.shape, leaf.spec, leaf.padded_shape(sizes)
        for coords in np.ndindex(*[sizes[a] for a in AXES]):
            c = dict(zip(AXES, coords))
            assert block_region(padded, spec, sizes, c) == local_slices(padded, spec, FakeMesh(sizes, c)), path
        blocks = leaf_blocks(shape, padded, spec, sizes)
        cover = np.zeros(shape, dtype=int)
        for _, region in blocks:
            cover[region] += 1
        assert (cover == 1).all(), path
        assert len({s for s, _ in blocks}) == len(blocks)
    assert block_region((8, 6), P(("dp", "tp"), None), dict(pp=1, dp=2, tp=2), dict(pp=0, dp=1, tp=0)) == (
        slice(4, 6), slice(0, 6))


def test_leaf_table_pads_only_the_vocabulary() -> None:
    """The GPT's leaf table pads wte to a multiple of tp and nothing else; pad_vocab and
    unpad_vocab are inverses; the format module itself imports no model."""
    import ast

    from numesh.base.tree import tree_map
    from numesh.checkpoint import format as fmt
    from numesh.checkpoint import pad_vocab, unpad_vocab
    from numesh.nn.gpt import GPTConfig, gpt_global_shapes

    model = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True)
    leaves = gpt_leaves(model)
    for tp in (1, 2, 4):
        sizes = dict(pp=1, dp=2, tp=tp)
        assert leaves["wte"].padded_shape(sizes) == (model.padded_vocab(tp), 16)
        assert all(leaf.padded_shape(sizes) == leaf.shape for path, leaf in leaves.items() if path != "wte")
    rng = np.random.default_rng(0)
    params = tree_map(lambda s: rng.standard_normal(s), gpt_global_shapes(model, 1))
    padded = pad_vocab(params, model, 4)
    assert padded.wte.shape == (12, 16) and not padded.wte[11:].any()
    assert_trees_equal(unpad_vocab(padded, model), params)
    imported = {
        n.module for n in ast.walk(ast.parse(Path(fmt.__file__).read_text())) if isinstance(n, ast.ImportFrom)
    }
    assert not any(m and m.startswith(("numesh.nn", "numesh.pipeline", "numesh.optim")) for m in imported), imported


@pytest.mark.parametrize("tp", [-1, 0, 2.5, True, "2"])
def test_padding_the_vocabulary_refuses_a_tp_that_is_no_size(tp: Any) -> None:
    """tp=-1 "padded" 65 entries to 65 and 2.5 to 65.0 (a float shape): every function that
    pads the vocabulary for tp refuses them in one line instead."""
    from numesh.base.padding import padded_vocab
    from numesh.base.tree import tree_map
    from numesh.checkpoint import pad_vocab
    from numesh.nn.gpt import GPTConfig, gpt_global_shapes

    model = GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=8)
    params = tree_map(np.zeros, gpt_global_shapes(model, 1))
    with pytest.raises(ValueError, match=r"^tp must be an integer >= 1, got .*$"):
        padded_vocab(65, tp)
    for pad in (lambda: model.padded_vocab(tp), lambda: pad_vocab(params, model, tp)):
        with pytest.raises(ConfigError, match=r"^tp must be (an integer|>= 1), got [^\n]*$"):
            pad()
    assert padded_vocab(65, 2) == model.padded_vocab(2) == pad_vocab(params, model, 2).wte.shape[0] == 66


def test_global_path_maps_pipeline_blocks() -> None:
    from numesh.nn.gpt import GPTConfig

    assert global_path("blocks.1.attn.qkv.w", [4, 5, 6]) == "blocks.5.attn.qkv.w"
    assert global_path("wte", [2, 3]) == "wte"
    assert global_path("ln_f.b", [2, 3]) == "ln_f.b"
    with pytest.raises(ValueError, match="blocks.2"):
        global_path("blocks.2.ln1.w", [0, 1])
    model = GPTConfig(vocab_size=11, block_size=8, n_layer=8, n_head=4, n_embd=16)
    paths = tree_map_with_path(lambda p, _s: p, gpt_specs(model))
    for pp, v in ((1, 1), (2, 1), (2, 2), (4, 2)):
        layout = StageLayout(8, pp, v)
        seen = []
        for rank in range(pp):
            for local, glob in tree_leaves_with_path(stage_tree(paths, layout, rank)):
                assert global_path(local, layout.owned(rank)) == glob
                seen.append(glob)
        assert set(seen) == set(tree_leaves(paths))


# ---------------------------------------------------------------------------------------
# round trip and resume


def test_round_trip_is_bit_exact(data: Path, tmp_path: Path) -> None:
    t = trainer_after(config(data, tmp_path / "a"), 3)
    step_dir = save_checkpoint(train_state(t), tmp_path / "a")
    assert step_dir == tmp_path / "a" / "ckpt" / "step_000003"
    latest = tmp_path / "a" / "ckpt" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == "step_000003"

    u = Trainer(config(data, tmp_path / "b"), MPI.COMM_SELF)
    restore(u, latest)
    assert u.step == 3 and u.opt.opt_step == t.opt.opt_step == 3
    assert_states_equal(state_trees(u), state_trees(t))

    # the files: no pickle, padding never stored, meta.json complete
    meta = json.loads((step_dir / "meta.json").read_text())
    assert (meta["format"], meta["version"], meta["step"], meta["seed"]) == ("numesh-ckpt", 1, 3, 5)
    assert meta["mesh"] == {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 1} and meta["train"] == attrs.asdict(t.cfg)
    assert meta["model"]["vocab_size"] == 11 and len(meta["tokenizer"]["chars"]) == 11
    assert meta["leaves"]["m/wte"]["shape"] == [11, 16]
    assert meta["leaves"]["params/blocks.1.attn.qkv.w"]["spec"] == [None, None, "tp"]
    for info in meta["leaves"].values():
        for rec in info["files"]:
            arr = np.load(step_dir / rec["file"], allow_pickle=False)
            assert list(arr.shape) == rec["shape"] and arr.dtype == np.float64
    model, tok, params = read_global_params(latest)
    assert model == t.model and tok.vocab_size == 11
    assert_trees_equal(params, t.gathered_params())
    assert read_params_dict(latest).keys() == dict(tree_leaves_with_path(params)).keys()


def test_resume_is_bit_for_bit(data: Path, tmp_path: Path) -> None:
    """2k steps in one go == k steps, save, a new process-like Trainer loads, k more steps."""
    k = 3
    whole = run(config(data, tmp_path / "whole", max_iters=2 * k))
    first = run(config(data, tmp_path / "first", max_iters=k))
    assert [r for r in first if "loss" in r] == [r for r in whole if r["step"] < k and "loss" in r]
    resumed = run(config(data, tmp_path / "second", max_iters=2 * k,
                         resume=str(tmp_path / "first" / "ckpt" / "latest")))
    assert resumed[0]["step"] == k
    assert resumed == [r for r in whole if r["step"] >= k]
    assert_states_equal(read_state(tmp_path / "second" / "ckpt" / "latest")[1],
                        read_state(tmp_path / "whole" / "ckpt" / "latest")[1])
    assert read_meta(tmp_path / "second" / "ckpt" / "latest").step == 2 * k
    lines = [json.loads(x) for x in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [r["step"] for r in resumed]


def test_resume_past_max_iters_is_an_error(saved: Path, data: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="past max_iters=2"):
        train(config(data, tmp_path, max_iters=2, resume=str(saved)), MPI.COMM_SELF)


CLI_RUN = ("--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--block-size", "8", "--batch-size", "4",
           "--eval-interval", "100", "--eval-iters", "1", "--peak-flops", "1e12")


def resume_cli(data: Path, out: Path, steps: int, *extra: str) -> Any:
    """`numesh train` of CLI_RUN's model to `steps` into `out`, resuming its latest if it has one."""
    again = ("--resume", str(out / "ckpt" / "latest")) if (out / "ckpt").exists() else ()
    res = cli("train", *CLI_RUN, "--data", str(data), "--out", str(out), "--max-iters", str(steps), *again, *extra)
    assert res.exit_code == 0, res.output
    return res


def notes(res: Any) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("note: ")]


def test_a_resume_continues_in_the_checkpoints_dtype_unless_dtype_is_given(data: Path, tmp_path: Path) -> None:
    """A float64 checkpoint resumed without --dtype was converted to float32 silently: it
    continues in float64 now, and a --dtype given converts it with a note line."""
    out = tmp_path / "r"
    resume_cli(data, out, 1, "--dtype", "float64")
    res = resume_cli(data, out, 2)
    assert notes(res) == [] and read_meta(out / "ckpt" / "latest").dtype == "float64"
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
    ckpt = str(out / "ckpt" / "latest")
    assert config_from(dict(resume=ckpt)).dtype == "float64"
    assert config_from(dict(resume="auto", out=str(out))).dtype == "float64"
    assert config_from(dict(resume="auto", out=str(tmp_path / "none"))).dtype == "float32"  # a fresh start
    assert config_from(dict(resume=ckpt, dtype="float32")).dtype == "float32"
    res = resume_cli(data, out, 3, "--dtype", "float32")
    assert notes(res) == [f"note: {ckpt} was saved in float64; its weights and moments are converted to float32 "
                          "(--dtype), in which this run continues"]
    assert read_meta(out / "ckpt" / "latest").dtype == "float32"


def test_a_resume_that_changes_hyper_parameters_says_so_and_config_json_keeps_each_change(data: Path,
                                                                                          tmp_path: Path) -> None:
    """Resuming with another learning rate or weight decay was silent, and config.json then
    held only the new values, as if the whole run had trained with them: a note line says
    old -> new, and config.json (like each later checkpoint's meta.json) lists every change
    with the step it applies from, across resumes."""
    out = tmp_path / "r"
    resume_cli(data, out, 1, "--learning-rate", "1e-2", "--min-lr", "1e-3")
    res = resume_cli(data, out, 2, "--learning-rate", "5e-3", "--min-lr", "1e-3", "--weight-decay", "0",
                     "--beta2", "0.95")
    assert notes(res) == ["note: resuming with hyper-parameters changed from the checkpoint's run: --learning-rate "
                          "0.01 -> 0.005, --beta2 0.99 -> 0.95, --weight-decay 0.1 -> 0.0 (config.json lists each "
                          "change and its step)"]
    first = {"step": 1, "learning_rate": [0.01, 0.005], "beta2": [0.99, 0.95], "weight_decay": [0.1, 0.0]}
    config = json.loads((out / "config.json").read_text())
    assert config["learning_rate"] == 0.005 and config["hyper_parameter_changes"] == [first]
    res = resume_cli(data, out, 3, "--learning-rate", "5e-3", "--min-lr", "1e-3", "--weight-decay", "0",
                     "--beta2", "0.95")  # nothing changed: no note, the changes kept
    assert notes(res) == []
    assert json.loads((out / "config.json").read_text())["hyper_parameter_changes"] == [first]
    resume_cli(data, out, 4, "--learning-rate", "2e-3", "--min-lr", "1e-3", "--weight-decay", "0",
               "--beta2", "0.95", "--grad-clip", "0.5")
    changes = [first, {"step": 3, "learning_rate": [0.005, 0.002], "grad_clip": [1.0, 0.5]}]
    assert json.loads((out / "config.json").read_text())["hyper_parameter_changes"] == changes
    assert read_meta(out / "ckpt" / "latest").raw["train"]["hyper_parameter_changes"] == changes
    other = tmp_path / "elsewhere"  # a resume into another --out carries the checkpoint's record
    cli_res = cli("train", *CLI_RUN, "--data", str(data), "--out", str(other), "--max-iters", "5", "--resume",
                  str(out / "ckpt" / "latest"), "--learning-rate", "2e-3", "--min-lr", "1e-3", "--weight-decay", "0",
                  "--beta2", "0.95", "--grad-clip", "0.5")
    assert cli_res.exit_code == 0, cli_res.output
    assert json.loads((other / "config.json").read_text())["hyper_parameter_changes"] == changes


def test_the_hyper_parameters_a_resume_compares_are_the_optimisers_the_schedules_and_clippings() -> None:
    from numesh.run.config import changed_hyper_parameters

    muon = config_from(dict(optimizer="muon", muon_momentum=0.9, muon_nesterov=False, warmup_iters=5))
    recorded = {**attrs.asdict(muon), "muon_momentum": 0.95, "muon_nesterov": True, "warmup_iters": 10, "seed": 1}
    assert changed_hyper_parameters(recorded, muon) == {
        "muon_momentum": [0.95, 0.9], "muon_nesterov": [True, False], "warmup_iters": [10, 5]}
    del recorded["muon_momentum"]  # a key an older numesh did not record: nothing to compare
    assert list(changed_hyper_parameters(recorded, muon)) == ["muon_nesterov", "warmup_iters"]
    assert changed_hyper_parameters(None, muon) == {}


# ---------------------------------------------------------------------------------------
# broken checkpoints: a CheckpointError naming the file


def test_corrupted_file(broken: Path, fresh: Trainer) -> None:
    f = broken / "params" / "blocks.1.mlp.fc.w.tp0.npy"
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.fc\.w\.tp0\.npy is corrupted"):
        restore(fresh, broken)
    with pytest.raises(CheckpointError, match=r"blocks\.1\.mlp\.fc\.w\.tp0\.npy is corrupted"):
        read_global_params(broken)
    assert fresh.step == 0


def test_truncated_file(broken: Path, fresh: Trainer) -> None:
    f = broken / "v" / "wte.tp0.npy"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"v/wte\.tp0\.npy is corrupted or truncated"):
        restore(fresh, broken)


def test_missing_file(broken: Path, fresh: Trainer) -> None:
    (broken / "m" / "wpe.full.npy").unlink()
    with pytest.raises(CheckpointError, match=r"m/wpe\.full\.npy is missing"):
        restore(fresh, broken)


def test_missing_meta(broken: Path, fresh: Trainer) -> None:
    (broken / "meta.json").unlink()
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        restore(fresh, broken)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        restore(fresh, broken / "nowhere")


def edit_meta(ckpt: Path, change: Any) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    change(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_wrong_format_or_version(broken: Path, fresh: Trainer) -> None:
    edit_meta(broken, lambda m: m.update(version=2))
    with pytest.raises(CheckpointError, match=r"meta\.json: checkpoint format version 2 is not supported"):
        restore(fresh, broken)
    edit_meta(broken, lambda m: m.update(version=1, format="something-else"))
    with pytest.raises(CheckpointError, match="not a numesh checkpoint"):
        read_global_params(broken)


def test_different_model_shape(saved: Path, data: Path, tmp_path: Path) -> None:
    other = Trainer(config(data, tmp_path, n_embd=32), MPI.COMM_SELF)
    with pytest.raises(CheckpointError,
                       match=r"meta\.json: the checkpoint's model has n_embd=16 but this run has n_embd=32"):
        restore(other, saved)
    with pytest.raises(CheckpointError, match="n_embd=32"):
        train(config(data, tmp_path / "x", n_embd=32, resume=str(saved)), MPI.COMM_SELF)


@pytest.mark.parametrize("bad", ["../step_000003/params/wpe.full.npy", "/etc/passwd", "params/../../x.npy"])
def test_metadata_path_escaping_the_dir(broken: Path, fresh: Trainer, bad: str) -> None:
    edit_meta(broken, lambda m: m["leaves"]["params/wpe"]["files"][0].update(file=bad))
    with pytest.raises(CheckpointError, match="absolute or leaves the checkpoint directory") as e:
        restore(fresh, broken)
    assert bad in str(e.value)


def test_symlinked_file_escaping_the_dir(broken: Path, fresh: Trainer, tmp_path: Path) -> None:
    f = broken / "params" / "wpe.full.npy"
    outside = tmp_path / "outside.npy"
    shutil.move(f, outside)
    f.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"wpe\.full\.npy leaves the checkpoint directory"):
        restore(fresh, broken)


def test_inconsistent_blocks(broken: Path, fresh: Trainer) -> None:
    edit_meta(broken, lambda m: m["leaves"]["params/wpe"]["files"][0].update(shape=[4, 16]))
    with pytest.raises(CheckpointError, match="the blocks of 'params/wpe' cover 64 of its 128 values"):
        restore(fresh, broken)


# ---------------------------------------------------------------------------------------
# atomic saves and pruning


def test_interrupted_save_keeps_latest(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    t = trainer_after(config(data, out), 2)
    save_checkpoint(train_state(t), out)
    t.train_step()
    calls = [0]
    real = save_mod.write_npy

    def killed_midway(path: Path, array: np.ndarray) -> str:
        calls[0] += 1
        if calls[0] == 7:
            raise KeyboardInterrupt("killed")  # like a kill: nothing gets to clean up
        return real(path, array)

    monkeypatch.setattr(save_mod, "write_npy", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(train_state(t), out)
    ck = out / "ckpt"
    assert (ck / ".tmp-step_000003").is_dir() and not (ck / "step_000003").exists()
    assert os.readlink(ck / "latest") == "step_000002"
    u = Trainer(config(data, tmp_path / "u"), MPI.COMM_SELF)
    restore(u, ck / "latest")
    assert u.step == 2

    # a write error (disk full) is a CheckpointError and leaves nothing behind
    def disk_full(path: Path, array: np.ndarray) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_mod, "write_npy", disk_full)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(train_state(t), out)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002"]
    assert os.readlink(ck / "latest") == "step_000002"

    # the next good save completes and moves latest
    monkeypatch.setattr(save_mod, "write_npy", real)
    save_checkpoint(train_state(t), out)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert os.readlink(ck / "latest") == "step_000003"


def test_keep_prunes_old_checkpoints(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(config(data, out, max_iters=5, ckpt_interval=2, keep=2), MPI.COMM_SELF)
    ck = out / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000004", "step_000005"]
    assert os.readlink(ck / "latest") == "step_000005"
    train(config(data, tmp_path / "all", max_iters=5, ckpt_interval=2), MPI.COMM_SELF)
    assert sorted(p.name for p in (tmp_path / "all" / "ckpt").iterdir()) == [
        "latest", "step_000002", "step_000004", "step_000005"
    ]
    # keep=1 on a directory with a newer step from an earlier run still keeps the new one
    t = trainer_after(config(data, out), 1)
    save_checkpoint(train_state(t), out, keep=1)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000001"]


def test_keep_after_a_rewind_keeps_the_continued_runs_checkpoints(data: Path, tmp_path: Path) -> None:
    """Resumed from step 2 of a run that went on to step 6: its steps 4 and 6 are an
    abandoned future. --keep 2 deleted the continued run's steps 2 and 3 and kept that old
    step 6 beside the new latest; now the abandoned steps go first."""
    out = tmp_path / "run"
    train(config(data, out, max_iters=6, ckpt_interval=2), MPI.COMM_SELF)
    ck = out / "ckpt"
    train(config(data, out, max_iters=5, ckpt_interval=1, keep=2, resume=str(ck / "step_000002")), MPI.COMM_SELF)
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000004", "step_000005"]
    assert os.readlink(ck / "latest") == "step_000005"
    # the continued run's own step 4 (its recorded config, not an inode number: a freed inode
    # is reused, and the old file's number once came back for the new one in a CI run)
    assert json.loads((ck / "step_000004" / "meta.json").read_text())["train"]["max_iters"] == 5


# ---------------------------------------------------------------------------------------
# resharding


def test_each_expert_block_is_written_once_per_ep_index() -> None:
    """On dp=2, ep=2, tp=2: an expert leaf (split over ep) is written by the dp=0, tp=0
    rank of each ep index, its block of experts; a leaf replicated over ep by rank 0 only."""
    sizes = dict(pp=1, dp=2, ep=2, cp=1, tp=2)
    ranks = [dict(zip(AXES, c)) for c in np.ndindex(*[sizes[a] for a in AXES])]
    expert, router, wte = P("ep", None, None), P(), P("tp", None)
    assert [(c["ep"], shard_suffix(expert, c)) for c in ranks if writes_leaf(expert, c)] == [(0, "ep0"), (1, "ep1")]
    assert [c for c in ranks if writes_leaf(router, c)] == [dict(pp=0, dp=0, ep=0, cp=0, tp=0)]
    assert [(c["ep"], c["tp"]) for c in ranks if writes_leaf(wte, c)] == [(0, 0), (0, 1)]
    assert writes_leaf(router, dict(pp=0, dp=0, cp=0, tp=0))  # coordinates of a mesh before ep: ep 0
    assert [r for _, r in leaf_blocks((4, 3, 5), (4, 3, 5), expert, sizes)] == [
        (slice(0, 2), slice(0, 3), slice(0, 5)), (slice(2, 4), slice(0, 3), slice(0, 5))]


@pytest.fixture(scope="module")
def saved_moe(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank checkpoint of a model with 4 experts in block 0, after 2 steps."""
    out = tmp_path_factory.mktemp("saved_moe")
    cfg = config(data, out, moe_experts=4, moe_every=2, moe_top_k=2, dropout=0.0)
    save_checkpoint(train_state(trainer_after(cfg, 2)), out)
    return out / "ckpt" / "step_000002"


def test_reshard_an_moe_checkpoint_across_ep_sizes(saved_moe: Path, data: Path, tmp_path: Path) -> None:
    """Experts split over ep in whole blocks (ep rank r: experts r*E/ep ...); the router and
    the dense leaves stay one block; every value survives ep=1 -> 2 -> 4 -> 1, and the
    result restores on one rank."""
    ep2 = reshard(saved_moe, "ep=2", tmp_path / "ep2")
    meta = json.loads((ep2 / "meta.json").read_text())
    assert meta["mesh"] == {"pp": 1, "dp": 1, "ep": 2, "cp": 1, "tp": 1}
    for leaf in ("params/blocks.0.mlp.fc.w", "m/blocks.0.mlp.proj.w", "v/blocks.0.mlp.fc.b",
                 "params/blocks.0.mlp.proj.b"):
        files = meta["leaves"][leaf]["files"]
        assert [(r["offset"][0], r["shape"][0]) for r in files] == [(0, 2), (2, 2)], leaf
        # fc and proj.w also name tp, which splits each expert's hidden units (here tp=1)
        want = ["ep0", "ep1"] if leaf.endswith("proj.b") else ["ep0-tp0", "ep1-tp0"]
        assert [r["file"].rsplit(".", 2)[-2] for r in files] == want, leaf
    for leaf in ("params/blocks.0.mlp.router.w", "params/blocks.1.mlp.fc.w", "params/wte"):
        assert len(meta["leaves"][leaf]["files"]) == 1, leaf
    ep4 = reshard(ep2, "dp=2,ep=4", tmp_path / "dp2ep4")
    assert len(json.loads((ep4 / "meta.json").read_text())["leaves"]["params/blocks.0.mlp.fc.w"]["files"]) == 4
    back = reshard(ep4, "dp=1,ep=1", tmp_path / "back")
    for d in (ep2, ep4, back):
        assert_states_equal(read_state(d)[1], read_state(saved_moe)[1])
    leaves = [json.loads((d / "meta.json").read_text())["leaves"] for d in (back, saved_moe)]
    assert leaves[0] == leaves[1]
    t = Trainer(config(data, tmp_path / "t", moe_experts=4, moe_every=2, moe_top_k=2, dropout=0.0), MPI.COMM_SELF)
    restore(t, ep2)
    assert t.step == 2
    assert_states_equal(state_trees(t), read_state(saved_moe)[1])
    with pytest.raises(ConfigError, match="^--to ep=3: the model's 4 experts do not split over ep=3: use an ep that "
                                          "divides 4$"):
        reshard(saved_moe, "ep=3", tmp_path / "x")


def test_reshard_tp1_to_tp4_keeps_every_value(saved: Path, data: Path, tmp_path: Path) -> None:
    src = tmp_path / "ckpt" / saved.name
    shutil.copytree(saved, src)
    (tmp_path / "ckpt" / "latest").symlink_to(saved.name)
    out = reshard(tmp_path / "ckpt" / "latest", "tp=4")
    assert out == tmp_path / "ckpt" / "step_000003-tp4"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mesh"] == {"pp": 1, "dp": 1, "ep": 1, "cp": 1, "tp": 4}
    wte = meta["leaves"]["params/wte"]["files"]  # vocabulary 11 over tp=4: rows 3, 3, 3, 2 (+1 padding)
    assert [(r["offset"][0], r["shape"][0]) for r in wte] == [(0, 3), (3, 3), (6, 3), (9, 2)]
    assert len(meta["leaves"]["v/blocks.0.mlp.proj.w"]["files"]) == 4
    assert len(meta["leaves"]["m/blocks.0.ln1.w"]["files"]) == 1
    assert_states_equal(read_state(out)[1], read_state(saved)[1])

    a = Trainer(config(data, tmp_path / "a"), MPI.COMM_SELF)
    b = Trainer(config(data, tmp_path / "b"), MPI.COMM_SELF)
    restore(a, saved)
    restore(b, out)
    assert_states_equal(state_trees(a), state_trees(b))
    assert b.step == 3

    back = reshard(out, "tp=2", tmp_path / "back")
    assert json.loads((back / "meta.json").read_text())["mesh"]["tp"] == 2
    assert_states_equal(read_state(back)[1], read_state(saved)[1])
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_reshard_to_a_cp_mesh_writes_the_same_blocks(saved: Path, data: Path, tmp_path: Path) -> None:
    """Parameters are replicated over cp: a cp mesh's checkpoint has the blocks of the same
    mesh without cp (written by cp index 0), and loads back to the same state."""
    out = reshard(saved, "cp=2,tp=2", tmp_path / "cp2tp2")
    ref = reshard(saved, "tp=2", tmp_path / "tp2")
    meta, want = (json.loads((d / "meta.json").read_text()) for d in (out, ref))
    assert meta["mesh"] == {"pp": 1, "dp": 1, "ep": 1, "cp": 2, "tp": 2}
    assert meta["leaves"] == want["leaves"]
    assert_states_equal(read_state(out)[1], read_state(saved)[1])
    b = Trainer(config(data, tmp_path / "b"), MPI.COMM_SELF)
    restore(b, out)
    assert b.step == 3
    with pytest.raises(ConfigError, match=r"block_size=8 does not split into 2\*cp=6 equal chunks"):
        reshard(saved, "cp=3", tmp_path / "x")


def test_reshard_to_a_pp_that_the_virtual_stages_do_not_fit_records_one(saved: Path, data: Path,
                                                                         tmp_path: Path) -> None:
    """A checkpoint written with 2 virtual stages (meta.json's record of the writing layout;
    its files hold leaves by global layer) refused --to pp=2 for n_layer=2 (2 x 2 chunks),
    though `train --mesh pp=2 --resume` of it works: the output records 1 virtual stage and
    says so; a pp they do fit keeps them."""
    src = tmp_path / "v2"
    shutil.copytree(saved, src)
    raw = json.loads((src / "meta.json").read_text())
    (src / "meta.json").write_text(json.dumps(raw | {"virtual_stages": 2}))
    notes: list[str] = []
    out = reshard(src, "pp=2", tmp_path / "pp2", log=notes.append)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["mesh"]["pp"] == 2 and meta["virtual_stages"] == 1
    assert notes == ["n_layer=2 does not split over pp x virtual stages = 2 x 2: the output records 1 virtual stage "
                     "(resume it with a --virtual-stages that splits the layers over pp=2, e.g. 1)"]
    assert_states_equal(read_state(out)[1], read_state(saved)[1])
    b = Trainer(config(data, tmp_path / "b"), MPI.COMM_SELF)
    restore(b, out)
    assert b.step == 3
    notes.clear()
    kept = reshard(src, "tp=2", tmp_path / "tp2", log=notes.append)
    assert json.loads((kept / "meta.json").read_text())["virtual_stages"] == 2 and not notes
    res = cli("reshard", str(src), "--to", "pp=2", "--out", str(tmp_path / "cli"))
    assert res.exit_code == 0 and res.stdout.strip() == str(tmp_path / "cli"), res.output
    assert "note: n_layer=2 does not split over pp x virtual stages = 2 x 2" in res.stderr


def test_reshard_validates_the_target(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^n_head=4 is not divisible by tp=3: reshard --to another tp, 1, 2 or 4$"):
        reshard(saved, "tp=3", tmp_path / "x")  # the checkpoint's model is fixed: no model option to name
    with pytest.raises(ConfigError, match="n_layer=2 does not split over pp x virtual stages = 3 x 1: reshard --to "
                                          "another pp, one of 1, 2"):
        reshard(saved, "pp=3", tmp_path / "x")
    with pytest.raises(MeshError, match="unknown mesh axis 'xp'"):
        reshard(saved, "xp=2", tmp_path / "x")
    with pytest.raises(ConfigError, match="^--to ep=2 splits the experts over ranks, but this checkpoint's model has "
                                          "none: drop ep from --to$"):
        reshard(saved, "ep=2", tmp_path / "x")
    with pytest.raises(MeshError, match="malformed"):
        reshard(saved, "tp", tmp_path / "x")
    for to in (None, {"tp": 2}):  # were AttributeErrors
        with pytest.raises(MeshError, match=f"^--to must be a mesh string of the axes to change, e.g. 'tp=4' or "
                                            f"'dp=2,tp=4', got {re.escape(repr(to))}$"):
            reshard(saved, to, tmp_path / "x")
    (tmp_path / "exists").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        reshard(saved, "tp=2", tmp_path / "exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


# ---------------------------------------------------------------------------------------
# export


def numesh_logits(params: Any, model: Any, idx: np.ndarray) -> np.ndarray:
    """Logits at every position by a full forward on the 1-rank mesh."""
    from numesh.mesh import Mesh
    from numesh.run.sample import shard_params
    from test_layers import _full_logits

    mesh = Mesh.create(comm=MPI.COMM_SELF)
    return _full_logits(shard_params(params, model, mesh), idx, model, mesh)


@pytest.mark.parametrize("bias", [True, False])
def test_export_loads_into_pytorch_nanogpt(data: Path, tmp_path: Path, bias: bool) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from numesh.testing.torch_nanogpt import from_config

    out = tmp_path / "run"
    train(config(data, out, max_iters=2, bias=bias, dtype="float32"), MPI.COMM_SELF)
    f = export_nanogpt(out / "ckpt" / "latest", tmp_path / "model.safetensors")
    model, _, params = read_global_params(out / "ckpt" / "latest")

    net = from_config(model)
    net.load_state_dict(load_file(str(f)), strict=True)
    idx = np.random.default_rng(0).integers(0, model.vocab_size, size=(3, model.block_size))
    with torch.no_grad():
        got = net(torch.from_numpy(idx)).numpy()
    want = numesh_logits(params, model, idx)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_sample_from_export_equals_sample_from_checkpoint(saved: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from numesh.cli.app import app

    runner = CliRunner()
    res = runner.invoke(app, ["export", str(saved), "--out", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 0, res.output
    texts = []
    for ckpt in (saved, tmp_path / "m.safetensors"):
        res = runner.invoke(app, ["sample", "--ckpt", str(ckpt), "--prompt", "abc", "--max-new-tokens", "24",
                                  "--temperature", "0"])
        assert res.exit_code == 0, res.output
        texts.append(res.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("abc") and len(texts[0]) >= 27

    res = runner.invoke(app, ["reshard", str(saved), "--to", "tp=2", "--out", str(tmp_path / "r")])
    assert res.exit_code == 0 and (tmp_path / "r" / "meta.json").is_file()
    res = runner.invoke(app, ["sample", "--ckpt", str(tmp_path / "nothing.safetensors")])
    assert res.exit_code == 2


def test_export_rejects_foreign_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from numesh.run.sample import load_checkpoint

    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not written by `numesh export`"):
        load_checkpoint(tmp_path / "other.safetensors")


# ---------------------------------------------------------------------------------------
# the vocabulary a checkpoint was trained on (issue #18, point 9)


def toml_of(cfg: TrainConfig) -> str:
    """`cfg` as a --config file (every field is a str, int, float or bool)."""
    return "".join(f"{k} = {json.dumps(v)}\n" for k, v in attrs.asdict(cfg).items())


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` (content, mtime), symlinks as their target."""
    return {
        str(p.relative_to(root)): (os.readlink(p).encode() if p.is_symlink() else p.read_bytes(), p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


@pytest.mark.parametrize(
    "other_text, where",
    [
        # same 11 characters but 'k' for 'a': every id from 1 on means another character
        (TEXT.replace("a", "k"), r"id 1 is 'a' in the checkpoint, 'b' in the dataset; vocab 11 vs 11"),
        # one more character: the vocabulary message, not check_model's vocab_size one
        (TEXT + "z", r"id 11 is absent in the checkpoint, 'z' in the dataset; vocab 11 vs 12"),
    ],
)
def test_resume_on_another_vocabulary_is_one_line_and_writes_nothing(
    data: Path, tmp_path: Path, other_text: str, where: str
) -> None:
    from typer.testing import CliRunner

    from numesh.cli.app import app

    other = tmp_path / "other-data"
    prepare_char_dataset(other_text, other)
    run_dir = tmp_path / "run"
    train(config(data, run_dir, max_iters=2), MPI.COMM_SELF)
    before = snapshot(run_dir)
    cfg = config(other, run_dir, max_iters=4, resume=str(run_dir / "ckpt" / "latest"))
    (tmp_path / "resume.toml").write_text(toml_of(cfg))
    res = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "resume.toml")])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "step_000002 was trained on another vocabulary than dataset " + str(other) in lines[0]
    assert re.search(where, lines[0]) and (
        "resume with --data set to the dataset the checkpoint was trained on" in lines[0])
    assert snapshot(run_dir) == before  # no config.json, metrics line or checkpoint written

    # the library path: the same error, the trainer untouched
    t = Trainer(config(other, tmp_path / "x"), MPI.COMM_SELF)
    with pytest.raises(CheckpointError, match="trained on another vocabulary") as e:
        restore(t, run_dir / "ckpt" / "latest")
    assert re.search(where, str(e.value)) and t.step == 0


def test_resume_on_the_same_vocabulary_in_another_directory(data: Path, saved: Path, tmp_path: Path) -> None:
    """What is compared is the vocabulary, not where the dataset lives."""
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    t = Trainer(config(copy, tmp_path / "x"), MPI.COMM_SELF)
    restore(t, saved)
    assert t.step == 3


def test_checkpoint_without_tokenizer_still_resumes(broken: Path, data: Path, tmp_path: Path) -> None:
    """Checkpoints written before meta.json recorded the tokenizer load, unchecked; sampling
    from one says what to do."""
    from numesh.run.sample import load_checkpoint

    edit_meta(broken, lambda m: m.pop("tokenizer"))
    records = run(config(data, tmp_path / "resumed", max_iters=5, resume=str(broken)))
    assert records[0]["step"] == 3 and read_meta(tmp_path / "resumed" / "ckpt" / "latest").step == 5
    # the new checkpoint records the dataset's tokenizer again
    assert read_meta(tmp_path / "resumed" / "ckpt" / "latest").tokenizer().vocab_size == 11
    with pytest.raises(CheckpointError, match=r"holds no tokenizer.*numesh train --resume .* --max-iters 3"):
        load_checkpoint(broken)


def test_an_older_checkpoint_with_more_rows_than_the_dataset_is_refused(data: Path, tmp_path: Path) -> None:
    """A checkpoint that records no tokenizer cannot show that its rows past --data's
    entries are padding: its vocabulary must be the dataset's, as before padded
    vocabularies were read (a resume from it on another dataset would train ids that mean
    other text)."""
    wider = tmp_path / "wider"
    prepare_char_dataset(TEXT + "XYZ", wider)  # 3 more characters: 14 entries
    out = tmp_path / "w"
    save_checkpoint(train_state(trainer_after(config(wider, out), 1)), out)
    edit_meta(out / "ckpt" / "step_000001", lambda m: m.pop("tokenizer"))
    with pytest.raises(CheckpointError, match="the checkpoint's model has vocab_size=14 but this run has "
                                              "vocab_size=11"):
        run(config(data, tmp_path / "resumed", max_iters=5, resume=str(out / "ckpt" / "step_000001")))


def test_a_tokenizer_larger_than_the_model_is_inconsistent(broken: Path, fresh: Trainer) -> None:
    """More entries than the model has rows: ids without a row. Fewer is a padded
    vocabulary (a run from a transformers model padded to a multiple of 64 keeps its rows)."""
    edit_meta(broken, lambda m: m["tokenizer"].update(vocab_size=12, chars=list("abcdefghijkl")))
    with pytest.raises(CheckpointError, match="its tokenizer has 12 entries but its model vocab_size is only 11"):
        restore(fresh, broken)
    with pytest.raises(CheckpointError, match="its tokenizer has 12 entries"):
        read_global_params(broken)
    edit_meta(broken, lambda m: m["tokenizer"].update(vocab_size=3, chars=["a", "b", "c"]))
    model, tok, _ = read_global_params(broken)
    assert (model.vocab_size, tok.vocab_size) == (11, 3)
    with pytest.raises(CheckpointError, match="was trained on another vocabulary"):  # its 3, not the dataset's 11
        restore(fresh, broken)


# ---------------------------------------------------------------------------------------
# exported files: no silent overwrite, a tokenizer that fits (issue #18, point 11)


def test_export_twice_needs_force(saved: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from numesh.cli.app import app

    runner = CliRunner()
    f = tmp_path / "m.safetensors"
    assert runner.invoke(app, ["export", str(saved), "--out", str(f)]).exit_code == 0
    f.write_bytes(f.read_bytes())  # a marker: is this copy replaced?
    before = f.stat().st_mtime_ns
    res = runner.invoke(app, ["export", str(saved), "--out", str(f), "--dtype", "float32"])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and lines == [f"error: {f} exists: pass --force to overwrite"], res.output
    assert f.stat().st_mtime_ns == before
    with pytest.raises(CheckpointError, match="exists: pass --force to overwrite"):
        export_nanogpt(saved, f)
    res = runner.invoke(app, ["export", str(saved), "--out", str(f), "--dtype", "float32", "--force"])
    assert res.exit_code == 0, res.output
    from numesh.checkpoint import import_nanogpt

    assert import_nanogpt(f)[3] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]  # no temp file left
    with pytest.raises(CheckpointError, match="is a directory"):
        export_nanogpt(saved, tmp_path, force=True)


def rewrite_metadata(src: Path, dst: Path, **changes: str | None) -> None:
    """Copy the exported file `src` to `dst` with metadata entries changed (None drops one)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), framework="numpy") as f:
        metadata = dict(f.metadata())
        sd = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in changes.items():
        if v is None:
            metadata.pop(k, None)
        else:
            metadata[k] = v
    save_file(sd, str(dst), metadata=metadata)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"tokenizer": "null"}, r"holds no tokenizer, so its token ids cannot be turned into text: export it again"),
        ({"tokenizer": None}, r"holds no tokenizer"),
        ({"tokenizer": json.dumps({"vocab_size": 12, "chars": list("abcdefghijkl")})},
         r"its tokenizer has 12 entries but its model vocab_size is only 11"),
        ({"tokenizer": "{not json"}, r"bad metadata"),
        ({"tokenizer": json.dumps({"chars": ["a", "a"]})}, r"bad metadata"),
    ],
)
def test_sample_from_export_with_a_bad_tokenizer(saved: Path, tmp_path: Path, changes: dict, match: str) -> None:
    from typer.testing import CliRunner

    from numesh.cli.app import app
    from numesh.run.sample import load_checkpoint

    good = export_nanogpt(saved, tmp_path / "good.safetensors")
    assert load_checkpoint(good).tokenizer.vocab_size == 11
    bad = tmp_path / "bad.safetensors"
    rewrite_metadata(good, bad, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(bad)
    res = CliRunner().invoke(app, ["sample", "--ckpt", str(bad), "--max-new-tokens", "2"])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and re.search(match, lines[0]), res.output


def test_an_older_export_with_more_rows_than_the_dataset_is_refused_as_a_start(data: Path, tmp_path: Path) -> None:
    """An export file without its tokenizer (written by an older numesh) starts a run only
    on a dataset of exactly its rows: with more rows, --data's ids may mean other text."""
    wider = tmp_path / "wider"
    prepare_char_dataset(TEXT + "XYZ", wider)  # 14 entries
    out = tmp_path / "w"
    save_checkpoint(train_state(trainer_after(config(wider, out), 1)), out)
    old = tmp_path / "old.safetensors"
    rewrite_metadata(export_nanogpt(out / "ckpt" / "step_000001", tmp_path / "new.safetensors"), old, tokenizer=None)
    with pytest.raises(ConfigError, match="has vocab_size 14 and records no tokenizer, --data's has 11 entries") as e:
        Trainer(config(data, tmp_path / "ft", init_from=str(old)), MPI.COMM_SELF)
    assert "\n" not in str(e.value)


def test_ranks_that_read_different_vocabularies_stop_in_one_line() -> None:
    from numesh.run.train import agree_on_vocab

    class Two:  # two ranks, one of which could not read the starting weights' rows
        def Get_size(self) -> int:
            return 2

        def allgather(self, _x: int) -> list[int]:
            return [64, 41]

    with pytest.raises(ConfigError, match=r"the ranks read different vocabulary sizes \(\[41, 64\]\)"):
        agree_on_vocab(64, Two())


def test_ranks_that_chose_different_dtypes_stop_in_one_line() -> None:
    """A resume without --dtype takes its checkpoint's on every rank that reads it; one that
    cannot keeps float32, and the run stops in one line rather than in a collective."""
    from numesh.run.train import agree_on_dtype

    class Two:
        def Get_size(self) -> int:
            return 2

        def allgather(self, _x: str) -> list[str]:
            return ["float64", "float32"]

    with pytest.raises(ConfigError, match=r"^the ranks chose different dtypes \(float32, float64\) .* --dtype$"):
        agree_on_dtype("float64", Two())


# ---------------------------------------------------------------------------------------
# every file numesh writes is a normal file of the user's: 0666 less the umask


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=oct)
def test_written_files_have_the_umask_mode(data: Path, tmp_path: Path, umask: int) -> None:
    """Dataset files, checkpoint blocks and meta.json, reshard outputs and exports (all
    written through temp files renamed into place) get the mode any new file would."""
    old = os.umask(umask)
    try:
        ds = tmp_path / "ds"
        prepare_char_dataset(TEXT, ds)
        run_dir = tmp_path / "run"
        train(config(ds, run_dir, max_iters=2), MPI.COMM_SELF)
        resharded = reshard(run_dir / "ckpt" / "latest", "tp=2", tmp_path / "resharded")
        exported = export_nanogpt(run_dir / "ckpt" / "latest", tmp_path / "out" / "m.safetensors")
        forced = export_nanogpt(run_dir / "ckpt" / "latest", tmp_path / "out" / "m.safetensors", force=True)
    finally:
        os.umask(old)
    assert exported == forced
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    dirs = [p for p in tmp_path.rglob("*") if p.is_dir() and not p.is_symlink()]
    names = {p.name for p in files}
    assert {"train.bin", "val.bin", "meta.json", "config.json", "metrics.jsonl", "m.safetensors", "wte.tp0.npy",
            "wte.tp1.npy"} <= names
    assert resharded in dirs and run_dir / "ckpt" / "step_000002" in dirs
    bad = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for p in files if p.stat().st_mode & 0o777 != 0o666 & ~umask}
    assert not bad, f"files not {oct(0o666 & ~umask)}: {bad}"
    bad = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777)
           for p in dirs if p.stat().st_mode & 0o777 != 0o777 & ~umask}
    assert not bad, f"directories not {oct(0o777 & ~umask)}: {bad}"


def test_a_train_state_the_reader_would_refuse_is_refused_before_the_save(tmp_path: Path) -> None:
    """A TrainState built by hand was written whatever it held: dtype bfloat16, step -3, a
    float64 model under meta.json's default float32, another model's layout; each saved a
    checkpoint the reader then refused (or misread), and optimizer 'foo' was a KeyError."""
    from numesh.checkpoint import TrainState, read_global
    from numesh.mesh import Mesh
    from numesh.nn.gpt import GPTConfig, init_gpt

    mesh, model = Mesh.create(), GPTConfig(vocab_size=17, n_layer=2, n_head=2, n_embd=16, block_size=8)
    params = init_gpt(model, mesh, dtype=np.float64)
    zeros = tree_map_with_path(lambda _, x: np.zeros_like(x), params)
    trees = {"params": params, "m": zeros, "v": zeros}

    def state(**kw: Any) -> TrainState:
        return TrainState(**{"mesh": mesh, "model": model, "layout": StageLayout(2), "trees": trees, "step": 1,
                             "opt_step": 1, "dtype": "float64", "optimizer": "adamw", **kw})

    for kw, says in [({"dtype": "bfloat16"}, "dtype must be float32 or float64, got 'bfloat16'"),
                     ({"step": -3}, "step and opt_step must be >= 0, got -3 and 1"),
                     ({"dtype": "float32"}, "of dtype float32 has float64 parameters: pass dtype='float64'"),
                     ({"layout": StageLayout(4)}, "layout splits 4 layers, its model has 2"),
                     ({"optimizer": "foo"}, "optimizer must be one of adamw, muon, got 'foo'")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            state(**kw)
    assert read_global(save_checkpoint(state(), tmp_path))[0].dtype == "float64"
