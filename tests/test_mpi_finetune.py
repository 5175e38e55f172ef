"""Fine-tuning a transformers Llama on a mesh equals fine-tuning it on one rank (issue 41).

A small float64 `LlamaForCausalLM` (2 layers, 4 query heads and 1 kv head, untied head over
a 41-token vocabulary, so tp pads it), saved by transformers itself, and a corpus tokenised
with its tokenizer: `--init-from DIR` alone sets the model, and a short run on tp=2 (fewer
kv heads than tp), pp=2 and dp=2 with ZeRO-3 gives every logged number and every final
parameter of the one-rank run (1e-10). Each rank reads only its own shards of the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import (
    WORLD,
    assert_same_run,
    mesh_for_world,
    on_first,
    prefetch_serial,
    serial_reference,
    small_run_config,
    train_records,
)

pytestmark = pytest.mark.mpi(min_size=2)

CASES = {"tp=2": {}, "pp=2": dict(micro_batches=2), "dp=2": dict(zero=3, micro_batches=2)}


def _prepare(root: Path) -> None:
    """The model directory and its dataset (rank 0; transformers builds the model)."""
    from conftest import SYNTH_TEXT
    from numesh.data.corpus import Reading
    from numesh.data.sharded import prepare_tokenized
    from numesh.data.tokenizer import HFTokenizer
    from test_hf_llama import llama_tokenizer_json, save_model

    tok = llama_tokenizer_json()
    save_model(root / "hf", tok, num_key_value_heads=1, seed=4)
    (root / "corpus.txt").write_text(SYNTH_TEXT * 4, encoding="utf-8")
    prepare_tokenized([root / "corpus.txt"], HFTokenizer(tok, "</s>"), root / "data", Reading(split_on="\n"))


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
