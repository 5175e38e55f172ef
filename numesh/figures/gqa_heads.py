"""Grouped-query attention on tp ranks: which query heads each rank owns
(`numesh.nn.parts.local_heads`), which key/value heads it computes for them
(`local_kv_heads`), and that it holds every kv head's weights (k and v are replicated
over tp, `gpt_specs`), their gradients zero off the heads it computed and summed over tp
once per step (`numesh.nn.transformer.tp_partial`).

The model is issue 40's small Llama: 8 query heads sharing 2 kv heads (groups of 4), on
tp = 2 (one kv head a rank), 4 (kv heads < tp: two ranks compute each) and 8 (one query
head a rank). Those functions read only the tp size and index, so a stand-in for one tp
rank replaces the mesh and no MPI runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from numesh.figures.style import PALETTE, new_figure
from numesh.nn.gpt import GPTConfig, gpt_specs
from numesh.nn.parts import local_heads, local_kv_heads
from numesh.nn.transformer import tp_partial

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NAME = "gqa-heads"
TITLE = "Grouped-query attention over tp: the query heads of each rank, the kv heads it computes, and the k, v " \
        "weights every rank holds"
MODEL = GPTConfig(n_layer=4, n_head=8, n_kv_head=2, n_embd=64, norm="rmsnorm", positions="rotary", mlp="swiglu",
                  tie_embeddings=False)
TPS = (2, 4, 8)
KV_PATHS = ("blocks.0.attn.k.w", "blocks.0.attn.v.w")
HELD = "#BBBBBB"


@attrs.frozen
class TpRank:
    """The mesh as the head functions see it: tp ranks, this one's index, no sequence
    parallelism, every other axis of size 1."""

    tp: int
    rank: int
    sequence_parallel: bool = False

    def size(self, axis: str) -> int:
        return self.tp if axis == "tp" else 1

    def index(self, axis: str) -> int:
        return self.rank if axis == "tp" else 0


def group(cfg: GPTConfig, head: int) -> int:
    """The kv head query head `head` reads: heads are grouped in runs of n_head / n_kv_head."""
    return head // (cfg.n_head // cfg.kv_heads)


def heads_of(cfg: GPTConfig, tp: int) -> list[tuple[range, range]]:
    """(query heads, kv heads computed) of each tp rank, from the functions the block runs."""
    out = []
    for r in range(tp):
        _, _, q = local_heads(cfg, TpRank(tp, r))
        kv = local_kv_heads(cfg, TpRank(tp, r))
        out.append((range(q.start, q.stop), range(kv.start, kv.stop)))
    return out


def summed_over_tp(cfg: GPTConfig, tp: int) -> tuple[str, ...]:
    """The k and v weight paths whose gradients are summed over tp (`tp_partial`) at this tp."""
    return tuple(path for path in KV_PATHS if tp_partial(path, TpRank(tp, 0)))


def _square(ax: "Axes", x: float, y: float, label: str, color: str, filled: bool) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x - 0.4, y - 0.4), 0.8, 0.8, facecolor=color if filled else "white",
                           edgecolor=color if filled else HELD, linewidth=1.0, linestyle="-" if filled else "--"))
    ax.text(x, y, label, ha="center", va="center", fontsize=7.5, color="white" if filled else "#777777")


def _rank(ax: "Axes", cfg: GPTConfig, x0: float, width: float, r: int, q: range, kv: range) -> None:
    """One rank's box: its query heads on top, every kv head's weights below (the computed
    ones filled), a line from each query head to the kv head it reads."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x0 + 0.05, -2.75), width - 0.1, 4.2, boxstyle="round,pad=0.02",
                                facecolor="#F7F7F7", edgecolor="#555555", linewidth=0.8))
    ax.text(x0 + width / 2, 1.1, f"tp rank {r}", ha="center", va="center", fontsize=8, fontweight="bold")
    qx = {h: x0 + width / 2 + i - (len(q) - 1) / 2 for i, h in enumerate(q)}
    kx = {j: x0 + width / 2 + j - (cfg.kv_heads - 1) / 2 for j in range(cfg.kv_heads)}
    for h, x in qx.items():
        ax.plot([x, kx[group(cfg, h)]], [-0.4, -1.6], color=PALETTE[group(cfg, h)], linewidth=1.0)
        _square(ax, x, 0, f"q{h}", PALETTE[group(cfg, h)], True)
    for j, x in kx.items():
        _square(ax, x, -2.0, f"kv{j}", PALETTE[j], j in kv)


def _panel(ax: "Axes", cfg: GPTConfig, tp: int, width: float) -> None:
    ranks = heads_of(cfg, tp)
    per = max(max(len(q) for q, _ in ranks), cfg.kv_heads) + 0.4
    for r, (q, kv) in enumerate(ranks):
        _rank(ax, cfg, r * per, per, r, q, kv)
    ax.text(-0.3, 0, "query heads\n(column-parallel)", ha="right", va="center", fontsize=8)
    ax.text(-0.3, -2.0, "k, v heads\n(replicated)", ha="right", va="center", fontsize=8)
    ax.set_xlim(-3.2, width)
    ax.set_ylim(-3.0, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    share = tp // cfg.kv_heads if tp > cfg.kv_heads else 1
    summed = "their k, v grads summed over tp" if summed_over_tp(cfg, tp) else "no sum over tp"
    ax.set_title(f"tp = {tp}: each rank owns {_count(cfg.n_head // tp, 'query head')} and computes "
                 f"{_count(max(1, cfg.kv_heads // tp), 'kv head')}; each kv head is computed on "
                 f"{_count(share, 'rank')}, {summed}", loc="left", fontsize=9)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def draw() -> "Figure":
    """The figure: one panel per tp of `TPS`, on one scale."""
    cfg = MODEL
    widths = [tp * (max(cfg.n_head // tp, cfg.kv_heads) + 0.4) for tp in TPS]
    fig = new_figure(10.0, 6.4)
    for ax, tp in zip(fig.subplots(len(TPS), 1), TPS):
        _panel(ax, cfg, tp, max(widths))
    specs = gpt_specs(cfg).blocks[0].attn
    fig.suptitle(f"{cfg.n_head} query heads, {cfg.kv_heads} kv heads (groups of {cfg.n_head // cfg.kv_heads}): "
                 f"q spec {specs.q.w}, k and v spec {specs.k.w} (every rank holds them whole);\n"
                 "filled: computed on this rank (its query heads read it); dashed: held, not computed, its "
                 "gradient zero here", fontsize=9.5)
    return fig
