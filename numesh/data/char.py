"""Character datasets: the default one (tiny Shakespeare, prepared on demand, with an
offline fallback corpus) and any text file's (`numesh data char`, `shakespeare-char`).

A character dataset directory holds `train.bin` and `val.bin` (raw little-endian uint16 token
ids) and `meta.json` (the characters, token counts and a record of every file; JSON, no
pickle), written whole by numesh/data/write.py and opened by numesh/data/dataset.py.

Pure NumPy and stdlib: no MPI here.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import platform
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from numesh.base.errors import DataError
from numesh.base.files import write_atomic
from numesh.data import write as dw
from numesh.data.dataset import FALLBACK_NAME, META_FILE, missing_dataset, read_corpus
from numesh.data.tokenizer import TOKEN_DTYPE, CharTokenizer

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
_CHUNK = 1 << 16
BOM = "\ufeff"  # the UTF-8 byte-order mark some editors write first, left out of the text


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
    """A non-empty UTF-8 text file, without a byte-order mark first; missing, empty, binary or
    unreadable files raise DataError."""
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
    if b"\x00" in raw[: 1 << 20]:
        raise DataError(f"source file {path} looks binary (it contains NUL bytes): pass a UTF-8 text file as --src")
    try:
        text = raw.decode("utf-8").removeprefix(BOM)  # a Windows editor's mark, not a character of the text
    except UnicodeDecodeError as e:
        raise DataError(
            f"source file {path} is not valid UTF-8 ({e.reason} at byte {e.start}): "
            "pass a UTF-8 text file (convert it, or it is not text)"
        ) from None
    if not text:
        raise DataError(f"source file {path} is empty: pass a non-empty text file as --src")
    return text


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
                         overwrite: bool = False, tokenizer: CharTokenizer | None = None) -> dict[str, Any]:
    """Tokenize `text` and write train.bin / val.bin (90% / 10%) and meta.json to `out_dir`.

    The vocabulary is `text`'s characters, or `tokenizer`'s (a character model's, to
    fine-tune it: every character of `text` must be in it).

    Written as `numesh.data.write` says: staged beside `out_dir`, every file recorded in
    meta.json and checked, then renamed into place whole. A complete dataset with other
    content is replaced only with `overwrite`. `corpus` (what the text is: name, source,
    checksum) is stored in meta.json under "corpus".
    Returns {"vocab_size", "train_tokens", "val_tokens", "out_dir"}.
    """
    tok = tokenizer if tokenizer is not None else CharTokenizer.from_text(text)
    ids = tok.encode(text)
    n_train = int(TRAIN_FRACTION * len(ids))
    train, val = ids[:n_train], ids[n_train:]
    if len(train) < 2 or len(val) < 2:  # a split trains or evaluates on a token and the next: 1 is unusable
        raise DataError(f"text of {len(ids)} characters is too short to split 90/10 into splits of 2 tokens or "
                        f"more (train {len(train)}, val {len(val)}): use a longer text")
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
    at the default location (DEFAULT_DATA_DIR), and only where that holds no dataset files
    numesh did not write (`numesh.data.write.foreign`): tiny Shakespeare from `input.txt` cached
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
        raise missing_dataset(d)
    foreign = dw.foreign(d)
    if foreign:  # a lost meta.json, or another tool's files (nanoGPT's prepare writes train.bin here too)
        raise DataError(f"{d} holds {', '.join(foreign)} but no meta.json numesh wrote, and numesh never deletes "
                        f"files it did not write: move them away to have tiny Shakespeare prepared there, or pass "
                        "--data with a dataset")
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
