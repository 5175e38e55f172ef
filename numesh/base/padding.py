"""Rounding sizes up: to a multiple (ZeRO's flat buffers padded to dp, checkpoint blocks,
the vocabulary padded to tp) and whole parts of a division."""

from __future__ import annotations

import numbers


def ceil_div(n: int, d: int) -> int:
    """The smallest k with k·d >= n (n >= 0, d >= 1)."""
    return -(-n // d)


def round_up(n: int, d: int) -> int:
    """`n` rounded up to a multiple of `d`."""
    return ceil_div(n, d) * d


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp, so the embedding and the LM head split
    evenly over tp (the padding rows never get probability). A tp that is no integer >= 1
    is a one-line ValueError: round_up(65, -1) is 65 and round_up(65, 2.5) is 65.0, a
    "padding" no mesh has (this module imports nothing of numesh: the model's and the
    checkpoint's callers say it as a ConfigError first, `numesh.nn.gpt.check_tp`)."""
    if isinstance(tp, bool) or not isinstance(tp, numbers.Integral) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    return round_up(vocab, tp)
