"""What a checkpoint is written from: one rank's training state, not the trainer object.

The run layer builds a `TrainState` (the trainer joins its optimiser's units into whole
GPT-shaped trees first), so the checkpoint layer never reaches into a trainer, an
optimiser or a run config, and stays the same when those change.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from numesh.checkpoint.format import GROUPS
from numesh.mesh import Mesh
from numesh.nn.gpt import GPT, GPTConfig
from numesh.pipeline.stages import StageLayout


def _check_groups(_inst: Any, _attr: Any, trees: Mapping[str, GPT]) -> None:
    if set(trees) != set(GROUPS):
        raise ValueError(f"a TrainState needs the trees {', '.join(GROUPS)}, got {', '.join(sorted(trees))}")


@attrs.frozen(eq=False)
class TrainState:
    """One rank's part of a training run at a step boundary, as a checkpoint stores it.

    `trees` are {"params", "m", "v"}: this rank's tp-local, pipeline-stage trees (laid out
    as `stage_tree` cuts them for `layout`), whole over dp. The data position and every
    random draw are pure functions of (seed, step), so `seed` and `step` restore them."""

    mesh: Mesh
    model: GPTConfig
    layout: StageLayout  # pp ranks x v chunks per rank
    trees: Mapping[str, GPT] = attrs.field(validator=_check_groups)
    step: int = attrs.field(converter=int)  # optimiser steps taken = the next step to run
    opt_step: int = attrs.field(converter=int)  # the optimiser's own count (AdamW bias correction)
    dtype: str = "float32"  # "float32" or "float64"
    seed: int | None = None
    run_config: dict[str, Any] | None = None  # meta.json "train": the run's whole config
    tokenizer: dict[str, Any] | None = None  # meta.json "tokenizer" (the dataset tokenizer's to_meta())


@attrs.frozen(eq=False)
class LocalState:
    """What loading a checkpoint gives one rank: trees shaped like `TrainState.trees` (in
    the run's dtype and layout), the step to continue from and the optimiser's step."""

    trees: dict[str, GPT]
    step: int
    opt_step: int
