"""Dropout that does not depend on the mesh.

Each site's mask is drawn for the whole global batch (and, for attention, all heads) from
a counter-based stream of (seed, step, site), and every rank or thread keeps its own rows
(and heads). So a dp, tp or thread split draws exactly the masks one rank would.
"""

from __future__ import annotations

import attrs
import numpy as np

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

    def shifted(self, rows: slice) -> DropoutKey:
        """The key of rows `rows` of this micro-batch (a thread's chunk of it)."""
        return attrs.evolve(self, row0=self.row0 + rows.start)
