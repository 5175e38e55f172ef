"""The mesh: where each rank sits and the groups each axis makes, for two 8-rank meshes.

Ranks come from `numesh.observe.diagnosis.grid_coords`, the pure form of the `Cart_create`
layout `Mesh` asks MPI for (row-major over `AXES`, tp fastest), so no MPI runs. An axis's
groups are the ranks that agree on every other coordinate: each is one communicator of
`mesh.comm(axis)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from numesh.figures.style import PALETTE, new_figure
from numesh.mesh.mesh import AXES
from numesh.observe.diagnosis import grid_coords

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NAME = "mesh-groups"
TITLE = "The ranks of two 8-rank meshes and the groups each axis makes"
MESHES = ({"pp": 2, "dp": 2, "tp": 2}, {"ep": 2, "cp": 2, "tp": 2})
NEAREST_FIRST = tuple(reversed(AXES))  # tp, cp, ep, dp, pp: neighbouring ranks first


def groups(shape: dict[str, int], axis: str) -> list[tuple[int, ...]]:
    """The ranks of each `axis` group of the mesh `shape`, ordered by their first rank."""
    coords = grid_coords(shape)
    out: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(coords):
        key = tuple(coords[rank][a] for a in AXES if a != axis)
        out.setdefault(key, []).append(rank)
    return sorted((tuple(g) for g in out.values()), key=lambda g: g[0])


def lanes(spans: list[tuple[int, ...]]) -> list[int]:
    """A lane for each group so that no two groups in one lane overlap (first fit, in order)."""
    ends: list[int] = []
    out = []
    for g in spans:
        lane = next((i for i, end in enumerate(ends) if end < g[0]), len(ends))
        if lane == len(ends):
            ends.append(g[-1])
        ends[lane] = g[-1]
        out.append(lane)
    return out


def _ranks_row(ax: "Axes", shape: dict[str, int]) -> None:
    """A box per rank, labelled with its rank and its coordinates on the axes > 1."""
    from matplotlib.patches import FancyBboxPatch

    shown = [a for a in AXES if shape.get(a, 1) > 1]
    for rank, c in grid_coords(shape).items():
        ax.add_patch(FancyBboxPatch((rank - 0.4, -0.5), 0.8, 1.45, boxstyle="round,pad=0.02",
                                    facecolor="#F2F2F2", edgecolor="#555555", linewidth=0.8))
        ax.text(rank, 0.62, str(rank), ha="center", va="center", fontsize=13, fontweight="bold")
        ax.text(rank, -0.05, "\n".join(f"{a} {c[a]}" for a in shown), ha="center", va="center", fontsize=7.5,
                linespacing=1.3)


def _axis_rows(ax: "Axes", shape: dict[str, int]) -> float:
    """Under the ranks, each axis > 1 (nearest first): a line through each group's ranks,
    one colour per group. Returns the lowest y used."""
    y = -0.85
    for axis in (a for a in NEAREST_FIRST if shape.get(a, 1) > 1):
        gs = groups(shape, axis)
        ls = lanes(gs)
        ax.text(-0.75, y - 0.25 * (max(ls)) / 2, f"{axis} groups", ha="right", va="center", fontsize=9)
        for i, (g, lane) in enumerate(zip(gs, ls)):
            yy = y - 0.25 * lane
            color = PALETTE[i % len(PALETTE)]
            ax.plot([g[0], g[-1]], [yy, yy], color=color, linewidth=2.2, solid_capstyle="round")
            ax.plot(g, [yy] * len(g), "o", color=color, markersize=6)
        y -= 0.25 * (max(ls) + 1) + 0.3
    return y


def _panel(ax: "Axes", shape: dict[str, int]) -> None:
    n = len(grid_coords(shape))
    bottom = _axis_rows(ax, shape)
    _ranks_row(ax, shape)
    ax.set_xlim(-2.2, n - 0.5)
    ax.set_ylim(bottom + 0.1, 1.05)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("mesh " + ",".join(f"{a}={shape[a]}" for a in AXES if a in shape)
                 + ": rank, its coordinates, and each axis's groups", loc="left")


def draw() -> "Figure":
    """The figure: one panel per mesh of `MESHES`."""
    fig = new_figure(8.0, 7.4)
    axes = fig.subplots(len(MESHES), 1)
    for ax, shape in zip(axes, MESHES):
        _panel(ax, shape)
    fig.suptitle("Cart_create's layout (tp fastest, then cp, ep, dp, pp): numesh.observe.diagnosis.grid_coords",
                 fontsize=10)
    return fig
