"""The optimisers by name: what `--optimizer` chooses and a checkpoint records.

Each entry builds an `Optimizer` (numesh/optim/interface.py) from a run's options (the
`TrainConfig` fields as a mapping, missing ones at their defaults), raising a one-line
ConfigError for a bad hyper-parameter. A new optimiser is one module in numesh/optim and
one line here (docs/design.md, "Adding an optimiser").
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

from numesh.base.errors import ConfigError, option_value
from numesh.optim import adamw, muon
from numesh.optim.interface import Leaf, MatrixRule, Optimizer, matrix_view

OPTIMIZERS: dict[str, Callable[[Mapping[str, Any]], Optimizer]] = {
    "adamw": adamw.define,
    "muon": muon.define,
}
# the options each one reads, with their types (its module's OPTIONS)
OPTIONS: dict[str, dict[str, type]] = {
    "adamw": adamw.OPTIONS,
    "muon": muon.OPTIONS,
}


def make_optimizer(name: str, options: Mapping[str, Any] | None = None) -> Optimizer:
    """The optimiser `name` with the hyper-parameters in `options` (its `OPTIONS`, missing
    ones at their defaults); one-line ConfigError for an unknown name, a key it does not
    read, a value of another type or not finite (the check of `numesh train`'s options), or
    one out of range."""
    if not isinstance(name, str) or name not in OPTIMIZERS:  # a list was a TypeError (unhashable)
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    known = OPTIONS[name]
    for key in options or {}:
        if key not in known:
            raise ConfigError(f"{name} has no option '{key}': its options are {', '.join(known)}")
    checked = {k: option_value(k, _plain(v), known[k]) for k, v in (options or {}).items()}
    if "learning_rate" in checked and not checked["learning_rate"] > 0:  # as a run's --learning-rate
        raise ConfigError(f"learning_rate must be > 0, got {checked['learning_rate']}")
    return OPTIMIZERS[name](checked)


def _plain(value: Any) -> Any:
    """A NumPy integer or float scalar as the Python int or float it is (np.int64(5) steps,
    np.float32(0.5) a beta, as np.float64, a float, always was); anything else as it is."""
    if isinstance(value, (bool, int, float)):  # np.bool_ is neither Integral nor Real: kept as it is below
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    return float(value) if isinstance(value, numbers.Real) else value


def run_optimizer(name: str, run_options: Mapping[str, Any]) -> Optimizer:
    """`make_optimizer` given a whole run's options (`TrainConfig`'s fields as a mapping):
    the ones `name` reads."""
    return make_optimizer(name, {k: v for k, v in run_options.items() if k in OPTIONS.get(name, {})})


def applies_to(name: str, key: str) -> str | None:
    """The optimiser that reads option `key` where `name` does not (--muon-momentum is
    muon's when `name` is adamw), else None: a key no optimiser reads, or one `name` reads."""
    if key in OPTIONS.get(name, {}):
        return None
    return next((other for other, keys in OPTIONS.items() if key in keys), None)


def describe(opt: Optimizer, leaves: Mapping[str, Leaf]) -> list[str]:
    """Lines saying which rule updates which leaves (printed at start-up): per rule, its
    leaves by path with the block index as `*` and by shape (a row per distinct shape:
    with --moe-every 2 the dense blocks' MLP is not the experts'), with their count and,
    for a matrix rule, the matrices each holds (`interface.matrix_view`)."""
    rows: dict[tuple[int, str, tuple[int, ...]], list[Leaf]] = {}
    for path, leaf in leaves.items():
        parts = path.split(".")
        if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
            parts[1] = "*"
        rows.setdefault((opt.rule_index(leaf), ".".join(parts), tuple(leaf.shape)), []).append(leaf)
    lines = [f"optimizer {opt.name}: {len(leaves)} leaves"]
    for i, rule in enumerate(opt.rules):
        mine = [(path, group) for (r, path, _), group in rows.items() if r == i]
        lines.append(f"  {rule.name}: {sum(len(g) for _, g in mine)} leaves")
        for path, group in mine:
            text = f"    {path} {list(group[0].shape)}" + (f" x{len(group)}" if len(group) > 1 else "")
            if isinstance(rule, MatrixRule):
                view = matrix_view(group[0])
                n = view.batch * view.matrices_per_slab
                text += f": {n} matri{'ces' if n > 1 else 'x'} [{view.shape[0]}, {view.shape[-1]}]"
            lines.append(text)
    return lines
