"""Real text in: byte-level BPE and Hugging Face tokenizers, streamed corpora, token shards.

`numesh data bpe` is deterministic and its tokenizer round-trips every document; the shards
hold exactly each document's ids and an end-of-text token, split by documents, and read
back as one stream across shard boundaries; .txt (whole or split), .jsonl and .parquet
corpora, files, directories and globs; every bad input is a one-line error; a BPE dataset
trains, checkpoints and refuses to resume on another tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import cli, one_error_line
from numesh.base.errors import DataError
from numesh.data import sharded as TD
from numesh.data import shards as S
from numesh.data import tokenizer as TK
from numesh.data.batches import read_rows
from numesh.data.char import fallback_corpus, prepare_char_dataset
from numesh.data.corpus import Reading, expand
from numesh.data.dataset import bits_per_byte, bytes_per_token, load_split, load_tokenizer, open_dataset, verify_dataset
from numesh.data.tokenizer import EOT, HFTokenizer, tokenizer_from_meta, train_bpe

pytest.importorskip("tokenizers")

DOCS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "All:\nSpeak, speak.",
        "Ünïcödé — and emoji 🙂 survive bytes.", "  leading and trailing spaces  ", "tabs\tand\r\nCRLF",
        "short", "x" * 300, "The quick brown fox jumps over the lazy dog. " * 5]


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """The documents as a .txt file split on a blank-line separator."""
    p = tmp_path / "corpus.txt"
    p.write_text("\n\n".join(DOCS), encoding="utf-8")
    return p


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_bpe_twice_is_byte_identical_and_round_trips(tmp_path: Path) -> None:
    """On ~1 MB of real text: this Python's standard-library sources (the offline corpus)."""
    src = tmp_path / "stdlib.txt"
    src.write_text(fallback_corpus()[0], encoding="utf-8")
    how = Reading(split_on="\n\n")
    a = TD.prepare_bpe([src], 400, tmp_path / "a", how)
    TD.prepare_bpe([src], 400, tmp_path / "b", how)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    tok = load_tokenizer(tmp_path / "a")
    assert tok.kind == "hf" and tok.vocab_size == 400 == a["vocab_size"]
    docs = list(TD.corpus_documents(expand([src]), how))
    assert len(docs) > 3000
    for doc in docs:
        assert tok.decode(tok.encode(doc)) == doc


def _signalling_corpus(pulled: list[int]) -> Iterator[str]:
    """20,000 documents, each recorded in `pulled` as the tokenizer reads it, with a SIGINT
    to this process at the 100th and 20 s more of corpus after it, which an interrupted
    training never reads."""
    for i in range(20_000):
        if i == 100:
            os.kill(os.getpid(), signal.SIGINT)
        if i >= 100:
            time.sleep(0.001)
        pulled.append(i)
        yield f"document {i} of a corpus " * 3


def test_a_ctrl_c_stops_bpe_training_at_the_next_piece() -> None:
    """`tokenizers` pulls the corpus on threads of its own with the GIL released, and only
    the main thread runs Python's SIGINT handler: a Ctrl-C waited for the whole training
    pass (an hour on a large corpus). Now the main thread takes it at once and the corpus
    is read no further."""
    pulled: list[int] = []
    # Python's own handler, as `numesh data bpe` has it (a test before may have left another)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            train_bpe(_signalling_corpus(pulled), 300)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again
    finally:
        signal.signal(signal.SIGINT, before)
    assert len(pulled) < 10_000  # ~a second's pieces here; the bound leaves a loaded machine 10 s
    # the training thread ended before the interrupt went on (it was left running in Rust)
    assert not [t for t in threading.enumerate() if t.name == "numesh-bpe-train"]


def test_a_second_ctrl_c_leaves_at_once_and_one_delivered_twice_counts_once() -> None:
    stop, left, now = threading.Event(), [], [100.0]
    handler = TK.sigint_stops(stop, leave=lambda: left.append(now[0]), clock=lambda: now[0])
    handler(signal.SIGINT, None)
    now[0] += TK.REPEAT_S / 2  # the launcher's forward of the terminal's Ctrl-C
    handler(signal.SIGINT, None)
    assert stop.is_set() and not left
    now[0] += TK.REPEAT_S
    handler(signal.SIGINT, None)
    assert left == [now[0]]


def test_a_second_ctrl_c_ends_the_process_only_where_numesh_owns_it() -> None:
    """`numesh data bpe` (within `ctrl_c_may_exit`) leaves at once; a script's or notebook's
    call to train_bpe gets a KeyboardInterrupt, its process left to it."""
    assert TK.second_ctrl_c() is TK._raise_interrupt
    with TK.ctrl_c_may_exit():
        assert TK.second_ctrl_c() is TK._leave_at_once
    assert TK.second_ctrl_c() is TK._raise_interrupt
    with pytest.raises(KeyboardInterrupt):
        TK._raise_interrupt()


def test_a_callers_own_handler_raising_stops_the_feed_too() -> None:
    """A caller's SIGINT handler that raises KeyboardInterrupt is left in place; its
    interrupt stops the corpus's feed before it goes on (the thread read on, in the
    background, to the corpus's end)."""
    pulled: list[int] = []
    def own(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, own)
    try:
        with pytest.raises(KeyboardInterrupt):
            train_bpe(_signalling_corpus(pulled), 300)
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, before)
    for t in [t for t in threading.enumerate() if t.name == "numesh-bpe-train"]:
        t.join(30)  # the merges of what was read finish, then the thread ends
    assert len(pulled) < 10_000


def test_a_ctrl_c_during_bpe_training_exits_130_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    """A real `numesh data bpe`, Ctrl-C'd while its BPE trains. It exited 134, "FATAL:
    exception not rethrown", four times in five: Python 3.11's Thread.join, interrupted,
    took the training thread for ended, and Python exited with it inside `tokenizers`."""
    src = tmp_path / "big.txt"
    src.write_text(fallback_corpus()[0] * 4, encoding="utf-8")  # ~4 MB: seconds of training on 2 cores
    # SIGINT as a terminal's job has it: a shell's background job (a CI run started with `&`)
    # has it ignored, which a child inherits, and Python then installs no handler
    proc = subprocess.Popen([sys.executable, "-m", "numesh.cli.app", "data", "bpe", "--src", str(src),
                             "--vocab-size", "2000", "--out", str(tmp_path / "o")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith("training a byte-level BPE"):
                break
        time.sleep(0.5)  # the training thread well inside `tokenizers`
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest
    assert rest.splitlines()[-1:] == ["interrupted"] and "FATAL" not in rest, rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]  # no dataset, no staging directory


def test_shards_hold_each_document_then_eot_split_by_documents(corpus: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "SHARD_TOKENS", 17)  # many shards, documents across their ends
    tok = train_bpe(DOCS, 300)
    summary = TD.prepare_tokenized([corpus], tok, tmp_path / "d", Reading(split_on="\n\n"), val_fraction=0.3)
    want: dict[str, list] = {"train": [], "val": []}
    plan = TD.split_plan([corpus], Reading(split_on="\n\n"), 0.3)
    for i, doc in enumerate(DOCS):
        want["val" if plan.is_val(i) else "train"] += [*tok.encode(doc).tolist(), tok.eot_id]
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    for split in ("train", "val"):
        stream = load_split(tmp_path / "d", split)
        assert len(stream) == len(want[split]) == summary[f"{split}_tokens"]
        np.testing.assert_array_equal(stream[np.arange(len(stream))], want[split])
        assert len(meta["shards"][split]) == -(-len(want[split]) // 17)
        x, y = read_rows(stream, np.array([0, len(stream) - 9, 5]), 8)  # rows across shard ends
        np.testing.assert_array_equal(x[1], want[split][-9:-1])
        np.testing.assert_array_equal(y[2], want[split][6:14])
    assert meta["dtype"] == "uint16"
    assert meta["corpus"]["files"][0]["sha256"] and meta["corpus"]["files"][0]["bytes"] == corpus.stat().st_size
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == len(DOCS)
    assert tokenizer_from_meta(meta["tokenizer"]).sha256 == tok.sha256
    assert json.loads((tmp_path / "d" / "tokenizer.json").read_text()) == json.loads(tok.json_text)


def test_a_vocabulary_past_uint16_writes_uint32(tmp_path: Path) -> None:
    assert S.token_dtype(65536) == np.dtype("<u2")
    assert S.token_dtype(65537) == np.dtype("<u4")
    with pytest.raises(DataError, match="does not fit uint32"):
        S.token_dtype((1 << 32) + 1)


def test_jsonl_parquet_directories_and_globs(tmp_path: Path) -> None:
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(DOCS[:4])) + "\n\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[4:]}), d / "sub" / "b.parquet")
    (d / "sub" / "notes.md").write_text("not a corpus file")
    how = Reading(text_field="body")
    assert list(TD.corpus_documents(expand([d]), how)) == DOCS
    assert expand([str(d / "**" / "*.parquet")]) == [d / "sub" / "b.parquet"]
    assert expand([d / "a.jsonl", str(d / "*.jsonl")]) == [d / "a.jsonl"]  # each file once


def test_a_directory_leaves_out_hidden_files_and_folders(tmp_path: Path) -> None:
    """A corpus checked out with git, or edited in Jupyter: .git and .ipynb_checkpoints are
    not the corpus (a notebook's checkpoint copies would be read twice); a hidden file named
    on its own still is."""
    d = tmp_path / "corpus"
    for name in ("a.txt", "sub/b.txt", ".git/c.txt", ".ipynb_checkpoints/a-checkpoint.txt", ".notes.txt",
                 "sub/.d.txt"):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(name)
    assert expand([d]) == [d / "a.txt", d / "sub" / "b.txt"]
    assert expand([d / ".notes.txt", d / ".git"]) == [d / ".notes.txt", d / ".git" / "c.txt"]
    (d / "a.txt").unlink()
    (d / "sub" / "b.txt").unlink()
    with pytest.raises(DataError, match=r"holds no .txt, .jsonl, .parquet file \(hidden ones left out\)"):
        expand([d])


def test_a_byte_order_mark_starting_a_file_is_not_text(tmp_path: Path) -> None:
    """.txt and .jsonl files saved "UTF-8 with BOM": the mark was a character of the first
    document (and broke a .jsonl's first line); only a leading one is left out."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + "first\n\nsecond \ufeff kept".encode("utf-8"))
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    got = list(TD.corpus_documents([tmp_path / "a.txt", tmp_path / "b.jsonl"], Reading(split_on="\n\n")))
    assert got == ["first", "second \ufeff kept", "one", "two"]


def test_a_file_reached_twice_is_read_once(tmp_path: Path) -> None:
    """A symbolic link beside its target, or the same file spelled another way, is one file
    of the corpus, not its documents twice (in train and val both)."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("a")
    (d / "b.txt").symlink_to(d / "a.txt")
    (d / "c.txt").write_text("c")
    assert expand([d]) == [d / "a.txt", d / "c.txt"]
    assert expand([d / "c.txt", d / ".." / "corpus" / "c.txt", d]) == [d / "c.txt", d / "a.txt"]


@pytest.mark.parametrize("content, how, match", [
    ('{"text": "ok"}\n{"body": "no text"}\n', Reading(), r"b.jsonl:2 has no text field 'text'"),
    ('{"text": "ok"}\nnot json\n', Reading(), r"b.jsonl:2 is not valid JSON"),
])
def test_bad_jsonl_is_one_line_naming_the_line(tmp_path: Path, content: str, how: Reading, match: str) -> None:
    (tmp_path / "b.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        list(TD.corpus_documents(expand([tmp_path / "b.jsonl"]), how))


def test_bad_sources_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "empty").mkdir()
    for src, match in [(tmp_path / "nope.txt", "does not exist"), (tmp_path / "x.csv", "is not a"),
                       (tmp_path / "empty", "holds no"), (str(tmp_path / "*.none"), "no file matches")]:
        with pytest.raises(DataError, match=match):
            expand([src])
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match="has no column 'text'"):
        list(TD.corpus_documents([tmp_path / "c.parquet"], Reading()))


def _small_files(d: Path, n: int, prefix: str = "s") -> None:
    d.mkdir(exist_ok=True)
    for i in range(n):
        (d / f"{prefix}{i:02d}.txt").write_text(f"small document {i} of the corpus, " * 30, encoding="utf-8")


def test_val_holds_the_fraction_of_bytes_however_large_one_document(tmp_path: Path) -> None:
    """12 small files and a large one: val was the documents a hash of their index picked,
    and picked the large one (90% of the tokens); now it holds at most 10% of the bytes,
    short of that by less than the smallest train document, and the large one trains."""
    _small_files(tmp_path / "c", 12)
    (tmp_path / "c" / "s01a.txt").write_text("one large document " * 5000, encoding="utf-8")
    TD.prepare_tokenized([tmp_path / "c"], train_bpe(DOCS, 300), tmp_path / "d")
    splits = json.loads((tmp_path / "d" / "meta.json").read_text())["splits"]
    total = splits["train"]["bytes"] + splits["val"]["bytes"]
    assert total * 0.1 - 1050 < splits["val"]["bytes"] <= total * 0.1  # 1050: one small document's bytes
    assert splits["train"]["tokens"] > 8 * splits["val"]["tokens"]
    plan = TD.split_plan(expand([tmp_path / "c"]), Reading(), 0.1)
    assert not plan.is_val([p.name for p in expand([tmp_path / "c"])].index("s01a.txt"))


def test_adding_a_file_at_the_front_keeps_the_others_splits(tmp_path: Path) -> None:
    """A document's split follows a hash of its text, not its place in the corpus: a file
    sorted first moves at most one other document (where val's share fills up), where the
    index hash moved 6 of the 30."""
    _small_files(tmp_path / "c", 30)

    def val_names() -> set[str]:
        plan = TD.split_plan(expand([tmp_path / "c"]), Reading(), 0.2)
        return {p.name for i, p in enumerate(expand([tmp_path / "c"])) if plan.is_val(i)}

    before = val_names()
    (tmp_path / "c" / "a00.txt").write_text("a new first document, " * 45, encoding="utf-8")
    after = val_names() - {"a00.txt"}
    assert len(before) >= 4 and len(before ^ after) <= 1


def test_a_val_share_far_below_the_fraction_is_one_warning_line(tmp_path: Path) -> None:
    """One large document and two small ones cannot fill 10% of the bytes with whole
    documents: the dataset is written and a warning line says how much val holds."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "big.txt").write_text("one large document " * 500, encoding="utf-8")
    (tmp_path / "c" / "a.txt").write_text("small", encoding="utf-8")
    (tmp_path / "c" / "b.txt").write_text("tiny", encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text(train_bpe(DOCS, 300).json_text, encoding="utf-8")
    res = cli("data", "tokenize", "--tokenizer", str(tmp_path / "tokenizer.json"), "--src", str(tmp_path / "c"),
              "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.stderr
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: val holds 0.095% of the corpus's bytes, not the 10% --val-fraction asks: its "
                       "documents are too large to fill it whole (--split-on cuts .txt files into more)"]


def test_three_whole_files_none_of_which_fits_the_share_put_the_smallest_in_val(tmp_path: Path) -> None:
    """Each file is a third of the bytes, more than 10 %: the hash-ordered fill took none and
    refused a corpus the index hash had split (it always sent one of three to val). The
    smallest goes to val, and a warning line says how much more than the share it holds."""
    (tmp_path / "c").mkdir()
    for name, n in (("a.txt", 60), ("b.txt", 50), ("c.txt", 55)):
        (tmp_path / "c" / name).write_text(f"the text of {name} " * n, encoding="utf-8")
    (tmp_path / "tokenizer.json").write_text(train_bpe(DOCS, 300).json_text, encoding="utf-8")
    res = cli("data", "tokenize", "--tokenizer", str(tmp_path / "tokenizer.json"), "--src", str(tmp_path / "c"),
              "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.stderr
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (2, 1)
    assert meta["splits"]["val"]["bytes"] == len("the text of b.txt " * 50)
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "val holds 30% of the corpus's bytes, not the 10% --val-fraction" in warning[0]


def test_a_corpus_without_tokens_or_without_a_val_document_is_refused(tmp_path: Path) -> None:
    tok = train_bpe(DOCS, 300)
    (tmp_path / "blank.txt").write_text("\n\n\n\n")
    with pytest.raises(DataError, match="yields no tokens"):
        TD.prepare_tokenized([tmp_path / "blank.txt"], tok, tmp_path / "o1", Reading(split_on="\n\n"))
    (tmp_path / "two.txt").write_text("a first document\n\na second one")  # neither fits in 10% of the bytes
    with pytest.raises(DataError, match="the 2 documents leave the val split empty"):
        TD.prepare_tokenized([tmp_path / "two.txt"], tok, tmp_path / "o2", Reading(split_on="\n\n"))
    assert not (tmp_path / "o2" / "meta.json").exists()  # nothing a run could mistake for a dataset
    (tmp_path / "one.txt").write_text("a single document")
    with pytest.raises(DataError, match="one document of 17 characters, too short to split 1/99 by position"):
        TD.prepare_tokenized([tmp_path / "one.txt"], tok, tmp_path / "o3", val_fraction=0.99)


def test_tokenizer_files_and_vocab_sizes_are_checked(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(DataError, match=f"^{re.escape(str(tmp_path / 't.json'))}: not a Hugging Face tokenizer file"):
        HFTokenizer.from_file(tmp_path / "t.json")  # which file: a model directory's, for one
    tok = train_bpe(DOCS, 300)
    with pytest.raises(DataError, match="no end-of-text token '<eos>'"):
        HFTokenizer(tok.json_text, "<eos>")
    with pytest.raises(DataError, match="below the 257 entries"):
        train_bpe(DOCS, 100)
    assert HFTokenizer(tok.json_text).eot_id == tok.eot_id and EOT == tok.eot


def test_cli_bpe_then_tokenize_with_its_tokenizer(corpus: Path, tmp_path: Path) -> None:
    res = cli("data", "bpe", "--src", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "a"),
              "--split-on", "\n\n", "--val-fraction", "0.3")
    assert res.exit_code == 0, res.stderr
    res = cli("data", "tokenize", "--tokenizer", str(tmp_path / "a" / "tokenizer.json"), "--src", str(corpus),
              "--out", str(tmp_path / "b"), "--split-on", "\n\n", "--val-fraction", "0.3")
    assert res.exit_code == 0, res.stderr
    for split in ("train", "val"):  # the same tokenizer and corpus give the same shards
        name = f"{split}-00000.bin"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("args, match", [
    (["--src", "missing.txt", "--vocab-size", "300"], "does not exist"),
    (["--vocab-size", "50"], "below the 257 entries"),
    (["--vocab-size", "300", "--val-fraction", "1.5"], "between 0 and 1"),
])
def test_cli_bad_bpe_inputs_are_one_line(corpus: Path, tmp_path: Path, args: list[str], match: str) -> None:
    src = [] if "--src" in args else ["--src", str(corpus)]
    line = one_error_line(cli("data", "bpe", *src, *args, "--out", str(tmp_path / "o")))
    assert match in line


def test_a_bpe_dataset_trains_and_a_char_checkpoint_refuses_it(corpus: Path, char_dataset: Path,
                                                               tmp_path: Path) -> None:
    """Train, checkpoint, export, sample and resume checks go through the one tokenizer interface."""
    TD.prepare_bpe([corpus], 300, tmp_path / "bpe", Reading(split_on="\n\n"), val_fraction=0.3)
    res = cli("train", "--data", str(tmp_path / "bpe"), "--out", str(tmp_path / "run"), "--max-iters", "2",
              "--block-size", "8", "--batch-size", "2", "--eval-iters", "1", "--n-layer", "1", "--n-embd", "16",
              "--n-head", "2")
    assert res.exit_code == 0, res.stderr
    meta = json.loads((tmp_path / "run" / "ckpt" / "latest" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "hf" and meta["tokenizer"]["vocab_size"] == 300
    exported = tmp_path / "m.safetensors"  # the nanoGPT file carries the BPE tokenizer too
    assert cli("export", str(tmp_path / "run" / "ckpt" / "latest"), "--out", str(exported)).exit_code == 0
    args = ["--prompt", "All:\nSpeak", "--max-new-tokens", "8", "--temperature", "0"]
    from_file = cli("sample", "--ckpt", str(exported), *args)
    assert from_file.exit_code == 0, from_file.stderr
    assert from_file.stdout == cli("sample", "--ckpt", str(tmp_path / "run" / "ckpt" / "latest"), *args).stdout
    assert from_file.stdout.startswith("All:\nSpeak")
    ckpt = str(tmp_path / "run" / "ckpt" / "latest")
    line = one_error_line(cli("train", "--data", str(char_dataset), "--resume", ckpt, "--out", str(tmp_path / "run2"),
                              "--max-iters", "3"))
    assert "another vocabulary" in line and "hf tokenizer in the checkpoint" in line


def test_bytes_per_token_and_bits_per_byte(tmp_path: Path, corpus: Path) -> None:
    """Char datasets count each character's UTF-8 bytes; sharded ones record them."""
    text = "aé🙂\n" * 50 + "b" * 40
    prepare_char_dataset(text, tmp_path / "c")
    got = bytes_per_token(tmp_path / "c")
    for split in ("train", "val"):
        ids = np.asarray(load_split(tmp_path / "c", split))
        chars = load_tokenizer(tmp_path / "c").decode(ids)
        assert got[split] == pytest.approx(len(chars.encode("utf-8")) / len(ids), rel=1e-12)
    TD.prepare_bpe([corpus], 300, tmp_path / "b", Reading(split_on="\n\n"), val_fraction=0.3)
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    bpt = bytes_per_token(tmp_path / "b")
    assert bpt["val"] == meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"]
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == sum(len(d.encode()) for d in DOCS)
    assert bits_per_byte(np.log(2) * 3.0, 1.5) == pytest.approx(2.0)


def test_metrics_and_plot_carry_bits_per_byte(char_dataset: Path, tmp_path: Path) -> None:
    from numesh.run.plot import build_figure, read_metrics

    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "run"), "--max-iters", "2",
              "--eval-interval", "1", "--eval-iters", "1", "--block-size", "8", "--batch-size", "2", "--n-layer", "1",
              "--n-embd", "16", "--n-head", "2")
    assert res.exit_code == 0, res.stderr
    bpt = bytes_per_token(char_dataset)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    assert evals
    for r in evals:
        for split in ("train", "val"):
            assert r[f"{split}_bpb"] == pytest.approx(r[f"{split}_loss"] / (np.log(2) * bpt[split]), rel=1e-12)
    pytest.importorskip("matplotlib")
    fig = build_figure([read_metrics(tmp_path / "run")])
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "val bits/byte", "tokens/s"]


def test_token_files_that_disagree_with_meta_json_are_refused(char_dataset: Path, tmp_path: Path) -> None:
    """A char dataset rewrite killed midway leaves new token files beside the old
    meta.json: the count check refuses it in one line instead of training on it."""
    from numesh.base.errors import DataError

    train = char_dataset / "train.bin"
    train.write_bytes(train.read_bytes() * 2)
    with pytest.raises(DataError, match="partly rewritten"):
        load_split(char_dataset, "train")
    line = one_error_line(cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--max-iters", "1"))
    assert "holds" in line and "but" in line and "partly rewritten" in line


def test_resume_keeps_each_step_once_in_the_metrics(char_dataset: Path, tmp_path: Path) -> None:
    """A run that died after its checkpoint logged steps the resumed run logs again: resume
    drops the lines from the checkpoint's step on (and a line cut off by the crash)."""
    base = ["--data", str(char_dataset), "--out", str(tmp_path / "run"), "--block-size", "8", "--batch-size", "2",
            "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--eval-interval", "100", "--eval-iters", "1"]
    assert cli("train", *base, "--max-iters", "4", "--ckpt-interval", "2").exit_code == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:  # what a crash after step 4's save would have left: steps past it, a cut line
        f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')
    res = cli("train", *base, "--max-iters", "7", "--resume", str(tmp_path / "run" / "ckpt" / "step_000002"))
    assert res.exit_code == 0, res.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    train_steps = [s for s in steps if s < 7]
    assert train_steps == sorted(set(train_steps)) and train_steps[0] == 0 and max(steps) == 7


# ---------------------------------------------------------------- datasets checked when read


def test_a_meta_json_naming_files_outside_its_directory_is_refused(corpus: Path, tmp_path: Path) -> None:
    TD.prepare_bpe([corpus], 300, tmp_path / "d", Reading(split_on="\n\n"), val_fraction=0.3)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    meta.pop("files", None)  # as written before the records
    meta["shards"]["train"][0]["file"] = "../secret.bin"
    (tmp_path / "d" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="names a file '../secret.bin' outside the dataset directory"):
        open_dataset(tmp_path / "d")


def test_ranks_that_opened_different_datasets_refuse_to_train(char_dataset: Path, tmp_path: Path) -> None:
    """A rewrite as a job starts could give its ranks different data: every rank compares
    the meta.json it opened with rank 0's."""
    from numesh.run.train import open_run_dataset

    class TwoRanks:  # rank 1 of 2, whose peer opened another meta.json
        def Get_rank(self) -> int:
            return 1

        def Get_size(self) -> int:
            return 2

        def allgather(self, mine: tuple) -> list:
            return [(None, "0" * 64), mine]

    with pytest.raises(DataError, match="the ranks opened different versions"):
        open_run_dataset(str(char_dataset), TwoRanks())
    from mpi4py import MPI

    assert open_run_dataset(str(char_dataset), MPI.COMM_SELF).tokenizer.vocab_size > 0


# ---------------------------------------------------------------- sharded datasets written whole, checked when read


def test_shards_and_tokenizer_json_are_recorded_and_a_changed_shard_is_caught(corpus: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    monkeypatch.setattr(S, "SHARD_TOKENS", 17)
    out = tmp_path / "d"
    assert cli("data", "bpe", "--src", str(corpus), "--vocab-size", "300", "--out", str(out), "--split-on", "\n\n",
               "--val-fraction", "0.3").exit_code == 0
    meta = json.loads((out / "meta.json").read_text())
    shards = [s["file"] for split in ("train", "val") for s in meta["shards"][split]]
    assert sorted(meta["files"]) == sorted([*shards, "tokenizer.json"]) and len(shards) > 4
    for name, rec in meta["files"].items():
        raw = (out / name).read_bytes()
        assert rec["bytes"] == len(raw) and rec["sha256"] == hashlib.sha256(raw).hexdigest()
    assert meta["rebuild"] == f"numesh data bpe --vocab-size 300 --src {corpus} --split-on $'\\n\\n' --val-fraction 0.3"
    verify_dataset(out)
    ids = np.fromfile(out / shards[1], np.uint16)
    ids[0] = (ids[0] + 1) % 300
    ids.tofile(out / shards[1])
    line = one_error_line(cli("train", "--data", str(out), "--out", str(tmp_path / "run"), "--max-iters", "1",
                              "--block-size", "8"))
    assert f"{out / shards[1]} does not match its sha256" in line and f"{meta['rebuild']} --out {out}" in line
    (out / shards[2]).unlink()
    with pytest.raises(DataError, match=f"{shards[2]} is missing"):
        open_dataset(out)


def test_a_bpe_dataset_of_other_inputs_needs_overwrite_before_the_corpus_is_read(corpus: Path, tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    out = tmp_path / "d"
    args = ["--vocab-size", "300", "--out", str(out), "--split-on", "\n\n", "--val-fraction", "0.3"]
    assert cli("data", "bpe", "--src", str(corpus), *args).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli("data", "bpe", "--src", str(corpus), *args).exit_code == 0  # the same again: fine
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(DOCS[::-1]), encoding="utf-8")
    monkeypatch.setattr(TD, "train_bpe", lambda *a: pytest.fail("the corpus was read before refusing"))
    line = one_error_line(cli("data", "bpe", "--src", str(other), *args))
    assert "already holds a dataset with other inputs" in line and "--overwrite" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    tok = HFTokenizer.from_file(out / "tokenizer.json")
    line = one_error_line(cli("data", "tokenize", "--tokenizer", str(out / "tokenizer.json"), "--src", str(other),
                              "--out", str(out), "--split-on", "\n\n", "--val-fraction", "0.3"))
    assert "--overwrite" in line
    TD.prepare_tokenized([other], tok, out, Reading(split_on="\n\n"), val_fraction=0.3, overwrite=True)
    assert json.loads((out / "meta.json").read_text())["corpus"]["files"][0]["path"] == str(other)


@pytest.mark.parametrize("args, match", [
    (["--split-on", ""], "--split-on is empty"),
    (["--text-field", ""], "--text-field is empty"),
    (["--val-fraction", "nan"], "between 0 and 1, got nan"),
])
def test_empty_or_nan_reading_options_are_one_line(corpus: Path, tmp_path: Path, args: list[str], match: str) -> None:
    """--split-on "" was a ValueError traceback (an empty separator) after training the BPE."""
    for cmd in (["bpe", "--vocab-size", "300"], ["tokenize", "--tokenizer", str(tmp_path / "t.json")]):
        if cmd[0] == "tokenize":
            (tmp_path / "t.json").write_text(train_bpe(DOCS, 300).json_text)
        line = one_error_line(cli("data", *cmd, "--src", str(corpus), "--out", str(tmp_path / "o"), *args))
        assert match in line
    assert not (tmp_path / "o").exists()


def test_a_corpus_file_written_to_while_it_is_tokenised_is_refused(corpus: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """meta.json records each corpus file's sha256: a file appended to mid-read would make
    it describe another text than the one tokenised."""
    read = TD.corpus_documents

    def appending(paths, how):
        for i, doc in enumerate(read(paths, how)):
            if i == 1:
                with open(corpus, "a", encoding="utf-8") as f:
                    f.write("\n\nmore text from another process")
            yield doc

    monkeypatch.setattr(TD, "corpus_documents", appending)
    with pytest.raises(DataError, match=f"{corpus} changed while it was read"):
        TD.prepare_tokenized([corpus], train_bpe(DOCS, 300), tmp_path / "d", Reading(split_on="\n\n"),
                             val_fraction=0.3)
    assert not (tmp_path / "d").exists()


def test_a_crlf_file_splits_on_a_blank_line_and_keeps_its_bytes(tmp_path: Path) -> None:
    """A Windows-edited corpus: `--split-on $'\\n\\n'` splits it on its CRLF blank lines too,
    across read chunks, and each document keeps its own CRLFs (issue 44)."""
    docs = ["line one\r\nline two", "second", "third\r\nwith\r\nlines"] * 300
    src = tmp_path / "crlf.txt"
    src.write_bytes("\r\n\r\n".join(docs).encode("utf-8"))
    got = list(TD.corpus_documents(expand([src]), Reading(split_on="\n\n")))
    assert got == docs


def test_a_document_quoting_the_end_of_text_string_stays_one_document(tmp_path: Path) -> None:
    """Text that contains `<|endoftext|>` is encoded as text: the shards hold exactly one
    end-of-text id per document, and the document decodes back whole (issue 44)."""
    docs = [f"doc {i} says {EOT} in the middle and ends with {EOT}" for i in range(12)]
    src = tmp_path / "quoted.txt"
    src.write_text("\n\n".join(docs), encoding="utf-8")
    tok = train_bpe(docs, 300)
    summary = TD.prepare_tokenized([src], tok, tmp_path / "d", Reading(split_on="\n\n"), val_fraction=0.25)
    ids = np.concatenate([np.asarray(load_split(tmp_path / "d", s)[np.arange(summary[f"{s}_tokens"])])
                          for s in ("train", "val")])
    assert int((ids == tok.eot_id).sum()) == len(docs)
    assert tok.decode(tok.encode_batch([docs[0]])[0]) == docs[0]


def test_a_vocab_size_past_what_the_corpus_holds_warns_records_and_reruns(corpus: Path, tmp_path: Path) -> None:
    """Asked 100,000 of a small corpus: one warning line with both sizes, meta.json keeps
    what was asked, and the identical command (the one meta.json records) runs again."""
    args = ["data", "bpe", "--src", str(corpus), "--vocab-size", "100000", "--out", str(tmp_path / "d"),
            "--split-on", "\n\n", "--val-fraction", "0.3"]
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["vocab_size"] < 1000 and meta["vocab_size_asked"] == 100000
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"{meta['vocab_size']:,}" in warnings[0] and "100,000" in warnings[0]
    before = _files(tmp_path / "d")
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    assert _files(tmp_path / "d") == before
    assert "--vocab-size 100000" in meta["rebuild"]
    res = cli(*[a if a != "100000" else "99999" for a in args])  # another size asked is other inputs
    assert res.exit_code == 2 and "pass --overwrite" in res.stderr


def test_a_single_text_file_splits_90_10_by_position(tmp_path: Path) -> None:
    """nanoGPT's prepare on its one input.txt: the first 90% of the characters train, the
    rest validate, and the summary line and meta.json say so."""
    text = "\n\n".join(DOCS) * 3
    src = tmp_path / "input.txt"
    src.write_text(text, encoding="utf-8")
    res = cli("data", "bpe", "--src", str(src), "--vocab-size", "300", "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.stderr
    assert "one document split 90/10 by position" in res.stderr.splitlines()[-1]
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["corpus"]["split"] == "position" and meta["splits"]["val"]["documents"] == 1
    tok, cut = load_tokenizer(tmp_path / "d"), int(len(text) * 0.9)
    for split, want in (("train", text[:cut]), ("val", text[cut:])):
        ids = np.asarray(load_split(tmp_path / "d", split))
        assert ids[-1] == tok.eot_id and tok.decode(ids[:-1]) == want
    summary = TD.prepare_bpe([src], 300, tmp_path / "d", Reading(split_on="\n\n"), val_fraction=0.3,
                             overwrite=True)
    assert summary["split"] == "documents"
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["corpus"]["split"] == "documents"


def test_an_empty_split_is_refused_before_the_tokenizer_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 33 MB corpus used to train for minutes before this was found: now no training starts;
    and the training pass is announced with the size of the text it reads."""
    (tmp_path / "two.txt").write_text("a first document\n\na second one")

    def no_training(*a, **k):
        raise AssertionError("the tokenizer trained before the split was checked")

    monkeypatch.setattr(TD, "train_bpe", no_training)
    line = one_error_line(cli("data", "bpe", "--src", str(tmp_path / "two.txt"), "--split-on", "\n\n",
                              "--vocab-size", "300", "--out", str(tmp_path / "o")))
    assert "the 2 documents leave the val split empty" in line
    monkeypatch.undo()
    (tmp_path / "two.txt").write_text("a first document\n\na second one\n\n" * 10)
    res = cli("data", "bpe", "--src", str(tmp_path / "two.txt"), "--split-on", "\n\n", "--vocab-size", "300",
              "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.stderr
    assert "training a byte-level BPE of 300 entries on 0.3 kB of text (1 file;" in res.stderr


def _long_text() -> str:
    """~200 kB of text that has it all: words, long whitespace, a 5,000-character word and
    a 3,000-space run, several TEXT_PIECEs long."""
    words = fallback_corpus()[0][:150_000]
    return words + " " + "ab" * 2_500 + " tail" + " " * 3_000 + "end\n" + words[:40_000]


def test_text_pieces_cut_between_words_and_long_runs_alone() -> None:
    """The pieces make the text again; none is much longer than TEXT_PIECE; no run longer
    than MAX_RUN survives; and away from such runs the byte-level pre-tokens (the words a
    BPE trains on and encodes) of the pieces are exactly the whole text's."""
    from tokenizers import pre_tokenizers

    words = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text = _long_text()
    pieces = list(TK.text_pieces(text))
    assert "".join(pieces) == text and len(pieces) > 4
    assert max(map(len, pieces)) <= TK.TEXT_PIECE
    assert all(len(w) <= TK.MAX_RUN for p in pieces for w, _ in words.pre_tokenize_str(p))
    plain = fallback_corpus()[0][:300_000]
    cut = list(TK.text_pieces(plain))
    assert len(cut) > 4 and [w for p in cut for w, _ in words.pre_tokenize_str(p)] == [
        w for w, _ in words.pre_tokenize_str(plain)]
    assert list(TK.text_pieces("short")) == ["short"]


def test_a_text_cut_in_pieces_trains_and_encodes_as_the_whole_text() -> None:
    """A 300 kB document without long runs: the BPE trained on its pieces is byte for byte
    the one trained on the whole, and the shards hold the whole text's ids."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = fallback_corpus()[0][:300_000]
    raw = Raw(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, special_tokens=[EOT], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = train_bpe([text], 400)
    assert tok.json_text == raw.to_str() and tok.cuts_between_words
    writers = {"train": _Collect(), "val": _Collect()}
    TD._tokenize(iter([("train", text)]), [], tok, writers, None)
    assert writers["train"].ids == [*tok.encode_batch([text])[0].tolist(), tok.eot_id]


class _Collect:
    """A ShardWriter's `add`, into a list."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def add(self, ids: np.ndarray) -> None:
        self.ids += np.asarray(ids).tolist()


def test_a_line_of_megabytes_without_a_space_makes_a_dataset(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 MB line without whitespace was one 2 MB word for BPE training, which merges it in
    time quadratic in its length and memory many times it (a 33 MB one took 5.4 GB and
    minutes). Cut into 1,000-character words it trains and tokenises as any 2 MB text;
    the shards decode back to the line, and no batch encoding held more than BATCH_CHARS."""
    line = "".join(np.random.default_rng(0).choice(list("abcdefghij"), 2_000_000))
    src = tmp_path / "line.txt"
    src.write_text(line, encoding="utf-8")
    held = []
    encode = HFTokenizer.encode_batch

    def measured(self: HFTokenizer, texts: list[str]) -> list[np.ndarray]:
        held.append(sum(map(len, texts)))
        return encode(self, texts)

    monkeypatch.setattr(HFTokenizer, "encode_batch", measured)
    summary = TD.prepare_bpe([src], 300, tmp_path / "d")
    assert summary["split"] == "position" and summary["vocab_size"] == 300
    tok, cut = load_tokenizer(tmp_path / "d"), int(len(line) * 0.9)
    for split, want in (("train", line[:cut]), ("val", line[cut:])):
        ids = np.asarray(load_split(tmp_path / "d", split))
        assert ids[-1] == tok.eot_id and tok.decode(ids[:-1]) == want
    assert len(held) > 1 and max(held) < TD.BATCH_CHARS + TK.TEXT_PIECE


# ---------------------------------------------------------------------------------------
# a tokenizer whose post-processor frames a text (Llama's `<s> $A`): documents framed so


def _with_template(tok: HFTokenizer, single: str | None) -> HFTokenizer:
    """`tok` with a start token `<s>` added and `single` as its TemplateProcessing template
    (None: GPT-2's ByteLevel post-processor, which adds no token)."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import processors

    raw = Raw.from_str(tok.json_text)
    raw.add_special_tokens(["<s>"])
    raw.post_processor = (processors.ByteLevel(trim_offsets=True) if single is None else processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", raw.token_to_id("<s>")), (EOT, raw.token_to_id(EOT))]))
    return HFTokenizer(raw.to_str())


def _stream(d: Path, split: str) -> list[int]:
    stream = load_split(d, split)
    return np.asarray(stream[np.arange(len(stream))]).tolist()


@pytest.mark.parametrize("single, start, end", [("<s> $A", ["<s>"], []), (f"$A {EOT}", [], [EOT]),
                                                (f"<s> $A {EOT}", ["<s>"], [EOT])], ids=["bos", "eos", "bos-eos"])
def test_documents_are_framed_as_the_tokenizer_frames_a_text(single: str, start: list[str], end: list[str],
                                                            corpus: Path, tmp_path: Path) -> None:
    """Each document's ids are the tokenizer's default encoding of it (`<s>` first for
    Llama's template), then one end-of-text token (not two when the template ends with
    it); meta.json records the template's ids."""
    tok = _with_template(train_bpe(DOCS, 300), single)
    TD.prepare_tokenized([corpus], tok, tmp_path / "d", Reading(split_on="\n\n"), val_fraction=0.3)
    start_ids, end_ids = ([tok._tok.token_to_id(t) for t in ts] for ts in (start, end))
    want: dict[str, list] = {"train": [], "val": []}
    plan = TD.split_plan([corpus], Reading(split_on="\n\n"), 0.3)
    for i, doc in enumerate(DOCS):
        framed = tok.encode_default(doc).tolist()
        assert framed == [*start_ids, *tok.encode(doc).tolist(), *end_ids]
        want["val" if plan.is_val(i) else "train"] += [*start_ids, *tok.encode(doc).tolist(), tok.eot_id]
    for split in ("train", "val"):
        assert _stream(tmp_path / "d", split) == want[split]
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["template"] == {"start": start_ids, "end": end_ids}


def test_a_tokenizer_without_a_template_writes_the_same_bytes(corpus: Path, tmp_path: Path) -> None:
    """GPT-2's ByteLevel post-processor adds no token: the shards are byte for byte those of
    the same tokenizer without a post-processor (each document's ids, then end-of-text),
    and meta.json has no template record, as datasets always were."""
    plain = train_bpe(DOCS, 300)
    for name, tok in (("plain", plain), ("bytelevel", _with_template(plain, None))):
        assert tok.template == ((), ())
        TD.prepare_tokenized([corpus], tok, tmp_path / name, Reading(split_on="\n\n"), val_fraction=0.3)
        assert "template" not in json.loads((tmp_path / name / "meta.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "plain").glob("*.bin"))
    assert shards and all((tmp_path / "plain" / s).read_bytes() == (tmp_path / "bytelevel" / s).read_bytes()
                          for s in shards)


def test_a_document_cut_in_pieces_gets_one_start_token() -> None:
    """A document tokenised in pieces (`text_pieces`) is framed once: `<s>` before its
    first piece only, one end-of-text after its last."""
    text = fallback_corpus()[0][:150_000]
    tok = _with_template(train_bpe([text], 300), "<s> $A")
    assert tok.cuts_between_words and len(list(TK.text_pieces(text))) > 1
    writers = {"train": _Collect(), "val": _Collect()}
    TD._tokenize(iter([("train", text), ("train", "short")]), [], tok, writers, None)
    bos = tok._tok.token_to_id("<s>")
    assert writers["train"].ids == [bos, *tok.encode_batch([text])[0].tolist(), tok.eot_id,
                                    bos, *tok.encode("short").tolist(), tok.eot_id]


def test_a_dataset_written_before_documents_were_framed_needs_overwrite(corpus: Path, tmp_path: Path) -> None:
    """The same inputs as a dataset whose documents lack the template's `<s>` (an older
    numesh's, its meta.json without the record): refused in one line before the corpus is
    read, replaced with --overwrite."""
    tok = _with_template(train_bpe(DOCS, 300), "<s> $A")
    d, how = tmp_path / "d", Reading(split_on="\n\n")
    TD.prepare_tokenized([corpus], tok, d, how)
    meta = json.loads((d / "meta.json").read_text())
    del meta["template"]
    (d / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(DataError, match="documents without the start and end tokens its tokenizer's") as e:
        TD.prepare_tokenized([corpus], tok, d, how)
    assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    TD.prepare_tokenized([corpus], tok, d, how, overwrite=True)
    assert json.loads((d / "meta.json").read_text())["template"] == {"start": [tok._tok.token_to_id("<s>")],
                                                                    "end": []}
    # a template that only ends a text with the end-of-text token frames documents as always:
    # an older dataset of it holds the same ids and is not refused
    eos_only, e = _with_template(train_bpe(DOCS, 300), f"$A {EOT}"), tmp_path / "e"
    TD.prepare_tokenized([corpus], eos_only, e, how)
    meta = json.loads((e / "meta.json").read_text())
    del meta["template"]
    (e / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    TD.prepare_tokenized([corpus], eos_only, e, how)


# ---------------------------------------------------------------------------------------
# inputs a user gets wrong, each one line


def test_corpus_inputs_a_user_gets_wrong_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpaired surrogate (a JSON escape of half a character, which no UTF-8 encodes) or
    a non-text field in a JSONL record, an empty --src, and an --out that cannot be written
    (found before the BPE is trained, not after): each a one-line DataError saying what to
    change. A file whose name looks like a glob is itself."""
    cases = {"s.jsonl": ('{"text": "a\\ud800b"}\n', "s.jsonl:1 holds an unpaired surrogate"),
             "n.jsonl": ('{"text": 42}\n', "n.jsonl:1: field 'text' holds int, not text")}
    for name, (text, says) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(DataError, match=re.escape(says)) as e:
            TD.prepare_bpe([tmp_path / name], 260, tmp_path / f"out-{name}")
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="--src is empty"):
        expand([""])
    literal = tmp_path / "notes[1].txt"
    literal.write_text("to be or not to be\n" * 50, encoding="utf-8")
    assert expand([literal]) == [literal]
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setattr(TD, "train_bpe", lambda *a, **k: pytest.fail("trained before finding --out unwritable"))
    with pytest.raises(DataError, match="a-file is a file, not a directory: choose another --out"):
        TD.prepare_bpe([literal], 260, tmp_path / "a-file" / "ds")


def test_a_tokenizer_that_cannot_encode_is_one_line(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Raw
    from tokenizers import models

    broken = Raw(models.WordLevel({EOT: 0, "the": 1}, unk_token="[UNK]"))  # its unk token is not in its vocabulary
    with pytest.raises(DataError, match="the tokenizer cannot encode a text"):
        HFTokenizer(broken.to_str()).template


def test_a_split_of_one_token_is_refused_as_a_character_dataset_s_is(tmp_path: Path) -> None:
    """A tokenizer that drops whitespace left val only its end-of-text token (31 / 1 tokens)
    and the dataset was written; now, as `numesh data char` refuses a split under 2 tokens,
    one line says what to change and nothing is left behind."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import models, pre_tokenizers

    words = Raw(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, EOT: 4}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # "   " encodes to no ids
    (tmp_path / "tok.json").write_text(words.to_str())
    (tmp_path / "one.txt").write_text("the cat sat " * 10 + " " * 15)  # its last 10% by position: spaces
    res = cli("data", "tokenize", "--tokenizer", str(tmp_path / "tok.json"), "--src", str(tmp_path / "one.txt"),
              "--out", str(tmp_path / "o"))
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]  # after the progress bar
    assert res.exit_code == 2 and errors == [res.stderr.splitlines()[-1]], res.stderr
    assert errors[0] == ("error: the val split holds 1 token, the end-of-text token after a document this tokenizer "
                    "encodes to no ids, and a split needs 2 or more (an input and its target): raise "
                    "--val-fraction 0.1, or give the corpus text the tokenizer encodes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.txt", "tok.json"]


def test_the_train_hint_is_quoted_for_the_shell(tmp_path: Path) -> None:
    src = tmp_path / "my file.txt"
    src.write_text("to be or not to be\n" * 200, encoding="utf-8")
    res = cli("data", "char", "--src", str(src), "--out", str(tmp_path / "c sp"))
    assert res.exit_code == 0, res.stderr
    assert f"numesh train --data '{tmp_path / 'c sp'}'" in res.stderr
