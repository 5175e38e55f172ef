"""Dropout that does not depend on the mesh.

Each residual site's mask is drawn for the whole global batch from a counter-based stream
of (seed, step, site), and every rank or thread keeps its own rows (and with cp its tokens'
positions). Attention dropout draws no mask at all: the attention kernel hashes each
(global row, head, query position, key position) with the site's stream key
(numesh/nn/attention.py). So a dp, tp, cp or thread split drops exactly what one rank would.
"""

from __future__ import annotations

import attrs
import numpy as np

from numesh.nn.attention import AttnDropout
from numesh.nn.context_parallel import CpSlice
from numesh.nn.layers import dropout_mask


@attrs.frozen
class Site:
    """A place in the model where dropout applies: the embedding output, or in block
    `layer` the attention probabilities, the attention output or the MLP output."""

    kind: str  # "embed" | "attn" | "attn_out" | "mlp_out"
    layer: int = 0

    @property
    def stream(self) -> int:
        """The site's random-stream number: 0 for the embedding, then three per block."""
        if self.kind == "embed":
            return 0
        return 1 + 3 * self.layer + ("attn", "attn_out", "mlp_out").index(self.kind)


EMBED = Site("embed")


@attrs.frozen
class DropoutKey:
    """Identifies the random stream of one micro-batch: rows [row0, row0+rows) of `global_rows`."""

    p: float
    seed: int
    step: int
    row0: int
    global_rows: int

    def __attrs_post_init__(self) -> None:
        # p = 1 divided by zero, a negative p overflowed the hash's threshold, p > 1 ran on
        if not 0.0 <= self.p < 1.0:
            raise ValueError(f"a DropoutKey's rate p must be in [0, 1), got {self.p}")

    def mask(self, site: Site, rows: int, inner_shape: tuple[int, ...], inner_index: tuple = ()) -> np.ndarray:
        """This micro-batch's slice of `site`'s mask over [global_rows, *inner_shape]."""
        rng = np.random.default_rng([self.seed, self.step, site.stream])
        full = dropout_mask(rng, (self.global_rows, *inner_shape), self.p, np.float64)
        return full[(slice(self.row0, self.row0 + rows), *inner_index)]

    def seq_mask(self, site: Site, rows: int, seq_len: int, inner: tuple[int, ...], cp: CpSlice) -> np.ndarray:
        """The mask of a [rows, seq_len, *inner] activation holding cp rank `cp`'s tokens:
        the whole sequence's mask at this rank's positions."""
        if cp.size == 1:
            return self.mask(site, rows, (seq_len, *inner))
        return self.mask(site, rows, (seq_len * cp.size, *inner), (cp.positions(seq_len),))

    def attention(self, layer: int, n_head: int, heads: slice, seq: int) -> AttnDropout:
        """Block `layer`'s attention dropout for this micro-batch's rows and the local `heads`
        of `n_head`, over sequences of `seq` tokens (the whole sequence, before any cp split):
        no mask, a hash stream the attention kernel evaluates per (row, head, query, key)."""
        stream = np.random.SeedSequence([self.seed, self.step, Site("attn", layer).stream])
        key = int(stream.generate_state(1, np.uint64)[0])
        return AttnDropout(self.p, key, self.row0, n_head, heads.start, seq)

    def shifted(self, rows: slice) -> DropoutKey:
        """The key of rows `rows` of this micro-batch (a thread's chunk of it)."""
        return attrs.evolve(self, row0=self.row0 + rows.start)
