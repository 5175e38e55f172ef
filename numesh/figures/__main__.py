"""`python -m numesh.figures [--out docs/img] [--png]`: regenerate every figure of the docs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from numesh.figures.catalog import DEFAULT_OUT, write_all


def main(argv: list[str] | None = None) -> int:
    """Write the figures; 2 and one line on stderr without matplotlib."""
    parser = argparse.ArgumentParser(prog="python -m numesh.figures", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write into (default docs/img)")
    parser.add_argument("--png", action="store_true", help="write PNGs to look at instead of the docs' SVGs")
    args = parser.parse_args(argv)
    try:
        paths = write_all(args.out, ".png" if args.png else ".svg")
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
