"""Corpora: the documents of text files, streamed, never held whole.

Inputs are files, directories (every .txt, .jsonl and .parquet file under them, sorted,
but for hidden ones: a name starting with '.', or under such a folder, as .git or
.ipynb_checkpoints) and globs (sorted); a file reached twice, by a symbolic link or
another spelling of its path, is read once. A `.txt` file is one document, or with
`split_on` many (split as it streams); a `.jsonl` file holds one document per line in its
`text_field`; a `.parquet` file the same field (with the `parquet` extra, pyarrow). A
UTF-8 byte-order mark starting a .txt or .jsonl file is not text: it is left out. Every
unreadable file, bad line or missing field is a one-line DataError naming where.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import attrs

from numesh.base.errors import DataError

SUFFIXES = (".txt", ".jsonl", ".parquet")
_READ = 1 << 20  # bytes per read when streaming or hashing


@attrs.frozen
class Reading:
    """How documents are cut from files: `split_on` a separator in .txt files (None: a file
    is one document) and `text_field` the field holding a .jsonl/.parquet document's text."""

    split_on: str | None = None
    text_field: str = "text"


def _scan(d: Path) -> list[Path]:
    """The corpus files under directory `d`, sorted: not hidden ones (a name starting with
    '.'), nor any under a hidden folder (.git, .ipynb_checkpoints), which are not walked."""
    found = []
    for top, dirs, names in os.walk(d):
        dirs[:] = [n for n in dirs if not n.startswith(".")]
        found += [Path(top, n) for n in names if not n.startswith(".") and Path(n).suffix in SUFFIXES]
    return sorted(p for p in found if p.is_file())


def expand(sources: Sequence[str | Path]) -> list[Path]:
    """The corpus files `sources` name, in order, each once (a symbolic link to a file
    already named, or one named again, is left out)."""
    out: list[Path] = []
    seen: set[Path] = set()
    for src in sources:
        s = str(src)
        if not s.strip():
            raise DataError("--src is empty: name the corpus's files, directories or globs")
        if any(c in s for c in "*?[") and not Path(s).exists():  # an existing path is itself: notes[1].txt
            found = [Path(p) for p in sorted(glob.glob(s, recursive=True)) if Path(p).is_file()]
            if not found:
                raise DataError(f"no file matches {s}: check the pattern")
        elif Path(s).is_dir():
            found = _scan(Path(s))
            if not found:
                raise DataError(f"directory {s} holds no {', '.join(SUFFIXES)} file (hidden ones left out): point "
                                "--src at the corpus")
        elif Path(s).is_file():
            found = [Path(s)]
        else:
            raise DataError(f"source {s} does not exist: pass existing files, directories or globs as --src")
        for p in found:
            if p.suffix not in SUFFIXES:
                raise DataError(f"{p} is not a {', '.join(SUFFIXES)} file: convert it or leave it out")
            if (real := p.resolve()) not in seen:
                seen.add(real)
                out.append(p)
    return out


def describe(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """{path, bytes, sha256} of each file (read in 1 MiB pieces), for meta.json."""
    out = []
    for p in paths:
        h, size = hashlib.sha256(), 0
        try:
            with open(p, "rb") as f:
                while piece := f.read(_READ):
                    h.update(piece)
                    size += len(piece)
        except OSError as e:
            raise DataError(f"cannot read {p} ({e.strerror or e}): check the path and permissions") from None
        out.append({"path": str(p), "bytes": size, "sha256": h.hexdigest()})  # the bytes hashed, not a later stat
    return out


def check_unchanged(paths: Sequence[Path], files: list[dict[str, Any]]) -> None:
    """The corpus files still hold what `describe` found (`files`): a file another process
    wrote to while it was read would leave a dataset that its meta.json misdescribes."""
    for before, now in zip(files, describe(paths)):
        if before != now:
            raise DataError(f"{now['path']} changed while it was read (another process wrote to it): run the "
                            "command again once it is complete")


def documents(path: Path, how: Reading) -> Iterator[str]:
    """The documents of one corpus file, streamed."""
    if path.suffix == ".jsonl":
        return _jsonl(path, how.text_field)
    if path.suffix == ".parquet":
        return _parquet(path, how.text_field)
    return _txt(path, how.split_on)


def _open_text(path: Path):
    """`path` to read as UTF-8 text, without newline translation and without the byte-order
    mark some Windows editors put first (it would be a character of the first document)."""
    try:
        return open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}): check the path and permissions") from None


def separator(split_on: str) -> re.Pattern[str]:
    """`split_on` as a pattern in which each newline also matches a CRLF: a blank-line
    separator splits a Windows-edited file too, while the documents keep their own bytes
    (text is read without newline translation, so a document's CRLFs stay CRLFs)."""
    return re.compile("\r?\n".join(re.escape(part) for part in split_on.split("\n")))


def _txt(path: Path, split_on: str | None) -> Iterator[str]:
    with _open_text(path) as f:
        try:
            if split_on is None:
                yield f.read()
                return
            sep, rest = separator(split_on), ""
            while piece := f.read(_READ):
                parts = sep.split(rest + piece)
                rest = parts.pop()
                yield from parts
            yield rest
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not valid UTF-8 ({e.reason}): convert it to UTF-8") from None


def _encodable(text: str, path: Path, n: int) -> str:
    """`text`, which JSON's \\ud800-style escapes may have given an unpaired surrogate that no
    UTF-8 encodes (the tokenizer and the byte counts would fail on it): one line saying where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{path}:{n} holds an unpaired surrogate {text[e.start]!r} (a JSON \\u escape of half a "
                        "character): fix the line") from None
    return text


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with _open_text(path) as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n} is not valid JSON ({e.msg}): fix or remove the line") from None
                if not isinstance(row, dict) or field not in row:
                    raise DataError(f"{path}:{n} has no text field {field!r}: pass --text-field with the field "
                                    "that holds the text")
                text = row[field]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{n}: field {field!r} holds {type(text).__name__}, not text: fix the "
                                    "line or pass --text-field with the field that holds the text")
                yield _encodable(text, path, n)
        except UnicodeDecodeError as e:
            raise DataError(f"{path} is not valid UTF-8 ({e.reason}): convert it to UTF-8") from None


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow: pip install 'numesh[parquet]'") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error types
        raise DataError(f"cannot read {path} as Parquet ({str(e).splitlines()[0][:120]})") from None
    if field not in f.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (it has {', '.join(f.schema_arrow.names)}): "
                        "pass --text-field with the column that holds the text")
    for batch in f.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataError(f"{path} has a non-text value in column {field!r}: clean the column")
            yield text
