"""Every error numesh raises on purpose, in one place (the lowest layer: imports nothing).

`UserError`s are mistakes in what a user asked for (a config, a mesh, a file): the CLI
prints them as one `error:` line on rank 0 and exits 2 on every rank. Anything else is a
bug or a fault and aborts the whole MPI job with a rank-tagged traceback.
"""

from __future__ import annotations

import signal


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


class PlotError(UserError):
    """Runs that cannot be plotted (no metrics), a bad output file, or no matplotlib."""


class ReplicaError(RuntimeError):
    """Copies of a parameter that should be identical differ between ranks."""


USER_ERRORS: tuple[type[BaseException], ...] = (UserError,)


class Interrupted(KeyboardInterrupt):
    """Training stopped on SIGINT/SIGTERM, at the same step on every rank (after saving a
    checkpoint when asked to). The CLI prints it as one line on rank 0 and exits 130 on every
    rank; a library caller that catches KeyboardInterrupt catches it too."""

    EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command

    def __init__(self, step: int, signum: int, checkpoint: str | None = None, why_not: str = ""):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        saved = f"checkpoint saved to {checkpoint}" if checkpoint else f"no checkpoint saved{why_not}"
        super().__init__(f"interrupted at step {step} by {name}: {saved}")
