"""Tests for numesh.data: tokenizer, dataset files, download handling, mesh-independent batches."""

from __future__ import annotations

import hashlib
import json
import urllib.error
from pathlib import Path

import numpy as np
import pytest

from numesh import data as D
from numesh.data import (
    CharTokenizer,
    DataError,
    batch_offsets,
    eval_key,
    load_split,
    load_tokenizer,
    local_batch,
    prepare_char_dataset,
    read_rows,
    read_source,
    train_key,
)

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
    assert isinstance(train, np.memmap) and train.dtype == np.uint16 and not train.flags.writeable
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


def test_prepare_too_short_text(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="too short"):
        prepare_char_dataset("a", tmp_path / "x")


def test_missing_dataset_hint(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=r"no dataset at .*nope: run `numesh data shakespeare-char --out"):
        load_tokenizer(missing)
    with pytest.raises(DataError, match="numesh data shakespeare-char"):
        load_split(missing, "train")


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

    monkeypatch.setattr(D.urllib.request, "urlopen", fail)
    with pytest.raises(DataError, match="--src") as info:
        read_source(None)
    assert "failed" in str(info.value)


def test_read_source_download_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args, **kwargs):
        raise TimeoutError("timed out")

    monkeypatch.setattr(D.urllib.request, "urlopen", slow)
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
    monkeypatch.setattr(D.urllib.request, "urlopen", lambda *a, **k: _FakeResponse(b"not shakespeare"))
    with pytest.raises(DataError, match="checksum") as info:
        read_source(None)
    assert "--src" in str(info.value)


def test_read_source_download_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    body = SYNTH.encode("utf-8") * 100
    monkeypatch.setattr(D.urllib.request, "urlopen", lambda *a, **k: _FakeResponse(body))
    monkeypatch.setattr(D, "SHAKESPEARE_SHA256", hashlib.sha256(body).hexdigest())
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
    with pytest.raises(DataError, match="use a smaller --block-size"):
        batch_offsets(train_key(0, 0), 64, 4, 64)
    with pytest.raises(DataError, match="block_size 100 is larger than the 64-token split"):
        batch_offsets(train_key(0, 0), 64, 4, 100)
    batch_offsets(train_key(0, 0), 65, 4, 64)  # one valid offset: fine


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
    with pytest.raises(DataError, match="smaller --block-size"):
        local_batch(data, eval_key(0, "val", 0), 4, len(data), 0, 1, 1)
