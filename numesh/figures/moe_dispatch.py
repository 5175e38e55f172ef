"""The MoE dispatch over ep on a tiny random example: each ep rank's router decisions
(`numesh.nn.moe.route`, the function the layer runs), its expert-sorted rows, and where
the all-to-all takes them: ep rank d holds experts d·E/ep ... (d+1)·E/ep - 1, receives the
rows of those experts grouped by source, and regroups them by expert (by source within an
expert) for one GEMM per expert; the outputs travel back the same way reversed.

`plan_dispatch` exchanges the counts over MPI, so the figure takes the row counts from the
same rule without it (each rank's per-expert counts summed over a destination's experts)
and the bytes from `numesh.perf.formulas.moe_all_to_all_bytes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from numesh.figures.style import PALETTE, new_figure
from numesh.nn.moe import Routing, route
from numesh.perf.formulas import moe_all_to_all_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NAME = "moe-dispatch"
TITLE = "MoE dispatch over ep = 2: each token's top-2 experts, and the rows the all-to-all moves to them and back"
EP, EXPERTS, TOP_K, TOKENS, SEED = 2, 4, 2, 6, 3
N_EMBD = 128  # for the bytes in the title: the default model's width, float32


def routings(seed: int = SEED) -> tuple[Routing, ...]:
    """Each ep rank's routing of its TOKENS tokens, from random router logits."""
    logits = np.random.default_rng(seed).standard_normal((EP, TOKENS, EXPERTS))
    return tuple(route(x, TOP_K) for x in logits)


def rows_matrix(rs: tuple[Routing, ...]) -> np.ndarray:
    """[ep, ep]: rows ep rank s sends to ep rank d (`Dispatch.send` of s is row s, `recv` of d column d)."""
    return np.stack([np.diff(r.bounds).reshape(len(rs), -1).sum(axis=1) for r in rs])


def sent(r: Routing) -> list[tuple[int, int]]:
    """(token, expert) of each of a rank's rows in its expert-sorted order (what it sends)."""
    k = r.top.shape[1]
    return [(int(a) // k, int(r.top.reshape(-1)[a])) for a in r.order]


def received(rs: tuple[Routing, ...], d: int) -> list[tuple[int, int, int]]:
    """(source rank, token, expert) of each row ep rank `d`'s experts get, grouped by expert
    and by source within one (the order its GEMMs read them in)."""
    per = EXPERTS // len(rs)
    rows = [(s, t, e) for s, r in enumerate(rs) for t, e in sent(r) if e // per == d]  # grouped by source
    return sorted(rows, key=lambda row: row[2])  # stable: by source within an expert


def _router(ax: "Axes", r: Routing, rank: int) -> None:
    """A rank's router probabilities, its chosen experts outlined with their combine weights."""
    from matplotlib.patches import Rectangle

    ax.pcolormesh(r.probs, cmap="Blues", vmin=0, vmax=1, edgecolors="white", linewidth=0.5)
    for t in range(r.top.shape[0]):
        for j, e in enumerate(r.top[t]):
            ax.add_patch(Rectangle((e, t), 1, 1, fill=False, edgecolor="black", linewidth=1.4))
            ax.text(e + 0.5, t + 0.5, f"{r.weights[t, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if r.probs[t, e] > 0.5 else "black")
    per = EXPERTS // EP
    ax.axvline(per, color="#333333", linewidth=1.2, linestyle="--")
    ax.set_xticks(np.arange(EXPERTS) + 0.5, [f"e{e}\n(ep {e // per})" for e in range(EXPERTS)], fontsize=7.5)
    ax.set_yticks(np.arange(TOKENS) + 0.5, [f"t{t}" for t in range(TOKENS)], fontsize=7.5)
    ax.set_ylim(TOKENS, 0)
    ax.tick_params(length=0)
    ax.set_title(f"ep rank {rank}: router probabilities;\ntop-{TOP_K} outlined, with combine weights",
                 loc="left", fontsize=9)


def _stack(ax: "Axes", x: float, y0: float, rows: list[tuple[int, int, int]], title: str) -> dict:
    """Rows as cells coloured by expert, from y0 down; returns (source, token, expert) -> y."""
    from matplotlib.patches import Rectangle

    ys = {}
    for i, (s, t, e) in enumerate(rows):
        y = y0 - i
        ax.add_patch(Rectangle((x - 0.6, y - 0.45), 1.2, 0.9, facecolor=PALETTE[e], edgecolor="white"))
        ax.text(x, y, f"r{s} t{t} → e{e}", ha="center", va="center", color="white", fontsize=7)
        ys[(s, t, e)] = y
    ax.text(x, y0 + 0.9, title, ha="center", va="bottom", fontsize=8)
    return ys


def _dispatch(ax: "Axes", rs: tuple[Routing, ...]) -> None:
    """Sent stacks on the left, received ones on the right, a line for each row's trip."""
    left, right, y0 = {}, {}, 0.0
    for s, r in enumerate(rs):
        out, got = [(s, t, e) for t, e in sent(r)], received(rs, s)
        left.update(_stack(ax, 0, y0, out, f"ep rank {s} sends (sorted by expert)"))
        right.update(_stack(ax, 4, y0, got, f"ep rank {s}'s experts get (by expert)"))
        y0 -= max(len(out), len(got)) + 2.2
    for key, y in left.items():
        stays = key[0] == key[2] // (EXPERTS // EP)
        ax.plot([0.62, 3.38], [y, right[key]], color="#BBBBBB" if stays else PALETTE[key[2]],
                linewidth=0.8 if stays else 1.1, linestyle=":" if stays else "-")
    m = rows_matrix(rs)
    ax.set_xlim(-0.7, 4.7)
    ax.set_ylim(y0 + 1.5, 2.2)
    ax.axis("off")
    ax.set_title("1. counts (all_to_all)   2. rows out (all_to_all_v)   3. outputs back the same way\n"
                 + ", ".join(f"{s}→{d}: {m[s, d]} rows" for s in range(EP) for d in range(EP))
                 + " (dotted: stays on its rank)", loc="left", fontsize=9)


def draw() -> "Figure":
    """The figure: the two routers on the left, the dispatch on the right."""
    rs = routings()
    fig = new_figure(10.0, 7.0)
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.9])
    for rank, r in enumerate(rs):
        _router(fig.add_subplot(grid[rank, 0]), r, rank)
    _dispatch(fig.add_subplot(grid[:, 1]), rs)
    m = rows_matrix(rs)
    sent_bytes = [moe_all_to_all_bytes(m[s], m[:, s], s, N_EMBD, EXPERTS, 4) for s in range(EP)]
    fig.suptitle(f"E = {EXPERTS} experts on ep = {EP} ranks, top-{TOP_K}, {TOKENS} tokens per rank: "
                 f"numesh.nn.moe.route\nbytes sent per rank, one layer's forward and backward, C = {N_EMBD}, "
                 "float32 (formulas.moe_all_to_all_bytes): " + ", ".join(f"{b:,}" for b in sent_bytes), fontsize=9.5)
    return fig
