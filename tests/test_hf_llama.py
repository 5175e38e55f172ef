"""Llama and Mixtral to and from Hugging Face transformers, exactly (issue 41).

Small random models built by transformers' own classes (`LlamaConfig`, `MixtralConfig`,
`save_pretrained`, no download): numesh's logits equal transformers' (1e-5 in float64, 1e-4
in float32) for tied and untied heads, kv heads = heads and fewer, a sharded directory,
bfloat16 weights and a Mixtral; greedy decoding gives `generate`'s tokens; numesh-trained
Llama and Llama-MoE checkpoints export to directories transformers loads with the same
logits, and import back to the same bits; an export over a sharded model leaves both
readers the new weights; a fine-tuned model exports with its source's special tokens, chat
template and context; the model's options come from the directory; the tokenizer travels;
every refusal is one line. The safetensors reader on its own first.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import SYNTH_TEXT, cli, one_error_line, self_mesh
from numesh.base.errors import CheckpointError, ConfigError, UserError
from numesh.checkpoint import hf_files
from numesh.checkpoint.hf_files import open_weights
from numesh.checkpoint.hf_llama import read_pretrained
from numesh.nn.gpt import GPT, GPTConfig

try:
    import torch
    import transformers
except ImportError:  # a failing test, not a skipped one: CI installs both (.ci/run)
    torch = transformers = None

NEEDS = "these tests build models with transformers itself: pip install torch==2.13.0 transformers==5.24.0"
ATOL = {"float64": 1e-5, "float32": 1e-4}
TORCH_DTYPE = {"float64": "float64", "float32": "float32", "bfloat16": "bfloat16"}


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    if transformers is None:
        pytest.fail(NEEDS)


# ---------------------------------------------------------------------------------------
# helpers: a tokenizer with Llama's special tokens, small transformers models, their logits


def llama_tokenizer_json(vocab: int = 120) -> str:
    """A byte-level BPE trained on the test corpus with `<s>` and `</s>` as Llama has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=sorted(set(SYNTH_TEXT)))
    tok.train_from_iterator([SYNTH_TEXT], trainer)
    return tok.to_str()


def with_bos(tok_json: str) -> str:
    """`tok_json` with the post-processor Llama 2's, TinyLlama's and Mistral's tokenizers have:
    `<s>` before every text, which transformers' `tokenizer(text)` adds by default."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_str(tok_json)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


def vocab_of(tok_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tok_json).get_vocab_size(with_added_tokens=True)


def save_model(out: Path, tok_json: str, kind: str = "llama", dtype: str = "float64", shard: str | None = None,
               seed: int = 0, **kw: Any) -> Path:
    """A random transformers model (2 layers, 16 wide, 4 heads) saved with its tokenizer;
    every weight random, the norms' too (their ones would hide a misplaced norm)."""
    base = dict(vocab_size=vocab_of(tok_json), hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                initializer_range=0.3)
    base.update(kw)
    if kind == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **base)
    else:
        config = transformers.LlamaConfig(**base)
    torch.manual_seed(seed)
    cls = transformers.MixtralForCausalLM if kind == "mixtral" else transformers.LlamaForCausalLM
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model = model.to(getattr(torch, TORCH_DTYPE[dtype]))
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}), encoding="utf-8")
    return out


def hf_logits(directory: Path, idx: np.ndarray, dtype: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=getattr(torch, dtype), experts_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(idx)).logits.numpy()


def numesh_logits(params: GPT, model: GPTConfig, idx: np.ndarray) -> np.ndarray:
    """numesh's forward on one rank (training's blocks): logits [B, T, V]."""
    from numesh.nn.parts import norm_fwd
    from numesh.nn.transformer import block_fwd, embed_fwd, head_weight

    mesh = self_mesh()
    x, _ = embed_fwd(params, idx, model, mesh)
    for layer, p in enumerate(params.blocks):
        x, _ = block_fwd(p, x, model, mesh, layer)
    return norm_fwd(params.ln_f, x, model.norm_eps)[0] @ head_weight(params)[: model.vocab_size].T


def spelled(model: GPTConfig) -> GPTConfig:
    """`model` with its defaults spelled out (ffn_hidden 0 = its SwiGLU size, n_kv_head 0 = n_head)."""
    import attrs

    return attrs.evolve(model, ffn_hidden=model.hidden, n_kv_head=model.kv_heads)


@pytest.fixture(scope="module")
def tok_json() -> str:
    return llama_tokenizer_json()


# ---------------------------------------------------------------------------------------
# the safetensors reader


def test_the_reader_converts_every_float_dtype_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F32, F64, F16 and BF16 into float32 and float64, transposed or not, in several row
    blocks (a block of 40 bytes here), equal to torch's own conversion."""
    from safetensors.torch import save_file

    monkeypatch.setattr(hf_files, "_BLOCK_BYTES", 40)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(7, 5, generator=gen, dtype=torch.float64).to(dt)
               for name, dt in (("f32", torch.float32), ("f64", torch.float64), ("f16", torch.float16),
                                ("bf16", torch.bfloat16))}
    save_file(tensors, tmp_path / "model.safetensors")
    w = open_weights(tmp_path)
    for name, t in tensors.items():
        for dtype in (np.float32, np.float64):
            want = t.to(torch.float64).numpy().astype(dtype)
            np.testing.assert_array_equal(w.read(name, np.empty((7, 5), dtype)), want, err_msg=name)
            np.testing.assert_array_equal(w.read(name, np.empty((5, 7), dtype), transpose=True), want.T,
                                          err_msg=name)
    with pytest.raises(CheckpointError, match=r"tensor 'f32' has shape \[7, 5\], the model needs \[5, 7\]"):
        w.read("f32", np.empty((5, 7), np.float32))


def test_the_reader_refuses_what_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2, dtype=torch.int32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor 'x' is I32; numesh reads F32, F64, F16 and BF16"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(CheckpointError, match="is not a safetensors file"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"[]")  # was an AttributeError
    with pytest.raises(CheckpointError, match="is not a safetensors file \\(its header is not a JSON object\\)"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no weights: it needs model.safetensors or "
                                              "model.safetensors.index.json"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match="names a.safetensors, which is missing"):
        open_weights(tmp_path)


def _index(d: Path, weight_map: dict[str, str]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_an_index_naming_files_outside_its_directory_is_refused(tmp_path: Path) -> None:
    """A shard named `../x` or by an absolute path was read from wherever it pointed: now the
    entry is named and refused before any file is opened. "./a" is "a", read once."""
    from safetensors.numpy import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"x": np.zeros(2, np.float32), "y": np.ones(2, np.float32)}, d / "a.safetensors")
    save_file({"z": np.zeros(2, np.float32)}, tmp_path / "b.safetensors")
    for entry in ("../b.safetensors", str(tmp_path / "b.safetensors"), "sub/../../b.safetensors"):
        _index(d, {"x": "a.safetensors", "y": "a.safetensors", "z": entry})
        with pytest.raises(CheckpointError, match=re.escape(f"names shard file '{entry}', which is not a file name "
                                                            f"inside {d}")):
            open_weights(d)
    _index(d, {"x": "a.safetensors", "y": "./a.safetensors"})  # "tensor 'x' is in both a and a" before
    assert sorted(open_weights(d).tensors) == ["x", "y"]


def test_a_tensor_in_two_shards_names_both(tmp_path: Path) -> None:
    """Named by base name, a shard in a subdirectory was the other's twin ("in both
    a.safetensors and a.safetensors"): each is named by its path in the directory."""
    from safetensors.numpy import save_file

    (tmp_path / "sub").mkdir()
    save_file({"x": np.zeros(2, np.float32)}, tmp_path / "a.safetensors")
    save_file({"x": np.zeros(2, np.float32), "y": np.ones(2, np.float32)}, tmp_path / "sub" / "a.safetensors")
    _index(tmp_path, {"x": "a.safetensors", "y": "sub/a.safetensors"})
    with pytest.raises(CheckpointError, match=re.escape("tensor 'x' is in both a.safetensors and sub/a.safetensors: "
                                                        "keep one copy of each tensor")):
        open_weights(tmp_path)


@pytest.mark.parametrize("size, says", [
    (0, "model.safetensors is empty (0 bytes): copy it again from the model's source"),
    (5, "model.safetensors is truncated: it has 5 bytes, fewer than the 8 of a safetensors header length"),
    (40, "model.safetensors is truncated: its header is "),
])
def test_an_empty_or_cut_short_weights_file_is_named_as_such(size: int, says: str, tok_json: str,
                                                              tmp_path: Path) -> None:
    """Not "its header length is -1" (or a length the file cannot hold): the file named,
    empty or truncated, for `numesh sample` and a GPT-2 directory's import alike."""
    from numesh.checkpoint.hf import import_hf

    d = save_model(tmp_path / "hf", tok_json)
    _truncate(d / "model.safetensors", size)
    line = one_error_line(cli("sample", str(d), "--max-new-tokens", "2"))
    assert f"{d / 'model.safetensors'}" in line and says in line
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=re.escape(says)):
        import_hf(d)


@pytest.mark.parametrize("shard", [None, "4KB"])
def test_weights_without_config_json_say_so_not_that_meta_json_is_missing(shard: str | None, tok_json: str,
                                                                          tmp_path: Path) -> None:
    """A transformers directory that lost its config.json was taken for a numesh checkpoint
    ("meta.json is missing"); sample and --init-from now name the file it lacks."""
    from numesh.checkpoint.init_from import load_init

    d = save_model(tmp_path / "hf", tok_json, shard=shard)
    (d / "config.json").unlink()
    first = "model.safetensors.index.json" if shard else "model.safetensors"
    says = f"{d} has {first} but no config.json, which a transformers directory needs beside its weights"
    line = one_error_line(cli("sample", str(d), "--max-new-tokens", "2"))
    assert says in line and "meta.json" not in line
    with pytest.raises(CheckpointError, match=re.escape(says)):
        load_init(d, GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=8), None, "float32")
    for f in list(d.iterdir()):
        if f.name.startswith("model"):
            f.unlink()
    (d / "gpt.safetensors").write_bytes(b"")  # a `numesh export` file put in a directory
    assert "has gpt.safetensors but no config.json: pass the file itself if it is a `numesh export` file" in \
        one_error_line(cli("sample", str(d)))


# ---------------------------------------------------------------------------------------
# import: logits, greedy decoding

# name: (save_model kwargs, numesh dtype)
CASES = {
    "tied-mha-float64": (dict(tie_word_embeddings=True, num_key_value_heads=4), "float64"),
    "untied-gqa-float64": (dict(), "float64"),
    "untied-gqa-float32": (dict(dtype="float32"), "float32"),
    "tied-mqa-sharded-bfloat16": (dict(tie_word_embeddings=True, num_key_value_heads=1, dtype="bfloat16",
                                       shard="4KB"), "float32"),
    "biases-float64": (dict(attention_bias=True, mlp_bias=True), "float64"),
    "mixtral-float64": (dict(kind="mixtral"), "float64"),
    "mixtral-float32": (dict(kind="mixtral", dtype="float32"), "float32"),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case: str, tok_json: str, tmp_path: Path) -> None:
    kw, dtype = CASES[case]
    d = save_model(tmp_path / "hf", tok_json, **kw)
    if "sharded" in case:
        assert len(list(d.glob("model-*.safetensors"))) > 2 and (d / "model.safetensors.index.json").exists()
    _, model, params = read_pretrained(d, np.dtype(dtype), 16)
    assert model.tie_embeddings == kw.get("tie_word_embeddings", False)
    assert model.kv_heads == kw.get("num_key_value_heads", 2) and model.moe_experts == (4 if "mixtral" in case else 0)
    idx = np.random.default_rng(3).integers(0, model.vocab_size, (3, 16))
    want = hf_logits(d, idx, dtype)  # bfloat16 weights: transformers computes in float32 too
    assert np.abs(want).max() > 0.1  # logits that would show a misplaced weight
    # transformers computes the rotary angles (and Mixtral's router) in float32 even in a
    # float64 model: 1e-5, not 1e-10 (tests/test_llama_model.py)
    np.testing.assert_allclose(numesh_logits(params, model, idx), want, rtol=0, atol=ATOL[dtype])


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"}, {}])
def test_a_default_rope_scaling_is_plain_rotary(scaling: dict, tok_json: str, tmp_path: Path) -> None:
    """transformers reads a rope_scaling entry of type "default" (or an empty one) as plain
    rotary positions: numesh reads it so too, to the same logits. (A v4 config.json: the base
    at the top, no v5 rope_parameters, which transformers would let rope_scaling replace.)"""
    d = save_model(tmp_path / "hf", tok_json)
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": theta, "rope_scaling": scaling}))
    _, model, params = read_pretrained(d, np.dtype("float64"), 16)
    idx = np.random.default_rng(3).integers(0, model.vocab_size, (2, 16))
    np.testing.assert_allclose(numesh_logits(params, model, idx), hf_logits(d, idx, "float64"), rtol=0,
                               atol=ATOL["float64"])


def test_a_sliding_window_as_long_as_the_context_is_full_attention(tok_json: str, tmp_path: Path) -> None:
    """Mistral with a window of max_position_embeddings tokens (64) hides no key from any
    query it can take: read as full causal attention, to transformers' logits."""
    d = save_model(tmp_path / "hf", tok_json)
    _edit_config(d, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    _, model, params = read_pretrained(d, np.dtype("float64"), 64)
    idx = np.random.default_rng(3).integers(0, model.vocab_size, (2, 64))
    np.testing.assert_allclose(numesh_logits(params, model, idx), hf_logits(d, idx, "float64"), rtol=0,
                               atol=ATOL["float64"])


@pytest.mark.parametrize("bos", [False, True], ids=["no-template", "bos-template"])
def test_greedy_sampling_gives_generates_tokens(bos: bool, tok_json: str, tmp_path: Path) -> None:
    """`numesh sample --ckpt DIR --temperature 0` straight from the transformers directory
    continues a prompt with the tokens `generate` picks from `tokenizer(prompt)`, `<s>` first
    where the tokenizer's template adds it, and prints the prompt and continuation without
    it; an empty prompt is `<s>` alone."""
    from numesh.run.sample import SampleConfig, sample

    d = save_model(tmp_path / "hf", with_bos(tok_json) if bos else tok_json, kind="llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float64).eval()
    for prompt in ["the cat sat", ""] if bos else ["the cat sat"]:
        inputs = tokenizer(prompt, return_tensors="pt")  # its attention mask: generate would take <s> for padding
        assert (inputs["input_ids"][0, :1].tolist() == [0]) == bos  # <s> is id 0
        with torch.no_grad():
            want = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0].numpy()
        text = tokenizer.decode(want[int(bos):], skip_special_tokens=False)
        assert text.startswith(prompt)
        for kv_cache in (True, False):
            got = sample(SampleConfig(str(d), prompt, max_new_tokens=12, temperature=0.0, kv_cache=kv_cache),
                         MPI.COMM_SELF)
            assert got == [text]
        res = cli("sample", "--ckpt", str(d), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0")
        assert res.exit_code == 0, res.stderr
        assert res.stdout.strip() == text.strip()


def test_a_prompt_is_encoded_as_transformers_tokenizer_encodes_it(tok_json: str, tmp_path: Path) -> None:
    """The prompt's ids are `tokenizer(prompt)["input_ids"]`, with and without a template
    that adds `<s>`; an empty prompt without one is refused in one line."""
    from numesh.run.sample import load_checkpoint, prompt_ids

    for name, text in (("plain", tok_json), ("bos", with_bos(tok_json))):
        d = save_model(tmp_path / name, text)
        tok = load_checkpoint(d).tokenizer
        tokenizer = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
        for prompt in ["the cat sat", "a hat, a bat;", " the end!</s>", "t"] + ([""] if name == "bos" else []):
            assert prompt_ids(tok, prompt).tolist() == tokenizer(prompt)["input_ids"], (name, prompt)
    with pytest.raises(ConfigError, match="gives no tokens and its tokenizer adds no start token") as e:
        prompt_ids(load_checkpoint(tmp_path / "plain").tokenizer, "")
    assert "\n" not in str(e.value)


def test_a_corpus_tokenised_with_a_bos_template_starts_each_document_with_it(tok_json: str, tmp_path: Path) -> None:
    """`numesh data tokenize --tokenizer DIR` writes each document as `tokenizer(doc)`
    does, `<s>` first, then the directory's eos token: what the model saw in pre-training."""
    from numesh.data import sharded as TD
    from numesh.data.corpus import Reading
    from numesh.data.dataset import load_split

    d = save_model(tmp_path / "hf", with_bos(tok_json))
    docs = [line for line in SYNTH_TEXT.split("\n") if line]
    (tmp_path / "corpus.txt").write_text("\n".join(docs), encoding="utf-8")
    res = cli("data", "tokenize", "--tokenizer", str(d), "--src", str(tmp_path / "corpus.txt"), "--split-on", "\n",
              "--val-fraction", "0.3", "--out", str(tmp_path / "data"))
    assert res.exit_code == 0, res.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
    want: dict[str, list] = {"train": [], "val": []}
    plan = TD.split_plan([tmp_path / "corpus.txt"], Reading(split_on="\n"), 0.3)
    for i, doc in enumerate(TD.corpus_documents([tmp_path / "corpus.txt"], Reading(split_on="\n"))):
        want["val" if plan.is_val(i) else "train"] += [*tokenizer(doc)["input_ids"], tokenizer.eos_token_id]
    assert want["train"][0] == tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    for split in ("train", "val"):
        stream = load_split(tmp_path / "data", split)
        assert np.asarray(stream[np.arange(len(stream))]).tolist() == want[split]


def test_sampling_a_directory_without_a_readable_tokenizer_is_one_line(tok_json: str, tmp_path: Path) -> None:
    """Missing, it says to copy it there (sample has no option naming a tokenizer, so not
    "pass a directory holding one or the file itself"); cut short, it names the file."""
    d = save_model(tmp_path / "hf", tok_json)
    (d / "tokenizer.json").unlink()
    line = one_error_line(cli("sample", str(d), "--max-new-tokens", "2"))
    assert f"{d} has no tokenizer.json: it turns the prompt into token ids" in line
    assert "copy the model's tokenizer.json into it" in line and "pass" not in line
    (d / "tokenizer.json").write_text(tok_json[:500], encoding="utf-8")
    line = one_error_line(cli("sample", str(d), "--max-new-tokens", "2"))
    assert f"{d / 'tokenizer.json'}: not a Hugging Face tokenizer file (" in line


# ---------------------------------------------------------------------------------------
# a dataset tokenised with the model's tokenizer; a short numesh run of the Llama kind


@pytest.fixture(scope="module")
def llama_data(tok_json: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test corpus tokenised by `numesh data tokenize --tokenizer DIR` with a model
    directory's tokenizer: documents end with its eos token, `</s>`."""
    root = tmp_path_factory.mktemp("llama-data")
    d = root / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}), encoding="utf-8")
    (root / "corpus.txt").write_text(SYNTH_TEXT * 4, encoding="utf-8")
    res = cli("data", "tokenize", "--tokenizer", str(d), "--src", str(root / "corpus.txt"), "--split-on", "\n",
              "--out", str(root / "data"))
    assert res.exit_code == 0, res.stderr
    meta = json.loads((root / "data" / "meta.json").read_text())
    assert meta["tokenizer"]["eot"] == "</s>"  # the directory's eos token, not <|endoftext|>
    return root / "data"


def llama_run(data: Path, out: Path, **kw: Any) -> Any:
    """A 2-step float64 run of a small Llama (untied, 2 kv heads for 4 query heads)."""
    from numesh.run.config import config_from

    base = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=2,
                eval_interval=2, eval_iters=1, learning_rate=1e-2, data=str(data), out=str(out), dtype="float64",
                peak_flops=1e12, rope_theta=500.0, norm_eps=1e-6)
    base.update(kw)
    return config_from(base)


# ---------------------------------------------------------------------------------------
# export, and export -> import


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "llama-moe"])
def test_export_loads_in_transformers_and_imports_to_the_same_bits(moe: bool, llama_data: Path,
                                                                    tmp_path: Path) -> None:
    from numesh.base.tree import tree_leaves_with_path
    from numesh.checkpoint import export_hf, read_global_params
    from numesh.run.config import config_from
    from numesh.run.train import Trainer, train

    kw = dict(moe_experts=4, moe_top_k=2) if moe else {}
    ckpt = train(llama_run(llama_data, tmp_path / "run", **kw), MPI.COMM_SELF).checkpoint
    hf = export_hf(ckpt, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM" if moe else "LlamaForCausalLM"]
    model, _, params = read_global_params(ckpt)
    idx = np.random.default_rng(0).integers(0, model.vocab_size, (2, 16))
    np.testing.assert_allclose(hf_logits(hf, idx, "float64"), numesh_logits(params, model, idx), rtol=0, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert tok.eos_token == "</s>" and tok.decode([5, 6, 7]) == transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf / "tokenizer.json")).decode([5, 6, 7])
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 1

    _, back_model, back = read_pretrained(hf, np.float64, model.block_size)
    assert spelled(back_model) == spelled(model)
    want = dict(tree_leaves_with_path(params))
    for path, x in tree_leaves_with_path(back):
        assert x.dtype == want[path].dtype and np.array_equal(x, want[path]), path
    # and as a run's starting point: --init-from alone sets the model, the same bits again
    cfg = config_from(dict(init_from=str(hf), data=str(llama_data), out=str(tmp_path / "ft"), block_size=16,
                           batch_size=4, dtype="float64", peak_flops=1e12))
    assert spelled(cfg.model(model.vocab_size)) == spelled(model)
    trainer = Trainer(cfg, MPI.COMM_SELF)
    for path, x in tree_leaves_with_path(trainer.params):
        assert np.array_equal(x[: want[path].shape[0]], want[path]), path


def test_max_iters_0_converts_a_directory_into_a_checkpoint(tok_json: str, llama_data: Path, tmp_path: Path) -> None:
    """`numesh train --init-from DIR --max-iters 0` evaluates the directory's weights and saves
    them as a numesh checkpoint, taking no step: its parameters are the directory's bits."""
    from numesh.base.tree import tree_leaves_with_path
    from numesh.checkpoint import read_global_params

    d = save_model(tmp_path / "hf", tok_json)
    res = cli("train", "--init-from", str(d), "--data", str(llama_data), "--out", str(tmp_path / "run"),
              "--block-size", "16", "--batch-size", "4", "--dtype", "float64", "--max-iters", "0", "--eval-iters",
              "1", "--peak-flops", "1e12")
    assert res.exit_code == 0, res.stderr
    assert "done: 0 steps" in res.stderr and "final loss n/a, val " in res.stderr
    _, _, params = read_global_params(tmp_path / "run" / "ckpt" / "latest")
    _, _, want = read_pretrained(d, np.float64, 16)
    got = dict(tree_leaves_with_path(params))
    for path, x in tree_leaves_with_path(want):
        assert np.array_equal(got[path][: x.shape[0]], x), path


def test_export_over_a_sharded_model_replaces_its_weights_for_both_readers(llama_data: Path, tok_json: str,
                                                                             tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`export --force` into a directory holding a sharded model of the same shapes left its
    index and shards beside the new model.safetensors; transformers loaded the new file,
    numesh's reader the index: the old weights under the new config. Now the export
    removes a model's weight files and the tokenizer side files it did not write (and only
    those: a user's notes stay), a failed export
    leaves the old model whole, and where both layouts are left numesh reads the one file,
    as transformers does: both give the checkpoint's logits."""
    from numesh.checkpoint import export_hf, read_global_params
    from numesh.run.train import train

    ckpt = train(llama_run(llama_data, tmp_path / "run"), MPI.COMM_SELF).checkpoint
    model, _, params = read_global_params(ckpt)
    d = save_model(tmp_path / "hf", tok_json, shard="8KB", intermediate_size=model.hidden, max_position_embeddings=16)
    old = {p.name: p.read_bytes() for p in d.glob("model*.safetensors*")}
    assert "model.safetensors.index.json" in old and len(old) > 2
    (d / "pytorch_model.bin").write_bytes(b"an older torch save")
    (d / "notes.txt").write_text("mine")
    (d / "chat_template.jinja").write_text("{{ 'an old model's template' }}")  # transformers would read it first
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    idx = np.random.default_rng(0).integers(0, model.vocab_size, (2, 16))
    before = hf_logits(d, idx, "float64")

    def fills_up(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    with monkeypatch.context() as m, pytest.raises(CheckpointError, match="the disk is full"):
        m.setattr(Path, "write_bytes", fills_up)
        export_hf(ckpt, d, force=True)
    assert {p.name: p.read_bytes() for p in d.glob("model*.safetensors*")} == old  # the old model whole
    np.testing.assert_allclose(_numesh_dir_logits(d, idx), before, rtol=0, atol=1e-5)

    export_hf(ckpt, d, force=True)
    assert sorted(p.name for p in d.iterdir() if p.suffix in (".safetensors", ".bin", ".json")) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (d / "notes.txt").read_text() == "mine"
    assert not (d / "chat_template.jinja").exists() and not (d / "special_tokens_map.json").exists()
    assert transformers.AutoTokenizer.from_pretrained(d, local_files_only=True).chat_template is None
    want = numesh_logits(params, model, idx)
    np.testing.assert_allclose(hf_logits(d, idx, "float64"), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(_numesh_dir_logits(d, idx), want, rtol=0, atol=1e-12)
    for name, data in old.items():  # both layouts side by side, as a save over a sharded one leaves them
        if name != "model.safetensors":
            (d / name).write_bytes(data)
    np.testing.assert_allclose(hf_logits(d, idx, "float64"), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(_numesh_dir_logits(d, idx), want, rtol=0, atol=1e-12)


def _numesh_dir_logits(d: Path, idx: np.ndarray) -> np.ndarray:
    """numesh's logits of the transformers directory `d`, read by its own reader."""
    _, model, params = read_pretrained(d, np.float64, idx.shape[1])
    return numesh_logits(params, model, idx)


CHAT = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def test_a_fine_tuned_model_exports_with_its_sources_tokens_and_context(llama_data: Path, tok_json: str,
                                                                           tmp_path: Path) -> None:
    """A model fine-tuned from a transformers directory exported with the dataset's eos in
    every token role (bos, unk; no pad, no chat template) and a context of the training
    block size (16 of the source's 64), so `--init-from EXPORT --block-size 64` was refused.
    Now its checkpoints record what the source said, a resume without the source (gone
    since) keeps it, and the export gives it back as transformers reads it; a model trained
    from scratch exports as before."""
    import shutil

    import attrs

    from numesh.checkpoint import export_hf
    from numesh.run.train import Trainer, train

    src = save_model(tmp_path / "src", tok_json, intermediate_size=24, max_position_embeddings=64, pad_token_id=0)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), bos_token="<s>",
                                                  eos_token="</s>", pad_token="<s>", model_max_length=64)
    theirs.chat_template = CHAT
    theirs.save_pretrained(src)  # transformers' own files: chat_template.jinja beside tokenizer_config.json
    (src / "tokenizer.json").write_text(tok_json, encoding="utf-8")  # the dataset's bytes, as they were
    assert (src / "chat_template.jinja").exists()
    cfg = llama_run(llama_data, tmp_path / "ft", init_from=str(src), ffn_hidden=24)
    first = train(cfg, MPI.COMM_SELF).checkpoint
    shutil.rmtree(src)
    resumed = attrs.evolve(cfg, init_from="", resume=str(first), max_iters=4)
    hf = export_hf(train(resumed, MPI.COMM_SELF).checkpoint, tmp_path / "hf")

    tok = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<s>", "</s>", "<s>", None)
    assert tok.chat_template == CHAT and tok.model_max_length == 64
    config = transformers.AutoConfig.from_pretrained(hf, local_files_only=True)
    assert (config.max_position_embeddings, config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        64, 0, 1, 0)
    gen = transformers.GenerationConfig.from_pretrained(hf, local_files_only=True)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, 1, 0)
    Trainer(llama_run(llama_data, tmp_path / "again", init_from=str(hf), block_size=64), MPI.COMM_SELF)

    scratch = export_hf(train(llama_run(llama_data, tmp_path / "scratch"), MPI.COMM_SELF).checkpoint,
                        tmp_path / "hf-scratch")
    tok = transformers.AutoTokenizer.from_pretrained(scratch, local_files_only=True)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token, tok.chat_template) == (
        "</s>", "</s>", "</s>", None, None)
    assert transformers.AutoConfig.from_pretrained(scratch, local_files_only=True).max_position_embeddings == 16


def test_a_source_without_a_bos_id_exports_none() -> None:
    """The export's token ids are the source's over the end-of-text id as eos: a source that
    names no bos gets none (not the eos id, which made every prompt start with an eos); a
    model trained from scratch has its end-of-text token as both."""
    from numesh.checkpoint.hf_source import config_ids, generation_ids

    source = {"config_ids": {"eos_token_id": 2}, "tokenizer": None, "generation_ids": None}
    assert config_ids(source, 7) == generation_ids(source, 7) == {"eos_token_id": 2}
    assert config_ids(None, 7) == {"bos_token_id": 7, "eos_token_id": 7}


def test_the_source_record_reads_older_spellings_and_a_broken_one_is_one_line(tok_json: str, tmp_path: Path) -> None:
    """transformers 4's spellings (an AddedToken object, the chat template inside
    tokenizer_config.json, several eos ids) are recorded as written; a file numesh cannot
    read records nothing, as `numesh data tokenize` reads it; max_position_embeddings left
    out is the class's default; a record edited into another shape is one line."""
    from numesh.checkpoint.hf_source import SOURCE_KEY, read_source, recorded_source, tokenizer_fields

    d = save_model(tmp_path / "src", tok_json)
    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False}
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": "</s>", "pad_token": None, "chat_template": CHAT, "model_max_length": 64}))
    (d / "generation_config.json").write_text("{not json")
    _edit_config(d, eos_token_id=[1, 0], max_position_embeddings=None)
    record = read_source(d)
    assert record == {"config_ids": {"bos_token_id": 0, "eos_token_id": [1, 0]}, "generation_ids": None,
                      "tokenizer": {"bos_token": bos, "eos_token": "</s>", "model_max_length": 64,
                                    "chat_template": CHAT},
                      "max_position_embeddings": 2048}  # LlamaConfig's default
    assert tokenizer_fields(record, "</s>", 16)["bos_token"] == bos
    assert read_source(tmp_path / "model.safetensors") is None  # a `numesh export` file: nothing to record
    with pytest.raises(CheckpointError, match=f"{SOURCE_KEY} is not the record numesh writes") as e:
        recorded_source({SOURCE_KEY: {"tokenizer": "<s>"}}, tmp_path)
    assert "\n" not in str(e.value)


REFUSED = {  # models one export format or both refuse (GPT-2's kind unless it says llama)
    "mlp-100-wide": dict(ffn_hidden=100), "untied": dict(tie_embeddings=False), "gqa": dict(n_kv_head=2),
    "rmsnorm": dict(norm="rmsnorm"), "gelu-llama": dict(norm="rmsnorm", positions="rotary", tie_embeddings=False),
    "moe": dict(moe_experts=4), "llama": dict(norm="rmsnorm", positions="rotary", mlp="swiglu"),
    "llama-gqa-untied": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", n_kv_head=2, tie_embeddings=False),
    "mixtral": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", moe_experts=4),
    "moe-every-2": dict(norm="rmsnorm", positions="rotary", mlp="swiglu", moe_experts=4, moe_every=2),
}


@pytest.mark.parametrize("name", REFUSED)
def test_an_export_refusal_never_sends_the_user_to_a_format_that_refuses_too(name: str) -> None:
    """--format hf of a GPT-2-kind model with an MLP not 4 x n_embd wide said "export it with
    --format hf", and its other refusals offered --format nanogpt, which refuses those
    models as well: a refusal names the other format only where that one holds the model,
    and otherwise says to sample or resume it with numesh."""
    from numesh.checkpoint.export import check_nanogpt
    from numesh.checkpoint.hf import hf_kind

    model = GPTConfig(**REFUSED[name])
    refusals = {}
    for fmt, check in (("hf", hf_kind), ("nanogpt", check_nanogpt)):
        try:
            check(model)
        except CheckpointError as e:
            refusals[fmt] = str(e)
    assert refusals, "one format at least refuses each of these models"
    for fmt, line in refusals.items():
        other = "nanogpt" if fmt == "hf" else "hf"
        assert f"--format {fmt}" not in line.replace(f"--format {fmt} refuses", ""), line
        offered = f"--format {other}" in line and f"--format {other} refuses" not in line
        assert offered == (other not in refusals), line
        assert offered or "sample or resume it with numesh" in line, line


def test_what_transformers_cannot_compute_is_refused_in_one_line(llama_data: Path, tmp_path: Path) -> None:
    from numesh.checkpoint.hf import hf_kind

    llama = dict(norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False)
    assert hf_kind(GPTConfig()) == "gpt2" and hf_kind(GPTConfig(**llama)) == "llama"
    assert hf_kind(GPTConfig(**llama, moe_experts=4)) == "mixtral"
    for kw, says in [
        (dict(positions="rotary"), "mixes GPT-2's and Llama's parts"),
        (dict(n_kv_head=2), "and this model has 2 kv heads for 4 query heads: neither export format holds it"),
        (dict(ffn_hidden=100), "and this model has an MLP 100 wide (GPT-2's is 4 x n_embd = 512): neither export"),
        (dict(llama, moe_experts=4, moe_every=2), "not a Mixtral: it has experts in one block of every 2"),
        (dict(llama, moe_experts=4, moe_capacity_factor=1.0), "a capacity factor 1.0 (Mixtral is dropless)"),
        (dict(llama, moe_experts=4, bias=True), "biases (Mixtral's Linears have none)"),
    ]:
        with pytest.raises(CheckpointError, match=re.escape(says)):
            hf_kind(GPTConfig(**kw))
    ckpt = cli("train", "--data", str(llama_data), "--out", str(tmp_path / "run"), "--arch", "llama", "--norm",
               "layernorm", "--norm-eps", "1e-5", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
               "--block-size", "8", "--batch-size", "2", "--max-iters", "1", "--eval-iters", "1", "--peak-flops",
               "1e12")
    assert ckpt.exit_code == 0, ckpt.stderr
    line = one_error_line(cli("export", str(tmp_path / "run" / "ckpt" / "latest"), "--format", "hf", "--out",
                              str(tmp_path / "hf")))
    assert "mixes GPT-2's and Llama's parts (norm layernorm, positions rotary" in line
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------
# the options come from the directory; one-line refusals


def _edit_config(d: Path, **changes: Any) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weights(d: Path, drop: str | None = None, transpose: str | None = None, add: str | None = None) -> None:
    from safetensors.numpy import load_file, save_file

    sd = load_file(d / "model.safetensors")
    if drop:
        del sd[drop]
    if transpose:
        sd[transpose] = np.ascontiguousarray(sd[transpose].T)
    if add:
        sd[add] = np.zeros(3, np.float64)
    save_file(sd, d / "model.safetensors")


def _truncate(file: Path, size: int) -> None:
    """`file` cut to its first `size` bytes, as a copy that stopped short leaves it."""
    file.write_bytes(file.read_bytes()[:size])


def test_init_from_alone_sets_the_model_and_a_conflicting_option_is_one_line(tok_json: str, llama_data: Path,
                                                                              tmp_path: Path) -> None:
    from numesh.run.config import config_from

    d = save_model(tmp_path / "hf", tok_json, kind="mixtral", tie_word_embeddings=True)
    cfg = config_from(dict(init_from=str(d), data=str(llama_data)))
    got = {k: getattr(cfg, k) for k in ("arch", "norm", "positions", "mlp", "n_layer", "n_head", "n_embd",
                                        "n_kv_head", "ffn_hidden", "rope_theta", "norm_eps", "tie_embeddings",
                                        "bias", "moe_experts", "moe_top_k")}
    assert got == dict(arch="llama", norm="rmsnorm", positions="rotary", mlp="swiglu", n_layer=2, n_head=4, n_embd=16,
                       n_kv_head=2, ffn_hidden=24, rope_theta=500.0, norm_eps=1e-6, tie_embeddings=True, bias=False,
                       moe_experts=4, moe_top_k=2)
    assert config_from(dict(init_from=str(d), n_layer=2, n_kv_head=2)).n_layer == 2  # agreeing options are fine
    assert config_from(dict(init_from=str(d), arch="llama")).tie_embeddings  # its own kind named: still tied
    for kw, says in [(dict(n_layer=3), "--n-layer 3 conflicts with --init-from"),
                     (dict(tie_embeddings=False), "--no-tie-embeddings conflicts with --init-from"),
                     (dict(arch="gpt2"), "--arch gpt2 conflicts"),
                     (dict(moe_experts=0), "--moe-experts 0 conflicts")]:
        with pytest.raises(ConfigError, match=re.escape(says)) as e:
            config_from(dict(init_from=str(d), **kw))
        assert "whose model has" in str(e.value) and "\n" not in str(e.value)
    line = one_error_line(cli("train", "--init-from", str(d), "--data", str(llama_data), "--n-embd", "32",
                              "--out", str(tmp_path / "run")))
    assert "--n-embd 32 conflicts with --init-from" in line
    with pytest.raises(ConfigError) as e:  # every conflict in one line, not one per run
        config_from(dict(init_from=str(d), n_layer=3, n_embd=32))
    assert str(e.value) == f"--n-layer 3 and --n-embd 32 conflict with --init-from {d}, whose model has 2 and 16: " \
                           "leave them out (the directory sets them)"



@pytest.mark.parametrize("mesh, says", [
    ("tp=4", "the MLP's hidden size 26 is not divisible by tp=4: {fixes}: use --mesh with tp 1 or 2"),
    ("ep=3", "moe_experts=4 is not divisible by ep=3: {fixes}: use --mesh with ep 1, 2 or 4"),
    ("pp=4", "n_layer=2 is not divisible by pp x virtual stages = 4 x 1: {fixes}: use a pp (--mesh) and "
             "--virtual-stages whose product is 1 or 2"),
])
def test_a_mesh_that_does_not_split_the_directorys_model_names_only_the_mesh(
        mesh: str, says: str, tok_json: str, llama_data: Path, tmp_path: Path) -> None:
    """The directory fixes the model (its options given otherwise conflict): a refused mesh
    advised --ffn-hidden, --moe-experts or --n-layer, options the user cannot change."""
    from numesh.run.config import check_layout, config_from

    d = save_model(tmp_path / "hf", tok_json, kind="mixtral", intermediate_size=26)
    cfg = config_from(dict(init_from=str(d), data=str(llama_data), mesh=mesh))
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, 4 if mesh != "ep=3" else 3, vocab_of(tok_json))
    assert str(e.value) == says.format(fixes=f"--init-from {d} fixes the model")
    assert check_layout(attrs.evolve(cfg, mesh="tp=2,ep=2"), 4, vocab_of(tok_json))[0]["tp"] == 2  # one that does


def test_a_library_models_mismatches_with_the_directory_are_named_at_once(tok_json: str, llama_data: Path,
                                                                          tmp_path: Path) -> None:
    """A model built by hand (not through config_from, which sets it from the directory)
    against the directory: every differing option in one line, not one per run."""
    import attrs

    from numesh.checkpoint.hf_llama import pretrained
    from numesh.checkpoint.init_from import _check_pretrained
    from numesh.data.dataset import load_tokenizer

    d = save_model(tmp_path / "hf", tok_json)
    model = attrs.evolve(pretrained(d).model(16), n_layer=3, n_embd=32)
    with pytest.raises(ConfigError) as e:
        _check_pretrained(d, model, load_tokenizer(str(llama_data)))
    assert str(e.value) == f"--init-from {d} has n_layer 2, n_embd 16, this run has n_layer 3, n_embd 32: set " \
                           "--n-layer, --n-embd to match (or leave them out: the directory sets them)"

REFUSALS = [  # (how the directory is spoiled, what the one line says)
    (lambda d: (d / "config.json").unlink(), "has model.safetensors but no config.json, which a transformers"),
    (lambda d: (d / "model.safetensors").unlink(), "holds no weights: it needs model.safetensors"),
    (lambda d: _edit_config(d, model_type="qwen2"), "model_type 'qwen2' is not one numesh reads: it reads llama, "
                                                    "mistral, mixtral and gpt2"),
    (lambda d: _edit_config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0}),
     "rope scaling 'llama3' is not implemented in numesh"),
    (lambda d: _edit_config(d, rope_scaling={"type": "linear", "factor": 2.0}),
     "rope scaling 'linear' is not implemented in numesh"),
    (lambda d: _edit_config(d, rope_scaling={"factor": 2.0}), "rope scaling '?' is not implemented in numesh"),
    (lambda d: _edit_config(d, model_type="mistral", sliding_window=32),  # max_position_embeddings 64
     "mistral with a sliding window (32 tokens) is not implemented"),
    (lambda d: _edit_config(d, head_dim=8), "head_dim is 8 but hidden_size / num_attention_heads is 16/4"),
    (lambda d: _edit_config(d, hidden_act="gelu"), "hidden_act is 'gelu', numesh's SwiGLU needs silu"),
    (lambda d: _edit_config(d, attention_bias=True), "attention_bias is True but mlp_bias False"),
    (lambda d: _edit_weights(d, drop="model.layers.1.mlp.up_proj.weight"),
     "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda d: _edit_weights(d, transpose="model.layers.0.self_attn.k_proj.weight"),
     "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 8], the model needs [8, 16]"),
    (lambda d: _edit_weights(d, add="model.layers.0.self_attn.q_norm.weight"),
     "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"),
    (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    (lambda d: _truncate(d / "tokenizer.json", 500), "tokenizer.json is not valid JSON ("),
    (lambda d: (d / "tokenizer.json").write_text("[]"), "tokenizer.json is not a JSON object but list"),
]


@pytest.mark.parametrize("spoil, says", REFUSALS, ids=[s for _, s in REFUSALS])
def test_a_directory_numesh_cannot_read_is_one_line(spoil: Any, says: str, tok_json: str, llama_data: Path,
                                                    tmp_path: Path) -> None:
    from numesh.run.train import Trainer

    d = save_model(tmp_path / "hf", tok_json)
    spoil(d)
    cfg = llama_run(llama_data, tmp_path / "ft", init_from="", ffn_hidden=24)
    import attrs

    with pytest.raises(UserError, match=re.escape(says)) as e:
        Trainer(attrs.evolve(cfg, init_from=str(d)), MPI.COMM_SELF)
    assert "\n" not in str(e.value) and "lacks or mistypes" not in str(e.value)  # not wrapped as a bad key


def test_a_block_size_not_given_fits_the_directory(tok_json: str, llama_data: Path, tmp_path: Path) -> None:
    """A Llama directory of max_position_embeddings 32 (a run at --block-size 32, exported
    with --format hf) was refused for --block-size 64, the default the user never gave:
    where not given (nor in a --config file at other than its default) it is the default or
    the bound where lower; one given above the bound stays the one-line error."""
    from numesh.run.config import config_from

    short = save_model(tmp_path / "short", tok_json, max_position_embeddings=32)
    long = save_model(tmp_path / "long", tok_json, max_position_embeddings=256)
    base = dict(data=str(llama_data), out=str(tmp_path / "ft"))
    assert config_from({**base, "init_from": str(short)}).block_size == 32
    assert config_from({**base, "init_from": str(long)}).block_size == 64  # the default, not the bound
    toml = tmp_path / "recipe.toml"
    toml.write_text("block_size = 64\n")  # a recipe listing the default: not given
    assert config_from({**base, "init_from": str(short)}, toml).block_size == 32
    toml.write_text("block_size = 48\n")
    assert config_from({**base, "init_from": str(short)}, toml).block_size == 48  # refused as the run starts
    # a --model preset's block_size is chosen, not the default: SmolLM2's 2048 stays 2048
    huge = save_model(tmp_path / "huge", tok_json, max_position_embeddings=8192)
    assert config_from({**base, "init_from": str(huge)}, preset={"block_size": 2048}).block_size == 2048
    run = ["train", "--data", str(llama_data), "--init-from", str(short), "--out", str(tmp_path / "ft"),
           "--max-iters", "0", "--eval-iters", "1", "--batch-size", "2", "--dtype", "float64"]
    res = cli(*run)
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "ft" / "config.json").read_text())["block_size"] == 32
    assert one_error_line(cli(*run, "--block-size", "48", "--overwrite")) == (
        f"error: --block-size 48 is longer than {short}'s max_position_embeddings 32: use at most 32")


def test_the_run_must_fit_the_directory_in_context_and_tokenizer(tok_json: str, llama_data: Path, char_dataset: Path,
                                                                  tmp_path: Path) -> None:
    """--block-size up to max_position_embeddings (64 here: rotary, no table to crop); a
    dataset tokenised with another tokenizer, of another size or the same size, refused as
    such; the directory's own tokenizer with more entries than its vocab_size, refused as that."""
    import attrs

    from numesh.data.dataset import load_tokenizer
    from numesh.run.config import config_from
    from numesh.run.train import Trainer

    d = save_model(tmp_path / "hf", tok_json)
    cfg = llama_run(llama_data, tmp_path / "ft", ffn_hidden=24, init_from=str(d))
    Trainer(attrs.evolve(cfg, block_size=64), MPI.COMM_SELF)  # the longest allowed
    with pytest.raises(ConfigError, match="--block-size 65 is longer than .* max_position_embeddings 64"):
        Trainer(attrs.evolve(cfg, block_size=65), MPI.COMM_SELF)
    with pytest.raises(ConfigError, match="was trained with another tokenizer than --data's: its token ids would "
                                          "mean other text; tokenise the corpus with its tokenizer.json"):
        Trainer(attrs.evolve(cfg, data=str(char_dataset)), MPI.COMM_SELF)  # another size, but that is not the cause
    other = json.loads(tok_json)  # the same size, two tokens swapped: other ids for the same text
    vocab = other["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (d / "tokenizer.json").write_text(json.dumps(other))
    assert load_tokenizer(llama_data).vocab_size == vocab_of(json.dumps(other))
    with pytest.raises(ConfigError, match="was trained with another tokenizer than --data's"):
        Trainer(cfg, MPI.COMM_SELF)
    (d / "tokenizer.json").write_text(tok_json)
    entries = vocab_of(tok_json)
    _edit_config(d, vocab_size=entries - 1)
    with pytest.raises(ConfigError, match=f"--data's tokenizer has {entries} entries, more than --init-from {d}'s "
                                          f"vocab_size {entries - 1}: .* is inconsistent with its own tokenizer"):
        Trainer(config_from(dict(init_from=str(d), data=str(llama_data), out=str(tmp_path / "ft2"),
                                 block_size=16)), MPI.COMM_SELF)


def test_a_vocabulary_padded_past_the_tokenizer_trains_samples_and_exports_back(tok_json: str, llama_data: Path,
                                                                                 tmp_path: Path) -> None:
    """A model whose config.json vocab_size is a multiple of 64 above its tokenizer's entries
    (as many real ones are) fine-tunes on a dataset tokenised by its own tokenizer, keeping
    every row; sampling never draws an id past the tokenizer (transformers' generate with
    those ids suppressed draws the same); the export writes vocab_size back, transformers
    loads it with numesh's logits and it imports to the same bits."""
    from tokenizers import Tokenizer

    from numesh.base.tree import tree_leaves_with_path
    from numesh.checkpoint import export_hf, read_global_params
    from numesh.run.config import config_from
    from numesh.run.sample import SampleConfig, sample
    from numesh.run.train import train

    entries = vocab_of(tok_json)
    rows = entries // 64 * 64 + 64
    d = save_model(tmp_path / "hf", tok_json, vocab_size=rows)
    run = dict(data=str(llama_data), block_size=16, batch_size=4, max_iters=2, eval_interval=2, eval_iters=1,
               dtype="float64", peak_flops=1e12, learning_rate=1e-2)
    ckpt = train(config_from(dict(run, init_from=str(d), out=str(tmp_path / "ft"))), MPI.COMM_SELF).checkpoint
    model, tok, params = read_global_params(ckpt)
    assert (model.vocab_size, tok.vocab_size, params.wte.shape[0]) == (rows, entries, rows)

    from safetensors.numpy import load_file, save_file

    prompt = "the cat sat"
    ids = Tokenizer.from_str(tok_json).encode(prompt).ids
    best = int(hf_logits(d, np.array([ids]), "float64")[0, -1].argmax())
    sd = load_file(d / "model.safetensors")  # the rows past the tokenizer: what greedy decoding would pick
    sd["lm_head.weight"][entries:] = 3 * sd["lm_head.weight"][best]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float64).eval()
    with torch.no_grad():
        assert hf(torch.tensor([ids])).logits[0, -1].argmax() >= entries
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                           suppress_tokens=list(range(entries, rows)))[0].tolist()
    text = Tokenizer.from_str(tok_json).decode(want, skip_special_tokens=False)
    assert sample(SampleConfig(str(d), prompt, max_new_tokens=8, temperature=0.0), MPI.COMM_SELF) == [text]
    from numesh.run.sample import generate, load_checkpoint

    ck = load_checkpoint(d)  # sampled hot, the padded rows (3x the best logit) are drawn unless cut
    hot = dict(max_new_tokens=24, temperature=2.0, top_k=None, seed=3)
    assert generate(ck.params, ck.model, self_mesh(), np.array([ids]), **hot)[0, len(ids):].max() >= entries
    assert generate(ck.params, ck.model, self_mesh(), np.array([ids]), **hot,
                    tokens=entries)[0, len(ids):].max() < entries
    res = cli("sample", str(ckpt), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "1")
    assert res.exit_code == 0, res.stderr

    out = export_hf(ckpt, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == rows
    idx = np.random.default_rng(0).integers(0, rows, (2, 16))
    np.testing.assert_allclose(hf_logits(out, idx, "float64"), numesh_logits(params, model, idx), rtol=0, atol=1e-5)
    _, back_model, back = read_pretrained(out, np.float64, model.block_size)
    assert spelled(back_model) == spelled(model)
    want_leaves = dict(tree_leaves_with_path(params))
    for path, x in tree_leaves_with_path(back):
        assert np.array_equal(x, want_leaves[path]), path
    train(config_from(dict(run, init_from=str(out), out=str(tmp_path / "again"), max_iters=1, eval_interval=1)),
          MPI.COMM_SELF)  # and the export starts a run of its own
    from numesh.checkpoint.hf_llama import pretrained

    resumed = config_from(dict(run, **pretrained(d).options, resume=str(ckpt), out=str(tmp_path / "ft"), max_iters=3))
    assert train(resumed, MPI.COMM_SELF).steps == 1  # --resume without --init-from: the checkpoint's rows too


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_as_such(tok_json: str, llama_data: Path,
                                                                    tmp_path: Path) -> None:
    """Its last ids would have no row: sampling and a run from the directory say so (not
    "another tokenizer", which it is not)."""
    from numesh.run.config import config_from
    from numesh.run.sample import SampleConfig, sample
    from numesh.run.train import Trainer

    entries = vocab_of(tok_json)
    d = save_model(tmp_path / "hf", tok_json, vocab_size=entries - 1)
    with pytest.raises(CheckpointError, match=f"tokenizer.json has {entries} entries but config.json's vocab_size is "
                                              f"only {entries - 1}: ids from {entries - 1} on have no embedding row"):
        sample(SampleConfig(str(d), "the cat", max_new_tokens=2), MPI.COMM_SELF)
    with pytest.raises(ConfigError, match=f"--data's tokenizer has {entries} entries, more than --init-from {d}'s "
                                          f"vocab_size {entries - 1}"):
        Trainer(config_from(dict(init_from=str(d), data=str(llama_data), out=str(tmp_path / "ft"), block_size=16)),
                MPI.COMM_SELF)


def test_a_tied_models_lm_head_copy_is_read_only_when_it_is_the_embedding(tok_json: str, tmp_path: Path) -> None:
    """A tied model's file may keep lm_head.weight as a copy; one that differs was dropped
    unread, and transformers (which reads it) computed other logits than numesh: refused."""
    from safetensors.numpy import load_file, save_file

    d = save_model(tmp_path / "hf", tok_json, tie_word_embeddings=True)
    path = d / "model.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].copy()}, path,
              metadata={"format": "pt"})
    read_pretrained(d, np.dtype("float64"), 16)  # the tied copy itself: read as tied
    other = tensors["model.embed_tokens.weight"] + 1.0
    save_file({**tensors, "lm_head.weight": other}, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        read_pretrained(d, np.dtype("float64"), 16)


def test_a_tied_lm_head_without_an_embedding_is_the_missing_tensor_line(tok_json: str, tmp_path: Path) -> None:
    """The tied-copy check ran before the missing-tensor check: a KeyError traceback."""
    from safetensors.numpy import load_file, save_file

    d = save_model(tmp_path / "hf", tok_json, tie_word_embeddings=True)
    tensors = load_file(d / "model.safetensors")
    embed = tensors.pop("model.embed_tokens.weight")
    save_file({**tensors, "lm_head.weight": embed}, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="has no tensor 'model.embed_tokens.weight'"):
        read_pretrained(d, np.dtype("float64"), 16)
