"""Rounding sizes up: to a multiple (ZeRO's flat buffers padded to dp, checkpoint blocks,
the vocabulary padded to tp) and whole parts of a division."""

from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """The smallest k with k·d >= n (n >= 0, d >= 1)."""
    return -(-n // d)


def round_up(n: int, d: int) -> int:
    """`n` rounded up to a multiple of `d`."""
    return ceil_div(n, d) * d


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp, so the embedding and the LM head split
    evenly over tp (the padding rows never get probability)."""
    return round_up(vocab, tp)
