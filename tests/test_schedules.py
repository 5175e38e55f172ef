"""Pipeline schedules as data: validity, ordering, bubble and activation memory."""

from __future__ import annotations

import attrs
import pytest

from numesh.pipeline import (
    SCHEDULES,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    bubble_fraction,
    check_shape,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    peak_activations,
    simulate,
    validate,
    zb_h1,
)

PS = (1, 2, 3, 4)
MS = (1, 2, 3, 4, 8)
VS = (2, 3)


def all_schedules() -> list[Schedule]:
    out = []
    for p in PS:
        for m in MS:
            out += [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m)]
            if m % p == 0:
                out += [interleaved(p, m, v) for v in VS]
    return out


SCHEDS = all_schedules()


def sid(s: Schedule) -> str:
    return f"{s.name}-p{s.p}-m{s.m}-v{s.v}"


# ---------------------------------------------------------------------------------------
# validity and ordering


@pytest.mark.parametrize("s", SCHEDS, ids=sid)
def test_valid_and_ordered(s: Schedule) -> None:
    validate(s)
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    for comm in (0.0, 0.5):
        t = simulate(s, t_f=1.0, t_b=1.3, t_w=0.7, comm=comm)  # no deadlock
        for rank, acts in enumerate(s.actions):
            assert len(acts) == s.m * s.v * len(kinds)
            # the rank runs its list back to back in order, never overlapping
            spans = t.intervals[rank]
            assert all(spans[i][1] <= spans[i + 1][0] + 1e-12 for i in range(len(spans) - 1))
            for mb in range(s.m):
                for c in range(s.v):
                    idx = [acts.index(Action(k, mb, c)) for k in kinds]
                    assert idx == sorted(idx), (rank, mb, c)  # F before B before W on the rank
                    ends = [t.span(rank, Action(k, mb, c)) for k in kinds]
                    assert all(ends[i][1] <= ends[i + 1][0] for i in range(len(ends) - 1))
        # F of (mb, k) ends (plus comm) before F of (mb, k+1) starts; B goes the other way
        for mb in range(s.m):
            for k in range(s.num_stages - 1):
                (r0, c0), (r1, c1) = s.rank_chunk(k), s.rank_chunk(k + 1)
                lag = comm if r0 != r1 else 0.0
                assert t.span(r0, F(mb, c0))[1] + lag <= t.span(r1, F(mb, c1))[0] + 1e-12
                assert t.span(r1, B(mb, c1))[1] + lag <= t.span(r0, B(mb, c0))[0] + 1e-12
        assert t.makespan == pytest.approx(max(sp[-1][1] for sp in t.intervals))


def test_stage_numbering() -> None:
    s = interleaved(4, 8, 2)
    assert s.num_stages == 8
    assert s.stage(1, 1) == 5 and s.rank_chunk(5) == (1, 1)
    assert all(s.rank_chunk(s.stage(r, c)) == (r, c) for r in range(4) for c in range(2))


def test_one_f_one_b_shape() -> None:
    s = one_f_one_b(4, 8)
    for rank, acts in enumerate(s.actions):
        warm = 4 - rank - 1
        assert acts[:warm] == tuple(F(i) for i in range(warm))
        assert acts[warm : warm + 2] == (F(warm), B(0))
        assert acts[len(acts) - warm :] == tuple(B(i) for i in range(8 - warm, 8))
    assert one_f_one_b(4, 2).actions[0] == (F(0), F(1), B(0), B(1))  # warm-up capped at m


def test_gpipe_shape() -> None:
    s = gpipe(3, 4)
    assert not s.split_backward
    for acts in s.actions:
        assert acts == tuple(F(i) for i in range(4)) + tuple(B(i) for i in range(4))


def test_zb_h1_shape() -> None:
    s = zb_h1(4, 8)
    assert s.split_backward
    # the F/B order is 1F1B's; only W's are added
    for fb, zb in zip(one_f_one_b(4, 8).actions, s.actions):
        assert tuple(a for a in zb if a.kind != "W") == fb
        assert [a.mb for a in zb if a.kind == "W"] == list(range(8))
    assert s.actions[3][:4] == (F(0), B(0), F(1), B(1))
    assert s.actions[0][4:6] == (B(0), W(0))


# ---------------------------------------------------------------------------------------
# bubbles


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_gpipe_1f1b_bubble(build, p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    s = build(p, m)
    assert bubble_fraction(s, t_f=1.0, t_b=1.0, t_w=0.0) == pytest.approx(want, abs=1e-12)
    # the full backward costs t_b + t_w; same formula with t_f = t_b + t_w
    assert bubble_fraction(s, t_f=2.0, t_b=1.0, t_w=1.0) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("p, m, v", [(p, m, v) for p in PS for m in MS for v in VS if m % p == 0])
def test_interleaved_bubble(p: int, m: int, v: int) -> None:
    t = simulate(interleaved(p, m, v), t_f=1.0 / v, t_b=1.0 / v, t_w=0.0)
    for rank in range(p):
        assert t.busy(rank) == pytest.approx(2.0 * m, abs=1e-12)
        assert t.idle(rank) / t.busy(rank) == pytest.approx((p - 1) / (v * m), abs=1e-12)
    # v chunks shrink 1F1B's bubble v times
    t1 = simulate(one_f_one_b(p, m), t_f=1.0, t_b=1.0, t_w=0.0)
    assert t.idle(0) == pytest.approx(t1.idle(0) / v, abs=1e-12)


@pytest.mark.parametrize("p", (2, 3, 4))
@pytest.mark.parametrize("m", MS)
def test_zb_h1_bubble(p: int, m: int) -> None:
    zb = bubble_fraction(zb_h1(p, m))
    fb = bubble_fraction(one_f_one_b(p, m))  # its B costs t_b + t_w = 2
    if m >= p:
        assert zb < fb
        # Qi et al.: idle (p-1)(t_f + t_b - t_w) per rank, a third of 1F1B's (p-1)(t_f+t_b+t_w)
        t = simulate(zb_h1(p, m))
        assert all(t.idle(r) == pytest.approx(p - 1, abs=1e-12) for r in range(p))
        assert zb == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert fb == pytest.approx(3 * (p - 1) / (3 * m + 3 * (p - 1)), abs=1e-12)
    else:
        assert zb <= fb


def test_single_stage_has_no_bubble() -> None:
    for s in (gpipe(1, 4), one_f_one_b(1, 4), zb_h1(1, 4), interleaved(1, 4, 3)):
        assert bubble_fraction(s) == 0.0


def test_comm_adds_latency() -> None:
    s = one_f_one_b(4, 8)
    assert simulate(s, comm=0.25).makespan > simulate(s).makespan
    # p=1: no cross-rank dependency, comm costs nothing
    assert simulate(interleaved(1, 2, 2), comm=5.0).makespan == pytest.approx(4 * 1.0 + 4 * 2.0)


def test_reported_numbers() -> None:
    """p=4, m=8, t_f=t_b=t_w=1 (full backward costs 2 where not split)."""
    assert bubble_fraction(gpipe(4, 8)) == pytest.approx(9 / 33)
    assert bubble_fraction(one_f_one_b(4, 8)) == pytest.approx(9 / 33)
    assert bubble_fraction(interleaved(4, 8, 2)) == pytest.approx(9 / 57)
    assert bubble_fraction(zb_h1(4, 8)) == pytest.approx(3 / 27)


# ---------------------------------------------------------------------------------------
# activation memory


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_peak_activations(p: int, m: int) -> None:
    one = peak_activations(one_f_one_b(p, m))
    assert one[0] == min(p, m)
    assert one == [min(p - s, m) for s in range(p)]
    assert peak_activations(gpipe(p, m)) == [m] * p
    zb = peak_activations(zb_h1(p, m))
    assert max(zb) == max(one) and zb[0] == one[0]  # H1: the same (max) memory as 1F1B
    assert zb == [min(p, m)] * p
    if m % p == 0:
        for v in VS:
            inter = peak_activations(interleaved(p, m, v))
            assert inter[0] <= m * v
            assert all(x <= m * v for x in inter)


def test_peak_activations_split_counts_until_w() -> None:
    s = Schedule("custom", 1, 2, 1, True, ((F(0), F(1), B(0), B(1), W(0), W(1)),))
    assert peak_activations(s) == [2]
    s = Schedule("custom", 1, 2, 1, True, ((F(0), B(0), W(0), F(1), B(1), W(1)),))
    assert peak_activations(s) == [1]


# ---------------------------------------------------------------------------------------
# errors


def test_make_schedule_names() -> None:
    assert make_schedule("gpipe", 2, 4) == gpipe(2, 4)
    assert make_schedule("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert make_schedule("1F1B", 2, 4) == one_f_one_b(2, 4)
    assert make_schedule("interleaved", 2, 4, v=2) == interleaved(2, 4, 2)
    assert make_schedule("zb-h1", 2, 4) == zb_h1(2, 4)
    assert make_schedule("zb_h1", 2, 4) == zb_h1(2, 4)
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    for name in SCHEDULES:
        assert make_schedule(name, 2, 4, v=2 if name == "interleaved" else 1).name == name


def test_unknown_name() -> None:
    with pytest.raises(ScheduleError, match="gpipe, 1f1b, interleaved, zb-h1") as e:
        make_schedule("pipedream", 2, 4)
    assert "\n" not in str(e.value)
    assert issubclass(ScheduleError, ValueError)


def test_interleaved_errors() -> None:
    with pytest.raises(ScheduleError, match=r"m=3 to be a multiple of pp=2"):
        interleaved(2, 3, 2)
    with pytest.raises(ScheduleError, match=r"m=2 to be a multiple of pp=4"):
        interleaved(4, 2, 2)
    with pytest.raises(ScheduleError, match=r"v >= 2"):
        interleaved(2, 4, 1)
    with pytest.raises(ScheduleError, match=r"v >= 2"):
        make_schedule("interleaved", 2, 4)
    with pytest.raises(ScheduleError, match=r"v=2"):
        make_schedule("1f1b", 2, 4, v=2)


@pytest.mark.parametrize("name, p, m, v", [
    ("pipedream", 2, 4, 1), ("interleaved", 2, 3, 2), ("interleaved", 4, 2, 2), ("interleaved", 2, 4, 1),
    ("1f1b", 2, 4, 2), ("gpipe", 0, 4, 1), ("zb_h1", 2, 0, 1), ("1F1B", 2, 1.5, 1), ("interleaved", True, 2, 2),
    ("gpipe", 0, 4, 2), ("interleaved", 0, 4, 1),
    ("gpipe", 3, 5, 1), ("ZB-H1", 4, 2, 1), ("interleaved", 4, 8, 3), ("1f1b", 1, 1, 1),
])
def test_check_shape_answers_as_make_schedule_does(name: str, p, m, v) -> None:
    """train's checks and the planner ask `check_shape` instead of building the schedule:
    it must accept what make_schedule builds and refuse the rest with make_schedule's error."""
    try:
        built = make_schedule(name, p, m, v)
    except ScheduleError as e:
        with pytest.raises(ScheduleError) as got:
            check_shape(name, p, m, v)
        assert str(got.value) == str(e)
    else:
        assert check_shape(name, p, m, v) == built.name


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, zb_h1, lambda p, m: interleaved(p, m, 2)])
@pytest.mark.parametrize("p, m", [(0, 4), (2, 0), (-1, 2), (2, 1.5), (True, 2)])
def test_bad_sizes(build, p, m) -> None:
    with pytest.raises(ScheduleError, match=">= 1"):
        build(p, m)


def test_validate_rejects() -> None:
    good = one_f_one_b(2, 2)
    bad = [
        attrs.evolve(good, actions=good.actions[:1]),  # wrong number of ranks
        attrs.evolve(good, actions=(good.actions[0] + (F(0),), good.actions[1])),  # duplicate
        attrs.evolve(good, actions=(good.actions[0][:-1], good.actions[1])),  # missing
        attrs.evolve(good, actions=(good.actions[0] + (W(0),), good.actions[1])),  # W when not split
        attrs.evolve(good, actions=((F(0), F(2), B(0), B(2)), good.actions[1])),  # mb out of range
        attrs.evolve(good, actions=((B(0), F(0), F(1), B(1)), good.actions[1])),  # B before F
        attrs.evolve(good, actions=((F(0), F(1), B(0), B(1)), (F(0, 1), B(0, 1), F(1), B(1)))),  # chunk
        attrs.evolve(zb_h1(2, 2), actions=((F(0), F(1), B(0), B(1), W(0), W(1)), (F(0), B(0), F(1), B(1), W(1)))),
    ]
    for s in bad:
        with pytest.raises(ScheduleError) as e:
            validate(s)
        assert "\n" not in str(e.value)
        with pytest.raises(ScheduleError):
            simulate(s)


def test_deadlock_detected() -> None:
    # rank 0 waits for B0 from rank 1 before it sends F1, which rank 1 needs before B0
    s = Schedule("custom", 2, 2, 1, False, ((F(0), B(0), F(1), B(1)), (F(1), F(0), B(0), B(1))))
    validate(s)  # well formed per rank...
    with pytest.raises(ScheduleError, match="deadlock") as e:
        simulate(s)  # ...but cannot run
    assert "\n" not in str(e.value)


def test_describe() -> None:
    text = interleaved(2, 2, 2).describe()
    assert text.splitlines()[1] == "rank 0: F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"
