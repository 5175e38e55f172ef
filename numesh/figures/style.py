"""What every figure shares: its matplotlib settings, its colours, and how it is written.

The SVGs in docs/img are compared byte for byte with a fresh drawing (tests/test_figures.py),
so everything that could vary between two runs is fixed here: the hash salt of the SVG's
ids, no date, a Creator without matplotlib's version, text kept as text (`svg.fonttype`
"none": no glyph paths, which also keeps it searchable) and one font for the layout.
matplotlib (the `plot` extra) is imported inside the functions, so importing a figure
module never needs it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MATPLOTLIB_HINT = "the figures need matplotlib: pip install -e '.[plot]' (or '.[dev]')"

# one colour per action kind, shared by every figure that shows F, B or W
KIND_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}
IDLE_COLOR = "#E4E4E4"
# one colour per rank or group (colour-blind-safe: Okabe and Ito's palette)
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")

RC = {
    "svg.hashsalt": "numesh",
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
    "font.size": 9.0,
    "axes.titlesize": 10.0,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "hatch.linewidth": 0.8,
}


@contextlib.contextmanager
def drawing() -> Iterator[None]:
    """Draw and save inside this: matplotlib's defaults and the settings above, whatever
    the caller's rcParams or matplotlibrc say (restored on leaving)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MATPLOTLIB_HINT) from None
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(RC)
        yield


def new_figure(width: float, height: float) -> "Figure":
    """An empty figure of a fixed size in inches, laid out by matplotlib's constrained
    layout (no pyplot: nothing global is kept)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save(fig: "Figure", path: Path, title: str) -> Path:
    """Write `fig` to `path` (SVG, or PNG for a look at it) with no date and a fixed Creator;
    `title` becomes the SVG's <title>, which screen readers announce."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".svg":
        fig.savefig(path, format="svg", metadata={"Date": None, "Creator": "numesh.figures", "Title": title})
    else:
        fig.savefig(path, dpi=110)
    return path
