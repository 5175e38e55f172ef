"""What the planner plans: a model (sizes only, no dataset) and one parallel layout of it."""

from __future__ import annotations

import functools
from typing import Any

import attrs

from numesh.optim.registry import OPTIONS
from numesh.perf import formulas
from numesh.pipeline.schedules import Schedule, make_schedule


@attrs.frozen
class ModelSpec:
    """A GPT's sizes, its kind's parts, the step's global batch and the optimiser: all the
    planner needs of a model."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int  # global batch in sequences per optimiser step
    bias: bool = False
    dropout: bool = False
    moe_experts: int = 0  # E experts in place of the MLP of every moe_every-th block; 0: dense
    moe_top_k: int = 2
    moe_every: int = 1
    optimizer: str = "adamw"  # the run's --optimizer: its state and its step's work (numesh/plan/optimizer.py)
    parts: formulas.Parts = formulas.GPT2  # the kind's norm, positions, MLP, kv heads and head (GPT-2's by default)
    # the run's options the optimiser reads, (name, value) pairs: Muon's Newton-Schulz steps price its step
    optimizer_options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, cfg: Any, vocab_size: int) -> "ModelSpec":
        """The sizes of a `TrainConfig`'s model (its experts and parts included) with `vocab_size`
        tokens, and its optimiser."""
        return cls(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, vocab_size, cfg.batch_size, cfg.bias,
                   cfg.dropout > 0, cfg.moe_experts, cfg.moe_top_k, cfg.moe_every, cfg.optimizer,
                   formulas.Parts.of(cfg.model(vocab_size)),
                   tuple((k, getattr(cfg, k)) for k in sorted(OPTIONS.get(cfg.optimizer, {})) if hasattr(cfg, k)))

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has experts (layer % moe_every == 0, as `GPTConfig.moe` says)."""
        return self.moe_experts > 0 and layer % self.moe_every == 0

    def moe_blocks(self, start: int = 0, stop: int | None = None) -> int:
        """MoE blocks among blocks start .. stop - 1 (the whole model by default)."""
        if not self.moe_experts:
            return 0
        stop = self.n_layer if stop is None else stop
        return max(0, (stop - 1) // self.moe_every - (start - 1) // self.moe_every) if stop > start else 0

    @property
    def n_params(self) -> int:
        """Parameters of the whole model (vocabulary unpadded), as `Trainer.n_params` counts them."""
        C, parts = self.n_embd, self.parts
        outer = (self.vocab_size * C * (1 if parts.tied else 2) + (0 if parts.rotary else self.block_size * C)
                 + parts.norm_values(C, self.bias))
        moe = self.moe_blocks()
        dense = (self.n_layer - moe) * formulas.block_params(C, 1, self.bias, parts)
        return dense + moe * (formulas.moe_block_params(C, self.moe_experts, self.bias, parts) if moe else 0) + outer

    @property
    def active_params(self) -> int:
        """Parameters one token uses (all of a dense model's; k of E experts per MoE block)."""
        moe = self.moe_blocks()
        if not moe:
            return self.n_params
        return formulas.active_params(self.n_params, self.n_embd, moe, self.moe_experts, self.moe_top_k, self.bias,
                                      self.parts)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token as MFU counts them: active parameters only (an untied
        embedding not: `formulas.counted_params`)."""
        counted = formulas.counted_params(self.active_params, self.vocab_size, self.n_embd, self.parts)
        return formulas.flops_per_token(self.n_layer, self.n_embd, self.block_size, counted)


@attrs.frozen
class Layout:
    """One way to run a model on `ranks` ranks: the mesh (cp: context parallelism, each
    rank holding block_size/cp tokens of every sequence; `sp`: sequence parallelism on tp),
    ZeRO stage, pipeline schedule and activation recomputation (none, full)."""

    dp: int
    tp: int
    pp: int
    zero: int
    schedule: str
    micro_batches: int
    virtual_stages: int = 1
    recompute: str = "none"
    cp: int = 1
    sp: bool = False
    ep: int = 1  # expert parallelism (MoE models only): E/ep experts per rank, the batch split over dp x ep

    @property
    def ranks(self) -> int:
        return self.dp * self.ep * self.cp * self.tp * self.pp

    @property
    def mesh(self) -> str:
        """The mesh as `--mesh` takes it (dp, tp and pp always written, so nothing is
        inferred; ep and cp when > 1, as older meshes never name them)."""
        ep = f"ep={self.ep}," if self.ep > 1 else ""
        cp = f"cp={self.cp}," if self.cp > 1 else ""
        return f"dp={self.dp},{ep}{cp}tp={self.tp},pp={self.pp}"

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes as `numesh.mesh.parse_mesh` gives them (what `formulas.StepShape.mesh` holds)."""
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    def rows(self, model: ModelSpec) -> int:
        """Sequences in one micro-batch on one rank (the batch is split over dp x ep)."""
        return model.batch_size // (self.dp * self.ep * self.micro_batches)

    @property
    def sched(self) -> Schedule:
        return schedule_of(self.schedule, self.pp, self.micro_batches, self.virtual_stages)

    def train_flags(self, every: bool = False) -> str:
        """The `numesh train` options that select this layout; `every`: its defaults too, so
        the line overrides a --config recipe's own (its sequence parallelism, virtual stages
        or recompute once ran another layout than the one planned, or none)."""
        flags = f"--mesh {self.mesh} --zero {self.zero} --schedule {self.schedule} --micro-batches {self.micro_batches}"
        if every or self.virtual_stages > 1:
            flags += f" --virtual-stages {self.virtual_stages}"
        if every or self.recompute != "none":
            flags += f" --recompute {self.recompute}"
        if every or self.sp:
            flags += " --sequence-parallel" if self.sp else " --no-sequence-parallel"
        return flags


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (O(√n): rank counts reach the thousands)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@functools.lru_cache(maxsize=256)
def schedule_of(name: str, pp: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """`make_schedule`, built once per shape: the memory walk, the time model and the search
    ask for the same schedule many times (a 64-stage schedule of 768 micro-batches has 98k actions)."""
    return make_schedule(name, pp, micro_batches, virtual_stages)
