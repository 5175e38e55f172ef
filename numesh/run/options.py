"""The options page (docs/options.md), written from `TrainConfig`'s fields so that it says
what `numesh train --help` says: each field is an option, `_` spelled `-`, and a key of the
`--config` TOML file, with its type, default and help text.

The page is committed, so it reads on GitHub as on the site; tests/test_docs.py fails when
it no longer matches the fields. To rewrite it after changing a field:

    python -m numesh.run.options docs/options.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import attrs

from numesh.base.flags import flag, flag_value
from numesh.run.config import TrainConfig, field_type

REGENERATE = "python -m numesh.run.options docs/options.md"
COLUMNS = ("option", "TOML key", "type", "default", "what it does")

_HEADER = f"""# Options of `numesh train`

<!-- Written by `{REGENERATE}` from TrainConfig's fields (numesh/run/config.py):
change a field there, then rerun it; tests/test_docs.py fails while this page is stale. -->

Every option of `numesh train` is a field of `numesh.run.config.TrainConfig`, named with `-`
where the field has `_`, and the same field is a key of the TOML file that `--config FILE`
reads (written with `_` or `-`; options given on the command line override it). Besides
these, `--config FILE` names that file and `--model NAME` (or `--preset NAME`) fills in a
preset's model shape, e.g. `gpt2` ([planning](planning.md)). A switch is on with its name
and off with `--no-` before it; "" is none. `numesh train --help` prints the same list, and
what the options do together is in the [quick start](quickstart.md).

An option the run would ignore is an error, not silence: another optimiser's (`--muon-*`
without `--optimizer muon`) or an MoE option (`--moe-top-k`, `--moe-every`,
`--moe-aux-coef`, `--moe-z-coef`, `--moe-capacity-factor`) without `--moe-experts`, given
on the command line, or in the `--config` file at other than its default (a recipe lists
every key, those it does not use at their defaults).

"""


def option_flag(field: attrs.Attribute) -> str:
    """The option as the CLI spells it: `--name`, or `--name` / `--no-name` for a switch."""
    on = flag(field.name)
    return f"`{on}` / `{flag_value(field.name, False)}`" if field_type(field) is bool else f"`{on}`"


def toml_value(value: Any) -> str:
    """A default as a TOML file writes it: true/false, a quoted string, a number."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def cell(text: str) -> str:
    """`text` as one Markdown table cell: pipes escaped everywhere (GitHub splits cells on a
    bare one even inside code), and outside code spans the characters that would otherwise
    start emphasis or HTML (`c*T*k` must not come out as c<em>T</em>k)."""
    parts = re.split(r"(`[^`]*`)", text.replace("\n", " "))
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part.replace("|", "\\|"))
        else:
            out.append(re.sub(r"([\\*_|])", r"\\\1", part).replace("<", "&lt;"))
    return "".join(out)


def option_row(field: attrs.Attribute) -> str:
    """One field's line of the table."""
    cells = (option_flag(field), f"`{field.name}`", f"`{field_type(field).__name__}`",
             f"`{toml_value(field.default)}`", cell(field.metadata["help"]))
    return "| " + " | ".join(cells) + " |"


def options_table(config: type = TrainConfig) -> str:
    """The Markdown table of every field of `config` (an attrs class whose fields carry a
    `help` in their metadata, as `TrainConfig`'s do), in the order they are declared."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += [option_row(f) for f in attrs.fields(config)]
    return "\n".join(lines) + "\n"


def options_page() -> str:
    """The whole of docs/options.md."""
    return _HEADER + options_table()


def main(argv: list[str]) -> int:
    """`python -m numesh.run.options PATH`: write the page to PATH."""
    if len(argv) != 1:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    Path(argv[0]).write_text(options_page(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
