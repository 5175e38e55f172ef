"""Samples end where transformers' `generate` ends them, and `numesh sample` shows them as
they grow.

A sample ends at its model's end-of-sequence token: a transformers directory's
generation_config.json eos_token_id (config.json's where it has none), a numesh checkpoint's
dataset end-of-text token (its source's ids when it was fine-tuned from a directory), none
for a character model; `--ignore-eos` draws every token. Greedy samples are compared with
transformers' own `generate` on small random models (tests/test_hf_llama.py builds them).
The text is handed out token by token, never half a character, and adds up to the sample;
weights with NaN are one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import cli, one_error_line, random_global_params, self_mesh, tiny_config
from numesh.base.errors import CheckpointError, ConfigError
from numesh.run.sample import SampleConfig, generate, load_checkpoint, sample, stop_ids
from test_hf_llama import llama_data, llama_tokenizer_json, save_model, torch, transformers  # noqa: F401 (fixture)

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def tok_json() -> str:
    return llama_tokenizer_json()


def _generate(d: Path, **kw: object) -> list[int]:
    """transformers' greedy `generate` from the directory as it loads it (its own
    generation config unless `kw` says otherwise), 12 new tokens at most."""
    from tokenizers import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float64).eval()
    ids = Tokenizer.from_str((d / "tokenizer.json").read_text()).encode(PROMPT).ids
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                              **kw)[0].tolist()


def _text(d: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_str((d / "tokenizer.json").read_text()).decode(ids, skip_special_tokens=False)


def _greedy(d: Path, **kw: object) -> str:
    return sample(SampleConfig(str(d), PROMPT, max_new_tokens=12, temperature=0.0, **kw), MPI.COMM_SELF)[0]


def _set_eos(d: Path, name: str, eos: object) -> None:
    cfg = json.loads((d / name).read_text())
    (d / name).write_text(json.dumps({**cfg, "eos_token_id": eos}))


def test_greedy_samples_end_where_generate_ends_them(tok_json: str, tmp_path: Path) -> None:
    """The eos of generation_config.json over config.json's, a list of them, config.json's
    alone without the file: each time the tokens and text transformers' `generate` gives;
    --ignore-eos draws all 12 tokens, as generate without an eos does."""
    d = save_model(tmp_path / "hf", tok_json)
    full = _generate(d, eos_token_id=None)
    n0 = len(full) - 12
    new = full[n0:]
    hit = new[4]  # an id greedy decoding draws: the sample ends at its first draw
    ends = n0 + new.index(hit) + 1
    assert ends < len(full)
    never = next(i for i in range(2, 100) if i not in full)
    _set_eos(d, "config.json", never)
    _set_eos(d, "generation_config.json", hit)
    want = _generate(d)
    assert want == full[:ends]  # transformers itself ends there
    assert _greedy(d) == _text(d, want)
    assert load_checkpoint(d).stop == (hit,)
    assert _greedy(d, ignore_eos=True) == _text(d, full)

    _set_eos(d, "generation_config.json", [never, new[7], hit])  # several: the first drawn ends it
    first = n0 + min(new.index(new[7]), new.index(hit)) + 1
    assert _generate(d) == full[:first]
    assert _greedy(d) == _text(d, full[:first])

    _set_eos(d, "config.json", hit)
    cfg = json.loads((d / "generation_config.json").read_text())
    del cfg["eos_token_id"]  # a file without an eos: transformers reads it alone and runs on
    (d / "generation_config.json").write_text(json.dumps(cfg))
    assert _generate(d) == full
    assert _greedy(d) == _text(d, full) and load_checkpoint(d).stop == ()

    (d / "generation_config.json").unlink()  # no file: transformers builds one from config.json
    assert _generate(d) == full[:ends]
    assert _greedy(d) == _text(d, full[:ends])


def test_an_exports_generation_ids_are_its_sources_file_alone() -> None:
    """The source's generation_config.json alone where it had one (an eos left out stays
    out: a merge with config.json's made the export stop where the source did not), else
    config.json's; a run from scratch ends at its end-of-text id."""
    from numesh.checkpoint.hf_source import generation_ids

    source = {"config_ids": {"bos_token_id": 0, "eos_token_id": 1}, "generation_ids": {"bos_token_id": 0}}
    assert generation_ids(source, 7) == {"bos_token_id": 0}
    assert generation_ids({**source, "generation_ids": None}, 7) == {"bos_token_id": 0, "eos_token_id": 1}
    assert generation_ids(None, 7) == {"bos_token_id": 7, "eos_token_id": 7}


def test_generate_ends_each_row_at_its_own_stop() -> None:
    """Two rows, sampled hot: each keeps the tokens it drew without `stop` up to and with
    its first stop id, then repeats it; generation ends when both have ended."""
    cfg = tiny_config(vocab_size=16)
    params = random_global_params(cfg, seed=1)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    kw = dict(temperature=1.0, top_k=None, seed=5)
    full = generate(params, cfg, self_mesh(), prompt, 20, **kw)
    new = full[:, 3:]
    stop = int(new[0, 2])
    assert stop in new[1]  # both rows draw it: generation ends at the later one
    ends = [int(np.argmax(row == stop)) + 1 for row in new]
    assert ends[0] != ends[1] and max(ends) < 20
    got = generate(params, cfg, self_mesh(), prompt, 20, **kw, stop=[stop])
    assert got.shape == (2, 3 + max(ends))
    for r, e in enumerate(ends):
        assert np.array_equal(got[r, :3 + e], full[r, :3 + e])
        assert (got[r, 3 + e:] == stop).all()
    seen: list[np.ndarray] = []
    generate(params, cfg, self_mesh(), prompt, 20, **kw, stop=[stop], on_token=lambda ids: seen.append(ids.copy()))
    assert [s.shape[1] for s in seen] == list(range(4, 4 + max(ends)))
    assert np.array_equal(seen[-1], got)
    with pytest.raises(ConfigError, match="stop must be a collection of token ids"):
        generate(params, cfg, self_mesh(), prompt, 2, stop=[1.5])


def test_stop_ids_take_what_config_files_spell() -> None:
    assert stop_ids(3, 10) == (3,)
    assert stop_ids([7, 2, 7], 10) == (2, 7)
    assert stop_ids([3, 12, -1, True, "x"], 10) == (3,)  # ids the tokenizer cannot produce are never drawn
    assert stop_ids(None, 10) == ()


def test_a_bpe_checkpoint_ends_at_its_end_of_text_and_a_char_one_nowhere(char_dataset: Path,
                                                                          tmp_path: Path) -> None:
    """A run from scratch ends samples at its dataset's end-of-text id, which ends each of its
    documents; a character model has none."""
    from numesh.data import sharded as TD
    from numesh.data.corpus import Reading
    from numesh.data.tokenizer import HFTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat.\n\nthe dog ran.\n\n" * 40)
    TD.prepare_bpe([corpus], 300, tmp_path / "bpe", Reading(split_on="\n\n"), val_fraction=0.3)
    for data, run in ((tmp_path / "bpe", "bpe"), (char_dataset, "char")):
        res = cli("train", "--data", str(data), "--out", str(tmp_path / f"run-{run}"), "--max-iters", "1",
                  "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "2")
        assert res.exit_code == 0, res.stderr
    bpe = load_checkpoint(tmp_path / "run-bpe" / "ckpt" / "latest")
    assert isinstance(bpe.tokenizer, HFTokenizer) and bpe.stop == (bpe.tokenizer.eot_id,)
    assert load_checkpoint(tmp_path / "run-char" / "ckpt" / "latest").stop == ()


class _Bytes:
    """A tokenizer whose ids are UTF-8 bytes: a character of two or three bytes takes as
    many tokens, as a byte-level BPE's rare characters do."""

    vocab_size = 256

    def decode(self, ids: np.ndarray) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def test_the_growing_text_never_shows_half_a_character() -> None:
    from numesh.run.sample import _Growing

    pieces: list[str] = []
    grow = _Growing(_Bytes(), pieces.append)
    text = "a é € b"
    ids = np.frombuffer(text.encode(), np.uint8).astype(np.int64)
    for n in range(1, len(ids) + 1):
        grow(ids[None, :n])
    grow.finish(text)
    assert pieces == ["a ", "é ", "€ ", "b"]  # a word at a time, none cut inside a character


class _Rewriting:
    """A decoder that rewrites the last word as tokens come (as byte fallback does): ids
    0-9 are letters, an id 10 after a word turns it upper case, 11 is a space."""

    vocab_size = 12

    def decode(self, ids: np.ndarray) -> str:
        words = "".join(" " if i == 11 else "^" if i == 10 else "abcdefghij"[i] for i in ids).split(" ")
        return " ".join(w.replace("^", "").upper() if "^" in w else w for w in words)


def test_a_word_is_shown_once_it_is_followed_by_whitespace() -> None:
    from numesh.run.sample import _Growing

    pieces: list[str] = []
    grow = _Growing(_Rewriting(), pieces.append)
    ids = np.array([0, 1, 10, 11, 2, 3, 11, 4])  # "AB cd e": "ab" becomes "AB" before its space comes
    for n in range(1, len(ids) + 1):
        grow(ids[None, :n])
    grow.finish(_Rewriting().decode(ids))
    assert pieces == ["AB ", "cd ", "e"]


def test_the_cli_shows_the_text_as_it_grows(tok_json: str, tmp_path: Path) -> None:
    """`show` gets the prompt's words first and then those of the tokens, adding up to the
    samples with SEPARATOR between them; the command prints the same."""
    from numesh.run.sample import SEPARATOR

    d = save_model(tmp_path / "hf", tok_json)
    pieces: list[str] = []
    texts = sample(SampleConfig(str(d), PROMPT, max_new_tokens=12, temperature=1.5, num_samples=2, ignore_eos=True),
                   MPI.COMM_SELF, show=pieces.append)
    assert PROMPT.startswith(pieces[0]) and len(pieces) > 3
    assert "".join(pieces) == SEPARATOR.join(texts)
    res = cli("sample", str(d), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "1.5",
              "--num-samples", "2", "--ignore-eos")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == SEPARATOR.join(texts) + "\n"


def test_weights_with_nan_are_one_line(tok_json: str, llama_data: Path, tmp_path: Path) -> None:  # noqa: F811
    """Sampling names the tensor (by the directory's own name) and says to get the files
    again; a run from the directory says so at step 0, not "training diverged" with advice
    (--on-nan skip) that skips every step."""
    from safetensors.numpy import load_file, save_file

    d = save_model(tmp_path / "hf", tok_json)
    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][3, 2] = np.nan
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="its weight model.layers.1.mlp.down_proj.weight holds NaN or inf "
                                              "values, so no token can be drawn from it: get the model's weight"):
        _greedy(d)
    line = one_error_line(cli("sample", str(d), "--max-new-tokens", "2"))
    assert "model.layers.1.mlp.down_proj.weight holds NaN or inf" in line
    res = cli("train", "--init-from", str(d), "--data", str(llama_data), "--block-size", "8", "--batch-size", "2",
              "--max-iters", "2", "--out", str(tmp_path / "run"))
    line = res.stderr.strip().splitlines()[-1]  # after the run's start-up lines
    assert res.exit_code == 2 and line == (
        "error: the loss or gradient is not finite at step 0, before any update (loss nan, gradient norm nan): the "
        f"weights of --init-from {d} hold NaN or inf, or overflow in float32; `numesh sample {d}` names the first "
        "such weight")


def test_a_prompt_that_is_not_utf8_is_one_line() -> None:
    bad = b"a\xff\xfeb".decode("utf-8", "surrogateescape")  # how a shell's bytes reach sys.argv
    with pytest.raises(ConfigError, match="--prompt is not UTF-8 text \\(byte 0xff at character 1\\)"):
        SampleConfig("nowhere", bad).validate()


def test_a_fine_tuned_checkpoint_samples_with_its_sources_context(tok_json: str, llama_data: Path,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    """A run from a directory trains at a short block (4 here) but keeps rotary positions up to
    its source's max_position_embeddings, as its export does: it samples the directory's
    tokens, where a window of its block size gave others."""
    from numesh.run.config import config_from
    from numesh.run.train import train

    d = save_model(tmp_path / "hf", tok_json)
    run = dict(data=str(llama_data), block_size=4, batch_size=2, max_iters=0, eval_iters=1, dtype="float64",
               init_from=str(d), out=str(tmp_path / "ft"))
    ckpt = train(config_from(run), MPI.COMM_SELF).checkpoint
    assert load_checkpoint(ckpt).max_positions == 64
    kw = dict(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    want = sample(SampleConfig(str(d), PROMPT, **kw), MPI.COMM_SELF)
    assert sample(SampleConfig(str(ckpt), PROMPT, **kw), MPI.COMM_SELF) == want
