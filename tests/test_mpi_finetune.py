"""Fine-tuning a transformers Llama on a mesh equals fine-tuning it on one rank (issue 41).

A small float64 `LlamaForCausalLM` (2 layers, 4 query heads and 1 kv head, untied head over
a 41-token vocabulary, so tp pads it), saved by transformers itself, and a corpus tokenised
with its tokenizer: `--init-from DIR` alone sets the model, and a short run on tp=2 (fewer
kv heads than tp), pp=2 and dp=2 with ZeRO-3 gives every logged number and every final
parameter of the one-rank run (1e-10). Each rank reads only its own shards of the file.

The same model with a padded vocabulary (config.json's vocab_size past the tokenizer's
entries: a multiple of 64 as many real models have, which tp=2 splits as it is, and one
more than an odd number of rows, which tp pads once more) fine-tunes on tp=2 as on one rank,
every row kept and trained; sampled on tp=2 it draws only ids the tokenizer has, the same
ids as one rank, though its rows past the tokenizer hold the likeliest logits. A sample on
tp=2 ends at its stop id at the step one rank ends it, on every rank.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest

from conftest import (
    WORLD,
    assert_same_run,
    mesh_for_world,
    on_first,
    prefetch_serial,
    self_mesh,
    serial_reference,
    small_run_config,
    train_records,
    world_mesh,
)

pytestmark = pytest.mark.mpi(min_size=2)

CASES = {"tp=2": {}, "pp=2": dict(micro_batches=2), "dp=2": dict(zero=3, micro_batches=2)}


def _prepare(root: Path) -> None:
    """The model directory and its dataset (rank 0; transformers builds the model)."""
    from conftest import SYNTH_TEXT
    from numesh.data.corpus import Reading
    from numesh.data.sharded import prepare_tokenized
    from numesh.data.tokenizer import HFTokenizer
    from test_hf_llama import llama_tokenizer_json, save_model, vocab_of

    tok = llama_tokenizer_json()
    save_model(root / "hf", tok, num_key_value_heads=1, seed=4)
    for name, rows in padded_rows(vocab_of(tok)).items():
        save_model(root / name, tok, num_key_value_heads=1, seed=4, vocab_size=rows)
    (root / "corpus.txt").write_text(SYNTH_TEXT * 4, encoding="utf-8")
    prepare_tokenized([root / "corpus.txt"], HFTokenizer(tok, "</s>"), root / "data", Reading(split_on="\n"))


def padded_rows(entries: int) -> dict[str, int]:
    """The padded models' directory names and rows for a tokenizer of `entries` entries: the
    next multiple of 64 (even: no tp padding on top), and an odd count past the entries
    (tp=2 pads one row more, which gets no probability, unlike the model's own rows)."""
    return {"hf-padded-64": entries // 64 * 64 + 64, "hf-padded-odd": entries + 5 + entries % 2}


@pytest.fixture(scope="module")
def pretrained(shared_tmp: Path) -> Path:
    root = shared_tmp / "finetune"
    on_first(1, lambda _: _prepare(root))
    return root


def _config(root: Path, mesh: str) -> object:
    # the directory sets the model; small_run_config's own shape agrees with it but for biases
    return small_run_config(root / "data", root / f"run-{mesh}", mesh, init_from=str(root / "hf"), bias=False,
                            **CASES[mesh])


@pytest.mark.parametrize("i", range(len(CASES)))
def test_finetuning_on_a_mesh_equals_one_rank(request: pytest.FixtureRequest, i: int) -> None:
    mesh = mesh_for_world({2: list(CASES)}, i, why="fine-tuning parity runs on 2 ranks (tp=2, pp=2, dp=2 ZeRO-3)")
    pretrained = request.getfixturevalue("pretrained")  # built only where the test runs
    if i == 0:
        prefetch_serial([_config(pretrained, m) for m in CASES])
    cfg = _config(pretrained, mesh)
    assert cfg.n_kv_head == 1 and cfg.arch == "llama" and not cfg.tie_embeddings  # from the directory
    assert_same_run(train_records(cfg, WORLD), serial_reference(cfg))


PADDED = ["hf-padded-64", "hf-padded-odd"]


def _padded_config(root: Path, which: str) -> object:
    return small_run_config(root / "data", root / f"run-{which}", "tp=2", init_from=str(root / which),
                            bias=False, max_iters=2, eval_interval=2)


@pytest.mark.parametrize("which", PADDED)
def test_a_padded_vocabulary_finetunes_on_tp2_as_on_one_rank(request: pytest.FixtureRequest, which: str) -> None:
    mesh_for_world({2: ["tp=2"]}, why="the padded vocabulary's parity runs on 2 ranks (tp=2)")
    root = request.getfixturevalue("pretrained")
    from numesh.data.dataset import load_tokenizer
    from numesh.run.config import run_vocab

    if which == PADDED[0]:
        prefetch_serial([_padded_config(root, w) for w in PADDED])
    cfg = _padded_config(root, which)
    entries = load_tokenizer(root / "data").vocab_size
    rows = run_vocab(cfg, entries)  # the directory's rows, not the tokenizer's entries
    assert rows == padded_rows(entries)[which] > entries
    got = train_records(cfg, WORLD)
    assert got[1]["wte"].shape[0] == got[1]["lm_head"].shape[0] == rows  # every row kept, none of tp's padding
    assert_same_run(got, serial_reference(cfg))


@pytest.mark.parametrize("which", PADDED)
def test_sampling_a_padded_vocabulary_on_tp2_draws_only_the_tokenizers_ids(request: pytest.FixtureRequest,
                                                                            which: str) -> None:
    """The rows past the tokenizer are given 3x the best logit of the prompt's next token, so a
    hot draw over every row picks them (checked: the cut is what keeps them out)."""
    mesh_for_world({2: ["tp=2"]}, why="sampling a padded vocabulary on tp runs on 2 ranks (tp=2)")
    root = request.getfixturevalue("pretrained")
    from numesh.checkpoint.model import shard_params
    from numesh.run.sample import generate, load_checkpoint, prompt_ids

    ck = load_checkpoint(root / which)
    entries = ck.tokenizer.vocab_size
    prompt = prompt_ids(ck.tokenizer, "the cat sat")[None, :]
    one = self_mesh()
    best = int(generate(ck.params, ck.model, one, prompt, 1, temperature=0.0, tokens=entries)[0, -1])
    head = ck.params.lm_head.copy()
    head[entries:] = 3 * head[best]
    params = attrs.evolve(ck.params, lm_head=head)
    hot = dict(max_new_tokens=24, temperature=2.0, top_k=None, seed=3)
    for mesh in world_mesh("tp=2"):
        sharded = shard_params(params, ck.model, mesh)
        every_row = generate(sharded, ck.model, mesh, prompt, **hot)[0, prompt.shape[1]:]
        cut = generate(sharded, ck.model, mesh, prompt, **hot, tokens=entries)
    assert every_row.max() >= entries  # the padded rows are the likeliest: only the cut keeps them out
    assert cut[0, prompt.shape[1]:].max() < entries
    np.testing.assert_array_equal(cut, generate(params, ck.model, one, prompt, **hot, tokens=entries))
    assert WORLD.allgather(cut.tolist()) == [cut.tolist()] * WORLD.Get_size()  # every rank the same text


def test_a_sample_on_tp2_ends_at_its_stop_id_as_on_one_rank(request: pytest.FixtureRequest) -> None:
    """Every tp rank draws the same token, so every rank ends the sample at the same step:
    the ids of one rank, ended at the stop id, on every rank."""
    mesh_for_world({2: ["tp=2"]}, why="sampling on tp runs on 2 ranks (tp=2)")
    root = request.getfixturevalue("pretrained")
    from numesh.checkpoint.model import shard_params
    from numesh.run.sample import generate, load_checkpoint, prompt_ids

    ck = load_checkpoint(root / "hf")
    prompt = prompt_ids(ck.tokenizer, "the cat sat")[None, :]
    hot = dict(max_new_tokens=24, temperature=1.5, top_k=None, seed=3, tokens=ck.tokenizer.vocab_size)
    one = self_mesh()
    full = generate(ck.params, ck.model, one, prompt, **hot)
    stop = int(full[0, prompt.shape[1] + 3])
    want = generate(ck.params, ck.model, one, prompt, **hot, stop=[stop])
    assert want.shape[1] < full.shape[1] and want[0, -1] == stop
    for mesh in world_mesh("tp=2"):
        got = generate(shard_params(ck.params, ck.model, mesh), ck.model, mesh, prompt, **hot, stop=[stop])
    np.testing.assert_array_equal(got, want)
    assert WORLD.allgather(got.tolist()) == [got.tolist()] * WORLD.Get_size()
