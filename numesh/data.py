"""Character-level datasets and mesh-independent batches.

A dataset directory holds `train.bin` and `val.bin` (raw little-endian uint16 token ids) and
`meta.json` (the tokenizer's characters, token counts and a record of every file; JSON, no
pickle). It is written whole (numesh/dataset_write.py) and read as it was opened
(`open_dataset`: its files checked against meta.json, numesh/dataset_check.py). Batches follow
the *mesh-independent data* rule of docs/design.md: the global batch of a step depends only on
its key (derived from seed and step), data-parallel rank r takes rows r*B/dp ... (r+1)*B/dp
and micro-batches split those rows in order, so every mesh sees the same global batch.

Pure NumPy and stdlib: no MPI here.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import platform
import shlex
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import attrs
import numpy as np

from numesh import dataset_check as dc
from numesh import dataset_write as dw
from numesh.errors import DataError
from numesh.files import write_atomic
from numesh.mesh.zigzag import take_local
from numesh.shards import TokenStream, open_split
from numesh.tokenizer import TOKEN_DTYPE, CharTokenizer, HFTokenizer, tokenizer_from_meta

__all__ = ["CharTokenizer", "HFTokenizer", "TOKEN_DTYPE", "TokenStream"]  # re-exported: where callers found them

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"

DOWNLOAD_TIMEOUT = 30.0  # seconds, per blocking network operation
DEFAULT_DATA_DIR = "data/shakespeare_char"  # TrainConfig.data's default: the one dir prepared on demand
SHAKESPEARE_FILE = "input.txt"  # the checksummed download, cached in the dataset dir (as nanoGPT)

# The offline fallback corpus: Python sources every installation has, so a first `numesh train`
# without network still trains and samples. Modules in sorted order (then any other top-level
# stdlib .py file, sorted, if these fall short), cut at a line end before FALLBACK_CHARS: the same
# text on every run of the same Python, about the size of tiny Shakespeare (1.1 M characters).
FALLBACK_NAME = "python-stdlib"
FALLBACK_CHARS = 1_000_000
FALLBACK_MODULES = (
    "argparse", "ast", "calendar", "cmd", "codecs", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "difflib", "dis", "enum", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "heapq", "inspect", "ipaddress", "json",
    "locale", "logging", "mailbox", "operator", "optparse", "os", "pdb", "pickle", "platform",
    "posixpath", "pprint", "queue", "random", "shlex", "shutil", "socket", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing",
    "uuid", "warnings", "weakref", "zipfile",
)
_MIN_FALLBACK_CHARS = 10_000
TRAIN_FRACTION = 0.9
SPLITS = ("train", "val")
META_FILE = "meta.json"
_CHUNK = 1 << 16


# --------------------------------------------------------------------------------------
# source text and dataset files


def _download(url: str, timeout: float, progress: Callable[[int, int], None] | None) -> bytes:
    """Fetch `url` in chunks, reporting (bytes so far, total or 0 if unknown) to `progress`."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        total = int(resp.headers.get("Content-Length") or 0)
        chunks: list[bytes] = []
        done = 0
        while True:
            chunk = resp.read(_CHUNK)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return b"".join(chunks)


class DownloadFailed(DataError):
    """The corpus could not be fetched or failed its checksum; `reason` says why, briefly."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def download_shakespeare(progress: Callable[[int, int], None] | None = None) -> str:
    """Tiny Shakespeare from SHAKESPEARE_URL, checked against SHAKESPEARE_SHA256.

    Raises DownloadFailed (a DataError) when offline, on a bad response or a wrong checksum.
    """
    hint = "pass --src path/to/input.txt (a local copy of tiny Shakespeare)"
    try:
        raw = _download(SHAKESPEARE_URL, DOWNLOAD_TIMEOUT, progress)
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError, timeouts, bad responses
        reason = str(getattr(e, "reason", None) or e)
        raise DownloadFailed(f"download of {SHAKESPEARE_URL} failed ({reason}): {hint}", reason) from None
    digest = _sha256(raw)
    if digest != SHAKESPEARE_SHA256:
        raise DownloadFailed(
            f"download of {SHAKESPEARE_URL} failed its checksum (sha256 {digest}, expected "
            f"{SHAKESPEARE_SHA256}): {hint}",
            f"wrong checksum: sha256 {digest[:12]}..., expected {SHAKESPEARE_SHA256[:12]}...",
        )
    return raw.decode("utf-8")


def read_text_file(path: str | Path) -> str:
    """A non-empty UTF-8 text file; missing, empty, binary or unreadable files raise DataError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"source file {path} does not exist: pass an existing text file as --src") from None
    except IsADirectoryError:
        raise DataError(f"source {path} is a directory: pass a text file as --src") from None
    except OSError as e:
        raise DataError(
            f"cannot read source file {path} ({e.strerror or e}): check the path and permissions"
        ) from None
    if not raw:
        raise DataError(f"source file {path} is empty: pass a non-empty text file as --src")
    if b"\x00" in raw[: 1 << 20]:
        raise DataError(f"source file {path} looks binary (it contains NUL bytes): pass a UTF-8 text file as --src")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"source file {path} is not valid UTF-8 ({e.reason} at byte {e.start}): "
            "pass a UTF-8 text file (convert it, or it is not text)"
        ) from None


def read_source(
    src: str | Path | None, *, progress: Callable[[int, int], None] | None = None
) -> str:
    """The corpus text: the UTF-8 file `src`, or tiny Shakespeare downloaded and checksummed.

    `progress(done_bytes, total_bytes)` is called during a download (total 0 if unknown).
    """
    if src is not None:
        return read_text_file(src)
    return download_shakespeare(progress)


def shakespeare_text(cache_dir: str | Path, progress: Callable[[int, int], None] | None = None) -> tuple[str, bool]:
    """Tiny Shakespeare from `cache_dir/input.txt` if it is there and checksums, else downloaded
    and written there. Returns (text, whether it was downloaded)."""
    cached = Path(cache_dir) / SHAKESPEARE_FILE
    try:
        raw = cached.read_bytes()
        if _sha256(raw) == SHAKESPEARE_SHA256:
            return raw.decode("utf-8"), False
    except OSError:
        pass
    text = download_shakespeare(progress)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cached, text.encode("utf-8"))
    except OSError as e:
        raise DataError(
            f"cannot write {cached} ({e.strerror or e}): choose a writable dataset directory"
        ) from None
    return text, True


def shakespeare_corpus(text: str) -> dict[str, Any]:
    """meta.json's description of the tiny Shakespeare corpus."""
    return {"name": "tinyshakespeare", "source": SHAKESPEARE_URL, "sha256": SHAKESPEARE_SHA256, "characters": len(text)}


def file_corpus(path: str | Path, text: str) -> dict[str, Any]:
    """meta.json's description of a corpus read from a file (tiny Shakespeare if it checksums)."""
    raw = text.encode("utf-8")
    if _sha256(raw) == SHAKESPEARE_SHA256:
        return shakespeare_corpus(text) | {"source": str(path)}
    return {"name": "file", "source": str(path), "sha256": _sha256(raw), "characters": len(text)}


def fallback_corpus() -> tuple[str, dict[str, Any]]:
    """The offline corpus: ~1 MB of this Python's standard-library sources, deterministic.

    Returns (text, the description for meta.json). Raises DataError if this Python ships
    no sources (some minimal installs keep only .pyc files).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for name in sorted(FALLBACK_MODULES):
        for cand in (root / f"{name}.py", root / name / "__init__.py"):
            if cand.is_file():
                files.append(cand)
                break
    try:
        files += [p for p in sorted(root.glob("*.py")) if p not in files]
    except OSError:
        pass
    parts: list[str] = []
    used: list[str] = []
    size = 0
    for f in files:
        if size >= FALLBACK_CHARS:
            break
        try:
            part = f.read_bytes().decode("utf-8", errors="replace").replace("\x00", "")
        except OSError:
            continue
        if not part:
            continue
        if not part.endswith("\n"):
            part += "\n"
        parts.append(part)
        used.append(f.relative_to(root).as_posix())
        size += len(part)
    text = "".join(parts)
    if len(text) > FALLBACK_CHARS:
        cut = text.rfind("\n", 0, FALLBACK_CHARS)
        text = text[: cut + 1 if cut > 0 else FALLBACK_CHARS]
    if len(text) < _MIN_FALLBACK_CHARS:
        raise DataError(
            f"no network and too little Python source under {root} for the fallback corpus: "
            "prepare a dataset with `numesh data char --src FILE` and pass --data"
        )
    corpus = {
        "name": FALLBACK_NAME,
        "python": platform.python_version(),
        "stdlib": str(root),
        "files": used,
        "characters": len(text),
        "sha256": _sha256(text.encode("utf-8")),
    }
    return text, corpus


def prepare_char_dataset(text: str, out_dir: str | Path, corpus: dict[str, Any] | None = None,
                         overwrite: bool = False) -> dict[str, Any]:
    """Tokenize `text` and write train.bin / val.bin (90% / 10%) and meta.json to `out_dir`.

    Written as `numesh.dataset_write` says: staged beside `out_dir`, every file recorded in
    meta.json and checked, then renamed into place whole. A complete dataset with other
    content is replaced only with `overwrite`. `corpus` (what the text is: name, source,
    checksum) is stored in meta.json under "corpus".
    Returns {"vocab_size", "train_tokens", "val_tokens", "out_dir"}.
    """
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    n_train = int(TRAIN_FRACTION * len(ids))
    train, val = ids[:n_train], ids[n_train:]
    if len(train) == 0 or len(val) == 0:
        raise DataError(f"text of {len(ids)} characters is too short to split 90/10: use a longer text")
    out = dw.target(Path(out_dir))
    meta = tok.to_meta() | {"train_tokens": int(len(train)), "val_tokens": int(len(val))}
    if corpus is not None:
        meta["corpus"] = corpus
    with dw.staging(out) as stage:
        try:
            train.astype(TOKEN_DTYPE).tofile(stage / "train.bin")
            val.astype(TOKEN_DTYPE).tofile(stage / "val.bin")
        except OSError as e:
            raise DataError(f"cannot write the dataset beside {out} ({e.strerror or e}): free some space or "
                            "choose another --out") from None
        meta = dw.seal(stage, meta, {"train.bin": len(train), "val.bin": len(val)}, TOKEN_DTYPE, tok.vocab_size)
        dw.publish(stage, out, meta, overwrite)
    return {
        "vocab_size": tok.vocab_size,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "out_dir": str(Path(out_dir)),
    }


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
        return f"rebuild it with `numesh data char{src} --out {d}`"
    return f"rebuild it with `numesh data char --src FILE --out {d}` from the text it was made of"


def _missing(data_dir: Path) -> DataError:
    return DataError(
        f"no dataset at {data_dir}: run `numesh data shakespeare-char --out {data_dir}` first"
    )


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
        raise _missing(d) from None
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
        raise _missing(d) from None
    except OSError as e:
        raise DataError(f"cannot read dataset {d} ({e.strerror or e}): check its permissions") from None
    try:
        try:
            raw = _read_at(dir_fd, META_FILE)
        except FileNotFoundError:
            raise _missing(d) from None
        meta = _parse_meta(raw, d)
        hint, tok = rebuild_hint(meta, d), _tokenizer(meta)
        dc.check(d, meta, tok.vocab_size, hint, dir_fd)
        splits = {s: _open_split(d, meta, s, hint, dir_fd) for s in SPLITS}
    finally:
        os.close(dir_fd)
    return Dataset(d, meta, _sha256(raw), tok, splits)


def load_split(data_dir: str | Path, split: str) -> TokenStream:
    """The token ids of `split` ("train" or "val") as a read-only `TokenStream`: the uint16
    `{split}.bin` of a character dataset, or all of a sharded dataset's shards as one."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    return open_dataset(data_dir).split(split)


def verify_dataset(data: Dataset | str | Path) -> None:
    """Every byte of the dataset's files against meta.json (`numesh.dataset_check.verify`:
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


def is_default_dir(data_dir: str | Path) -> bool:
    """Whether `data_dir` is the default dataset location (relative to the working directory)."""
    return os.path.abspath(data_dir) == os.path.abspath(DEFAULT_DATA_DIR)


def _describe_fallback(corpus: dict[str, Any]) -> str:
    return (
        f"{corpus.get('characters', 0):,} characters of Python {corpus.get('python', '?')}'s "
        "standard-library sources"
    )


def ensure_dataset(
    data_dir: str | Path, *, progress: Callable[[int, int], None] | None = None
) -> tuple[Path, str | None]:
    """Make sure `data_dir` holds a dataset; returns (its path, a one-line note or None).

    A complete dataset (meta.json present) is used as it is. A missing one is prepared only
    at the default location (DEFAULT_DATA_DIR): tiny Shakespeare from `input.txt` cached
    there, else downloaded (sha256-checked, `progress(done, total)` called) and cached; when
    that fails (offline, or a wrong checksum), from `fallback_corpus()`, which meta.json
    then names. A missing directory the user chose raises the usual DataError: numesh
    never invents data for a path it was given.
    """
    d = Path(data_dir)
    if (d / META_FILE).is_file():
        corpus = read_corpus(d) or {}
        if corpus.get("name") == FALLBACK_NAME:
            return d, (
                f"{d} holds the offline fallback corpus ({_describe_fallback(corpus)}), not tiny "
                f"Shakespeare: run `numesh data shakespeare-char --out {d} --overwrite` online to replace it"
            )
        return d, None
    if not is_default_dir(d):
        raise _missing(d)
    try:
        text, downloaded = shakespeare_text(d, progress)
    except DownloadFailed as e:
        text, corpus = fallback_corpus()
        summary = prepare_char_dataset(text, d, corpus)
        return d, (
            f"offline: could not download tiny Shakespeare ({e.reason}); training on a fallback "
            f"corpus instead, {_describe_fallback(corpus)} (vocab {summary['vocab_size']}, written to {d}, "
            f"meta.json says so): run `numesh data shakespeare-char --out {d} --overwrite` online to replace it"
        )
    summary = prepare_char_dataset(text, d, shakespeare_corpus(text))
    how = f"downloaded tiny Shakespeare to {d / SHAKESPEARE_FILE}" if downloaded else f"used {d / SHAKESPEARE_FILE}"
    return d, (
        f"{how} and prepared {d}: vocab {summary['vocab_size']}, "
        f"{summary['train_tokens']:,} train / {summary['val_tokens']:,} val tokens"
    )


# --------------------------------------------------------------------------------------
# batches


def train_key(seed: int, step: int) -> tuple[int, ...]:
    """Key of the global training batch of `step`."""
    return (int(seed), 0, int(step))


def eval_key(seed: int, split: str, i: int) -> tuple[int, ...]:
    """Key of eval batch `i` of `split`: the same at every eval, apart from the training stream."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    return (int(seed), 1 if split == "train" else 2, int(i))


def batch_offsets(key: tuple[int, ...], n_tokens: int, batch_size: int, block_size: int) -> np.ndarray:
    """Start offsets (int64, shape (batch_size,)) of the global batch for `key`.

    Depends only on (key, n_tokens, batch_size, block_size), never on the mesh.
    """
    if block_size < 1:
        raise DataError(f"block_size must be positive, got {block_size}: pass a positive --block-size")
    if batch_size < 1:
        raise DataError(f"batch_size must be positive, got {batch_size}: pass a positive --batch-size")
    if n_tokens <= block_size:
        raise DataError(
            f"block_size {block_size} is larger than the {n_tokens}-token split: use a smaller --block-size"
        )
    parts = [int(k) for k in key]
    if not parts or min(parts) < 0:
        raise DataError(f"batch key {tuple(key)} must be non-empty and non-negative: use a seed >= 0")
    rng = np.random.default_rng(parts)
    return rng.integers(0, n_tokens - block_size, size=batch_size, dtype=np.int64)


def read_rows(data: np.ndarray | TokenStream, offsets: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs x = data[o:o+T] and targets y = data[o+1:o+1+T] for each offset, as int64.

    From a `TokenStream` (a dataset's split) one read per row, of only these rows; from an
    array one fancy index.
    """
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1)
    if offs.size and (offs.min() < 0 or offs.max() + block_size + 1 > len(data)):
        raise DataError(
            f"row offsets reach outside the {len(data)}-token split for block_size {block_size}: "
            "compute them with batch_offsets on this split"
        )
    if isinstance(data, TokenStream):
        rows = data.rows(offs, block_size + 1).astype(np.int64)
    else:
        rows = np.asarray(data[offs[:, None] + np.arange(block_size + 1)], dtype=np.int64)
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def local_batch(
    data: np.ndarray | TokenStream,
    key: tuple[int, ...],
    batch_size: int,
    block_size: int,
    dp_rank: int,
    dp_size: int,
    micro_batches: int,
    cp_rank: int = 0,
    cp_size: int = 1,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """This dp rank's share of the global batch for `key`, split in order into micro-batches.

    Rank r takes global rows r*B/dp ... (r+1)*B/dp; only those rows are read from `data`.
    Returns `micro_batches` pairs (x, y), each of shape (B/(dp*micro_batches), block_size/cp):
    with context parallelism, cp rank c keeps of each sequence its chunks c and 2cp-1-c of
    2cp (`numesh.mesh.zigzag.positions`), inputs and targets alike.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp rank {dp_rank} is not in 0..{dp_size - 1}: check the mesh's dp axis")
    if micro_batches < 1:
        raise DataError(f"micro_batches must be positive, got {micro_batches}: pass a positive --micro-batches")
    if batch_size % (dp_size * micro_batches):
        raise DataError(
            f"batch_size {batch_size} is not divisible by dp {dp_size} x micro_batches {micro_batches}: "
            f"use a --batch-size that is a multiple of {dp_size * micro_batches} or change dp / --micro-batches"
        )
    offsets = batch_offsets(key, len(data), batch_size, block_size)
    per_rank = batch_size // dp_size
    mine = offsets[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    x, y = read_rows(data, mine, block_size)
    if cp_size > 1:
        if block_size % (2 * cp_size):
            raise DataError(f"block_size {block_size} does not split into 2*cp={2 * cp_size} chunks: "
                            f"use a --block-size that is a multiple of {2 * cp_size}")
        x, y = take_local(x, cp_size, cp_rank), take_local(y, cp_size, cp_rank)  # [B/dp, T/cp]
    per_micro = per_rank // micro_batches
    # each micro-batch its own arrays (not views of the rank's rows), so what a micro-batch's
    # saved state holds (the embedding keeps its ids) is its own rows: activation accounting
    return [
        (x[m * per_micro : (m + 1) * per_micro].copy(), y[m * per_micro : (m + 1) * per_micro].copy())
        for m in range(micro_batches)
    ]
