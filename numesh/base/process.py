"""Processes of this host, as the kernel sees them (stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process `pid` (of this host) still runs; a zombie (exited, not yet reaped by
    mpiexec's proxy) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != "Z"


def stopped(pid: int) -> bool:
    """Whether process `pid` (of this host) is stopped: by SIGSTOP or Ctrl-Z (state T), or
    by a debugger (t). False where that cannot be read (no /proc, or the process is gone)."""
    return _state(pid) in ("T", "t")


def _state(pid: int) -> str:
    """The process's state letter in /proc/PID/stat (R, S, D, T, t, Z, ...); '' if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
