"""Context parallelism's zigzag: which tokens of a sequence each cp rank holds
(`numesh.mesh.zigzag.positions`), the ring its K/V blocks travel (`MeshRing`: to the next
rank, from the previous), and which rank computes each (query, key) pair of causal
attention at which ring step (`numesh.nn.ring_attention.block_pairs`, at step s rank r
holding the block of rank (r - s) mod cp, as `ring_attention_fwd` loops).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from numesh.figures.style import PALETTE, new_figure
from numesh.mesh.zigzag import chunk_len, positions
from numesh.nn.ring_attention import block_pairs

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NAME = "cp-zigzag"
TITLE = "Context parallelism on 4 ranks: the zigzag layout of a 16-token sequence, the K/V ring, and who computes what"
CP, T = 4, 16


def holders(seq_len: int, cp: int) -> np.ndarray:
    """[T] the cp rank holding each position of a sequence."""
    out = np.full(seq_len, -1)
    for r in range(cp):
        out[positions(seq_len, cp, r)] = r
    return out


def attention_work(seq_len: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """([T, T] rank, [T, T] ring step) that computes each (query position, key position)
    pair of ring attention, -1 where none does. Raises ValueError if one is computed twice."""
    rank = np.full((seq_len, seq_len), -1)
    step = np.full((seq_len, seq_len), -1)
    c = chunk_len(seq_len, cp)
    for r in range(cp):
        for s in range(cp):
            src = (r - s) % cp
            rows, cols, causal = block_pairs(r, src, c)
            q, k = positions(seq_len, cp, r)[rows], positions(seq_len, cp, src)[cols]
            qq, kk = np.meshgrid(q, k, indexing="ij")
            keep = kk <= qq if causal else np.ones(qq.shape, bool)
            if (rank[qq[keep], kk[keep]] >= 0).any():
                raise ValueError(f"cp rank {r} computes a pair twice at step {s}")
            rank[qq[keep], kk[keep]], step[qq[keep], kk[keep]] = r, s
    return rank, step


def _cell_row(ax: "Axes", y: float, xs: np.ndarray, labels: np.ndarray, colors: list[str]) -> None:
    from matplotlib.patches import Rectangle

    for x, label, color in zip(xs, labels, colors):
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=color, edgecolor="none"))
        ax.text(x + 0.46, y + 0.4, str(label), ha="center", va="center", color="white", fontsize=7)


def _layout(ax: "Axes") -> None:
    """The sequence coloured by holder, then each rank's tokens in its local order."""
    who = holders(T, CP)
    _cell_row(ax, 0, np.arange(T), np.arange(T), [PALETTE[r] for r in who])
    ax.text(-0.4, 0.4, "sequence", ha="right", va="center")
    for r in range(CP):
        pos = positions(T, CP, r)
        xs = np.arange(T // CP) + np.repeat([0, 0.5], T // CP // 2)  # a gap between the two chunks
        _cell_row(ax, -1.5 - r, xs, pos, [PALETTE[r]] * len(pos))
        ax.text(-0.4, -1.1 - r, f"cp rank {r}", ha="right", va="center")
    ax.text(T / 2, -0.45, "each rank's tokens, in its local order (positions(16, 4, r))", ha="center",
            va="center", fontsize=8)
    ax.set_xlim(-2.6, T)
    ax.set_ylim(-1.7 - CP, 1.0)
    ax.axis("off")
    ax.set_title(f"zigzag: {2 * CP} chunks of {chunk_len(T, CP)}; rank r holds chunks r and {2 * CP - 1}-r",
                 loc="left")


def _ring(ax: "Axes") -> None:
    """The cp ranks on a circle, an arrow from each to the next (where its K/V goes)."""
    from matplotlib.patches import Circle

    angle = [math.pi / 2 - 2 * math.pi * r / CP for r in range(CP)]
    xy = [(math.cos(a), math.sin(a)) for a in angle]
    for r in range(CP):
        (x0, y0), (x1, y1) = xy[r], xy[(r + 1) % CP]
        ax.annotate("", xy=(0.78 * x1 + 0.22 * x0, 0.78 * y1 + 0.22 * y0),
                    xytext=(0.78 * x0 + 0.22 * x1, 0.78 * y0 + 0.22 * y1),
                    arrowprops={"arrowstyle": "-|>", "color": "#555555", "linewidth": 1.2,
                                "connectionstyle": "arc3,rad=-0.25"})
        ax.add_patch(Circle(xy[r], 0.24, color=PALETTE[r]))
        ax.text(*xy[r], str(r), ha="center", va="center", color="white", fontsize=12, fontweight="bold")
    ax.text(0, 0, "K/V\nblocks", ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.35, 1.35)
    ax.set_ylim(-1.35, 1.35)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("the ring: step s, rank r holds\nrank (r - s) mod cp's K/V block", loc="left", fontsize=9)


def _matrix(ax: "Axes") -> None:
    """The causal attention matrix: each pair coloured by the rank computing it, each
    chunk pair labelled with the ring step it is computed at."""
    from matplotlib.colors import ListedColormap

    rank, step = attention_work(T, CP)
    ax.pcolormesh(np.ma.masked_less(rank, 0), cmap=ListedColormap(PALETTE[:CP]), vmin=-0.5, vmax=CP - 0.5)
    c = chunk_len(T, CP)
    for qc in range(T // c):
        for kc in range(qc + 1):
            s = step[qc * c:(qc + 1) * c, kc * c:(kc + 1) * c].max()
            x, y = (kc * c + c / 4, qc * c + 3 * c / 4) if qc == kc else (kc * c + c / 2, qc * c + c / 2)
            ax.text(x, y, f"s{s}", ha="center", va="center", color="white", fontsize=7.5, fontweight="bold")
    ax.set_xticks(np.arange(0, T + 1, c))
    ax.set_yticks(np.arange(0, T + 1, c))
    ax.grid(True, color="white", linewidth=1.2)
    ax.set_xlim(0, T)
    ax.set_ylim(T, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title("causal attention: colour = the cp rank computing a pair,\nsN = the ring step it does so at",
                 loc="left", fontsize=9)


def draw() -> "Figure":
    """The figure: the layout and the ring on the left, the attention matrix on the right."""
    fig = new_figure(10.0, 5.6)
    grid = fig.add_gridspec(2, 2, width_ratios=[1.25, 1], height_ratios=[1, 1.05])
    _layout(fig.add_subplot(grid[0, 0]))
    _ring(fig.add_subplot(grid[1, 0]))
    _matrix(fig.add_subplot(grid[:, 1]))
    fig.suptitle(f"cp = {CP}, a sequence of {T} tokens: numesh.mesh.zigzag and numesh.nn.ring_attention",
                 fontsize=11)
    return fig
