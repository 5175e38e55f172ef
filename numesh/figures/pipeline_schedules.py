"""Each pipeline schedule's timeline: every rank's F, B and W actions where
`numesh.pipeline.schedules.simulate` places them, and the idle time between them (the
bubble), one panel per schedule on one time axis.

The costs are docs/parallelism/pipeline.md's: F = B = W = 1 (an unsplit B costs B + W = 2),
and for the interleaved schedule each of a rank's v chunks costs 1/v of that, so every
schedule does the same work and only the idle time differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from numesh.figures.style import IDLE_COLOR, KIND_COLORS, new_figure
from numesh.pipeline.schedules import SCHEDULES, Timeline, make_schedule, simulate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NAME = "pipeline-schedules"
TITLE = "Pipeline schedules on 4 ranks with 8 micro-batches: when each rank runs F, B and W, and its idle time"
P, M, V = 4, 8, 2  # ranks, micro-batches, chunks per rank of the interleaved schedule
LATER_CHUNK_COLORS = {"F": "#A9BDE0", "B": "#F0C09B"}  # lighter F and B: chunk 1 of the interleaved schedule
LABELS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": f"interleaved 1F1B (v = {V})", "zb-h1": "ZB-H1"}


def timelines(p: int = P, m: int = M, v: int = V) -> tuple[Timeline, ...]:
    """`simulate` of every schedule in `SCHEDULES`' order, at equal costs per stage."""
    out = []
    for name in SCHEDULES:
        chunks = v if name == "interleaved" else 1
        cost = 1.0 / chunks
        out.append(simulate(make_schedule(name, p, m, chunks), t_f=cost, t_b=cost, t_w=cost))
    return tuple(out)


def _panel(ax: "Axes", tl: Timeline, width: float) -> None:
    """One schedule: a grey lane per rank (idle) with its actions on it, each box labelled
    with its micro-batch; a chunk > 0 in a lighter colour."""
    s = tl.schedule
    for rank in range(s.p):
        ax.barh(rank, tl.makespan, height=0.8, color=IDLE_COLOR, linewidth=0)
        for a, (start, end) in zip(s.actions[rank], tl.intervals[rank]):
            color = LATER_CHUNK_COLORS[a.kind] if a.chunk else KIND_COLORS[a.kind]
            ax.barh(rank, end - start, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.6)
            ax.text((start + end) / 2, rank, str(a.mb), ha="center", va="center",
                    color="black" if a.chunk else "white", fontsize=6.5 if end - start >= 0.75 else 5.5)
    ax.set_yticks(range(s.p), [f"rank {r}" for r in range(s.p)])
    ax.set_ylim(s.p - 0.5, -0.5)
    ax.set_xlim(0, width)
    ax.tick_params(axis="y", length=0)
    ax.set_title(f"{LABELS[s.name]}: bubble {tl.bubble_fraction:.1%}, step time {tl.makespan:g}", loc="left")


def _legend(fig: "Figure") -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=KIND_COLORS["F"], label="F  forward"),
               Patch(color=KIND_COLORS["B"], label="B  backward (ZB-H1: input gradient only)"),
               Patch(color=KIND_COLORS["W"], label="W  weight gradient (ZB-H1)"),
               Patch(color=LATER_CHUNK_COLORS["F"], label="F, B of chunk 1 (interleaved)"),
               Patch(color=IDLE_COLOR, label="idle: the bubble")]
    fig.legend(handles=handles, loc="outside lower center", ncols=5, frameon=False, fontsize=8)


def draw() -> "Figure":
    """The figure: one panel per schedule, the numbers in each box the micro-batch."""
    tls = timelines()
    fig = new_figure(10.0, 8.0)
    axes = fig.subplots(len(tls), 1, sharex=True)
    width = max(tl.makespan for tl in tls)
    for ax, tl in zip(axes, tls):
        _panel(ax, tl, width)
    axes[-1].set_xlabel("time (F = B = W = 1 per stage; an interleaved chunk costs half)")
    fig.suptitle(f"pp = {P} ranks, {M} micro-batches: numesh.pipeline.schedules.simulate", fontsize=11)
    _legend(fig)
    return fig
