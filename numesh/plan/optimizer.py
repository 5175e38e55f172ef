"""The optimiser in a plan: its state per rank, and the work and bytes of its step, from
the optimiser's own declaration (numesh/optim/interface.py), so a plan follows any optimiser.

Which leaves each rule updates is asked of the optimiser for the model's leaves (the GPT's
global shapes and specs, cut to one tp and ep rank), per kind of block (dense, with experts)
and for the outer unit. The state is each rule's values times its state buffers per value
(`Optimizer.state_per_value`), the padding of a unit rule 0's, as `ZeroOptimizer` holds
it: exact under ZeRO 0; under ZeRO >= 1 a rank holds 1/dp of each unit and the plan counts
the rules' shares of it in proportion (the exact split depends where the cut falls in the
unit: `formulas.rule_values`, which the tests hold the optimiser to).

A matrix rule (Muon) runs its function on whole matrices: each dp rank on about 1/dp of
them (dealt by cost, numesh/optim/matrices.py), under every ZeRO stage, and each of an
owner's replicas on its share of those: an expert's over the cp x tp ranks of its ep rank,
the others over ep x cp x tp. Its bytes are expected ones (`formulas.matrix_exchange_bytes`
is the exact count for a rank's slabs): under ZeRO >= 1 a rank's shard holds 1/dp of the
matrix values, (dp - 1)/dp of which go to other owners, and as many come back; under ZeRO
0 the results are all-gathered over dp (all the matrix values); over the replicas a rank
sends its parts of the split matrices its tp neighbours compute, and the others' parts
(or all) of the results of those it computes.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs

from numesh.base.padding import round_up
from numesh.base.tree import tree_leaves_with_path
from numesh.mesh import P
from numesh.nn.gpt import GPTConfig, gpt_global_shapes, gpt_specs, outer_held
from numesh.optim import Leaf, MatrixRule, Optimizer, make_optimizer
from numesh.optim.interface import fan, matrix_view
from numesh.plan.layout import Layout, ModelSpec


@attrs.frozen
class Matrices:
    """A kind of whole matrix a matrix rule runs on: (in, out), how many a unit holds, the
    tp-local values of each, whether tp splits it and whether it is an expert's (each ep
    rank its own)."""

    fan_in: int
    fan_out: int
    count: int
    local: int
    split: bool
    experts: bool = False


@attrs.frozen
class UnitRules:
    """One unit on one rank: each rule's values, and a matrix rule's matrices."""

    values: tuple[tuple[int, int], ...]  # (rule, values)
    matrices: tuple[Matrices, ...] = ()

    @property
    def size(self) -> int:
        return sum(n for _, n in self.values)


def optimizer_of(model: ModelSpec) -> Optimizer:
    """The model's run's optimiser with the run's options (Muon's Newton-Schulz steps set
    its step's FLOPs; at their defaults the plan priced 5 whatever --muon-ns-steps said)."""
    return _optimizer(model.optimizer, model.optimizer_options)


@functools.lru_cache(maxsize=8)  # asked per layout
def _optimizer(name: str, options: tuple[tuple[str, Any], ...]) -> Optimizer:
    return make_optimizer(name, dict(options))


def _local(shape: tuple[int, ...], spec: P, sizes: dict[str, int]) -> tuple[int, ...]:
    dims = list(spec) + [None] * (len(shape) - len(spec))
    return tuple(n // math.prod(sizes.get(a, 1) for a in ((d,) if isinstance(d, str) else d or ()))
                 for n, d in zip(shape, dims))


def _unit(opt: Optimizer, leaves: list[tuple[str, tuple[int, ...], P]], sizes: dict[str, int]) -> UnitRules:
    values: dict[int, int] = {}
    mats: list[Matrices] = []
    for path, shape, spec in leaves:
        leaf = Leaf(path, _local(shape, spec, sizes), spec)
        rule = opt.rule_index(leaf)
        values[rule] = values.get(rule, 0) + math.prod(leaf.shape)
        if isinstance(opt.rules[rule], MatrixRule):
            view = matrix_view(leaf)
            f = fan(view, sizes["tp"])
            mats.append(Matrices(f[0], f[1], view.batch * view.matrices_per_slab, view.size // view.matrices_per_slab,
                                 view.tp_dim is not None, view.experts))
    return UnitRules(tuple(sorted(values.items())), tuple(mats))


@functools.lru_cache(maxsize=1024)
def block_rules(model: ModelSpec, tp: int, ep: int, moe: bool) -> UnitRules:
    """A block's unit on one (tp, ep) rank: dense, or with experts (`moe`)."""
    cfg = _gpt(model)
    layer = next((i for i in range(model.n_layer) if model.is_moe(i) == moe), 0)
    shapes, specs = _leaves(cfg, tp)
    prefix = f"blocks.{layer}."
    leaves = [(p, shapes[p], specs[p]) for p in shapes if p.startswith(prefix)]
    return _unit(optimizer_of(model), leaves, {"tp": tp, "ep": ep})


@functools.lru_cache(maxsize=1024)
def outer_rules(model: ModelSpec, tp: int, first: bool, last: bool) -> UnitRules:
    """The outer unit (embeddings, final norm) of a pipeline rank, first and/or last."""
    shapes, specs = _leaves(_gpt(model), tp)
    leaves = [(p, shapes[p], specs[p]) for p in shapes
              if not p.startswith("blocks.") and outer_held(p.split(".")[0], first, last, model.parts.tied)]
    return _unit(optimizer_of(model), leaves, {"tp": tp, "ep": 1})


def _gpt(model: ModelSpec) -> GPTConfig:
    """The model's config, its kind's parts included (the leaves a rule is asked about)."""
    p = model.parts
    return GPTConfig(vocab_size=model.vocab_size, block_size=model.block_size, n_layer=model.n_layer,
                     n_head=model.n_head, n_embd=model.n_embd, bias=model.bias, moe_experts=model.moe_experts,
                     moe_every=model.moe_every, moe_top_k=model.moe_top_k,
                     norm="rmsnorm" if p.rmsnorm else "layernorm", positions="rotary" if p.rotary else "learned",
                     mlp="swiglu" if p.gated else "gelu", ffn_hidden=p.hidden, n_kv_head=p.kv_heads,
                     tie_embeddings=p.tied)


@functools.lru_cache(maxsize=256)
def _leaves(cfg: GPTConfig, tp: int) -> tuple[dict[str, tuple[int, ...]], dict[str, P]]:
    """Global shapes (vocabulary padded for tp) and specs of the model's leaves by path."""
    return (dict(tree_leaves_with_path(gpt_global_shapes(cfg, tp))), dict(tree_leaves_with_path(gpt_specs(cfg))))


def rank_units(model: ModelSpec, layout: Layout, layers: list[int], first: bool, last: bool) -> list[UnitRules]:
    """The units of a pipeline rank holding global blocks `layers`: each block's, then the outer one."""
    blocks = [block_rules(model, layout.tp, layout.ep, model.is_moe(i)) for i in layers]
    return [*blocks, outer_rules(model, layout.tp, first, last)]


def state_values(model: ModelSpec, layout: Layout, units: list[UnitRules]) -> float:
    """Optimiser state values of a rank (module docstring): each unit's slice (the whole
    unit padded to a multiple of dp, or 1/dp of it under ZeRO >= 1) times the rules' state
    per value in proportion to their values, the padding rule 0's."""
    per = optimizer_of(model).state_per_value
    total = 0.0
    for u in units:
        padded = round_up(u.size, layout.dp)
        whole = sum(per[r] * n for r, n in u.values) + per[0] * (padded - u.size)
        total += whole / layout.dp if layout.zero >= 1 else whole
    return total


def matrix_work(model: ModelSpec, layout: Layout, units: list[UnitRules]) -> list[tuple[Matrices, float]]:
    """The matrices a rank runs a matrix rule on in one step: (kind, how many), about
    1/(dp·cp·tp) of its units' experts and 1/(dp·ep·cp·tp) of the others (dealt by cost
    over dp, then over the replicas that hold them alike)."""
    row = layout.dp * layout.cp * layout.tp
    return [(m, m.count / (row if m.experts else row * layout.ep)) for u in units for m in u.matrices]


def matrix_bytes(model: ModelSpec, layout: Layout, units: list[UnitRules], itemsize: int) -> dict[str, float]:
    """Expected payload bytes of the matrix exchange a rank sends in one step (module
    docstring): "dp" all-to-all (both ways, ZeRO >= 1), "dp_gather" the results'
    all-gather over dp (ZeRO 0), "replicas" the two all-to-alls over ep x cp x tp."""
    local = sum(m.count * m.local for u in units for m in u.matrices)
    out = {"dp": 0.0, "dp_gather": 0.0, "replicas": 0.0}
    if layout.dp > 1 and layout.zero >= 1:
        out["dp"] = 2 * (layout.dp - 1) / layout.dp * local / layout.dp * itemsize
    elif layout.dp > 1:
        out["dp_gather"] = local * itemsize
    for experts in (True, False):  # an expert's replicas are the cp x tp ranks of its ep rank
        n = layout.cp * layout.tp * (1 if experts else layout.ep)
        kind = [m.count * m.local for u in units for m in u.matrices if m.experts == experts]
        split = sum(m.count * m.local for u in units for m in u.matrices if m.experts == experts and m.split)
        # split parts to the replica beside me computing them; the results' parts (or all) back
        out["replicas"] += ((n - 1) * sum(kind) + (layout.tp - 1) * split) / n / layout.dp * itemsize
    return out
