"""The documentation's figures (numesh/figures): the committed SVGs in docs/img are exactly
what `python -m numesh.figures` draws now, every one of them is shown on a page, and what
each figure draws holds the properties its caption claims.

matplotlib comes with the dev extra, pinned there because the comparison is byte for byte:
without it these tests fail with the install to run, they do not skip.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from numesh.figures import cp_zigzag, gqa_heads, mesh_groups, moe_dispatch, pipeline_schedules, zero_memory
from numesh.figures.__main__ import main
from numesh.figures.catalog import FIGURES
from numesh.mesh import P
from numesh.nn.gpt import GPTConfig, gpt_specs
from numesh.perf.formulas import memory_formula

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
REGENERATE = "regenerate with `python -m numesh.figures`"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every figure drawn now, by the command the docs give, into a temporary directory."""
    out = tmp_path_factory.mktemp("figures")
    assert main(["--out", str(out)]) == 0, "python -m numesh.figures failed: pip install -e '.[dev]' brings matplotlib"
    return out


def test_committed_figures_are_a_fresh_drawing(fresh: Path) -> None:
    drawn = sorted(p.name for p in fresh.glob("*.svg"))
    assert drawn == sorted(f"{m.NAME}.svg" for m in FIGURES)
    committed = sorted(p.name for p in IMG.glob("*.svg"))
    assert committed == drawn, f"docs/img holds {committed}, the figures are {drawn}: {REGENERATE}"
    for name in drawn:
        assert (IMG / name).read_bytes() == (fresh / name).read_bytes(), \
            f"docs/img/{name} differs from a fresh drawing: {REGENERATE}"


def test_a_drawing_records_no_date_or_version_and_keeps_its_text(fresh: Path) -> None:
    for path in fresh.glob("*.svg"):
        text = path.read_text()
        assert "<dc:date>" not in text and "Matplotlib v" not in text, f"{path.name} records a date or a version"
        assert "<text" in text, f"{path.name} has no text elements: svg.fonttype must be 'none'"


def test_every_figure_is_shown_on_a_page() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    text = "\n".join(p.read_text() for p in pages)
    for svg in sorted(IMG.glob("*.svg")):
        assert re.search(rf"\]\((\.\./)*(docs/)?img/{re.escape(svg.name)}\)", text), \
            f"docs/img/{svg.name} is on no page: show it with ![what it shows](img/{svg.name}) or delete it"


def test_every_schedule_does_the_same_work_and_only_idles_differently() -> None:
    tls = pipeline_schedules.timelines()
    assert [t.schedule.name for t in tls] == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    p, m = pipeline_schedules.P, pipeline_schedules.M
    for t in tls:  # F + B + W = 3 per micro-batch and stage, whatever the chunks
        assert sum(t.busy(r) for r in range(p)) == pytest.approx(3.0 * p * m), t.schedule.name
    gpipe, one_f_one_b, interleaved, zb = (t.bubble_fraction for t in tls)
    assert gpipe == pytest.approx(one_f_one_b) and zb < interleaved < one_f_one_b


def _page_groups(axis_words: str) -> list[tuple[int, ...]]:
    page = (ROOT / "docs" / "parallelism" / "index.md").read_text()
    listed = re.search(rf"{axis_words} ((?:\{{[\d,]+\}}(?:, |;|\.)\s*)+)", page)
    assert listed, f"docs/parallelism/index.md no longer lists the {axis_words}"
    return [tuple(int(x) for x in g.split(",")) for g in re.findall(r"\{([\d,]+)\}", listed.group(1))]


@pytest.mark.parametrize("axis, words", [("tp", "the tp groups are"), ("dp", "the dp groups"),
                                         ("pp", "the pipeline pairs")])
def test_mesh_groups_are_those_the_mesh_page_lists(axis: str, words: str) -> None:
    assert mesh_groups.groups({"dp": 2, "tp": 2, "pp": 2}, axis) == _page_groups(words)


@pytest.mark.parametrize("shape", mesh_groups.MESHES)
def test_each_axis_splits_the_ranks_into_groups_in_lanes_that_do_not_overlap(shape: dict[str, int]) -> None:
    n = int(np.prod(list(shape.values())))
    for axis, size in shape.items():
        gs = mesh_groups.groups(shape, axis)
        assert sorted(r for g in gs for r in g) == list(range(n)) and all(len(g) == size for g in gs)
        lanes = mesh_groups.lanes(gs)
        for i, (a, la) in enumerate(zip(gs, lanes)):
            for b, lb in zip(gs[:i], lanes[:i]):
                assert la != lb or b[-1] < a[0], f"{axis} groups {b} and {a} share lane {la}"


@pytest.mark.parametrize("cp, seq", [(1, 8), (2, 16), (4, 16), (4, 32)])
def test_ring_attention_computes_each_causal_pair_once_and_every_rank_as_much(cp: int, seq: int) -> None:
    rank, step = cp_zigzag.attention_work(seq, cp)
    causal = np.tril(np.ones((seq, seq), bool))
    assert np.array_equal(rank >= 0, causal), "a causal pair is missed, or a pair above the diagonal computed"
    assert np.array_equal(step >= 0, causal) and step.max() == cp - 1
    assert len(set(np.bincount(rank[causal], minlength=cp))) == 1, "the zigzag layout should balance the work"
    assert sorted(np.bincount(cp_zigzag.holders(seq, cp))) == [seq // cp] * cp


def test_zero_figure_models_gpt2_and_follows_the_papers_formula() -> None:
    from numesh.plan.presets import PRESETS

    gpt2, shape = PRESETS["gpt2"], zero_memory.GPT2
    assert (shape.n_layer, shape.n_embd, shape.block_size, shape.vocab_size) == \
        (gpt2.n_layer, gpt2.n_embd, gpt2.block_size, gpt2.vocab_size)
    psi = sum(zero_memory.unit_sizes())
    assert 124e6 < psi < 125e6  # GPT-2 small with biases
    dp = zero_memory.DP
    padding = len(zero_memory.unit_sizes()) * dp * zero_memory.ITEMSIZE  # each unit padded to a multiple of dp
    for stage, got in zero_memory.stage_bytes().items():
        for part, want in memory_formula(psi, dp, stage, zero_memory.ITEMSIZE).items():
            assert want <= got[part] <= want + 2 * padding, (stage, part)


def test_moe_rows_each_reach_their_experts_rank_once_grouped_by_expert() -> None:
    rs = moe_dispatch.routings()
    m = moe_dispatch.rows_matrix(rs)
    k, tokens, ep = moe_dispatch.TOP_K, moe_dispatch.TOKENS, moe_dispatch.EP
    assert m.sum(axis=1).tolist() == [tokens * k] * ep
    per = moe_dispatch.EXPERTS // ep
    every = []
    for d in range(ep):
        got = moe_dispatch.received(rs, d)
        assert len(got) == m[:, d].sum() and all(e // per == d for _, _, e in got)
        assert got == sorted(got, key=lambda row: (row[2], row[0])), "rows grouped by expert, by source within"
        every += got
    assert sorted(every) == sorted((s, t, int(e)) for s, r in enumerate(rs) for t in range(tokens) for e in r.top[t])


@pytest.mark.parametrize("n_head, n_kv_head, tp", [(8, 2, 2), (8, 2, 4), (8, 2, 8), (8, 4, 2), (9, 3, 3), (9, 3, 9),
                                                   (4, 4, 2), (8, 1, 4)])
def test_each_tp_rank_computes_exactly_the_kv_heads_its_query_heads_read(n_head: int, n_kv_head: int, tp: int) -> None:
    cfg = GPTConfig(n_head=n_head, n_kv_head=n_kv_head, n_embd=8 * n_head)
    ranks = gqa_heads.heads_of(cfg, tp)
    assert [h for q, _ in ranks for h in q] == list(range(n_head)), "the query heads are split over tp in order"
    computed = [j for _, kv in ranks for j in kv]
    for q, kv in ranks:
        assert set(kv) == {gqa_heads.group(cfg, h) for h in q}, (q, kv)
    share = max(1, tp // n_kv_head)  # the ranks that compute each kv head, whose k, v grads the sum adds
    assert sorted(computed) == sorted(list(range(n_kv_head)) * share)


def test_gqa_figure_shows_k_and_v_replicated_and_their_grads_summed_over_tp() -> None:
    cfg = gqa_heads.MODEL
    assert cfg.kv_heads < cfg.n_head and max(gqa_heads.TPS) > cfg.kv_heads, "the figure should show tp > kv heads"
    attn = gpt_specs(cfg).blocks[0].attn
    assert attn.k.w == P() and attn.v.w == P() and attn.q.w == P(None, "tp")
    for tp in gqa_heads.TPS:
        assert gqa_heads.summed_over_tp(cfg, tp) == gqa_heads.KV_PATHS
    assert gqa_heads.summed_over_tp(cfg, 1) == (), "on one rank nothing is partial"
