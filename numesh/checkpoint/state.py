"""What a checkpoint is written from: one rank's training state, not the trainer object.

The run layer builds a `TrainState` (the trainer joins its optimiser's units into whole
GPT-shaped trees first), so the checkpoint layer never reaches into a trainer, an
optimiser or a run config, and stays the same when those change.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import numpy as np

from numesh.base.tree import tree_leaves
from numesh.checkpoint.format import LEGACY_OPTIMIZER, PARAMS, LeafDef
from numesh.mesh import Mesh
from numesh.nn.gpt import GPT, GPTConfig
from numesh.optim.interface import Leaf
from numesh.optim.registry import OPTIMIZERS
from numesh.pipeline.stages import StageLayout


def checkpoint_groups(optimizer: str, defs: Mapping[str, LeafDef]) -> dict[str, tuple[str, ...]]:
    """"params" (every leaf) and each state name of `optimizer` -> the paths of the leaves
    it holds, in the table's order (`Optimizer.groups` on the global leaves; the format's
    `Groups`). KeyError for an optimiser this numesh does not know."""
    opt = OPTIMIZERS[optimizer]({})  # which rule a leaf gets depends on no hyper-parameter
    return opt.groups({path: Leaf(path, d.shape, d.spec) for path, d in defs.items()})


def state_groups(optimizer: str) -> tuple[str, ...]:
    """The groups a checkpoint of a run with `optimizer` holds: "params" and its state names."""
    return (PARAMS, *OPTIMIZERS[optimizer]({}).state_names)


@attrs.frozen(eq=False)
class TrainState:
    """One rank's part of a training run at a step boundary, as a checkpoint stores it.

    `trees` are "params" and the optimiser's state names (`state_groups`): this rank's
    tp-local, pipeline-stage trees (laid out as `stage_tree` cuts them for `layout`), whole
    over dp; a state tree holds the leaves of the rule that keeps that state, None
    elsewhere. The data position and every random draw are pure functions of (seed, step),
    so `seed` and `step` restore them."""

    mesh: Mesh
    model: GPTConfig
    layout: StageLayout  # pp ranks x v chunks per rank
    trees: Mapping[str, GPT]
    step: int = attrs.field(converter=int)  # optimiser steps taken = the next step to run
    opt_step: int = attrs.field(converter=int)  # the optimiser's own count (AdamW bias correction)
    dtype: str = "float32"  # "float32" or "float64"
    seed: int | None = None
    run_config: dict[str, Any] | None = None  # meta.json "train": the run's whole config
    tokenizer: dict[str, Any] | None = None  # meta.json "tokenizer" (the dataset tokenizer's to_meta())
    optimizer: str = LEGACY_OPTIMIZER  # meta.json "optimizer"
    source: dict[str, Any] | None = None  # meta.json "init_source": what the run's --init-from directory said

    def __attrs_post_init__(self) -> None:
        """Refuse what the reader would refuse after the save (a library caller builds one by hand)."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"a TrainState's optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"a TrainState's dtype must be float32 or float64, got {self.dtype!r}")
        if self.step < 0 or self.opt_step < 0:
            raise ValueError(f"a TrainState's step and opt_step must be >= 0, got {self.step} and {self.opt_step}")
        if self.layout.n_layer != self.model.n_layer:
            raise ValueError(f"a TrainState's layout splits {self.layout.n_layer} layers, its model has "
                             f"{self.model.n_layer}")
        want = state_groups(self.optimizer)
        if set(self.trees) != set(want):
            raise ValueError(f"a TrainState of {self.optimizer} needs the trees {', '.join(want)}, "
                             f"got {', '.join(sorted(self.trees))}")
        other = {str(x.dtype) for x in tree_leaves(self.trees[PARAMS]) if x.dtype != np.dtype(self.dtype)}
        if other:  # meta.json would say dtype while the files held another
            raise ValueError(f"a TrainState of dtype {self.dtype} has {', '.join(sorted(other))} parameters: pass "
                             f"dtype={sorted(other)[0]!r} or cast them")


@attrs.frozen(eq=False)
class LocalState:
    """What loading a checkpoint gives one rank: trees shaped like `TrainState.trees` (in
    the run's dtype and layout), the step to continue from, the optimiser's step and name,
    the record of the transformers directory its run started from (or None), the dtype it
    was saved in and its run's config (meta.json "train", or None), which a resume compares
    its own with."""

    trees: dict[str, GPT]
    step: int
    opt_step: int
    optimizer: str = LEGACY_OPTIMIZER
    source: dict[str, Any] | None = None
    dtype: str = "float32"
    run_config: dict[str, Any] | None = None
