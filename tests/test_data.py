"""Tests for numesh.data: tokenizer, dataset files, download handling, mesh-independent batches."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from conftest import cli, one_error_line
from numesh.base.errors import DataError
from numesh.data import char as char_data
from numesh.data import dataset as opened
from numesh.data import shards as shards
from numesh.data.batches import batch_offsets, eval_key, local_batch, read_rows, train_key
from numesh.data.char import prepare_char_dataset, read_source
from numesh.data.dataset import load_split, load_tokenizer
from numesh.data.tokenizer import CharTokenizer

SHARED_CORPUS = Path("/work/shared/data/tinyshakespeare.txt")

SYNTH = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
) * 20 + "Zounds! é ü — the end.\n"


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    prepare_char_dataset(SYNTH, out)
    return out


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_sorted_vocab_and_round_trip() -> None:
    tok = CharTokenizer.from_text(SYNTH)
    assert list(tok.chars) == sorted(set(SYNTH))
    assert tok.vocab_size == len(set(SYNTH))
    ids = tok.encode(SYNTH)
    assert ids.dtype == np.uint16 and ids.shape == (len(SYNTH),)
    assert tok.decode(ids) == SYNTH
    assert tok.decode(ids.tolist()) == SYNTH
    # ids are the position in the sorted vocabulary
    assert [tok.chars[i] for i in ids[:20]] == list(SYNTH[:20])
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""


def test_tokenizer_meta_round_trip() -> None:
    tok = CharTokenizer.from_text(SYNTH)
    meta = json.loads(json.dumps(tok.to_meta()))
    assert meta["vocab_size"] == tok.vocab_size
    assert all(isinstance(c, str) and len(c) == 1 for c in meta["chars"])
    assert CharTokenizer.from_meta(meta) == tok
    with pytest.raises(DataError):
        CharTokenizer.from_meta({"vocab_size": 3, "chars": ["a", "b"]})


def test_encode_unknown_char_raises_naming_it() -> None:
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match="'z'"):
        tok.encode("abzc")
    with pytest.raises(DataError):
        tok.decode([0, 3])


def test_tokenizer_rejects_bad_vocab() -> None:
    with pytest.raises(DataError):
        CharTokenizer(("a", "a"))
    with pytest.raises(DataError):
        CharTokenizer(("ab",))
    with pytest.raises(DataError):
        CharTokenizer.from_text("")


# ---------------------------------------------------------------- dataset files


def _check_prepared(text: str, out: Path, summary: dict) -> CharTokenizer:
    n = len(text)
    n_train = int(0.9 * n)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert len(train) == n_train and len(val) == n - n_train
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    assert meta["train_tokens"] == n_train and meta["val_tokens"] == n - n_train
    tok = load_tokenizer(out)
    assert tok.vocab_size == meta["vocab_size"] == summary["vocab_size"]
    assert tok.decode(np.concatenate([train, val])) == text
    assert summary["train_tokens"] == n_train and summary["val_tokens"] == n - n_train
    assert Path(summary["out_dir"]) == out
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    return tok


def test_prepare_synthetic(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "ds"  # out_dir is created, parents included
    summary = prepare_char_dataset(SYNTH, out)
    _check_prepared(SYNTH, out, summary)
    train = load_split(out, "train")
    assert isinstance(train, shards.TokenStream) and train.dtype == np.uint16  # read at offsets, never memory-mapped
    assert len(train) == summary["train_tokens"]
    assert len(load_split(out, "val")) == summary["val_tokens"]


@pytest.mark.skipif(not SHARED_CORPUS.is_file(), reason=f"shared corpus {SHARED_CORPUS} not present")
def test_prepare_real_corpus(tmp_path: Path) -> None:
    text = read_source(SHARED_CORPUS)
    assert len(text) == 1_115_394
    summary = prepare_char_dataset(text, tmp_path / "sc")
    tok = _check_prepared(text, tmp_path / "sc", summary)
    assert tok.vocab_size == 65
    assert summary["train_tokens"] == 1_003_854 and summary["val_tokens"] == 111_540


@pytest.mark.parametrize("text, splits", [("a", "train 0, val 1"), ("abc", "train 2, val 1"),
                                          ("\n\n", "train 1, val 1"), ("abcdefghij", "train 9, val 1")])
def test_prepare_too_short_text(tmp_path: Path, text: str, splits: str) -> None:
    """A split under 2 tokens (an input and its target) is one no run can use: all but "a"
    were written."""
    with pytest.raises(DataError, match=f"^text of {len(text)} characters is too short to split 90/10 into splits of "
                                        f"2 tokens or more \\({splits}\\): use a longer text$"):
        prepare_char_dataset(text, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert prepare_char_dataset("abcdefghijk", tmp_path / "y")["val_tokens"] == 2  # 11 characters: the fewest


def test_missing_dataset_hint(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=r"no dataset at .*nope: run `numesh data shakespeare-char --out"):
        load_tokenizer(missing)
    with pytest.raises(DataError, match="numesh data shakespeare-char"):
        load_split(missing, "train")
    text = tmp_path / "my text.txt"  # --data naming the text itself: the hint's `--out FILE` failed on it
    text.write_text("hello world\n")
    with pytest.raises(DataError, match=re.escape(f"is a file: --data takes a dataset directory; make one from it "
                                                  f"with `numesh data char --src '{text}' --out DIR`")):
        load_tokenizer(text)
    # a BPE recipe's data directory (configs/gpt2.toml's data/sh8k) is not only a character one
    with pytest.raises(DataError, match=r"or `numesh data bpe --src FILE --vocab-size N --out .*nope` for a BPE"):
        load_tokenizer(missing)


def test_load_split_unknown_split(dataset: Path) -> None:
    with pytest.raises(DataError, match="unknown split"):
        load_split(dataset, "test")


# ---------------------------------------------------------------- read_source


def test_read_source_file(tmp_path: Path) -> None:
    f = tmp_path / "in.txt"
    f.write_text(SYNTH, encoding="utf-8")
    assert read_source(f) == SYNTH
    assert read_source(str(f)) == SYNTH


def test_read_source_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_source(tmp_path / "missing.txt")


def test_read_source_download_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(char_data.urllib.request, "urlopen", fail)
    with pytest.raises(DataError, match="--src") as info:
        read_source(None)
    assert "failed" in str(info.value)


def test_read_source_download_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args, **kwargs):
        raise TimeoutError("timed out")

    monkeypatch.setattr(char_data.urllib.request, "urlopen", slow)
    with pytest.raises(DataError, match="--src"):
        read_source(None)


class _FakeResponse:
    def __init__(self, body: bytes) -> None:
        self._body = body
        self._pos = 0
        self.headers = {"Content-Length": str(len(body))}

    def read(self, n: int) -> bytes:
        chunk = self._body[self._pos : self._pos + n]
        self._pos += len(chunk)
        return chunk

    def __enter__(self) -> "_FakeResponse":
        return self

    def __exit__(self, *exc) -> None:
        return None


def test_read_source_checksum_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(char_data.urllib.request, "urlopen", lambda *a, **k: _FakeResponse(b"not shakespeare"))
    with pytest.raises(DataError, match="checksum") as info:
        read_source(None)
    assert "--src" in str(info.value)


def test_read_source_download_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    body = SYNTH.encode("utf-8") * 100
    monkeypatch.setattr(char_data.urllib.request, "urlopen", lambda *a, **k: _FakeResponse(body))
    monkeypatch.setattr(char_data, "SHAKESPEARE_SHA256", hashlib.sha256(body).hexdigest())
    seen: list[tuple[int, int]] = []
    assert read_source(None, progress=lambda done, total: seen.append((done, total))) == body.decode()
    assert seen and seen[-1] == (len(body), len(body))
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


# ---------------------------------------------------------------- batches


def test_keys() -> None:
    assert train_key(7, 3) == (7, 0, 3)
    assert eval_key(7, "train", 2) == (7, 1, 2)
    assert eval_key(7, "val", 2) == (7, 2, 2)
    assert len({train_key(7, 2), eval_key(7, "train", 2), eval_key(7, "val", 2)}) == 3
    with pytest.raises(DataError):
        eval_key(7, "test", 0)


def test_batch_offsets_deterministic() -> None:
    a = batch_offsets(train_key(1, 5), 10_000, 16, 32)
    b = batch_offsets(train_key(1, 5), 10_000, 16, 32)
    assert a.dtype == np.int64 and a.shape == (16,)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, batch_offsets(train_key(1, 6), 10_000, 16, 32))
    assert not np.array_equal(a, batch_offsets(train_key(2, 5), 10_000, 16, 32))
    assert not np.array_equal(a, batch_offsets(eval_key(1, "val", 5), 10_000, 16, 32))
    assert a.min() >= 0 and a.max() < 10_000 - 32
    # expected definition, so the stream stays stable across refactors
    np.testing.assert_array_equal(a, np.random.default_rng([1, 0, 5]).integers(0, 10_000 - 32, size=16))


def test_batch_offsets_block_too_large() -> None:
    with pytest.raises(DataError, match="use a --block-size below it"):
        batch_offsets(train_key(0, 0), 64, 4, 64)
    with pytest.raises(DataError, match="block_size 100 needs a split of at least 101 tokens, this one has 64"):
        batch_offsets(train_key(0, 0), 64, 4, 100)
    batch_offsets(train_key(0, 0), 65, 4, 64)  # one valid offset: fine
    with pytest.raises(DataError, match="this one has 1: too small for any --block-size: use a larger corpus$"):
        batch_offsets(train_key(0, 0), 1, 4, 1)  # was told to use a --block-size below 1


def test_read_rows_shift(dataset: Path) -> None:
    data = load_split(dataset, "train")
    T = 24
    offs = batch_offsets(train_key(3, 0), len(data), 8, T)
    x, y = read_rows(data, offs, T)
    assert x.shape == y.shape == (8, T) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for i, o in enumerate(offs):
        np.testing.assert_array_equal(x[i], data[o : o + T])
        np.testing.assert_array_equal(y[i], data[o + 1 : o + 1 + T])
    # the last valid offset still has its target
    last = np.array([len(data) - T - 1])
    _, y_last = read_rows(data, last, T)
    assert y_last[0, -1] == data[-1]
    with pytest.raises(DataError):
        read_rows(data, np.array([len(data) - T]), T)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("mb", [1, 2, 3])
def test_local_batch_mesh_independent(dataset: Path, dp: int, mb: int) -> None:
    data = load_split(dataset, "train")
    B, T = 24, 16
    key = train_key(11, 4)
    gx, gy = read_rows(data, batch_offsets(key, len(data), B, T), T)
    parts = []
    for r in range(dp):
        micro = local_batch(data, key, B, T, r, dp, mb)
        assert len(micro) == mb
        for x, y in micro:
            assert x.shape == y.shape == (B // (dp * mb), T)
        parts.extend(micro)
    np.testing.assert_array_equal(np.concatenate([x for x, _ in parts]), gx)
    np.testing.assert_array_equal(np.concatenate([y for _, y in parts]), gy)


@pytest.mark.parametrize("cp", [2, 4])
def test_local_batch_with_cp_takes_the_zigzag_chunks(dataset: Path, cp: int) -> None:
    """cp rank c holds chunks c and 2cp-1-c of each of its dp rows, inputs and targets;
    together the cp ranks hold every token of the global batch exactly once."""
    from numesh.nn.context_parallel import positions

    data = load_split(dataset, "train")
    B, T, dp = 8, 16, 2
    key = train_key(11, 4)
    gx, gy = read_rows(data, batch_offsets(key, len(data), B, T), T)
    for r in range(dp):
        rows = slice(r * B // dp, (r + 1) * B // dp)
        x_full, y_full = np.zeros_like(gx[rows]), np.zeros_like(gy[rows])
        for c in range(cp):
            ((x, y),) = local_batch(data, key, B, T, r, dp, 1, c, cp)
            assert x.shape == y.shape == (B // dp, T // cp)
            x_full[:, positions(T, cp, c)], y_full[:, positions(T, cp, c)] = x, y
        np.testing.assert_array_equal(x_full, gx[rows])
        np.testing.assert_array_equal(y_full, gy[rows])
    with pytest.raises(DataError, match="does not split into 2\\*cp=12 chunks"):
        local_batch(data, key, B, T, 0, dp, 1, 0, 6)


def test_local_batch_reads_only_own_rows(dataset: Path) -> None:
    data = np.asarray(load_split(dataset, "train"))
    B, T, dp = 8, 16, 4
    key = train_key(0, 1)
    offs = batch_offsets(key, len(data), B, T)

    class Spy(np.ndarray):
        touched: list = []

        def __getitem__(self, idx):
            Spy.touched.append(np.asarray(idx).copy())
            return np.asarray(self)[idx]

    spy = data.view(Spy)
    Spy.touched = []
    local_batch(spy, key, B, T, 1, dp, 1)
    rows = np.unique(np.concatenate([t.reshape(-1) for t in Spy.touched]))
    mine = offs[2:4]
    expected = np.unique((mine[:, None] + np.arange(T + 1)).reshape(-1))
    np.testing.assert_array_equal(rows, expected)


def test_local_batch_not_divisible(dataset: Path) -> None:
    data = load_split(dataset, "train")
    with pytest.raises(DataError, match=r"batch_size 10 .*dp 4 .*micro_batches 1"):
        local_batch(data, train_key(0, 0), 10, 8, 0, 4, 1)
    with pytest.raises(DataError, match=r"batch_size 8 .*dp 2 .*micro_batches 3"):
        local_batch(data, train_key(0, 0), 8, 8, 0, 2, 3)
    with pytest.raises(DataError):
        local_batch(data, train_key(0, 0), 8, 8, 2, 2, 1)  # rank out of range


def test_local_batch_block_too_large(dataset: Path) -> None:
    data = load_split(dataset, "val")
    with pytest.raises(DataError, match="--block-size below it"):
        local_batch(data, eval_key(0, "val", 0), 4, len(data), 0, 1, 1)


# ---------------------------------------------------------------- text files, `numesh data char`


def test_read_text_file_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "nul.bin").write_bytes(b"abc\x00\x01\x02def")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="empty.txt is empty"):
        char_data.read_text_file(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="looks binary"):
        char_data.read_text_file(tmp_path / "nul.bin")
    with pytest.raises(DataError, match="not valid UTF-8"):
        char_data.read_text_file(tmp_path / "latin1.txt")
    with pytest.raises(DataError, match="does not exist"):
        char_data.read_text_file(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="is a directory"):
        char_data.read_text_file(tmp_path)


def test_a_byte_order_mark_is_not_a_character_of_the_vocabulary(tmp_path: Path) -> None:
    """A file a Windows editor saved as "UTF-8 with BOM": `numesh data char` read U+FEFF as
    the first character of the text and gave it a token; a file of the mark alone is empty."""
    src = tmp_path / "bom.txt"
    src.write_bytes(b"\xef\xbb\xbf" + SYNTH.encode("utf-8"))
    res = cli("data", "char", "--src", str(src), "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output
    meta = json.loads((tmp_path / "o" / "meta.json").read_text(encoding="utf-8"))
    assert "\ufeff" not in meta["chars"] and meta["chars"] == sorted(set(SYNTH))
    src.write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(DataError, match="bom.txt is empty"):
        char_data.read_text_file(src)


def test_cli_data_char_any_text_file(tmp_path: Path) -> None:
    src = tmp_path / "my.txt"
    src.write_text(SYNTH, encoding="utf-8")
    res = cli("data", "char", "--src", str(src), "--out", str(tmp_path / "my"))
    assert res.exit_code == 0, res.output
    _check_prepared(SYNTH, tmp_path / "my", {**json.loads((tmp_path / "my" / "meta.json").read_text()),
                                             "out_dir": str(tmp_path / "my")})
    corpus = opened.read_corpus(tmp_path / "my")
    assert corpus["name"] == "file" and corpus["source"] == str(src)
    assert corpus["sha256"] == hashlib.sha256(SYNTH.encode()).hexdigest()
    assert "numesh train --data" in res.stderr


@pytest.mark.parametrize(
    "content, match",
    [(None, "does not exist"), (b"", "is empty"), (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "looks binary"),
     (b"\xff\xfe\xfa", "not valid UTF-8")],
)
def test_cli_data_char_bad_source_is_one_line(tmp_path: Path, content: bytes | None, match: str) -> None:
    src = tmp_path / "in.txt"
    if content is not None:
        src.write_bytes(content)
    line = one_error_line(cli("data", "char", "--src", str(src), "--out", str(tmp_path / "o")))
    assert match in line and str(src) in line
    assert not (tmp_path / "o").exists()


def test_cli_data_shakespeare_char_still_works(tmp_path: Path) -> None:
    src = tmp_path / "input.txt"
    src.write_text(SYNTH, encoding="utf-8")
    res = cli("data", "shakespeare-char", "--src", str(src), "--out", str(tmp_path / "sc"))
    assert res.exit_code == 0, res.output
    assert load_tokenizer(tmp_path / "sc").vocab_size == len(set(SYNTH))


# ---------------------------------------------------------------- ensure_dataset


@pytest.fixture
def fake_net(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Work in an empty directory (so the default dataset dir is missing) with a fake network:
    `fake_net.body` is served (None = offline); `fake_net.calls` counts downloads."""
    monkeypatch.chdir(tmp_path)

    class Net:
        body: bytes | None = None
        calls = 0

    def urlopen(url, *a, **k):
        Net.calls += 1
        assert url == char_data.SHAKESPEARE_URL
        if Net.body is None:
            raise urllib.error.URLError("Name or service not known")
        return _FakeResponse(Net.body)

    monkeypatch.setattr(char_data.urllib.request, "urlopen", urlopen)
    return Net


def test_ensure_dataset_downloads_once_and_caches(fake_net, monkeypatch: pytest.MonkeyPatch) -> None:
    body = SYNTH.encode("utf-8") * 50
    fake_net.body = body
    monkeypatch.setattr(char_data, "SHAKESPEARE_SHA256", hashlib.sha256(body).hexdigest())
    seen: list[tuple[int, int]] = []
    path, note = char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR, progress=lambda d, t: seen.append((d, t)))
    assert path == Path(char_data.DEFAULT_DATA_DIR) and fake_net.calls == 1
    assert "downloaded tiny Shakespeare" in note and "\n" not in note
    assert seen[-1] == (len(body), len(body))
    assert (path / char_data.SHAKESPEARE_FILE).read_bytes() == body  # cached beside the dataset
    assert opened.read_corpus(path)["name"] == "tinyshakespeare"
    assert load_tokenizer(path).decode(
        np.concatenate([load_split(path, "train"), load_split(path, "val")])) == body.decode()

    # the next run finds the dataset: no download, nothing to say
    assert char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR) == (path, None)
    # a lost meta.json leaves files numesh cannot tell from another tool's (nanoGPT's
    # train.bin): refused, naming them; once they are moved away, the dataset is rebuilt
    # from the cached download, still without the network
    (path / "meta.json").unlink()
    fake_net.body = None
    with pytest.raises(DataError, match="holds train.bin, val.bin but no meta.json numesh wrote"):
        char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR)
    for name in ("train.bin", "val.bin"):
        (path / name).unlink()
    path2, note2 = char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR)
    assert fake_net.calls == 1 and note2.startswith("used ") and opened.read_corpus(path2)["name"] == "tinyshakespeare"


def test_ensure_dataset_rejects_wrong_checksum(fake_net) -> None:
    fake_net.body = b"<html>captive portal</html>" * 100  # not tiny Shakespeare
    path, note = char_data.ensure_dataset("./data/shakespeare_char/")  # the default location, however written
    assert fake_net.calls == 1
    assert not (path / char_data.SHAKESPEARE_FILE).exists()  # the bad bytes are neither cached nor used
    assert "checksum" in note and note.startswith("offline")
    assert opened.read_corpus(path)["name"] == opened.FALLBACK_NAME
    text, _ = char_data.fallback_corpus()
    assert load_tokenizer(path).decode(load_split(path, "train")) == text[: len(load_split(path, "train"))]


def test_fallback_corpus_is_deterministic_and_trains_a_tokenizer() -> None:
    a, meta_a = char_data.fallback_corpus()
    b, meta_b = char_data.fallback_corpus()
    assert a.encode("utf-8") == b.encode("utf-8") and meta_a == meta_b
    assert 100_000 < len(a) <= char_data.FALLBACK_CHARS and a.endswith("\n")
    assert meta_a["name"] == opened.FALLBACK_NAME and meta_a["characters"] == len(a)
    assert meta_a["sha256"] == hashlib.sha256(a.encode("utf-8")).hexdigest()
    listed = [f for f in meta_a["files"] if f.split("/")[0].removesuffix(".py") in char_data.FALLBACK_MODULES]
    assert listed and listed == sorted(listed) and meta_a["files"][: len(listed)] == listed
    tok = CharTokenizer.from_text(a)
    assert tok.vocab_size > 20 and tok.decode(tok.encode(a[:5000])) == a[:5000]


def test_ensure_dataset_offline_falls_back_and_says_so(fake_net) -> None:
    path, note = char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR)
    assert fake_net.calls == 1
    assert note.startswith("offline:") and "\n" not in note
    assert "Name or service not known" in note and "standard-library" in note
    corpus = opened.read_corpus(path)
    text, want = char_data.fallback_corpus()
    assert corpus == want
    tok = load_tokenizer(path)
    assert tok.vocab_size > 20
    assert tok.decode(np.concatenate([load_split(path, "train"), load_split(path, "val")])) == text
    opened.verify_dataset(path)  # written whole, with its records, like every dataset
    # later runs do not try the network again, but keep saying what the data is
    path2, note2 = char_data.ensure_dataset(char_data.DEFAULT_DATA_DIR)
    assert fake_net.calls == 1 and path2 == path
    assert "offline fallback corpus" in note2 and "numesh data shakespeare-char" in note2


def test_ensure_dataset_user_named_missing_dir_errors(fake_net, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    with pytest.raises(DataError, match=r"no dataset at .*mine: run `numesh data shakespeare-char --out"):
        char_data.ensure_dataset(mine)
    assert fake_net.calls == 0 and not mine.exists()


def test_ensure_dataset_existing_user_dir_untouched(fake_net, dataset: Path) -> None:
    assert char_data.ensure_dataset(dataset) == (dataset, None)
    assert fake_net.calls == 0


def test_cli_train_first_run_offline(fake_net, tmp_path: Path) -> None:
    res = cli("train", "--max-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--n-layer", "1",
               "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4")
    assert res.exit_code == 0, res.output
    offline = [line for line in res.stderr.splitlines() if line.startswith("offline:")]
    assert len(offline) == 1 and "fallback corpus" in offline[0]
    assert (tmp_path / "runs" / "shakespeare_char" / "metrics.jsonl").is_file()
    assert opened.read_corpus(tmp_path / char_data.DEFAULT_DATA_DIR)["name"] == opened.FALLBACK_NAME


def test_cli_train_user_named_missing_data_is_one_line(fake_net, tmp_path: Path) -> None:
    line = one_error_line(cli("train", "--data", str(tmp_path / "nope"), "--max-iters", "1"))
    assert "no dataset at" in line and fake_net.calls == 0


def test_cli_data_shakespeare_char_download_is_cached(fake_net, monkeypatch: pytest.MonkeyPatch) -> None:
    body = SYNTH.encode("utf-8") * 50
    fake_net.body = body
    monkeypatch.setattr(char_data, "SHAKESPEARE_SHA256", hashlib.sha256(body).hexdigest())
    for _ in range(2):
        res = cli("data", "shakespeare-char", "--out", "ds")
        assert res.exit_code == 0, res.output
    assert fake_net.calls == 1 and Path("ds/input.txt").read_bytes() == body
    assert opened.read_corpus("ds")["name"] == "tinyshakespeare"
    fake_net.body = None  # offline, a dir without the cached download: the explicit command errors
    line = one_error_line(cli("data", "shakespeare-char", "--out", "elsewhere"))
    assert "failed" in line and "--src" in line


@pytest.mark.mpi(min_size=2)
def test_mpi_ensure_run_dataset_same_outcome_on_every_rank(shared_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 alone prepares the default dataset (offline: the fallback); every rank gets it,
    and rank 0's error is the same error on every rank (not a hang)."""
    from mpi4py import MPI

    from numesh.cli.dataset import ensure_run_dataset

    comm = MPI.COMM_WORLD
    work = shared_tmp / "ensure"
    if comm.Get_rank() == 0:
        work.mkdir()
    comm.Barrier()
    monkeypatch.chdir(work)
    calls: list[str] = []

    def offline(url, *a, **k):
        calls.append(url)
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(char_data.urllib.request, "urlopen", offline)
    path = ensure_run_dataset(char_data.DEFAULT_DATA_DIR)
    assert load_tokenizer(path).vocab_size > 20
    assert len(calls) == (1 if comm.Get_rank() == 0 else 0)
    with pytest.raises(DataError, match="no dataset at") as info:
        ensure_run_dataset(work / "user-named")
    messages = comm.allgather(str(info.value))
    assert len(set(messages)) == 1


# ---------------------------------------------------------------- datasets written whole, checked when read

OTHER = SYNTH.replace("e", "E")  # another text, another dataset


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_a_dataset_records_each_file_and_leaves_nothing_beside_it(dataset: Path) -> None:
    """meta.json records each file's size, ids, largest id and sha256; the staging
    directory is gone once the dataset is in place."""
    meta = json.loads((dataset / "meta.json").read_text())
    for name in ("train.bin", "val.bin"):
        raw = (dataset / name).read_bytes()
        ids = np.frombuffer(raw, np.uint16)
        assert meta["files"][name] == {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                                       "tokens": ids.size, "max_id": int(ids.max())}
    assert [p.name for p in dataset.parent.iterdir()] == [dataset.name]
    opened.verify_dataset(dataset)


def test_a_file_edited_after_writing_fails_the_check_at_train_start(dataset: Path, tmp_path: Path) -> None:
    """Same size, ids in range, one byte changed: the sizes pass when opened, the sha256 at
    a run's start does not, and the error names the file and the command that rebuilds it."""
    src = tmp_path / "my.txt"
    src.write_text(SYNTH, encoding="utf-8")
    assert cli("data", "char", "--src", str(src), "--out", str(tmp_path / "my")).exit_code == 0
    train = tmp_path / "my" / "train.bin"
    ids = np.fromfile(train, np.uint16)
    ids[10] = (ids[10] + 1) % (ids.max() + 1)
    ids.tofile(train)
    opened.open_dataset(tmp_path / "my")  # sizes agree
    with pytest.raises(DataError, match="does not match its sha256"):
        opened.verify_dataset(tmp_path / "my")
    line = one_error_line(cli("train", "--data", str(tmp_path / "my"), "--out", str(tmp_path / "o"),
                              "--max-iters", "1"))
    assert str(train) in line and f"`numesh data char --src {src} --out {tmp_path / 'my'}`" in line
    assert not (tmp_path / "o").exists()  # refused before the run took its --out


@pytest.mark.parametrize("records", [True, False], ids=["recorded", "before-records"])
def test_an_id_outside_the_vocabulary_is_one_line_before_training(dataset: Path, tmp_path: Path,
                                                                  records: bool) -> None:
    """It was an IndexError on tp=1 and 'training diverged at step 0' on tp=2; a dataset
    written before the file records is scanned for it too."""
    meta = json.loads((dataset / "meta.json").read_text())
    if not records:
        meta.pop("files", None)
        (dataset / "meta.json").write_text(json.dumps(meta))
    ids = np.fromfile(dataset / "train.bin", np.uint16)
    ids[7] = meta["vocab_size"] + 3
    ids.tofile(dataset / "train.bin")
    line = one_error_line(cli("train", "--data", str(dataset), "--out", str(tmp_path / "o"), "--max-iters", "1"))
    assert f"holds id {meta['vocab_size'] + 3} at token 7, outside the vocabulary of {meta['vocab_size']}" in line


def test_a_recorded_largest_id_outside_the_vocabulary_is_refused_when_opened(dataset: Path) -> None:
    meta = json.loads((dataset / "meta.json").read_text())
    meta["files"]["val.bin"]["max_id"] = meta["vocab_size"]
    (dataset / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"says val.bin holds id {meta['vocab_size']}, outside the vocabulary"):
        opened.open_dataset(dataset)


def test_other_content_over_a_dataset_needs_overwrite(dataset: Path, tmp_path: Path) -> None:
    before = _snapshot(dataset)
    with pytest.raises(DataError, match="already holds a dataset with another tokenizer: pass --overwrite"):
        prepare_char_dataset(OTHER, dataset)
    assert _snapshot(dataset) == before and [p.name for p in dataset.parent.iterdir()] == [dataset.name]
    prepare_char_dataset(SYNTH, dataset, corpus={"name": "file", "source": "again.txt"})  # the same ids: fine
    assert json.loads((dataset / "meta.json").read_text())["corpus"]["source"] == "again.txt"
    prepare_char_dataset(OTHER, dataset, overwrite=True)
    assert load_tokenizer(dataset) == CharTokenizer.from_text(OTHER)
    # the same through the command line, one line each
    src = tmp_path / "other.txt"
    src.write_text(SYNTH, encoding="utf-8")
    for cmd in (["data", "char"], ["data", "shakespeare-char"]):
        line = one_error_line(cli(*cmd, "--src", str(src), "--out", str(dataset)))
        assert "pass --overwrite to replace it" in line and str(dataset) in line
    assert cli("data", "char", "--src", str(src), "--out", str(dataset), "--overwrite").exit_code == 0
    assert load_tokenizer(dataset) == CharTokenizer.from_text(SYNTH)


def test_a_broken_or_older_dataset_is_replaced_without_overwrite(dataset: Path) -> None:
    """--overwrite guards a dataset runs could train on: one that fails its own check (a
    rewrite killed midway) is not one; one written before the records is compared by its ids."""
    meta = json.loads((dataset / "meta.json").read_text())
    del meta["files"]
    (dataset / "meta.json").write_text(json.dumps(meta))
    prepare_char_dataset(SYNTH, dataset)  # an older dataset, the same ids: fine
    with pytest.raises(DataError, match="another tokenizer"):
        prepare_char_dataset(OTHER, dataset)
    (dataset / "train.bin").write_bytes((dataset / "train.bin").read_bytes()[:-2])  # half a rewrite
    prepare_char_dataset(OTHER, dataset)
    opened.verify_dataset(dataset)


def test_leftovers_of_a_dead_writer_are_cleaned_and_a_live_ones_kept(dataset: Path) -> None:
    from numesh.data import write as dw

    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = dataset.parent / f".{dataset.name}.writing-{host}-{dead.pid}"
    live = dataset.parent / f".{dataset.name}.writing-{host}-1"  # pid 1 is alive
    other_host = dataset.parent / f".{dataset.name}.writing-elsewhere-{dead.pid}"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "train.bin").write_bytes(b"\0\0")
    opened.open_dataset(dataset)  # readers ignore them
    prepare_char_dataset(OTHER, dataset, overwrite=True)
    assert not stale.exists() and live.exists() and other_host.exists()
    # killed between the two renames of the fallback: the dataset is put back first
    old = dataset.parent / f".{dataset.name}.old-{host}-{dead.pid}"
    dataset.rename(old)
    assert dw.clean_leftovers(dataset) == [] and not old.exists()
    assert load_tokenizer(dataset) == CharTokenizer.from_text(OTHER)


def test_the_rename_fallback_replaces_whole_and_other_files_are_kept(dataset: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Where renameat2's exchange is missing, two renames; either way the files of the old
    directory that are not the dataset's (the cached input.txt, a note) come along."""
    from numesh.data import write as dw

    (dataset / "input.txt").write_text("cached corpus")
    (dataset / "notes").mkdir()
    (dataset / "notes" / "why.md").write_text("a note")
    for exchange in (True, False):
        if not exchange:
            monkeypatch.setattr(dw, "_exchange", lambda a, b: False)
        prepare_char_dataset(OTHER if exchange else SYNTH, dataset, overwrite=True)
        assert (dataset / "input.txt").read_text() == "cached corpus"
        assert (dataset / "notes" / "why.md").read_text() == "a note"
        assert sorted(p.name for p in dataset.parent.iterdir()) == [dataset.name]
        opened.verify_dataset(dataset)


def test_files_numesh_did_not_write_are_never_replaced(tmp_path: Path) -> None:
    """A transformers export (its tokenizer.json), nanoGPT's data directory (train.bin,
    val.bin, meta.pkl) or another tool's meta.json: every writer, --overwrite or not,
    refuses in one line before it reads anything and leaves the files as they were; a
    directory holding other files only (a note) still gets its dataset beside them."""
    src = tmp_path / "in.txt"
    src.write_text(SYNTH, encoding="utf-8")
    dirs = {"export": {"config.json": b"{}", "tokenizer.json": b'{"model": {}}', "model.safetensors": b"w"},
            "nanogpt": {"train.bin": b"\1\0", "val.bin": b"\2\0", "meta.pkl": b"p"},
            "other": {"meta.json": b'{"name": "not a dataset"}'}}
    for name, files in dirs.items():
        d = tmp_path / name
        d.mkdir()
        for f, raw in files.items():
            (d / f).write_bytes(raw)
        for cmd in (["data", "char"], ["data", "shakespeare-char"], ["data", "bpe", "--vocab-size", "300"]):
            for extra in ([], ["--overwrite"]):
                line = one_error_line(cli(*cmd, "--src", str(src), "--out", str(d), *extra))
                assert "no dataset numesh wrote" in line and "choose a new or empty --out" in line, line
        with pytest.raises(DataError, match="would delete them"):
            prepare_char_dataset(SYNTH, d, overwrite=True)
        assert _snapshot(d) == files and not list(tmp_path.glob(".*"))  # nor a staging directory left
    # the hint of a run pointed at the export: tokenise with its tokenizer into a new directory
    line = one_error_line(cli("train", "--data", str(tmp_path / "export"), "--max-iters", "1"))
    assert f"numesh data tokenize --tokenizer {tmp_path / 'export' / 'tokenizer.json'}" in line
    assert "shakespeare-char" not in line and "holds config.json" in line
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("mine")
    assert "numesh data char --src FILE --out DIR" in str(opened.missing_dataset(notes))
    prepare_char_dataset(SYNTH, notes)
    assert (notes / "README.md").read_text() == "mine" and load_tokenizer(notes) == CharTokenizer.from_text(SYNTH)


@pytest.mark.parametrize("out", ["", ".", ".."])
def test_an_out_that_is_the_current_directory_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          out: str) -> None:
    """The dataset directory is renamed as a whole: never the one the shell stands in
    (`--out ""` is it too)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "in.txt").write_text(SYNTH, encoding="utf-8")
    for cmd in (["data", "char", "--src", "in.txt"], ["data", "shakespeare-char", "--src", "in.txt"]):
        line = one_error_line(cli(*cmd, "--out", out))
        assert "is the current directory or holds it" in line
    assert sorted(p.name for p in work.iterdir()) == ["in.txt"]
    (work / "afile").write_text("x")
    assert "is a file" in one_error_line(cli("data", "char", "--src", "in.txt", "--out", "afile"))


def test_an_out_under_a_file_or_through_a_symlink_loop_is_one_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A file where a parent of --out should be said "File exists" (the mkdir beside it); a
    symlink loop was a RuntimeError traceback (Path.resolve on Python 3.11)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text(SYNTH, encoding="utf-8")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop-a").symlink_to("loop-b")
    (tmp_path / "loop-b").symlink_to("loop-a")
    for cmd in (["data", "char", "--src", "in.txt"], ["data", "bpe", "--src", "in.txt", "--vocab-size", "300"]):
        assert "--out afile/sub: afile is a file, not a directory" in one_error_line(cli(*cmd, "--out", "afile/sub"))
        assert "cannot resolve --out loop-a (a symlink loop)" in one_error_line(cli(*cmd, "--out", "loop-a"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.txt", "loop-a", "loop-b"]


def test_resolved_or_none_follows_links_and_names_a_loop_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one answer to a symlink loop that `--out` (numesh.data.write.target) and the
    checkpoint commands (numesh.checkpoint.common.check_apart) share, whatever Python's
    own Path.resolve does with one (3.11 raises RuntimeError, 3.13 returns a path)."""
    from numesh.base.files import resolved_or_none

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop-a").symlink_to("loop-b")
    (tmp_path / "loop-b").symlink_to("loop-a")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    assert resolved_or_none("loop-a") is None and resolved_or_none(tmp_path / "loop-b" / "x") is None
    assert resolved_or_none("link") == (tmp_path / "real").resolve()
    assert resolved_or_none("link/not-yet") == (tmp_path / "real" / "not-yet").resolve()  # a new --out


def test_a_dataset_replaced_while_open_is_read_as_it_was_opened(dataset: Path) -> None:
    """A run reads the files it opened: a rewrite renamed into place meanwhile changes
    nothing under it (and its checkpoints keep the tokenizer it trained with)."""
    ds = opened.open_dataset(dataset)
    before = np.asarray(ds.split("train")).copy()
    prepare_char_dataset(OTHER, dataset, overwrite=True)
    np.testing.assert_array_equal(np.asarray(ds.split("train")), before)
    opened.verify_dataset(ds)  # the files it holds still match the meta.json it read
    assert ds.tokenizer == CharTokenizer.from_text(SYNTH) != load_tokenizer(dataset)


def test_a_file_truncated_or_rewritten_under_a_reader_is_a_data_error(dataset: Path) -> None:
    """A memory map that shrinks under its reader is SIGBUS ('Bus error', exit 135): the
    stream reads at offsets and checks, and names the file."""
    ds = opened.open_dataset(dataset)
    train, val = ds.split("train"), ds.split("val")
    offs = np.array([0, len(train) - 20])
    read_rows(train, offs, 16)
    path = dataset / "train.bin"
    os.truncate(path, 64)
    with pytest.raises(DataError, match=f"{path} shrank from .* to 64 bytes while this run read it.*numesh data"):
        read_rows(train, offs, 16)
    with pytest.raises(DataError, match="shrank"):
        read_rows(train, np.array([0]), 16)  # rows still there: the size check says so
    raw = (dataset / "val.bin").read_bytes()
    with open(dataset / "val.bin", "r+b") as f:  # the same size, written in place
        f.write(raw[::-1])
    os.utime(dataset / "val.bin", ns=(0, 1))
    with pytest.raises(DataError, match="val.bin changed while this run read it"):
        val.rows(np.array([0]), 4)


def test_a_token_stream_reads_like_an_array(dataset: Path) -> None:
    train = load_split(dataset, "train")
    whole = np.fromfile(dataset / "train.bin", np.uint16)
    assert len(train) == whole.size and train.dtype == np.uint16
    np.testing.assert_array_equal(np.asarray(train), whole)
    np.testing.assert_array_equal(train[5:40:3], whole[5:40:3])
    assert train[-1] == whole[-1] and train[3] == whole[3]
    idx = np.array([[4, 9], [len(whole) - 1, 0]])
    np.testing.assert_array_equal(train[idx], whole[idx])
    np.testing.assert_array_equal(train.rows(np.array([3, 50]), 7), np.stack([whole[3:10], whole[50:57]]))
    with pytest.raises(IndexError):
        train.rows(np.array([len(whole) - 3]), 7)


def _numesh(*args: str, **kw) -> subprocess.Popen:
    """`numesh ARGS` as a real process (stdin closed, stderr piped)."""
    return subprocess.Popen([sys.executable, "-m", "numesh.cli.app", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)


def test_kill_9_of_a_writer_midway_leaves_the_old_dataset_whole(dataset: Path, tmp_path: Path) -> None:
    """A real `numesh data char --overwrite` over an existing dataset, killed once its
    staging directory is there (~0.1 s of files being written and checked on 40 MB): the
    old dataset is byte for byte as it was and verifies; the next write removes the leftover.
    (Before, the new train.bin sat beside the old meta.json and a run trained on it.)"""
    big = tmp_path / "big.txt"
    line = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak!\n"
    big.write_text(line * (40_000_000 // len(line)), encoding="utf-8")
    before = _snapshot(dataset)
    for _ in range(5):  # a kill that comes too late (the writer done) is tried again
        proc = _numesh("data", "char", "--src", str(big), "--out", str(dataset), "--overwrite")
        while proc.poll() is None and not list(tmp_path.glob(f".{dataset.name}.writing-*")):
            time.sleep(0.001)
        proc.kill()
        proc.communicate(timeout=60)
        if proc.returncode == -signal.SIGKILL and list(tmp_path.glob(f".{dataset.name}.writing-*")):
            break
        prepare_char_dataset(SYNTH, dataset, overwrite=True)
    else:
        pytest.fail("the writer never got killed while writing")
    assert _snapshot(dataset) == before
    opened.verify_dataset(dataset)
    prepare_char_dataset(OTHER, dataset, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt", dataset.name]


def test_truncating_train_bin_under_a_running_train_is_one_line(tmp_path: Path) -> None:
    """It was "Bus error", exit 135, from the memory map shrinking under the reader."""
    dataset = tmp_path / "big"
    prepare_char_dataset(SYNTH * 100, dataset)
    run = tmp_path / "run"
    proc = _numesh("train", "--data", str(dataset), "--out", str(run), "--max-iters", "1000000", "--n-layer", "1",
                   "--n-head", "1", "--n-embd", "8", "--block-size", "16", "--batch-size", "4", "--eval-iters", "1",
                   "--eval-interval", "1000000", "--log-interval", "1", "--ckpt-interval", "0",
                   "--peak-flops", "1e12")
    try:
        deadline = time.monotonic() + 180  # stops a hung start; a busy machine may take long
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no metrics line within 180 s (hung?)"
            time.sleep(0.02)
        os.truncate(dataset / "train.bin", 64)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 2, err
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"{dataset / 'train.bin'} shrank from" in errors[0] and "then resume" in errors[0]


def test_a_character_models_export_fine_tunes_through_data_char(tmp_path: Path) -> None:
    """`numesh data tokenize --tokenizer` wanted an end-of-text token a character export
    lacks; it now names the route that works, `numesh data char --tokenizer`, whose dataset
    keeps the export's ids (what --init-from compares), whatever characters the new text has."""
    from numesh.checkpoint.init_from import _same_tokenizer

    exported = tmp_path / "tokenizer.json"  # what `numesh export --format hf` writes for a character run
    exported.write_text(CharTokenizer.from_text(SYNTH).to_hf_json(), encoding="utf-8")
    src = tmp_path / "new.txt"
    src.write_text("Speak, speak.\n" * 50, encoding="utf-8")  # fewer characters than the export knows
    line = one_error_line(cli("data", "tokenize", "--tokenizer", str(exported), "--src", str(src),
                              "--out", str(tmp_path / "t")))
    assert f"`numesh data char --tokenizer {exported} --src FILE --out DIR`" in line
    res = cli("data", "char", "--tokenizer", str(exported), "--src", str(src), "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.stderr
    tok = load_tokenizer(tmp_path / "d")
    assert tok == CharTokenizer.from_text(SYNTH) != CharTokenizer.from_text(src.read_text(encoding="utf-8"))
    # the export's directory, as `data tokenize --tokenizer DIR` suggests it, is as good as its file
    line = one_error_line(cli("data", "tokenize", "--tokenizer", str(tmp_path), "--src", str(src),
                              "--out", str(tmp_path / "t")))
    assert f"`numesh data char --tokenizer {tmp_path} --src FILE --out DIR`" in line
    res = cli("data", "char", "--tokenizer", str(tmp_path), "--src", str(src), "--out", str(tmp_path / "dd"))
    assert res.exit_code == 0, res.stderr
    assert load_tokenizer(tmp_path / "dd") == tok
    (tmp_path / "empty").mkdir()
    assert f"{tmp_path / 'empty'} has no tokenizer.json" in one_error_line(cli(
        "data", "char", "--tokenizer", str(tmp_path / "empty"), "--src", str(src), "--out", str(tmp_path / "g")))
    assert _same_tokenizer(exported.read_text(encoding="utf-8"), tok)
    assert f"--tokenizer {exported}" in opened.rebuild_hint(opened.read_meta(tmp_path / "d"), tmp_path / "d")
    src.write_text(SYNTH + "§", encoding="utf-8")
    assert "'§' is not in the" in one_error_line(cli("data", "char", "--tokenizer", str(exported), "--src", str(src),
                                                     "--out", str(tmp_path / "e")))
    (tmp_path / "bpe.json").write_text('{"model": {"type": "BPE", "vocab": {"ab": 0}, "merges": [["a", "b"]]}}')
    assert "is not a character vocabulary" in one_error_line(cli(
        "data", "char", "--tokenizer", str(tmp_path / "bpe.json"), "--src", str(src), "--out", str(tmp_path / "f")))
