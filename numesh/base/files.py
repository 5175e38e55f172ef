"""Writing a file so that readers never see half of it, and reading a file the user names."""

from __future__ import annotations

import errno
import json
import os
import secrets
import tomllib
from pathlib import Path
from typing import Any, Callable

# what `read_user_file` parses: every parser's errors (and a file that is not UTF-8) are ValueErrors
PARSERS: dict[str, Callable[[str], Any]] = {"TOML": tomllib.loads, "JSON": json.loads}


def write_atomic(path: Path, content: str | bytes | Callable[[Path], None]) -> None:
    """Write `content` (text as UTF-8, bytes, or a function that writes the path it is given)
    to a temporary sibling, then rename it to `path`: a reader sees the old file or the whole
    new one. The temporary file is removed if writing fails. No fsync: checkpoints, which
    must survive a crash, use numesh.checkpoint.format.write_file_atomic."""
    # the random part: two hosts' processes of the same pid writing one file on a shared
    # file system (each host's first rank caches the peak in one home directory) must not
    # write into the same temporary file
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        elif isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            content(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def resolved_or_none(path: str | Path) -> Path | None:
    """`path` absolute with every symbolic link followed (Path.resolve), or None where a
    symbolic link loop stands in the way; any other OSError (the working directory deleted)
    is raised. Python disagrees with itself about a loop: 3.11's resolve raises
    RuntimeError, 3.13's returns a path it could not resolve; os.stat's ELOOP says it on both.
    Each caller says in its own words what a loop means for it."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None
    try:
        return Path(path).resolve()
    except RuntimeError:  # 3.11's "Symlink loop from ...", where only a component past the stat loops
        return None


def os_reason(e: OSError) -> str:
    """Why a file could not be written, in words for a one-line error. A file standing where
    a directory must be is named: mkdir says only "File exists" and open "Not a directory",
    about a path further down. A full disk is called one."""
    if isinstance(e, (FileExistsError, NotADirectoryError)) and e.filename:
        path = Path(os.fsdecode(e.filename))
        for p in [*reversed(path.parents), path]:
            if p.exists() and not p.is_dir():
                return f"{p} is a file, not a directory"
    if e.errno == errno.ENOSPC:
        return f"{e.strerror or 'No space left on device'}, the disk is full"
    return e.strerror or str(e)


def read_user_file(path: Path, what: str, fmt: str, error: Callable[[str], Exception], hint: str = "") -> Any:
    """The parsed content of a `fmt` ("TOML" or "JSON") file the user named, or `error` (a
    UserError class: this module imports none) with one line that names the file as `what`:
    not found (or a directory; `hint` says what to pass instead), not valid `fmt`, or not
    readable. A config file and a hardware profile fail alike."""
    if not path.is_file():
        raise error(f"{what} {path} not found" + (" (it is a directory)" if path.is_dir() else "")
                    + (f": {hint}" if hint else ""))
    try:
        return PARSERS[fmt](path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise error(f"{what} {path} is not valid {fmt}: {e}") from None
    except OSError as e:
        raise error(f"{what} {path} cannot be read: {e.strerror or e}") from None


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None where it is missing, unreadable or not an object:
    for a file a reader can do without (a transformers directory's tokenizer_config.json)."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
