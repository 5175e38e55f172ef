"""A dataset directory opened and verified as one snapshot.

A dataset is `meta.json` (its tokenizer, token counts and a record of every file) beside its
token files: a character dataset's `train.bin` and `val.bin` (numesh/data/char.py) or a
sharded one's `train-N.bin`/`val-N.bin` (numesh/data/sharded.py). `open_dataset` reads meta.json
once and checks each file against its record (numesh/data/check.py), so a run reads the
dataset as it was when it started; a missing or damaged one is a DataError that says how to
rebuild it.

Pure NumPy and stdlib: no MPI here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from numesh.base.errors import DataError
from numesh.data import check as dc
from numesh.data.shards import TokenStream, open_split
from numesh.data.tokenizer import TOKEN_DTYPE, CharTokenizer, HFTokenizer, tokenizer_from_meta

SPLITS = ("train", "val")
META_FILE = "meta.json"
FALLBACK_NAME = "python-stdlib"  # the default dataset's offline corpus (numesh/data/char.py)


def rebuild_hint(meta: Any, data_dir: Path) -> str:
    """How to write `data_dir` again, from what its meta.json says it was made of: the
    command a sharded dataset recorded, or one for the corpus a character dataset names."""
    d = shlex.quote(str(data_dir))
    meta = meta if isinstance(meta, dict) else {}
    if isinstance(meta.get("rebuild"), str):  # a sharded dataset's command, but for its --out
        return f"rebuild it with `{meta['rebuild']} --out {d}`"
    if "shards" in meta:
        return f"rebuild it with `numesh data bpe` or `numesh data tokenize` (--out {d})"
    corpus = meta.get("corpus") if isinstance(meta.get("corpus"), dict) else {}
    source = corpus.get("source")
    local = isinstance(source, str) and "://" not in source
    src = f" --src {shlex.quote(source)}" if local else ""
    if corpus.get("name") in ("tinyshakespeare", FALLBACK_NAME):
        return f"rebuild it with `numesh data shakespeare-char{src} --out {d}`"
    if corpus.get("name") == "file" and local:
        vocab = corpus.get("tokenizer")
        src += f" --tokenizer {shlex.quote(vocab)}" if isinstance(vocab, str) else ""
        return f"rebuild it with `numesh data char{src} --out {d}`"
    return f"rebuild it with `numesh data char --src FILE --out {d}` from the text it was made of"


def missing_dataset(data_dir: Path) -> DataError:
    """The error for a directory without a dataset, with the command that writes one: into
    it when it is missing or empty, else into a new directory (a writer never replaces
    files it did not write; a transformers export's tokenizer.json is the one to tokenise with)."""
    if data_dir.is_file():  # a text file: `--out FILE` would fail on it, it is the source
        src = shlex.quote(str(data_dir))
        return DataError(f"--data {data_dir} is a file: --data takes a dataset directory; make one from it with "
                         f"`numesh data char --src {src} --out DIR` (or `numesh data bpe --src {src} --vocab-size N "
                         "--out DIR`) and pass --data DIR")
    try:
        held = sorted(p.name for p in data_dir.iterdir())
    except OSError:
        held = []
    if not held:
        d = shlex.quote(str(data_dir))
        return DataError(f"no dataset at {data_dir}: run `numesh data shakespeare-char --out {d}` first for "
                         f"characters, or `numesh data bpe --src FILE --vocab-size N --out {d}` for a BPE (a "
                         "recipe's header names its own)")
    shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
    if "tokenizer.json" in held:
        how = f"`numesh data tokenize --tokenizer {shlex.quote(str(data_dir / 'tokenizer.json'))} --src FILE --out DIR`"
    else:
        how = "`numesh data char --src FILE --out DIR` (or `numesh data bpe`)"
    return DataError(f"no dataset at {data_dir} (no {META_FILE}; it holds {shown}): prepare one in a new "
                     f"directory with {how} and pass --data DIR")


def _parse_meta(raw: bytes, d: Path) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {d / META_FILE} ({e}): {rebuild_hint(None, d)}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{d / META_FILE} is not a JSON object: {rebuild_hint(None, d)}")
    return meta


def read_meta(data_dir: str | Path) -> dict[str, Any]:
    """`data_dir/meta.json`; a missing or unreadable one is a DataError saying what to run."""
    d = Path(data_dir)
    try:
        raw = (d / META_FILE).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise missing_dataset(d) from None
    except OSError as e:
        raise DataError(f"cannot read {d / META_FILE} ({e.strerror or e}): check its permissions") from None
    return _parse_meta(raw, d)


def _tokenizer(meta: dict[str, Any]) -> CharTokenizer | HFTokenizer:
    """The tokenizer a dataset's meta.json holds: its top level (a character vocabulary, as
    `numesh data char` writes it) or a sharded dataset's "tokenizer" entry."""
    return tokenizer_from_meta(meta["tokenizer"] if "shards" in meta else meta)


def load_tokenizer(data_dir: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer stored in `data_dir/meta.json`."""
    return _tokenizer(read_meta(data_dir))


@attrs.frozen(eq=False)
class Dataset:
    """A dataset as it was when opened (`open_dataset`): its meta.json (and that file's
    sha256, which ranks compare), tokenizer and both splits' open token files. Everything
    is read through one handle on the directory, so a rewrite that renames a new dataset
    into place meanwhile is never half seen: a run keeps reading the files it opened."""

    path: Path
    meta: dict[str, Any]
    meta_sha256: str
    tokenizer: CharTokenizer | HFTokenizer
    splits: dict[str, TokenStream]

    @property
    def hint(self) -> str:
        return rebuild_hint(self.meta, self.path)

    def split(self, name: str) -> TokenStream:
        if name not in SPLITS:
            raise DataError(f"unknown split {name!r}: use one of {', '.join(SPLITS)}")
        return self.splits[name]


def _read_at(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _open_split(d: Path, meta: dict[str, Any], split: str, hint: str, dir_fd: int) -> TokenStream:
    if "shards" in meta:
        return open_split(d, meta, split, hint, dir_fd)
    name = f"{split}.bin"
    records = meta.get("files") if isinstance(meta.get("files"), dict) else {}
    tokens = (records.get(name) or {}).get("tokens")
    if not isinstance(tokens, int):  # written before the records: check() held the size to {split}_tokens
        tokens = os.stat(name, dir_fd=dir_fd).st_size // TOKEN_DTYPE.itemsize
    return TokenStream([(d / name, tokens)], TOKEN_DTYPE, hint, dir_fd)


def open_dataset(data_dir: str | Path) -> Dataset:
    """The dataset in `data_dir`, its files checked against meta.json's records (sizes,
    recorded ids; `verify_dataset` reads every byte). A missing, partly rewritten or
    edited dataset is a one-line DataError naming the file and how to rebuild it."""
    d = Path(data_dir)
    try:
        dir_fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        raise missing_dataset(d) from None
    except OSError as e:
        raise DataError(f"cannot read dataset {d} ({e.strerror or e}): check its permissions") from None
    try:
        try:
            raw = _read_at(dir_fd, META_FILE)
        except FileNotFoundError:
            raise missing_dataset(d) from None
        meta = _parse_meta(raw, d)
        hint, tok = rebuild_hint(meta, d), _tokenizer(meta)
        dc.check(d, meta, tok.vocab_size, hint, dir_fd)
        splits = {s: _open_split(d, meta, s, hint, dir_fd) for s in SPLITS}
    finally:
        os.close(dir_fd)
    return Dataset(d, meta, hashlib.sha256(raw).hexdigest(), tok, splits)


def load_split(data_dir: str | Path, split: str) -> TokenStream:
    """The token ids of `split` ("train" or "val") as a read-only `TokenStream`: the uint16
    `{split}.bin` of a character dataset, or all of a sharded dataset's shards as one."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    return open_dataset(data_dir).split(split)


def verify_dataset(data: Dataset | str | Path) -> None:
    """Every byte of the dataset's files against meta.json (`numesh.data.check.verify`:
    sha256 and ids below the vocabulary), through the handles an open `Dataset` reads."""
    ds = data if isinstance(data, Dataset) else open_dataset(data)
    fds = {name: fd for s in ds.splits.values() for name, fd in s.handles.items()}
    dc.verify(ds.path, ds.meta, ds.tokenizer.vocab_size, ds.hint, fds)


def bytes_per_token(data: Dataset | str | Path) -> dict[str, float]:
    """UTF-8 bytes of text per token in each split, which turns a loss in nats per token
    into bits per byte (`bits_per_byte`), the measure that compares tokenizers: a sharded
    dataset records each split's bytes and tokens; a character one's are counted from its
    ids (each character's UTF-8 length times how often it occurs)."""
    ds = data if isinstance(data, Dataset) else open_dataset(data)
    meta = ds.meta
    if "shards" in meta:
        return {s: meta["splits"][s]["bytes"] / meta["splits"][s]["tokens"] for s in SPLITS}
    chars = ds.tokenizer.chars  # type: ignore[union-attr]
    lengths = np.array([len(c.encode("utf-8", errors="surrogatepass")) for c in chars], dtype=np.float64)
    out = {}
    for split in SPLITS:
        ids = np.asarray(ds.split(split))
        counts = np.bincount(ids, minlength=len(chars))[: len(chars)]
        out[split] = float(counts @ lengths) / len(ids)
    return out


def bits_per_byte(loss_nats: float, bytes_per_tok: float) -> float:
    """A loss in nats per token as bits per byte of text."""
    return loss_nats / (math.log(2.0) * bytes_per_tok)


def read_corpus(data_dir: str | Path) -> dict[str, Any] | None:
    """The "corpus" entry of `data_dir/meta.json` (None if absent or unreadable)."""
    try:
        meta = json.loads((Path(data_dir) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    corpus = meta.get("corpus") if isinstance(meta, dict) else None
    return corpus if isinstance(corpus, dict) else None
