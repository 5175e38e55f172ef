"""Dropout that does not depend on the mesh.

Each site's mask is drawn for the whole global batch (and, for attention, all heads) from
a counter-based stream of (seed, step, site), and every rank or thread keeps its own rows
(and heads, and with cp its tokens' positions). So a dp, tp, cp or thread split draws
exactly the masks one rank would.
"""

from __future__ import annotations

import attrs
import numpy as np

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

    def attn_mask(self, layer: int, rows: int, n_head: int, seq_len: int, heads: slice, cp: CpSlice) -> np.ndarray:
        """The attention-probability mask [rows, local heads, seq_len, seq_len·cp]: this rank's
        query rows against every key of the whole sequence."""
        site = Site("attn", layer)
        if cp.size == 1:
            return self.mask(site, rows, (n_head, seq_len, seq_len), (heads,))
        T = seq_len * cp.size
        return self.mask(site, rows, (n_head, T, T), (heads, cp.positions(seq_len)))

    def shifted(self, rows: slice) -> DropoutKey:
        """The key of rows `rows` of this micro-batch (a thread's chunk of it)."""
        return attrs.evolve(self, row0=self.row0 + rows.start)
