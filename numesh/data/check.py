"""A dataset's files checked against what its meta.json records of them.

meta.json's "files" maps each file of the dataset to a `FileRecord`: its size and sha256
and, for a file of token ids, how many ids it holds and the largest. `check` compares the
sizes (one stat per file: every time a dataset is opened); `verify` reads every byte once
(sha256 and the ids: when a run starts). sha256 because the rest of numesh records it
(checkpoints, corpus files, tokenizers), `sha256sum` checks it by hand, and with the CPU's
SHA extensions it is the fastest hash in hashlib here (1.7 GB/s against blake2b's 0.8 on
the 2-core VM), so verifying is cheaper than one training step per GB.

A dataset written before the records (no "files") is checked by the token counts its
meta.json holds and, when verified, by the ids in its files, which must be below the
vocabulary: one wrong id made the embedding's lookup raise IndexError, or on tp=2 made
training "diverge" at step 0.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

import attrs
import numpy as np

from numesh.base.errors import DataError

META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
CHAR_DTYPE = np.dtype("<u2")  # a character dataset's train.bin / val.bin
SHARD_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_READ = 1 << 22  # bytes per read when scanning a file: 4 MiB, a multiple of every id size


@attrs.frozen
class FileRecord:
    """What meta.json records of one file: its size and sha256, and for a file of token
    ids how many it holds and the largest (None for other files)."""

    bytes: int
    sha256: str
    tokens: int | None = None
    max_id: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if v is not None}


@attrs.frozen
class Expected:
    """A file a meta.json promises: its ids' dtype (None: not a token file), its size when
    known, and its record when the dataset has them."""

    name: str
    dtype: np.dtype | None
    bytes: int | None
    record: FileRecord | None


def token_dtype(meta: Mapping[str, Any]) -> np.dtype:
    """The dtype of a dataset's ids: a sharded dataset's "dtype", else a character one's uint16."""
    if "shards" not in meta:
        return CHAR_DTYPE
    dtype = SHARD_DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise DataError(f"meta.json's dtype {meta.get('dtype')!r} is not one of {', '.join(SHARD_DTYPES)}")
    return dtype


def _plain_name(name: Any, where: Path) -> str:
    """A file name from meta.json: a name inside the dataset directory, nothing else."""
    if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
        raise DataError(f"{where} names a file {name!r} outside the dataset directory: prepare the dataset again")
    return name


def _record(raw: Any, name: str, where: Path) -> FileRecord:
    try:
        rec = FileRecord(**raw)
    except TypeError:
        raise DataError(f"{where}'s record of {name} is not {{bytes, sha256, tokens, max_id}}: "
                        "prepare the dataset again") from None
    ints = [rec.bytes] + [v for v in (rec.tokens, rec.max_id) if v is not None]
    if not isinstance(rec.sha256, str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise DataError(f"{where}'s record of {name} has a value of the wrong type: prepare the dataset again")
    return rec


def _legacy(meta: Mapping[str, Any], dtype: np.dtype) -> list[Expected]:
    """What a meta.json written before the records promises: each shard's ids, or the
    char splits' token counts."""
    if "shards" in meta:
        try:
            return [Expected(s["file"], dtype, int(s["tokens"]) * dtype.itemsize, None)
                    for split in ("train", "val") for s in meta["shards"][split]]
        except (KeyError, TypeError, ValueError):
            raise DataError("meta.json does not list the train and val shards: prepare the dataset again") from None
    out = []
    for split in ("train", "val"):
        n = meta.get(f"{split}_tokens")
        out.append(Expected(f"{split}.bin", dtype, n * dtype.itemsize if isinstance(n, int) else None, None))
    return out


def expected_files(meta: Mapping[str, Any], where: Path) -> list[Expected]:
    """Every file `meta` (read from `where`) promises, with what is known of it."""
    dtype = token_dtype(meta)
    files = meta.get("files")
    if files is None:
        return [attrs.evolve(e, name=_plain_name(e.name, where)) for e in _legacy(meta, dtype)]
    if not isinstance(files, dict) or not files:
        raise DataError(f"{where}'s \"files\" is not a map of file records: prepare the dataset again")
    out = []
    for name, raw in files.items():
        rec = _record(raw, _plain_name(name, where), where)
        out.append(Expected(name, dtype if rec.tokens is not None else None, rec.bytes, rec))
    return out


def _size(d: Path, name: str, dir_fd: int | None, hint: str) -> int:
    try:
        return os.stat(name if dir_fd is not None else d / name, dir_fd=dir_fd).st_size
    except FileNotFoundError:
        raise DataError(f"{d / name} is missing: {hint}") from None
    except OSError as e:
        raise DataError(f"cannot read {d / name} ({e.strerror or e}): check its permissions") from None


def check(d: Path, meta: Mapping[str, Any], vocab_size: int, hint: str, dir_fd: int | None = None) -> None:
    """Every file `meta` promises is in `d` (or the directory `dir_fd` holds open) with the
    size it records, and no recorded largest id reaches `vocab_size`: one stat per file.
    `hint` says how to rebuild the dataset; a DataError names the first file that disagrees."""
    where = d / META_FILE
    for e in expected_files(meta, where):
        size = _size(d, e.name, dir_fd, hint)
        if e.bytes is not None and size != e.bytes:
            # a rewrite killed midway (before the records) left new token files beside the old meta.json
            raise DataError(f"{d / e.name} holds {size:,} bytes but {where} says {e.bytes:,}: the dataset was "
                            f"partly rewritten or edited; {hint}")
        if e.dtype is not None and (size == 0 or size % e.dtype.itemsize):
            raise DataError(f"{d / e.name} has {size} bytes, not a non-empty array of {e.dtype.itemsize}-byte ids: "
                            f"{hint}")
        if e.record is not None and e.record.max_id is not None and e.record.max_id >= vocab_size:
            raise DataError(f"{where} says {e.name} holds id {e.record.max_id}, outside the vocabulary of "
                            f"{vocab_size}: {hint}")


@attrs.frozen
class Scan:
    """One read of a file: its record, and where its first id at or above the limit is and
    that id (None, None: there is none)."""

    record: FileRecord
    first_bad: int | None = None
    bad_id: int | None = None


def scan_fd(fd: int, dtype: np.dtype | None, limit: int | None = None) -> Scan:
    """Read the open file `fd` from its start (pread: its offset is left alone) to its end:
    size, sha256, and for ids of `dtype` their count, largest and first one >= `limit`."""
    h, buf = hashlib.sha256(), bytearray(_READ)
    view, done, top, bad, bad_id = memoryview(buf), 0, -1, None, None
    while n := os.preadv(fd, [view], done):
        h.update(view[:n])
        if dtype is not None and n >= dtype.itemsize:
            ids = np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
            top = max(top, int(ids.max()))
            if bad is None and limit is not None and top >= limit:
                at = int(np.argmax(ids >= limit))
                bad, bad_id = done // dtype.itemsize + at, int(ids[at])
        done += n
    if dtype is None:
        return Scan(FileRecord(done, h.hexdigest()))
    return Scan(FileRecord(done, h.hexdigest(), done // dtype.itemsize, max(top, 0)), bad, bad_id)


def scan_file(path: Path, dtype: np.dtype | None, limit: int | None = None) -> Scan:
    """`scan_fd` of the file at `path`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror or e}): check the path and its permissions") from None
    try:
        return scan_fd(fd, dtype, limit)
    finally:
        os.close(fd)


def verify(d: Path, meta: Mapping[str, Any], vocab_size: int, hint: str, fds: Mapping[str, int] | None = None) -> None:
    """`check`, then every file read once: its sha256 against the record (when there is one)
    and every id below `vocab_size`. `fds` are files already open (a run's own handles, so
    what is verified is what it reads); the others are opened by name in `d`."""
    check(d, meta, vocab_size, hint)
    fds = fds or {}
    for e in expected_files(meta, d / META_FILE):
        path = d / e.name
        limit = vocab_size if e.dtype is not None else None
        got = scan_fd(fds[e.name], e.dtype, limit) if e.name in fds else scan_file(path, e.dtype, limit)
        if got.first_bad is not None:
            raise DataError(f"{path} holds id {got.bad_id} at token {got.first_bad:,}, outside the vocabulary of "
                            f"{vocab_size} in {d / META_FILE}: {hint}")
        if e.record is not None and got.record.sha256 != e.record.sha256:
            raise DataError(f"{path} does not match its sha256 in {d / META_FILE} (it changed after it was "
                            f"written): {hint}")
