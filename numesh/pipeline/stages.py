"""Which layers each pipeline rank owns, and its part of the parameter tree.

With pp ranks and v virtual stages (chunks) per rank there are pp·v model stages of
n_layer/(pp·v) contiguous layers each; model stage k = chunk·pp + rank. Model stage 0
also owns the embedding (wte, wpe), the last one the final LayerNorm and the LM head,
which is tied to wte: the first and last ranks both hold wte and sum its gradients.
A rank's tree is a `GPT` whose `blocks` are its layers in chunk order and whose parts
it does not own are None.
"""

from __future__ import annotations

import attrs

from numesh.nn.gpt import GPT, ConfigError


@attrs.frozen
class StageLayout:
    n_layer: int
    pp: int = 1
    v: int = 1

    def __attrs_post_init__(self) -> None:
        if self.pp < 1 or self.v < 1:
            raise ConfigError(f"pp and virtual stages must be >= 1, got pp={self.pp}, v={self.v}")
        if self.n_layer % (self.pp * self.v):
            raise ConfigError(
                f"n_layer={self.n_layer} is not divisible by pp x virtual stages = {self.pp} x {self.v}: "
                f"use an n_layer that is a multiple of {self.pp * self.v}"
            )

    @property
    def per_stage(self) -> int:
        return self.n_layer // (self.pp * self.v)

    def layers(self, rank: int, chunk: int = 0) -> range:
        """Global layer indices of model stage chunk·pp + rank."""
        k = chunk * self.pp + rank
        return range(k * self.per_stage, (k + 1) * self.per_stage)

    def owned(self, rank: int) -> list[int]:
        """Every global layer of `rank`, chunk by chunk: local block j is global layer owned[j]."""
        return [i for c in range(self.v) for i in self.layers(rank, c)]

    def local_index(self, rank: int, layer: int) -> int:
        return self.owned(rank).index(layer)

    def is_first(self, rank: int) -> bool:
        return rank == 0

    def is_last(self, rank: int) -> bool:
        return rank == self.pp - 1


def stage_tree(full: GPT, layout: StageLayout, rank: int) -> GPT:
    """The part of a whole-model tree (params, grads or specs) that pipeline rank `rank` holds."""
    first, last = layout.is_first(rank), layout.is_last(rank)
    return GPT(
        wte=full.wte if (first or last) else None,
        wpe=full.wpe if first else None,
        blocks=tuple(full.blocks[i] for i in layout.owned(rank)),
        ln_f=full.ln_f if last else None,
    )
