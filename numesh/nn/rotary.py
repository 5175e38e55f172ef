"""Rotary position embeddings (RoPE) in transformers' convention, with their backward.

A head vector of size d is split in halves (x1, x2) and rotated pair-wise by angles that
grow with the token's position: `rope(x) = x * cos + rotate_half(x) * sin`, with
`rotate_half(x) = (-x2, x1)` and the angle of pair i at position p `p / theta**(2i/d)`,
repeated for both halves. That is the layout `LlamaForCausalLM` uses (the "rotate-half"
form), so weights imported from transformers need no permutation of q and k.

The angles come from each token's *true* position, passed in, never from its index in
the local array: cp's zigzag chunks, pipeline micro-batches and the KV cache's next token
all rotate by where the token sits in its sequence.

The rotation runs as one fused kernel pass (numesh/host/llama_kernels.py `rope`) when numba
is installed; `rope_fwd_reference` and `rope_bwd_reference` are the NumPy definition.
"""

from __future__ import annotations

import attrs
import numpy as np

from numesh.host import kernels as K
from numesh.host import llama_kernels as LK
from numesh.host.threads import over_rows


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


def rope_fwd(x: np.ndarray, rot: Rotary, out: np.ndarray | None = None) -> np.ndarray:
    """Rotate x by the tables of its T tokens: x [..., T, d] (heads before T, e.g. [B, H, T,
    d]) with tables [T, d], or x [B, T, H, d] with tables [T, 1, d] (as the block lays out its
    projections). Into `out` (a new array by default; `out=x` rotates in place)."""
    return _rotate(x, rot, False, out)


def rope_bwd(dy: np.ndarray, rot: Rotary, out: np.ndarray | None = None) -> np.ndarray:
    """The input gradient: the rotation is orthogonal, so its backward rotates by minus the
    angle (`rotate_half`'s transpose is its negative, and sin is the same in both halves).
    `out` as `rope_fwd`'s."""
    return _rotate(dy, rot, True, out)


def rope_fwd_reference(x: np.ndarray, rot: Rotary) -> np.ndarray:
    return x * rot.cos + _rotate_half(x) * rot.sin


def rope_bwd_reference(dy: np.ndarray, rot: Rotary) -> np.ndarray:
    return dy * rot.cos - _rotate_half(dy) * rot.sin


def _token_major(x: np.ndarray, rot: Rotary) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """x as [B, T, H, d] (a view) and the tables as [T, d], for the kernel; None for a layout
    it does not take (the reference runs)."""
    if x.ndim == 4 and rot.cos.ndim == 3 and rot.cos.shape[1] == 1:  # [B, T, H, d] by [T, 1, d]
        return x, rot.cos[:, 0], rot.sin[:, 0]
    if x.ndim == 4 and rot.cos.ndim == 2:  # [B, H, T, d] by [T, d]
        return x.transpose(0, 2, 1, 3), rot.cos, rot.sin
    return None


def _rotate(x: np.ndarray, rot: Rotary, inverse: bool, out: np.ndarray | None) -> np.ndarray:
    """One kernel pass over the token rows, split over the threads (every row alone, so any
    split gives the same bits), or the NumPy reference."""
    laid = _token_major(x, rot) if K.enabled() and x.dtype == rot.cos.dtype else None
    if laid is None:
        y = (rope_bwd_reference if inverse else rope_fwd_reference)(x, rot)
        if out is None:
            return y
        out[...] = y
        return out
    out = np.empty_like(x) if out is None else out
    xt, cos, sin = laid
    ot = _token_major(out, rot)[0]
    cos, sin = np.ascontiguousarray(cos), np.ascontiguousarray(sin)
    B, T, H, d = xt.shape
    over_rows(lambda r: LK.rope(xt, cos, sin, inverse, ot, r.start, r.stop), B * T, max(1, (1 << 15) // (H * d)))
    return out
