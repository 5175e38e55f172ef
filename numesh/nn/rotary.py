"""Rotary position embeddings (RoPE) in transformers' convention, with their backward.

A head vector of size d is split in halves (x1, x2) and rotated pair-wise by angles that
grow with the token's position: `rope(x) = x * cos + rotate_half(x) * sin`, with
`rotate_half(x) = (-x2, x1)` and the angle of pair i at position p `p / theta**(2i/d)`,
repeated for both halves. That is the layout `LlamaForCausalLM` uses (the "rotate-half"
form), so weights imported from transformers need no permutation of q and k.

The angles come from each token's *true* position, passed in, never from its index in
the local array: cp's zigzag chunks, pipeline micro-batches and the KV cache's next token
all rotate by where the token sits in its sequence.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class Rotary:
    """The cos and sin tables of a run of positions, [T, d] each (halves repeated)."""

    cos: np.ndarray
    sin: np.ndarray


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """1 / theta**(2i/d) for the d/2 pairs, in float64 (cast once, where the tables are made)."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def rotary_tables(positions: np.ndarray, head_dim: int, theta: float, dtype) -> Rotary:
    """cos and sin [T, d] for the tokens at `positions` [T] (global positions in their sequence)."""
    angles = np.outer(np.asarray(positions, dtype=np.float64), inv_freq(head_dim, theta))  # [T, d/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, d]: both halves rotate by the pair's angle
    return Rotary(np.cos(angles).astype(dtype), np.sin(angles).astype(dtype))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    """(x1, x2) -> (-x2, x1) over the last axis."""
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope_fwd(x: np.ndarray, rot: Rotary) -> np.ndarray:
    """Rotate x [..., T, d] (heads before T, e.g. [B, H, T, d]) by the tables of its T tokens."""
    return x * rot.cos + _rotate_half(x) * rot.sin


def rope_bwd(dy: np.ndarray, rot: Rotary) -> np.ndarray:
    """The input gradient: the rotation is orthogonal, so its backward rotates by minus the
    angle (`rotate_half`'s transpose is its negative, and sin is the same in both halves)."""
    return dy * rot.cos - _rotate_half(dy) * rot.sin
