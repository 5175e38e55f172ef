"""ZeRO's bytes per rank, stage by stage: parameters, gradients, AdamW's moments and its
workspace for GPT-2's shape over dp = 8 in float32, from `numesh.perf.formulas`
(`zero_buffer_bytes` over the rank's parameter units, `block_params` and `outer_params`),
the numbers `ZeroOptimizer.memory()` is held to by the tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from numesh.figures.style import PALETTE, new_figure
from numesh.perf.formulas import block_params, outer_params, zero_buffer_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAME = "zero-memory"
TITLE = "ZeRO stages 0 to 3: bytes per rank of parameters, gradients and optimiser state for GPT-2 over dp = 8"
DP, ITEMSIZE, MIB = 8, 4, 2**20
PARTS = {"params": "parameters", "grads": "gradients", "optimizer": "AdamW moments (m, v)",
         "workspace": "AdamW workspace (scratch, masks)"}


@attrs.frozen
class Shape:
    """The model's shape: `numesh.plan.presets` "gpt2" (the figures may not import the
    planner; tests/test_figures.py holds the two equal)."""

    n_layer: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    bias: bool = True


GPT2 = Shape()


def unit_sizes(shape: Shape = GPT2) -> list[int]:
    """Values of each parameter unit on one rank (tp = pp = 1): every block, then the outer unit."""
    block = block_params(shape.n_embd, 1, shape.bias)
    outer = outer_params(shape.n_embd, shape.vocab_size, shape.block_size, bias=shape.bias)
    return [block] * shape.n_layer + [outer]


def stage_bytes(shape: Shape = GPT2, dp: int = DP) -> dict[int, dict[str, int]]:
    """ZeRO stage -> `zero_buffer_bytes` of a rank (params, grads, optimizer, workspace)."""
    return {stage: zero_buffer_bytes(unit_sizes(shape), dp, stage, ITEMSIZE) for stage in range(4)}


def draw() -> "Figure":
    """The figure: one stacked bar per stage, its parts in MiB, the total at its end."""
    data = stage_bytes()
    fig = new_figure(9.0, 3.6)
    ax = fig.add_subplot()
    for i, (key, label) in enumerate(PARTS.items()):
        left = [sum(data[s][k] for k in list(PARTS)[:i]) / MIB for s in data]
        width = [data[s][key] / MIB for s in data]
        bars = ax.barh(list(data), width, left=left, height=0.62, color=PALETTE[i], label=label)
        ax.bar_label(bars, [f"{w:,.0f}" if w > 110 else "" for w in width], label_type="center",
                     color="white", fontsize=8)
    for s, parts in data.items():
        total = sum(parts.values()) / MIB
        ax.text(total + 25, s, f"{total:,.0f} MiB", va="center", fontsize=9)
    ax.set_yticks(list(data), [f"stage {s}" for s in data])
    ax.set_ylim(3.6, -0.6)
    ax.set_xlim(0, 1.16 * max(sum(p.values()) for p in data.values()) / MIB)
    ax.set_xlabel("MiB per rank, between steps")
    ax.tick_params(axis="y", length=0)
    n = sum(unit_sizes())
    ax.set_title(f"GPT-2 ({n / 1e6:.1f} M parameters, float32) over dp = {DP}: "
                 "numesh.perf.formulas.zero_buffer_bytes", loc="left")
    ax.legend(loc="lower right", frameon=False, fontsize=8)
    return fig
