"""Tests for numesh.run.plot and `numesh plot`: curves of several runs on one figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import cli, one_error_line
from numesh.base.errors import PlotError
from numesh.run import plot as PL

pytest.importorskip("matplotlib")


def write_run(run: Path, steps: int = 10, eval_every: int = 5, scale: float = 1.0) -> Path:
    """A run directory with a metrics.jsonl shaped like `numesh train`'s."""
    run.mkdir(parents=True)
    lines = []
    for s in range(steps):
        rec: dict = {}
        if s % eval_every == 0:
            rec |= {"train_loss": scale * 4.0 / (1 + s), "val_loss": scale * 4.2 / (1 + s)}
        rec |= {"step": s, "loss": scale * 4.1 / (1 + s), "lr": 1e-3, "tokens_per_s": 1000.0 + 10 * s}
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_read_metrics(tmp_path: Path) -> None:
    m = PL.read_metrics(write_run(tmp_path / "r", steps=10, eval_every=5))
    assert m.label == "r"
    np.testing.assert_array_equal(m.step, np.arange(10))
    np.testing.assert_allclose(m.loss, 4.1 / (1 + np.arange(10)))
    np.testing.assert_array_equal(m.eval_step, [0, 5])
    np.testing.assert_allclose(m.val_loss, [4.2, 4.2 / 6])
    np.testing.assert_allclose(m.tokens_per_s, 1000 + 10 * np.arange(10))


def test_read_metrics_tolerates_nan_infinity_null_and_a_cut_off_last_line(tmp_path: Path) -> None:
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 0, "loss": NaN, "tokens_per_s": Infinity, "val_loss": NaN, "train_loss": 1.0}\n'
        '{"step": 1, "loss": 2.5, "tokens_per_s": null}\n'
        "\n"
        '{"step": 2, "loss": 2.0, "tok'  # a run killed while writing
    )
    m = PL.read_metrics(run)
    np.testing.assert_array_equal(m.step, [0, 1])
    assert np.isnan(m.loss[0]) and m.loss[1] == 2.5
    assert np.isinf(m.tokens_per_s[0]) and np.isnan(m.tokens_per_s[1])
    assert np.isnan(m.val_loss[0])


def test_build_figure_one_line_per_run(tmp_path: Path) -> None:
    runs = [PL.read_metrics(write_run(tmp_path / name, scale=k)) for k, name in enumerate(["dp2", "tp2", "pp2"], 1)]
    fig = PL.build_figure(runs)
    ax_loss, ax_speed = fig.axes
    assert [line.get_label() for line in ax_speed.get_lines()] == ["dp2", "tp2", "pp2"]
    assert [line.get_label() for line in ax_loss.get_lines()] == [
        "dp2 train", "dp2 val", "tp2 train", "tp2 val", "pp2 train", "pp2 val"]
    # the legend names every run, and a run's train and val share its colour
    assert [t.get_text() for t in ax_loss.get_legend().get_texts()][::2] == ["dp2 train", "tp2 train", "pp2 train"]
    lines = ax_loss.get_lines()
    assert lines[0].get_color() == lines[1].get_color() != lines[2].get_color()
    np.testing.assert_array_equal(lines[2].get_xdata(), np.arange(10))
    np.testing.assert_allclose(lines[3].get_ydata(), [8.4, 8.4 / 6])
    assert ax_speed.get_xlabel() == "step" and ax_speed.get_ylabel() == "tokens/s"


@pytest.mark.parametrize("ext, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot_runs_writes_file(tmp_path: Path, ext: str, magic: bytes) -> None:
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", scale=2)
    out = tmp_path / "sub" / f"cmp{ext}"
    path, fig = PL.plot_runs([a, b], out)
    assert path == out and out.read_bytes().startswith(magic)
    assert out.stat().st_size > 10_000  # a drawn figure, not an empty canvas
    assert len(fig.axes[1].get_lines()) == 2


def test_a_plot_that_fails_half_way_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The figure goes through a temporary file: a savefig that dies half-way (or a viewer
    reloading the file meanwhile) never leaves half an image where the last plot was."""
    from matplotlib.figure import Figure

    a, out = write_run(tmp_path / "a"), tmp_path / "loss.png"
    PL.plot_runs([a], out)
    before = out.read_bytes()

    def half(self: Figure, fname: object, **kw: object) -> None:
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half)
    with pytest.raises(PlotError, match="No space left"):
        PL.plot_runs([a], out)
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_labels_disambiguate_equal_names(tmp_path: Path) -> None:
    a, b = write_run(tmp_path / "x" / "run"), write_run(tmp_path / "y" / "run")
    assert PL.run_labels([a, b]) == [str(a), str(b)]
    assert PL.run_labels([a, tmp_path / "z"]) == ["run", "z"]


def test_cli_plot(tmp_path: Path) -> None:
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    out = tmp_path / "p.svg"
    res = cli("plot", str(a), str(b), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 10_000 and str(out) in res.stdout


@pytest.mark.parametrize(
    "make, out, match",
    [
        (lambda d: d.mkdir(), "p.png", "has no metrics.jsonl"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("")), "p.png", "holds no records"),
        (lambda d: None, "p.png", "no run directory"),
        (lambda d: write_run(d), "p.jpg", "must end in .png or .svg"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('oops\n{"step": 0, "loss": 1}\n')), "p.png",
         "line 1 is not JSON"),
    ],
)
def test_cli_plot_errors_are_one_line(tmp_path: Path, make, out: str, match: str) -> None:
    run = tmp_path / "run"
    make(run)
    line = one_error_line(cli("plot", str(run), "--out", str(tmp_path / out)))
    assert match in line
    assert not (tmp_path / out).exists()


def test_missing_matplotlib_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    run = write_run(tmp_path / "r")
    with pytest.raises(PlotError, match="numesh plot needs matplotlib"):
        PL.plot_runs([run], tmp_path / "p.png")
    line = one_error_line(cli("plot", str(run), "--out", str(tmp_path / "p.png")))
    assert line == "error: numesh plot needs matplotlib: pip install 'numesh[plot]'"
    assert not (tmp_path / "p.png").exists()


def test_a_run_with_experts_gets_routing_panels(tmp_path: Path) -> None:
    """The experts' max/min token-assignments per logged step (inf where an expert got
    none), the load-balancing loss, and the dropped assignments on a second scale; a dense
    run beside it has no line there, and alone gets no routing panels."""
    moe = write_run(tmp_path / "moe", steps=3)
    recs = [json.loads(line) for line in (moe / "metrics.jsonl").read_text().splitlines()]
    for rec, (lo, hi) in zip(recs, [(0, 40), (10, 30), (20, 20)]):
        rec |= {"moe_aux_loss": 0.01 + hi / 1e4, "moe_tokens_min": lo, "moe_tokens_max": hi, "moe_dropped": lo}
    (moe / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    dense = write_run(tmp_path / "dense", steps=3)
    m = PL.read_metrics(moe)
    np.testing.assert_array_equal(m.moe_spread, [np.inf, 3.0, 1.0])
    assert np.isnan(PL.read_metrics(dense).moe_spread).all()
    fig = PL.build_figure([m, PL.read_metrics(dense)])
    ax_moe, ax_aux = fig.axes[1], fig.axes[2]
    assert "max/min" in ax_moe.get_ylabel()
    assert [line.get_label() for line in ax_moe.get_lines()] == ["moe", "an expert got no tokens (drawn at the top)"]
    np.testing.assert_allclose(ax_aux.get_lines()[0].get_ydata(), [0.014, 0.013, 0.012])
    drop = next(a for a in fig.axes if a.get_ylabel().startswith("dropped"))
    np.testing.assert_array_equal(drop.get_lines()[0].get_ydata(), [0, 10, 20])
    assert len(PL.build_figure([PL.read_metrics(dense)]).axes) == 2


def test_a_collapsed_router_is_drawn_at_the_top_not_left_out(tmp_path: Path) -> None:
    """A step where an expert got no token has an infinite spread, which matplotlib draws
    as nothing: the worst load looked like missing data. It is drawn at the panel's top,
    above every finite spread of every run, with a marker the legend names; NaN (a step that
    logged no routing) stays a gap."""
    runs = []
    for name, lows in [("a", [0, 10, 20, 0]), ("b", [5, 0, 20, 20])]:
        run = write_run(tmp_path / name, steps=4)
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for rec, lo in zip(recs, lows):
            rec |= {"moe_aux_loss": 0.01, "moe_tokens_min": lo, "moe_tokens_max": 40}
        recs[2].pop("moe_tokens_min")  # a step without routing numbers: a gap, not a collapse
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        runs.append(PL.read_metrics(run))
    fig = PL.build_figure(runs)
    ax_moe = fig.axes[1]
    lines = {line.get_label(): line for line in ax_moe.get_lines()}
    a, b = lines["a"].get_ydata(), lines["b"].get_ydata()
    top = a[0]
    assert np.isfinite(top) and top > 8.0  # above b's 40/5, the largest finite spread
    np.testing.assert_array_equal(a[[0, 3]], [top, top])
    assert a[1] == 4.0 and np.isnan(a[2]) and b[0] == 8.0 and b[1] == top
    ylo, yhi = ax_moe.get_ylim()
    assert ylo < top <= yhi  # on the panel, not clipped off it
    marker = lines["an expert got no tokens (drawn at the top)"]
    np.testing.assert_array_equal(marker.get_xdata(), [0, 3])
    np.testing.assert_array_equal(marker.get_ydata(), [top, top])
    b_marker = [line for line in ax_moe.get_lines() if line.get_label() == "_nolegend_"]
    assert len(b_marker) == 1 and list(b_marker[0].get_xdata()) == [1]
    legend = [t.get_text() for t in ax_moe.get_legend().get_texts()]
    assert legend.count("an expert got no tokens (drawn at the top)") == 1
