"""A configuration key and value as `numesh train`'s command line spells them: the one
spelling every message that names an option to pass uses (plan's printed command, a
resume's or an --init-from's mismatch)."""

from __future__ import annotations

import shlex
from typing import Any


def flag(name: str) -> str:
    """The option of a key: --n-kv-head for n_kv_head."""
    return "--" + name.replace("_", "-")


def flag_value(name: str, value: Any) -> str:
    """The option that sets `name` to `value`: `--n-layer 4`, a boolean as --bias / --no-bias,
    the value shell-quoted (a `best:` line with `--data 'my data'` is pasted into a shell)."""
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + flag(name)[2:]
    return f"{flag(name)} {shlex.quote(str(value))}"


def n_ranks(n: int) -> str:
    """"1 rank", "8 ranks": the count as messages say it."""
    return f"{n} rank" if n == 1 else f"{n} ranks"
