"""Every error numesh raises on purpose, in one place (the lowest layer: imports nothing).

`UserError`s are mistakes in what a user asked for (a config, a mesh, a file): the CLI
prints them as one `error:` line on rank 0 and exits 2 on every rank. Anything else is a
bug or a fault and aborts the whole MPI job with a rank-tagged traceback.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import time
from typing import Any, NoReturn


class UserError(ValueError):
    """A request that cannot work, with what to change in the message."""


class ConfigError(UserError):
    """A model or run configuration that cannot work, with what to change."""


class MeshError(UserError):
    """A mesh that cannot be built, or an axis/spec that does not fit it."""


class ScheduleError(UserError):
    """A pipeline schedule that cannot be built or would deadlock."""


class DataError(UserError):
    """A dataset that is missing, malformed or does not fit the run."""


class CheckpointError(UserError):
    """A checkpoint that cannot be written or read, naming the file."""


class TraceError(UserError):
    """A trace file that cannot be read, is cut off or is not a numesh trace, naming it."""


class PlotError(UserError):
    """Runs that cannot be plotted (no metrics), a bad output file, or no matplotlib."""


class ReplicaError(RuntimeError):
    """Copies of a parameter that should be identical differ between ranks."""


USER_ERRORS: tuple[type[BaseException], ...] = (UserError,)


class Interrupted(KeyboardInterrupt):
    """Training stopped on SIGINT/SIGTERM, at the same step on every rank (after saving a
    checkpoint when asked to). The CLI prints it as one line on rank 0 and exits `exit_code`
    on every rank (130 for SIGINT, 143 for SIGTERM); a library caller that catches
    KeyboardInterrupt catches it too."""

    EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command

    def __init__(self, step: int, signum: int, checkpoint: str | None = None, why_not: str = ""):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        saved = f"checkpoint saved to {checkpoint}" if checkpoint else f"no checkpoint saved{why_not}"
        super().__init__(f"interrupted at step {step} by {name}: {saved}")

    @property
    def exit_code(self) -> int:
        """128 + the signal, what a shell reports for a command that signal ended (130 for
        Ctrl-C, 143 for SIGTERM): a script tells them apart as it would without numesh."""
        return 128 + self.signum


class Preempted(Interrupted):
    """Training stopped on a --save-on-signal signal (by default SIGTERM or SIGUSR1: a
    scheduler's warning ahead of preemption or a time limit) after every rank saved the
    same step's checkpoint (`checkpoint` None: it came before step 0 ran, so there was
    none to save). The CLI exits with EXIT_CODE, which a batch script can take as
    "requeue me": the same command with --resume auto continues from `checkpoint`."""

    EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: a temporary failure, try again

    @property
    def exit_code(self) -> int:
        """75 whatever the signal: "requeue me"."""
        return self.EXIT_CODE

    def __init__(self, step: int, signum: int, checkpoint: str | None):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        if checkpoint is None:  # it came before the first step: nothing trained, nothing to save
            KeyboardInterrupt.__init__(self, f"preempted by {name} before step {step} ran: no checkpoint needed; "
                                             f"rerun with --resume auto to start")
            return
        KeyboardInterrupt.__init__(self, f"preempted by {name}: checkpoint at step {step} ({checkpoint}); "
                                         f"rerun with --resume auto to continue")


def option_value(name: str, value: Any, want: type) -> Any:
    """`value` as option `name` of type `want` takes it (an int where a float is wanted
    becomes that float), or a one-line ConfigError: another type (a bool is no int, 2.5 no
    int), or a float that is NaN or infinite (every comparison with NaN is False, so range
    checks alone let it through). The one check of `numesh train`'s options, its --config
    file's and the library's (`numesh.optim.make_optimizer`); `--name` is
    `numesh.base.flags.flag`'s spelling (this module imports nothing of numesh)."""
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise ConfigError(f"config key '{name}' must be {want.__name__}, got {value!r}")
    return check_finite(name, value) if want is float else value


_KINDS = {int: "an integer", float: "a finite number", bool: "True or False", str: "a string"}
_BY_NAME = {t.__name__: t for t in _KINDS}


def field_type(field: Any) -> type:
    """The Python type of an attrs config field (its annotation is a string under `from
    __future__ import annotations`: "int", "float", "bool" or "str"): what `check_scalar`
    checks it against."""
    return _BY_NAME[field.type] if isinstance(field.type, str) else field.type


def check_scalar(name: str, value: Any, want: type, error: type[UserError] = ConfigError) -> Any:
    """`value` unless it is no `want` (int, float, bool or str), then a one-line `error`
    naming `name`: an int is a Python or NumPy integer but no bool, a float any real
    number (an integer too) that is finite, a bool only True or False ('no' is truthy)."""
    if want is bool:
        ok = isinstance(value, bool)
    elif want is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)  # np.bool_ is no Integral
    elif want is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, want)
    if not ok:
        raise error(f"{name} must be {_KINDS.get(want, want.__name__)}, got {value!r}")
    return value


def check_path(name: str, value: Any, error: type[UserError] = ConfigError, hint: str = "") -> Any:
    """`value` unless it is no path (None, a number) or an empty one, then a one-line `error`
    naming `name` (and `hint`: what to pass): `Path("")` is ".", so an empty CKPT or --out was
    taken for the current directory, and `Path(None)` is a TypeError's traceback."""
    if not isinstance(value, (str, os.PathLike)) or os.fspath(value) in ("", b""):
        raise error(f"{name} must name a file or directory, got {value!r}" + (f": {hint}" if hint else ""))
    return value


def check_finite(name: str, value: float) -> float:
    """`value`, or a one-line ConfigError where option `name` is NaN or infinite."""
    if not math.isfinite(value):
        raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    return value


def abort_job(comm: Any, code: int) -> NoReturn:
    """End every rank of an MPI job with `code`, after what this rank printed reached the user.

    Under mpiexec a rank's stderr is a pipe that the launcher's proxy reads; MPI_Abort makes
    the proxy kill the job, and bytes still in the pipe are lost (CI once lost a flight
    recorder diagnosis this way). So wait until the pipe is empty (FIONREAD, at most 2 s),
    then 0.3 s for the proxy to pass it on, and only then `comm.Abort(code)`.
    """
    sys.stderr.flush()
    _drain_stderr_pipe(max_s=2.0, settle_s=0.3)
    try:
        comm.Abort(code)
    finally:
        os._exit(code)


def _drain_stderr_pipe(max_s: float, settle_s: float) -> None:
    try:
        import fcntl
        import termios

        fd = sys.stderr.fileno()
        if "pipe" not in os.readlink(f"/proc/self/fd/{fd}"):
            return  # a terminal or a file keeps what was written
        unread = bytearray(4)
        end = time.monotonic() + max_s
        while time.monotonic() < end:
            fcntl.ioctl(fd, termios.FIONREAD, unread)
            if int.from_bytes(unread, sys.byteorder) == 0:
                break
            time.sleep(0.02)
        time.sleep(settle_s)
    except (OSError, ValueError, ImportError):  # not Linux, or stderr is closed: nothing to wait for
        return
