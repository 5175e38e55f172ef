"""benchmarks/bench_llama.py's workers run: each side trains a tiny SmolLM2-shaped model in a
fresh process and reports its step, and from numesh's initial weights transformers'
LlamaForCausalLM follows numesh's losses on the same batches (the two sides train the same
model on the same data). The benchmark's numbers are its own to print; nothing here is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_llama  # noqa: E402

# SmolLM2's parts (GQA 6:2, SwiGLU, tied head, rotary theta 1e5) at a test's size
TINY = dict(bench_llama.SMOLLM2, n_layer=1, n_embd=48, n_head=6, n_kv_head=2, ffn_hidden=64, block_size=16,
            batch_size=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    from numesh.data.char import prepare_char_dataset

    rng = np.random.default_rng(0)
    text = "".join(rng.choice(list("abcdefgh \n"), 4000))
    out = tmp_path_factory.mktemp("bench_llama") / "data"
    prepare_char_dataset(text, out)
    return str(out)


def _run(kind: str, data: str, same_init: bool = False) -> dict:
    res = bench_llama.run_worker(kind, TINY, data, threads=1, warmup=1, iters=1, same_init=same_init, timeout=600)
    assert "error" not in res, res["error"]
    return res


@pytest.fixture(scope="module")
def ours(data: str) -> dict:
    return _run("numesh", data)


def test_numesh_worker_reports_a_step(ours: dict) -> None:
    res = ours
    assert res["tokens_per_s"] > 0 and res["rss_mb"] > 0
    assert len(res["losses"]) == 2 and all(np.isfinite(res["losses"]))
    assert res["n_params"] > 0


def test_transformers_worker_follows_numesh_from_its_init(data: str, ours: dict) -> None:
    pytest.importorskip("torch", reason="pip install torch==2.13.0 transformers==5.24.0 to run the torch side")
    pytest.importorskip("transformers", reason="pip install transformers==5.24.0 to run the torch side")
    theirs = _run("torch", data, same_init=True)
    assert theirs["tokens_per_s"] > 0 and theirs["rss_mb"] > 0
    assert theirs["n_params"] == ours["n_params"]  # the same model: the tied head counted once
    # two AdamW steps on the same batches from the same weights: the same losses to float32 rounding
    np.testing.assert_allclose(theirs["losses"], ours["losses"], rtol=1e-5)
    assert ours["losses"][1] != ours["losses"][0]  # the first step changed the weights


def test_rows_are_parsed_or_refused() -> None:
    assert bench_llama.parse_rows("512x4, 2048x1") == [(512, 4), (2048, 1)]
    with pytest.raises(SystemExit, match="--rows takes TxB"):
        bench_llama.parse_rows("512")


def test_padded_bpe_dataset_has_exactly_the_vocabulary_asked(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    import json

    import common
    from numesh.data.tokenizer import tokenizer_from_meta, train_bpe

    rng = np.random.default_rng(0)
    src = tmp_path / "text.txt"
    src.write_text(" ".join("".join(rng.choice(list("abcde"), rng.integers(1, 6))) for _ in range(3000)))
    learned = train_bpe([src.read_text()], 2000).vocab_size
    assert learned < 2000  # the text holds merges for fewer entries than asked: padding fills the rest
    info = common.padded_bpe_dataset(str(src), 2000, str(tmp_path / "data"))
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert info["vocab_size"] == meta["vocab_size"] == 2000
    added = [t["content"] for t in json.loads(meta["tokenizer"]["json"])["added_tokens"]]
    assert sum(a.startswith("<|reserved_") for a in added) == 2000 - learned
    ids = np.fromfile(tmp_path / "data" / meta["shards"]["train"][0]["file"], dtype=meta["dtype"])
    assert int(ids.max()) < learned  # the text never uses the reserved entries
    tok = tokenizer_from_meta(meta["tokenizer"])
    head = tok.decode(ids[:50].tolist())
    assert src.read_text().startswith(head) and len(head) > 50


def test_vocab_is_refused_beside_a_dataset_or_below_a_bpe(data: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        bench_llama.main(["--vocab", "100"])
    assert "257" in capsys.readouterr().err
    for where in (data, str(Path(data) / "not-yet")):
        with pytest.raises(SystemExit):
            bench_llama.main(["--vocab", "49152", "--data", where])
        assert "leave out one of them" in capsys.readouterr().err


def test_a_workers_json_line_is_read_through_terminal_resets() -> None:
    """Under Open MPI a 16-core node's ranks wrote "\\x1b[0m" resets on the worker's JSON
    line, and bench_node.py's rows of 4 and 16 ranks read as errors."""
    import common

    line = '\x1b[0m\x1b[0m{"ms": 1.5, "ranks": 16}\x1b[0m'
    got = common.run_json([sys.executable, "-c", f"print({line!r})"])
    assert got == {"ms": 1.5, "ranks": 16}
