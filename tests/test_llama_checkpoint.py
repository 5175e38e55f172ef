"""Checkpoints of the Llama kind on one process: `numesh train --arch llama` saves a
checkpoint whose meta.json holds the model's parts, `numesh sample` reads it (the same text
with and without the KV cache), `numesh reshard` moves it between tp=1, 2 and 4 unchanged
(the untied head padded like wte), resuming with other parts or other rotary/norm math is
one line, an older checkpoint without the parts reads as the GPT-2 kind, its transformers
export samples alike, and the nanoGPT export and `--init-from`, which know only GPT-2,
refuse it in one line. Resuming exactly on tp=1, 2
and 4 from resharded copies: tests/test_mpi_checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import cli, make_dataset, one_error_line
from numesh.base.errors import CheckpointError, ConfigError
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import read_meta, read_state, reshard
from numesh.checkpoint.init_from import OPTION, load_init
from numesh.checkpoint.model import MATH_KEYS, SHAPE_KEYS, check_model
from numesh.data.dataset import load_tokenizer
from numesh.nn.gpt import GPTConfig
from numesh.run.config import config_from
from numesh.run.train import train

LLAMA_FLAGS = ("--arch", "llama", "--n-kv-head", "2", "--n-layer", "2", "--n-head", "4", "--n-embd", "16",
               "--block-size", "16", "--rope-theta", "500", "--norm-eps", "1e-6")
RUN_FLAGS = ("--batch-size", "4", "--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--dtype",
             "float64", "--peak-flops", "1e12")


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of 2 steps of a tiny Llama (2 kv heads for 4 query heads, untied)."""
    root = tmp_path_factory.mktemp("llama")
    data = make_dataset(root / "data")
    res = cli("train", *LLAMA_FLAGS, *RUN_FLAGS, "--data", str(data), "--out", str(root / "run"))
    assert res.exit_code == 0, res.output
    return root / "run"


def test_meta_json_round_trips_the_models_parts(llama_run: Path) -> None:
    meta = read_meta(llama_run / "ckpt" / "latest")
    vocab = load_tokenizer(llama_run.parent / "data").vocab_size
    want = config_from(dict(arch="llama", n_kv_head=2, n_layer=2, n_head=4, n_embd=16, block_size=16,
                            rope_theta=500.0, norm_eps=1e-6)).model(vocab)  # LLAMA_FLAGS
    assert meta.model == want
    assert want.norm == "rmsnorm" and want.positions == "rotary" and not want.tie_embeddings
    assert set(meta.raw["model"]) == {f.name for f in attrs.fields(GPTConfig)}
    assert meta.raw["model"]["rope_theta"] == 500.0 and meta.raw["model"]["n_kv_head"] == 2


def test_sample_reads_a_llama_checkpoint_alike_with_and_without_the_cache(llama_run: Path) -> None:
    texts = [cli("sample", "--ckpt", str(llama_run / "ckpt" / "latest"), "--prompt", "the ", "--max-new-tokens",
                 "24", "--temperature", "1", "--top-k", "0", flag) for flag in ("--kv-cache", "--no-kv-cache")]
    assert all(t.exit_code == 0 for t in texts), texts[0].output + texts[1].output
    assert texts[0].stdout == texts[1].stdout
    assert texts[0].stdout.startswith("the ") and len(set(texts[0].stdout)) > 3  # drawn text, past block 16


def test_sample_reads_the_transformers_export_of_a_character_model_alike(llama_run: Path, tmp_path: Path) -> None:
    """`numesh export --format hf` of a character-level Llama writes its vocabulary as a
    tokenizer.json without an end-of-text token; sampling from that directory once refused
    it as if it were preparing a dataset."""
    ckpt = llama_run / "ckpt" / "latest"
    res = cli("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert res.exit_code == 0, res.output
    texts = [cli("sample", "--ckpt", str(src), "--prompt", "the ", "--max-new-tokens", "12", "--temperature", "0")
             for src in (ckpt, tmp_path / "hf")]
    assert all(t.exit_code == 0 for t in texts), texts[0].output + texts[1].output
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("the ")


def test_reshard_moves_a_llama_checkpoint_between_tp_1_2_4_unchanged(llama_run: Path, tmp_path: Path) -> None:
    """tp=4 has more ranks than the 2 kv heads (k and v are whole on every rank) and pads
    the 17-entry vocabulary of wte and of the untied lm_head to 20 rows, 5 per rank."""
    src = llama_run / "ckpt" / "latest"
    tp2 = reshard(src, "tp=2", tmp_path / "tp2")
    res = cli("reshard", str(tp2), "--to", "tp=4", "--out", str(tmp_path / "tp4"))
    assert res.exit_code == 0, res.output
    tp4 = tmp_path / "tp4"
    back = reshard(tp4, "tp=1", tmp_path / "tp1")
    _, want = read_state(src)
    for path in (tp2, tp4, back):
        _, got = read_state(path)
        for group in want:
            for (name, x), (other, y) in zip(tree_leaves_with_path(got[group]), tree_leaves_with_path(want[group])):
                assert name == other and np.array_equal(x, y), (path.name, group, name)
    leaves = json.loads((tp4 / "meta.json").read_text())["leaves"]
    rows = {name: [f["shape"][0] for f in leaves[f"params/{name}"]["files"]] for name in ("wte", "lm_head")}
    assert rows == {"wte": [5, 5, 5, 2], "lm_head": [5, 5, 5, 2]}
    assert [f["shape"] for f in leaves["params/blocks.0.attn.k.w"]["files"]] == [[16, 8]]  # replicated: one file


@pytest.mark.parametrize("change, key", [
    (dict(rope_theta=1000.0), "rope_theta"), (dict(norm_eps=1e-5), "norm_eps"), (dict(n_kv_head=4), "n_kv_head"),
    (dict(tie_embeddings=True), "tie_embeddings"), (dict(mlp="gelu"), "mlp"), (dict(norm="layernorm"), "norm"),
    (dict(positions="learned"), "positions"), (dict(ffn_hidden=32), "ffn_hidden"),
])
def test_resuming_with_other_parts_or_math_is_one_line(llama_run: Path, change: dict, key: str) -> None:
    meta = read_meta(llama_run / "ckpt" / "latest")
    with pytest.raises(CheckpointError, match=f"the checkpoint's model has {key}=.* but this run has {key}=") as e:
        check_model(meta, attrs.evolve(meta.model, **change))
    assert "\n" not in str(e.value)


def test_resuming_with_several_differences_names_them_all_in_one_line(llama_run: Path) -> None:
    """Every difference at once, with the options that resume the checkpoint, not one per try."""
    meta = read_meta(llama_run / "ckpt" / "latest")
    m = meta.model
    change = dict(block_size=m.block_size // 2, n_layer=m.n_layer + 1, tie_embeddings=not m.tie_embeddings,
                  rope_theta=m.rope_theta * 2)
    with pytest.raises(CheckpointError) as e:
        check_model(meta, attrs.evolve(m, **change))
    line = str(e.value)
    assert "\n" not in line and f"has block_size={m.block_size}, n_layer={m.n_layer}, tie_embeddings=" in line
    flags = (f"--block-size {m.block_size} --n-layer {m.n_layer} "
             f"{'--tie-embeddings' if m.tie_embeddings else '--no-tie-embeddings'} --rope-theta {m.rope_theta}")
    assert line.endswith(f"({flags})")
    gpt2_meta = attrs.evolve(meta, model=GPTConfig(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                                                   block_size=m.block_size, vocab_size=m.vocab_size))
    with pytest.raises(CheckpointError) as e:  # a GPT-2 checkpoint has no rotary base nor RMSNorm epsilon
        check_model(gpt2_meta, m)
    assert "None" not in str(e.value) and "--norm layernorm --positions learned --mlp gelu" in str(e.value)


def test_resuming_a_llama_checkpoint_with_gpt2_options_names_its_math_in_the_first_refusal(
        llama_run: Path, tmp_path: Path) -> None:
    """The parts first, then (once --norm and --positions were fixed) --rope-theta and
    --norm-eps in a second refusal: every setting to change is in the first one now, and
    its options resume the checkpoint as they are pasted."""
    data, ckpt = str(llama_run.parent / "data"), str(llama_run / "ckpt" / "latest")
    shape = [f for f in LLAMA_FLAGS[2:] if f not in ("--rope-theta", "500", "--norm-eps", "1e-6")]
    line = one_error_line(cli("train", *shape, *RUN_FLAGS, "--data", data, "--out", str(tmp_path / "r"),
                              "--resume", ckpt, "--max-iters", "3"))
    assert "rope_theta=500.0, norm_eps=1e-06 but this run has" in line and "rope_theta=10000.0, norm_eps=1e-05" in line
    fix = line[line.rindex("(") + 1:-1].split()
    assert fix[:7] == ["--norm", "rmsnorm", "--positions", "rotary", "--mlp", "swiglu", "--no-tie-embeddings"]
    assert fix[7:] == ["--rope-theta", "500.0", "--norm-eps", "1e-06"]
    res = cli("train", *shape, *fix, *RUN_FLAGS, "--data", data, "--out", str(tmp_path / "r"), "--resume", ckpt,
              "--max-iters", "3")
    assert res.exit_code == 0, res.output
    m = read_meta(ckpt).model  # a part the run has and the checkpoint lacks: its key (norm) is the change
    gpt2_meta = attrs.evolve(read_meta(ckpt), model=attrs.evolve(m, norm="layernorm", norm_eps=1e-5))
    with pytest.raises(CheckpointError) as e:
        check_model(gpt2_meta, m)
    assert "has norm=layernorm but this run has norm=rmsnorm" in str(e.value)


def test_resume_compares_what_the_parameters_mean(llama_run: Path) -> None:
    """0 and the default it stands for are the same tree; a rotary base or an RMSNorm
    epsilon means nothing to a model without them."""
    meta = read_meta(llama_run / "ckpt" / "latest")
    check_model(meta, attrs.evolve(meta.model, ffn_hidden=meta.model.hidden, dropout=0.2))
    gpt2 = GPTConfig()
    gpt2_meta = attrs.evolve(meta, model=gpt2)
    check_model(gpt2_meta, attrs.evolve(gpt2, rope_theta=1.0))
    check_model(gpt2_meta, attrs.evolve(gpt2, n_kv_head=gpt2.n_head))
    assert set(SHAPE_KEYS) <= set(OPTION) and not set(MATH_KEYS) & set(SHAPE_KEYS)  # every key names its option


def test_cli_resume_with_another_rope_theta_is_one_line(llama_run: Path, tmp_path: Path) -> None:
    flags = [f if f != "500" else "900" for f in LLAMA_FLAGS]
    line = one_error_line(cli("train", *flags, *RUN_FLAGS, "--data", str(llama_run.parent / "data"),
                              "--out", str(tmp_path / "r"), "--resume", str(llama_run / "ckpt" / "latest"),
                              "--max-iters", "3"))
    assert "the checkpoint's model has rope_theta=500.0 but this run has rope_theta=900.0" in line


def test_an_older_checkpoint_without_the_parts_reads_as_gpt2(tmp_path: Path) -> None:
    data = make_dataset(tmp_path / "data")
    cfg = config_from(dict(n_layer=1, n_head=2, n_embd=8, block_size=8, batch_size=2, max_iters=1, eval_iters=1,
                           data=str(data), out=str(tmp_path / "run"), peak_flops=1e12))
    train(cfg, MPI.COMM_SELF)
    meta_path = tmp_path / "run" / "ckpt" / "latest" / "meta.json"
    raw = json.loads(meta_path.read_text())
    for key in ("norm", "norm_eps", "positions", "rope_theta", "mlp", "ffn_hidden", "n_kv_head", "tie_embeddings"):
        del raw["model"][key]
    meta_path.write_text(json.dumps(raw))
    meta = read_meta(meta_path.parent)
    assert meta.model == cfg.model(meta.model.vocab_size)  # the GPT-2 kind's defaults
    res = cli("sample", "--ckpt", str(meta_path.parent), "--max-new-tokens", "4")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("fmt, out, match", [  # --format hf writes LlamaForCausalLM (tests/test_hf_llama.py)
    ("nanogpt", "x.safetensors", "nanoGPT's format holds GPT-2's parts only, and this model has rmsnorm norms, "
                                 "rotary positions, a swiglu MLP, 2 kv heads for 4 query heads, an untied LM head"),
])
def test_export_refuses_a_llama_checkpoint_in_one_line(llama_run: Path, tmp_path: Path, fmt: str, out: str,
                                                        match: str) -> None:
    line = one_error_line(cli("export", str(llama_run / "ckpt" / "latest"), "--format", fmt,
                              "--out", str(tmp_path / out)))
    assert match in line and "sample or resume it with numesh" in line
    assert not (tmp_path / out).exists()


def test_init_from_refuses_a_llama_run_in_one_line(llama_run: Path, tmp_path: Path) -> None:
    line = one_error_line(cli("train", *LLAMA_FLAGS, *RUN_FLAGS, "--data", str(llama_run.parent / "data"),
                              "--out", str(tmp_path / "r"), "--init-from", str(tmp_path / "gpt2.safetensors")))
    assert "--init-from a GPT-2 directory or a `numesh export` file holds GPT-2's parts" in line
    assert "--arch gpt2" in line
    assert not (tmp_path / "r").exists()
    # the library call refuses too, before it reads anything
    model = read_meta(llama_run / "ckpt" / "latest").model
    with pytest.raises(ConfigError, match="holds GPT-2's parts"):
        load_init(tmp_path / "nothing-here", model, load_tokenizer(llama_run.parent / "data"), np.float64)
    with pytest.raises(ConfigError, match="a swiglu MLP"):  # one part of the kind is enough
        load_init(tmp_path / "nothing-here", GPTConfig(mlp="swiglu"), None, np.float64)
