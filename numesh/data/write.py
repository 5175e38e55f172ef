"""Writing a dataset directory as checkpoints are written: staged, recorded, checked, renamed.

A writer builds the dataset in `.NAME.writing-HOST-PID` beside its target (`staging`),
records every file in meta.json (`seal`: size, token count, largest id, sha256) and checks
the staged files against those records, then `publish` renames the directory into place:
one atomic exchange on Linux (renameat2 RENAME_EXCHANGE), two renames elsewhere. A dataset
is so replaced only as a whole: a writer killed at any point (kill -9 included) leaves the
old one as it was, and the next writer removes the staging directory a dead one left.

A complete dataset is replaced by different content only when asked (`overwrite`): runs
were trained on it. The same content again, or a dataset that fails its own check, is
replaced freely. Files of the old directory that are not the dataset's (the cached
`input.txt` of tiny Shakespeare, a note) are carried into the new one as hard links. A
directory that holds files of a dataset's names (`tokenizer.json`, `train.bin`, a
`meta.json`, ...) but no meta.json numesh wrote is refused, with or without `overwrite`:
they are someone else's (a transformers export's tokenizer, nanoGPT's `train.bin`), and
numesh never deletes files it did not write.
No fsync: a power cut can leave a dataset that fails its check at the next run's start,
never one that trains silently.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from numesh.base.errors import DataError
from numesh.base.files import resolved_or_none, write_atomic
from numesh.base.process import alive
from numesh.data import check as dc

_OWNED = re.compile(r"^(meta\.json|tokenizer\.json|(train|val)(-\d+)?\.bin)$")  # a dataset's files, never carried
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>writing|old)-(?P<host>.+)-(?P<pid>\d+)$")


def _sibling(out: Path, kind: str) -> Path:
    return out.with_name(f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}")


def target(out: Path) -> Path:
    """Where a dataset for `out` goes: `out`, or the directory it links to (the link stays).
    Not a file, and not the current directory or one holding it: the dataset directory is
    renamed as a whole (and `--out ""` is the current directory)."""
    try:
        here, real = Path.cwd().resolve(), resolved_or_none(out)
    except OSError as e:
        raise DataError(f"cannot resolve --out {out} ({e.strerror or e}): choose another --out") from None
    if real is None:
        raise DataError(f"cannot resolve --out {out} (a symlink loop): choose another --out")
    above = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if above is not None:  # else the mkdir beside it said "File exists"
        raise DataError(f"--out {out}: {above} is a file, not a directory: choose another --out")
    if real == here or real in here.parents:
        raise DataError(f"--out {out} is the current directory or holds it: name a directory for the dataset, "
                        "e.g. data/NAME")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory: choose another --out")
    found = real if out.is_symlink() else out
    refuse_foreign(found)
    return found


def _written_by_numesh(meta: Any) -> bool:
    """Whether a parsed meta.json is a dataset's as numesh writes it: a vocabulary size and
    its characters (a character dataset) or its shards (a sharded one)."""
    return (isinstance(meta, dict) and isinstance(meta.get("vocab_size"), int)
            and (isinstance(meta.get("chars"), list) or isinstance(meta.get("shards"), dict)))


def foreign(out: Path) -> list[str]:
    """The entries of `out` a dataset written there would replace although numesh did not
    write them: every one of a dataset's names (tokenizer.json, train-N.bin, ...) when
    `out` has no meta.json of numesh's, else none."""
    try:
        names = sorted(p.name for p in out.iterdir() if _OWNED.match(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise DataError(f"cannot list --out {out} ({e.strerror or e}): check its permissions") from None
    if not names:
        return []
    try:
        meta = json.loads((out / dc.META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = None
    return [] if _written_by_numesh(meta) else names


def refuse_foreign(out: Path) -> None:
    """A DataError when writing a dataset to `out` would replace files numesh did not write
    (`foreign`); `overwrite` does not change this: they are not a dataset numesh can rebuild."""
    names = foreign(out)
    if names:
        raise DataError(f"--out {out} holds {', '.join(names)} but no dataset numesh wrote (no meta.json of its "
                        "own), and writing one would delete them: choose a new or empty --out")


def clean_leftovers(out: Path) -> list[Path]:
    """Remove what writers of `out` killed on this host left beside it (a staging directory,
    or the old dataset between the two renames of a fallback `publish`, put back if `out`
    is gone). A live writer's directories, and other hosts', are left alone. Returns those removed."""
    removed = []
    for p in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        m = _LEFTOVER.match(p.name)
        if not m or m["name"] != out.name or m["host"] != socket.gethostname() or alive(int(m["pid"])):
            continue
        if m["kind"] == "old" and not out.exists():
            os.rename(p, out)  # killed between the renames: the old dataset goes back
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def check_writable(out: Path) -> None:
    """Fail now where `out`'s dataset cannot be written, before a BPE is trained for it (an
    hour on a large corpus): the staging directory made and removed."""
    with staging(out):
        pass


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A new empty directory beside `out` (a `target`) to write a dataset into, removed on
    the way out (after `publish` it holds the old dataset, or nothing)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(out)
        stage = _sibling(out, "writing")
        shutil.rmtree(stage, ignore_errors=True)
        os.mkdir(stage)  # not mkdtemp: the mode any new directory of the user's gets
    except OSError as e:
        raise DataError(f"cannot create a dataset beside {out} ({e.strerror or e}): choose a writable --out") from None
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def seal(stage: Path, meta: dict[str, Any], tokens: Mapping[str, int], dtype: np.dtype, vocab_size: int,
         others: tuple[str, ...] = ()) -> dict[str, Any]:
    """Record the staged files in meta.json: the token files `tokens` (name -> ids written)
    and the `others`, each read back once; check them (every count as written, every id
    below `vocab_size`, the reader's `check`) and write meta.json. Returns the meta written."""
    files = {}
    for name, n in tokens.items():
        got = dc.scan_file(stage / name, dtype, vocab_size)
        if got.record.tokens != n:
            raise DataError(f"{stage / name} holds {got.record.tokens:,} ids after writing {n:,}: "
                            "is the disk full? Free some space and prepare the dataset again")
        if got.first_bad is not None:
            raise DataError(f"writing id {got.bad_id} into {name}, outside the vocabulary of {vocab_size}")
        files[name] = got.record.to_json()
    for name in others:
        files[name] = dc.scan_file(stage / name, None).record.to_json()
    meta = {**meta, "files": files}
    write_atomic(stage / dc.META_FILE, json.dumps(meta, ensure_ascii=False, indent=1))
    dc.check(stage, meta, vocab_size, "a bug in the writer")
    return meta


def existing(out: Path) -> dict[str, Any] | None:
    """The meta.json of the complete dataset in `out`, or None: no dataset, or one that
    fails its own check (sizes), which nothing can train on and anything may replace."""
    try:
        meta = json.loads((out / dc.META_FILE).read_text(encoding="utf-8"))
        vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
        if not isinstance(vocab, int):
            return None
        dc.check(out, meta, vocab, "")
        return meta
    except (OSError, ValueError, DataError):
        return None


def _tokenizer_of(meta: Mapping[str, Any]) -> Any:
    return meta.get("tokenizer", meta.get("chars"))


def difference(out: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """What differs between the dataset `old` describes (in `out`) and `new` (recorded),
    or None when they hold the same ids with the same tokenizer. An old dataset without
    records has its token files read to compare."""
    if _tokenizer_of(old) != _tokenizer_of(new):
        return "another tokenizer"
    olds = {e.name: e for e in dc.expected_files(old, out / dc.META_FILE) if e.dtype is not None}
    news = {e.name: e.record for e in dc.expected_files(new, Path(dc.META_FILE)) if e.dtype is not None}
    if olds.keys() != news.keys():
        return f"{len(olds)} token files where the new one has {len(news)}"
    for name, e in olds.items():
        rec = e.record or dc.scan_file(out / name, e.dtype).record
        if rec.sha256 != news[name].sha256:
            return f"another {name}"
    return None


def refused(out: Path, what: str) -> DataError:
    return DataError(f"{out} already holds a dataset with {what}: pass --overwrite to replace it (runs trained "
                     "on it will not match it any more), or choose another --out")


def refuse_replacing(out: Path, new: Mapping[str, Any], overwrite: bool) -> None:
    """A DataError when `out` holds a complete dataset with other content than `new` and
    `overwrite` is not set: runs trained on it would silently no longer match it."""
    old = None if overwrite else existing(out)
    what = difference(out, old, new) if old is not None else None
    if what is not None:
        raise refused(out, what)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry(out: Path, stage: Path) -> None:
    """Hard links in `stage` of `out`'s entries that are not a dataset's files (nor a writer's leftovers)."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        if _OWNED.match(p.name) or (stage / p.name).exists() or ".tmp-" in p.name:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.copytree(p, stage / p.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(p), str(stage / p.name))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where this system
    or filesystem cannot, and nothing was done."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc before glibc 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(stage: Path, out: Path, meta: Mapping[str, Any], overwrite: bool) -> None:
    """Put the sealed dataset `stage` (its meta.json `meta`) in place as `out` in one
    rename, unless `refuse_foreign` or `refuse_replacing` says no; the old dataset ends up
    in `stage`."""
    refuse_foreign(out)
    refuse_replacing(out, meta, overwrite)
    try:
        _carry(out, stage)
        if not out.exists():
            os.rename(stage, out)
        elif not _exchange(stage, out):
            old = _sibling(out, "old")
            os.rename(out, old)
            os.rename(stage, out)  # between these two renames `out` is missing: clean_leftovers puts old back
            os.rename(old, stage)
    except OSError as e:
        raise DataError(f"cannot put the new dataset in place at {out} ({e.strerror or e}): check the "
                        "permissions of its directory") from None
