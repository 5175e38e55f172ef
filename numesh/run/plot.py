"""Loss and speed curves of one or more runs on one figure, so meshes and configs compare by eye.

Pure: read each run's `metrics.jsonl`, build a matplotlib Figure (no pyplot, no global
state), save it. matplotlib is an optional extra (`pip install 'numesh[plot]'`), imported
only here and only when a figure is built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import attrs
import numpy as np

from numesh.base.errors import PlotError
from numesh.base.files import os_reason, write_atomic

METRICS_FILE = "metrics.jsonl"
FORMATS = (".png", ".svg")
MATPLOTLIB_HINT = "numesh plot needs matplotlib: pip install 'numesh[plot]'"


@attrs.frozen
class RunMetrics:
    """One run's curves: every logged step, and the eval steps with their losses.

    Attributes:
        label: the run's name in the plot's legend.
        path: its metrics.jsonl.
        step: the steps that logged a training loss.
        loss: their training losses.
        tokens_per_s: their throughput.
        eval_step: the steps that logged train_loss and val_loss.
        train_loss: the evaluated training loss at each eval step.
        val_loss: the validation loss at each eval step.
    """

    label: str
    path: Path
    step: np.ndarray
    loss: np.ndarray
    tokens_per_s: np.ndarray
    eval_step: np.ndarray
    train_loss: np.ndarray
    val_loss: np.ndarray
    val_bpb: np.ndarray  # val loss as bits per byte of text (NaN for runs that predate it)
    moe_spread: np.ndarray  # most / fewest token-assignments of any expert per logged step (NaN: dense)
    moe_aux_loss: np.ndarray  # the load-balancing loss per logged step (NaN: dense)
    moe_dropped: np.ndarray  # token-assignments a capacity dropped per logged step (NaN: dense)


def _number(value: Any) -> float:
    """A metric as float; null (or anything not a number) is NaN, a gap in the curve."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a metrics file. Bare NaN / Infinity (older files) parse as floats;
    a cut-off last line (a run killed mid-write) is ignored, a bad line elsewhere is an error."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"cannot read {path} ({e}): pass a run directory written by `numesh train`") from None
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)  # accepts NaN, Infinity and -Infinity
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise PlotError(f"{path} line {i + 1} is not JSON ({e.msg}): fix or remove that line") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise PlotError(f"{path} line {i + 1} is not a metrics record with a 'step': fix or remove that line")
        records.append(rec)
    return records


def read_metrics(run: str | Path, label: str | None = None) -> RunMetrics:
    """The curves of the run directory `run` (or of its metrics.jsonl given directly)."""
    run = Path(run)
    path = run if run.name == METRICS_FILE and run.is_file() else run / METRICS_FILE
    if not run.exists():
        raise PlotError(f"no run directory {run}: pass the --out directory of a `numesh train` run")
    if not path.is_file():
        raise PlotError(f"{run} has no {METRICS_FILE}: pass the --out directory of a `numesh train` run")
    records = _records(path)
    if not records:
        raise PlotError(f"{path} holds no records: the run has not logged a step yet")
    logged = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r or "train_loss" in r]

    def col(rows: list[dict[str, Any]], key: str) -> np.ndarray:
        return np.array([_number(r.get(key)) for r in rows], dtype=np.float64)

    return RunMetrics(
        label=label if label is not None else (run.parent.name if path == run else run.name) or str(run),
        path=path,
        step=col(logged, "step"),
        loss=col(logged, "loss"),
        tokens_per_s=col(logged, "tokens_per_s"),
        eval_step=col(evals, "step"),
        train_loss=col(evals, "train_loss"),
        val_loss=col(evals, "val_loss"),
        val_bpb=col(evals, "val_bpb"),
        moe_spread=_spread(col(logged, "moe_tokens_max"), col(logged, "moe_tokens_min")),
        moe_aux_loss=col(logged, "moe_aux_loss"),
        moe_dropped=col(logged, "moe_dropped"),
    )


def _spread(most: np.ndarray, fewest: np.ndarray) -> np.ndarray:
    """most / fewest, inf where an expert got no token, NaN where not logged."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(fewest == 0, np.inf, most / fewest) * np.where(np.isnan(most), np.nan, 1.0)


COLLAPSED = "an expert got no tokens"


def collapsed_top(spreads: Sequence[np.ndarray]) -> float:
    """Where the load-spread panel draws a step whose spread is infinite (an expert got no
    token): a quarter above the largest finite spread of any run (at least 2, where the
    balanced value 1 is all there is), so the worst load tops the panel instead of vanishing."""
    finite = [float(np.max(s[np.isfinite(s)])) for s in spreads if np.isfinite(s).any()]
    return max([2.0] + [1.25 * f for f in finite])


def clip_collapsed(spread: np.ndarray, top: float) -> np.ndarray:
    """The spread with +inf drawn at `top` (matplotlib draws no point at inf); NaN stays a gap."""
    return np.where(np.isposinf(spread), top, spread)


def run_labels(runs: Sequence[str | Path]) -> list[str]:
    """Short legend names: each directory's name, or the path as given where names repeat."""
    names = [Path(r).name if Path(r).name != METRICS_FILE else Path(r).parent.name for r in runs]
    return [n if n and names.count(n) == 1 else str(r) for n, r in zip(names, runs)]


def check_output(out: str | Path) -> Path:
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise PlotError(f"--out {out} must end in {' or '.join(FORMATS)}: the figure is written as PNG or SVG")
    return out


def require_matplotlib() -> None:
    """PlotError with the install hint when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(MATPLOTLIB_HINT) from None


def build_figure(runs: Sequence[RunMetrics]) -> Any:
    """A matplotlib Figure: losses against steps on top (per run a solid train line and a
    dashed val line with markers, one colour per run), then the val loss in bits per byte
    (which compares runs with different tokenizers; when any run logged it), the experts'
    load spread and load-balancing loss (when any run has experts, with the assignments a
    capacity dropped dotted on a second scale), tokens/s below (one line per run). A step
    where an expert got no token (an infinite spread, a collapsed router) is drawn as a
    marker at the panel's top, named in the legend, not left out as matplotlib leaves inf."""
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    bpb = any(r.val_bpb.size and not np.isnan(r.val_bpb).all() for r in runs)
    moe = any(r.moe_spread.size and not np.isnan(r.moe_spread).all() for r in runs)
    n = 2 + bpb + 2 * moe
    fig = Figure(figsize=(9, 5 + 2 * n), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, height_ratios=(2,) + (1,) * (n - 1))
    ax_loss, ax_speed = axes[0], axes[-1]
    ax_moe, ax_aux = (axes[-3], axes[-2]) if moe else (None, None)
    ax_drop = ax_aux.twinx() if moe and any(np.nansum(r.moe_dropped) > 0 for r in runs) else None
    top = collapsed_top([r.moe_spread for r in runs])
    marked = False  # the "no tokens" marker gets one legend entry, however many runs collapse
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        dot = "." if run.step.size == 1 else None  # a one-step run is a point, not an invisible line
        ax_loss.plot(run.step, run.loss, color=color, lw=1.0, alpha=0.85, marker=dot, label=f"{run.label} train")
        if run.eval_step.size and not np.isnan(run.val_loss).all():
            ax_loss.plot(run.eval_step, run.val_loss, color=color, lw=1.5, ls="--", marker="o", ms=3,
                         label=f"{run.label} val")
        ax_speed.plot(run.step, run.tokens_per_s, color=color, lw=1.0, marker=dot, label=run.label)
        if ax_moe is not None and not np.isnan(run.moe_spread).all():
            ax_moe.plot(run.step, clip_collapsed(run.moe_spread, top), color=color, lw=1.0, marker=dot,
                        label=run.label)
            collapsed = np.isposinf(run.moe_spread)
            if collapsed.any():
                ax_moe.plot(run.step[collapsed], np.full(int(collapsed.sum()), top), ls="none", marker="^",
                            ms=7, color=color, mec="black", label=f"{COLLAPSED} (drawn at the top)" if not marked
                            else "_nolegend_")
                marked = True
            ax_aux.plot(run.step, run.moe_aux_loss, color=color, lw=1.0, marker=dot, label=run.label)
            if ax_drop is not None:
                ax_drop.plot(run.step, run.moe_dropped, color=color, lw=1.0, ls=":", label=f"{run.label} dropped")
        if bpb and not np.isnan(run.val_bpb).all():
            axes[1].plot(run.eval_step, run.val_bpb, color=color, lw=1.5, ls="--", marker="o", ms=3, label=run.label)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("train loss (every logged step) and val loss (eval steps)")
    ax_loss.legend(fontsize="small")
    ax_loss.grid(alpha=0.3)
    if bpb:
        axes[1].set_ylabel("val bits/byte")
        axes[1].legend(fontsize="small")
        axes[1].grid(alpha=0.3)
    if ax_moe is not None:
        ax_moe.set_ylabel("expert load max/min")
        ax_moe.set_title("mixture of experts: most / fewest token-assignments of any expert (1 = balanced)")
        ax_moe.legend(fontsize="small")
        ax_moe.grid(alpha=0.3)
        ax_aux.set_ylabel("load-balancing loss")
        ax_aux.grid(alpha=0.3)
        if ax_drop is not None:
            ax_drop.set_ylabel("dropped (dotted)")
    ax_speed.set_ylabel("tokens/s")
    ax_speed.set_xlabel("step")
    ax_speed.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_speed.legend(fontsize="small")
    ax_speed.grid(alpha=0.3)
    return fig


def save_figure(fig: Any, out: str | Path) -> Path:
    out = check_output(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # through a temporary file: a viewer reloading it, or a plot killed mid-write, never finds half an image
        write_atomic(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lower()[1:], dpi=120))
    except OSError as e:
        raise PlotError(f"cannot write {out} ({os_reason(e)}): choose another --out") from None
    return out


def plot_runs(runs: Sequence[str | Path], out: str | Path) -> tuple[Path, Any]:
    """Read every run, draw them on one figure, save it to `out` (.png or .svg).
    Returns (the file written, the Figure)."""
    if not runs:
        raise PlotError("no runs to plot: pass one or more run directories")
    check_output(out)
    require_matplotlib()
    metrics = [read_metrics(r, label) for r, label in zip(runs, run_labels(runs))]
    fig = build_figure(metrics)
    return save_figure(fig, out), fig
