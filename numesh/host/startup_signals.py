"""Preemption signals from `numesh train`'s first line to its training loop: kept, not lost.

The training loop's `InterruptWatch` (numesh/host/interrupt.py) turns the signals
`--save-on-signal` names into a stop at a step boundary that every rank agrees on. Before
it starts, a run spends seconds to minutes on imports and kernel compilation, MPI
initialisation, the dataset's checks, `--mesh auto`, `--init-from`, the checkpoint of a
`--resume auto` attempt and the MFU peak. A scheduler's warning in that window was lost:
before MPI initialisation SIGUSR1's default action killed the process (exit 138, no
message); after it, MPICH's own SIGUSR1 handler swallowed it and the run trained to the end
(issue 44). So `catch_for_command`, the first thing the `numesh train` process does, records
those signals from then on (`take` hands the first to the loop, which stops every rank at
its first step boundary and exits 75); it installs the handlers again right after MPI's
initialisation, which replaces them, and gives every other signal `--save-on-signal` could
name the disposition it had before (under `--save-on-signal none`, SIGUSR1's default
action: the process ends, as the docs promise). `settle` does the same once the run's
configuration (a --config file may name other signals) is known, delivering a signal it
no longer keeps with its own action.

Nothing here imports MPI at module level: this runs before the heavy imports.
"""

from __future__ import annotations

import os
import signal
from typing import Any, Sequence

from numesh.base.errors import ConfigError

# what --save-on-signal may name: the signals schedulers send ahead of a kill (Slurm's
# --signal, PBS/LSF's warnings), and Ctrl-C's
SAVE_SIGNALS = ("HUP", "INT", "QUIT", "TERM", "USR1", "USR2", "XCPU")
DEFAULT_SAVE_SIGNALS = "TERM,USR1"  # --save-on-signal's default

_before: dict[int, Any] = {}  # each of SAVE_SIGNALS' disposition before `catch_for_command`
_pending = 0  # the first signal recorded and not yet taken (0: none)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def parse_signals(text: str) -> tuple[int, ...]:
    """Signal numbers of a comma-separated list of names ("TERM,USR1", "SIGUSR1"; any case);
    "" and "none" are none. A name outside SAVE_SIGNALS is a ConfigError."""
    if text.strip().lower() in ("", "none"):
        return ()
    out = []
    for part in text.split(","):
        name = part.strip().upper().removeprefix("SIG")
        if name not in SAVE_SIGNALS:
            raise ConfigError(f"--save-on-signal: {part.strip()!r} is not one of {', '.join(SAVE_SIGNALS)} "
                              "(comma-separated), or none")
        out.append(int(getattr(signal, f"SIG{name}")))
    return tuple(dict.fromkeys(out))


def argv_signals(argv: Sequence[str]) -> tuple[int, ...] | None:
    """The signals `numesh train` will save on, as far as its command line says (the last
    --save-on-signal, else the default; a --config file is read later, by `settle`); None
    when `argv` is not `numesh train` or names a signal it will refuse."""
    if list(argv[1:2]) != ["train"]:
        return None
    text = DEFAULT_SAVE_SIGNALS
    for i, arg in enumerate(argv):
        if arg == "--save-on-signal" and i + 1 < len(argv):
            text = argv[i + 1]
        elif arg.startswith("--save-on-signal="):
            text = arg.split("=", 1)[1]
    try:
        return parse_signals(text)
    except ConfigError:
        return None  # the run's checks say so in one line


def _record(signum: int, frame: object) -> None:
    global _pending
    if not _pending:
        _pending = signum


def catch_for_command(argv: Sequence[str]) -> None:
    """At the first line of the `numesh` process: for `numesh train`, record the signals it
    saves on from now on, initialise MPI and install the handlers again (MPI_Init replaces
    SIGUSR1's), the other SAVE_SIGNALS back as they were. Nothing for other commands."""
    signals = argv_signals(argv)
    if signals is None:
        return
    for name in SAVE_SIGNALS:
        num = int(getattr(signal, f"SIG{name}"))
        _before.setdefault(num, signal.getsignal(num))
    _keep(signals)
    from mpi4py import MPI  # noqa: F401  (MPI_Init: its handlers replace ours, so ours go back on)

    _keep(signals)


def settle(signals: tuple[int, ...]) -> None:
    """Once the run's --save-on-signal is known: record exactly `signals`, the other
    SAVE_SIGNALS as they were before `catch_for_command` (one that came meanwhile is
    delivered now, with that action). Nothing unless `catch_for_command` caught signals
    (a library caller's handlers are its own)."""
    if _before:
        _keep(signals)


def _keep(signals: tuple[int, ...]) -> None:
    global _pending
    for num, before in _before.items():
        if num in signals:
            signal.signal(num, _record)
        elif before is not None:  # None: set outside Python, left alone
            signal.signal(num, before)
    if _pending and _pending not in signals:
        came, _pending = _pending, 0
        os.kill(os.getpid(), came)  # its own action now: e.g. SIGUSR1's default ends the process


def take() -> int:
    """The first signal recorded since `catch_for_command` (0: none), forgotten here: the
    training loop's watch takes it over."""
    global _pending
    came, _pending = _pending, 0
    return came


def release() -> None:
    """Every SAVE_SIGNAL back to its disposition before `catch_for_command`, nothing pending
    (for a caller that goes on after the command, as a test does)."""
    global _pending
    for num, before in _before.items():
        if before is not None:
            signal.signal(num, before)
    _before.clear()
    _pending = 0
