"""`numesh plan`'s output: a short table with the best layout's command line, or JSON."""

from __future__ import annotations

from typing import Any

import attrs

from numesh.base.flags import n_ranks
from numesh.plan.predict import Plan, Prediction


def human_bytes(n: float) -> str:
    """`n` bytes in the largest binary unit it reaches, one decimal (a model of 10^15 layers
    in EiB, not a 10-digit count of TiB); what --memory-per-rank reads back (`parse_bytes`)."""
    for unit, size in (("EiB", 2**60), ("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def as_json(p: Prediction, ranks: int) -> dict[str, Any]:
    """One layout as `--json` prints it."""
    lay, t = p.layout, p.time
    return {
        "mesh": lay.mesh, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp, "tp": lay.tp, "pp": lay.pp,
        "sequence_parallel": lay.sp, "zero": lay.zero, "schedule": lay.schedule,
        "micro_batches": lay.micro_batches, "virtual_stages": lay.virtual_stages, "recompute": lay.recompute,
        "fits": p.fits, "memory_bytes_per_rank": p.memory.total, "memory": attrs.asdict(p.memory),
        "step_time_s": t.total, "time": {"compute": t.compute, **{f"comm_{k}": v for k, v in t.comm.items()},
                                         "bubble": t.bubble, "optimizer": t.optimizer},
        "tokens_per_s": p.tokens_per_s, "train_flags": lay.train_flags(),
    }


def command(p: Prediction, ranks: int, extra: str = "", recipe: bool = False) -> str:
    """The `mpirun` line that runs this layout (`recipe`: `extra` names a --config file, whose
    own layout options the line overrides, defaults too)."""
    launch = f"mpirun -n {ranks} " if ranks > 1 else ""
    return f"{launch}numesh train {p.layout.train_flags(recipe)}{' ' + extra if extra else ''}"


def table(found: Plan, ranks: int, top: int, limit: float, profile: str, extra: str = "", recipe: bool = False) -> str:
    """The `top` best layouts that fit as a table, a count of all, and the best one's command."""
    preds = found.fitting
    # "wait": blocking calls waiting for their groups' last members, on a calibrated profile only
    waits = any(p.time.comm.get("wait", 0.0) > 0 for p in preds[:top])
    # "ep": the MoE blocks' all-to-alls and the ep gradient sum, where a layout shown has ep > 1
    ep = any(p.layout.ep > 1 for p in preds[:top])
    # "other": the tied embedding's gradient sum across pp and the loss's and norm's scalar
    # all-reduces, part of the step like every column from compute to optim, which add up to it
    head = ["#", "mesh", "sp", "zero", "schedule", "m", "v", "recompute", "memory/rank", "fits", "step", "compute",
            "tp", "cp", *(["ep"] if ep else []), "pp", "dp", "other", *(["wait"] if waits else []), "bubble", "optim",
            "tokens/s"]
    rows = []
    for i, p in enumerate(preds[:top], 1):
        t, lay = p.time, p.layout
        rows.append([str(i), lay.mesh, "yes" if lay.sp else "no", str(lay.zero), lay.schedule, str(lay.micro_batches),
                     str(lay.virtual_stages), lay.recompute, human_bytes(p.memory.total), "yes" if p.fits else "NO",
                     human_seconds(t.total), human_seconds(t.compute), human_seconds(t.comm["tp"]),
                     human_seconds(t.comm["cp"]), *([human_seconds(t.comm.get("ep", 0.0))] if ep else []),
                     human_seconds(t.comm["pp"]), human_seconds(t.comm["dp"]), human_seconds(t.comm["other"]),
                     *([human_seconds(t.comm["wait"])] if waits else []), human_seconds(t.bubble),
                     human_seconds(t.optimizer), f"{p.tokens_per_s:,.0f}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) if i not in (1, 4, 7) else c.ljust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    fit = len(preds)
    lines = [fmt(head), *map(fmt, rows)]
    lim = human_bytes(limit) if limit > 0 else "no limit"
    listed = "all" if fit == found.layouts else f"the {fit} that fit,"
    lines.append(f"{found.layouts} layouts on {n_ranks(ranks)} ({fit} fit in {lim} per rank), profile {profile}; "
                 f"--json lists {listed} with memory and time parts")
    if preds:
        lines.append(f"best: {command(preds[0], ranks, extra, recipe)}")
    return "\n".join(lines)
