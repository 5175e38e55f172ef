"""Every figure of the documentation, by file name, and writing them all.

Each figure module has NAME (its file in docs/img without ".svg"), TITLE (the SVG's
<title>) and draw() -> Figure, built from the functions numesh itself runs.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from numesh.figures import cp_zigzag, gqa_heads, mesh_groups, moe_dispatch, pipeline_schedules, zero_memory
from numesh.figures.style import drawing, save

FIGURES: tuple[ModuleType, ...] = (pipeline_schedules, mesh_groups, cp_zigzag, zero_memory, moe_dispatch, gqa_heads)
DEFAULT_OUT = Path("docs/img")


def write_all(out: Path = DEFAULT_OUT, suffix: str = ".svg") -> list[Path]:
    """Draw every figure into `out` as NAME + `suffix` (".svg" for the docs, ".png" to look
    at one); returns the paths written."""
    paths = []
    for module in FIGURES:
        with drawing():
            fig = module.draw()
            paths.append(save(fig, Path(out) / f"{module.NAME}{suffix}", module.TITLE))
    return paths
