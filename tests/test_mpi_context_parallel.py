"""Context parallelism (ring attention on the cp axis) reproduces the 1-rank model.

float64, 1e-10 relative against dp=1,tp=1,pp=1:
* the loss and every leaf's gradient of one forward/backward (`loss_and_grads`, dropout
  on and off: attention, residual and embedding dropout masks are the whole sequence's);
* the parity matrix of issue #15 (`parity_matrix`): whole `numesh.run.train.train` runs
  (losses, gradient norms, evaluation losses, final parameters; dropout 0.1, biases)
  against the plain 1-rank run without recomputation, on every mesh of the world size
  with cp=2 or cp=4 (`cp_meshes`: every pp x dp x cp x tp factorisation; 2 ranks: cp=2;
  4: cp=4, dp=2,cp=2, cp=2,tp=2, cp=2,pp=2; 8: cp=2 with tp=4, dp=4, pp=4, dp=2,tp=2,
  dp=2,pp=2, tp=2,pp=2 and cp=4 with dp=2, tp=2, pp=2), each with every `--recompute`
  mode (none, full) and, where tp > 1, with and without `--sequence-parallel`: one run
  per (mesh, mode, sp), 2, 12 and 26 runs on 2, 4 and 8 ranks. The pipeline schedule
  rotates over gpipe, 1f1b, interleaved (2 virtual stages) and zb-h1 through the pp
  cases, so every pp mesh runs several schedules and every schedule runs with cp in the
  4- and 8-rank suites (the 4-rank one adds runs for the two schedules its two pp cases
  miss); the ZeRO stage rotates 3, 1, 2, 0 through the dp cases; micro-batches are pp on
  pp meshes and alternate 1 and 2 elsewhere. `test_parity_matrix_covers_the_brief` counts
  the meshes again independently and holds the matrix to that;
* the bytes one step moves on every axis, from the byte counter, equal
  `formulas.step_bytes` (the ring's K/V and dK/dV blocks, the gradients' sum over cp);
* bad combinations fail at start-up with one line on every rank (block size not in 2·cp
  chunks, `--sequence-parallel` without tp, sp's cp·tp split, interleaved's layer count),
  and `numesh sample` refuses a cp mesh but samples a cp-trained checkpoint on a mesh
  without cp exactly as the 1-rank run's checkpoint.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Iterator

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import (
    WORLD,
    assert_one_step_matches,
    assert_same_run,
    mesh_for_world,
    one_step,
    serial_reference,
    train_records,
    world_mesh,
)
from numesh.base.errors import ConfigError
from numesh.mesh import Mesh
from numesh.nn.units import OUTER
from numesh.perf import formulas
from numesh.run.config import TrainConfig, check_layout, config_from
from numesh.run.train import Trainer

pytestmark = pytest.mark.mpi(min_size=2)

CP_SIZES = (2, 4)
MODES = ("none", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
ZERO_ROTATION = (3, 1, 2, 0)  # a 4-rank suite has two dp cases: the sharded stages first, 1 and 3 there
BLOCK_SIZE = 16
BATCH = 4
LAYER_MESHES = {2: ["cp=2"], 4: ["cp=4", "cp=2,tp=2"], 8: ["cp=4,tp=2", "cp=2,tp=4"]}


@pytest.fixture(params=range(2))
def layer_mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    yield from world_mesh(mesh_for_world(LAYER_MESHES, request.param, "no such cp mesh on this world size"))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_loss_and_grads_match_one_rank(layer_mesh: Mesh, dropout: float) -> None:
    """Each cp rank's loss and gradients are its tokens' share: summed over cp they are the
    1-rank loss and gradient of the whole sequences, and its per-token losses are the
    1-rank ones of its chunks."""
    assert_one_step_matches(one_step(layer_mesh, dropout, block_size=BLOCK_SIZE))


def test_a_bad_id_on_one_cp_rank_is_one_error_on_every_rank(layer_mesh: Mesh) -> None:
    """cp ranks hold different chunks of the ids and meet in the ring: one rank's id outside
    the vocabulary is a ConfigError on all of them, none left waiting in the ring."""
    from conftest import model_config
    from numesh.nn.gpt import init_gpt
    from numesh.nn.walk import loss_and_grads

    cfg = model_config(block_size=BLOCK_SIZE)
    cp = layer_mesh.size("cp")
    idx = np.zeros((1, BLOCK_SIZE // cp), np.int64)
    if layer_mesh.index("cp") == cp - 1:
        idx[0, 0] = cfg.vocab_size
    last = layer_mesh.index("cp") == cp - 1
    params = init_gpt(cfg, layer_mesh, dtype=np.float64)
    with pytest.raises(ConfigError, match="idx holds ids from 0 to 11" if last else "another rank's inputs are wrong"):
        loss_and_grads(params, idx, idx, cfg, layer_mesh, 1.0)
    # a badly shaped array on one rank (a 1-D idx): its peers, whose checks pass, raise too
    idx = np.zeros((1, BLOCK_SIZE // cp), np.int64)
    bad = idx[0] if last else idx
    with pytest.raises(ConfigError, match="idx must be .B, T." if last else "another rank's inputs are wrong"):
        loss_and_grads(params, bad, bad, cfg, layer_mesh, 1.0)


def test_a_cp_split_that_cannot_be_is_one_error_on_every_rank(layer_mesh: Mesh) -> None:
    """An odd local T (each cp rank holds two zigzag chunks) was a broadcast error deep in the
    model, T=1 a ZeroDivisionError; one rank's extra row aborted the job with MPI's "Message
    truncated"; and generate read a cp mesh's prompt as chunks. One line on every rank now."""
    from conftest import model_config
    from numesh.nn.gpt import init_gpt
    from numesh.nn.walk import loss_and_grads
    from numesh.run.sample import generate

    cfg = model_config(block_size=BLOCK_SIZE)
    cp = layer_mesh.size("cp")
    params = init_gpt(cfg, layer_mesh, dtype=np.float64)
    for T in (1, 3):
        idx = np.zeros((1, T), np.int64)
        with pytest.raises(ConfigError, match=f"under cp={cp} each rank holds two chunks of every sequence: idx's "
                                              f"T \\({T}\\) must be even"):
            loss_and_grads(params, idx, idx, cfg, layer_mesh, 1.0)
    idx = np.zeros((1 + (layer_mesh.index("cp") == cp - 1), 2), np.int64)
    with pytest.raises(ConfigError, match="the cp ranks' idx arrays differ in shape"):
        loss_and_grads(params, idx, idx, cfg, layer_mesh, 1.0)
    with pytest.raises(ConfigError, match="sampling does not run with context parallelism"):
        generate(params, cfg, layer_mesh, np.zeros((1, 2), np.int64), 1)

def test_observers_see_the_ring(layer_mesh: Mesh) -> None:
    """Every K/V block goes through the mesh's observer hook (the tracer and the flight
    recorder see cp traffic): one layer's ring sends and receives, on the cp axis, with the
    same results as unobserved."""
    from numesh.nn.context_parallel import MeshRing
    from numesh.nn.ring_attention import ring_attention_bwd, ring_attention_fwd
    from numesh.observe import Recorder, attach

    mesh = layer_mesh
    cp = mesh.size("cp")
    rng = np.random.default_rng(mesh.index("cp"))
    q, k, v, dy = (rng.standard_normal((2, 2, 4, 3)) for _ in range(4))

    def ring() -> tuple[np.ndarray, list[np.ndarray]]:
        y, grads = np.empty_like(q), [np.zeros_like(q) for _ in range(3)]
        ctx = ring_attention_fwd(q, k, v, y, MeshRing(mesh))
        ring_attention_bwd(ctx, dy, *grads, MeshRing(mesh))
        return y, grads

    y0, g0 = ring()
    rec = Recorder()
    attach(mesh, rec)
    try:
        y1, g1 = ring()
    finally:
        mesh.observer = None
    np.testing.assert_array_equal(y0, y1)
    for a, b in zip(g0, g1):
        np.testing.assert_array_equal(a, b)
    sends = [c for c in rec.calls if c.op == "send"]
    assert {c.axes for c in rec.calls} == {("cp",)}
    assert len(sends) == len([c for c in rec.calls if c.op == "recv"]) == 2 * (cp - 1) * 2 + 2 * cp
    assert all(c.end is not None for c in rec.calls)


def run_config(data: Path, out: Path, mesh: str, schedule: str, m: int, zero: int, sp: bool = False,
               **kw: object) -> TrainConfig:
    pp = int(dict(p.split("=") for p in mesh.split(",")).get("pp", 1))
    base: dict = dict(
        n_layer=2 * pp, n_head=4, n_embd=16, block_size=BLOCK_SIZE, batch_size=BATCH, max_iters=3, dropout=0.1,
        bias=True, learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=3, grad_clip=0.5, eval_interval=2,
        eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=11, dtype="float64", schedule=schedule,
        micro_batches=m, zero=zero, sequence_parallel=sp,
        # MFU's denominator given, not measured: the start-up GEMM benchmark is a large share
        # of a run this short (cProfile it), and parity does not look at MFU
        peak_flops=1e12,
    )
    base.update(kw)
    return config_from(base)


def plain_reference(cfg: TrainConfig):
    """The dp=1,tp=1,pp=1 run without recomputation, one micro-batch, no ZeRO."""
    return serial_reference(attrs.evolve(cfg, schedule="1f1b", virtual_stages=1, micro_batches=1, zero=0,
                                         recompute="none"))


# ---------------------------------------------------------------------------------------
# the parity matrix: every cp mesh of the world size x every --recompute mode x sp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_meshes(n: int, block_size: int = BLOCK_SIZE) -> list[dict[str, int]]:
    """Every (pp, dp, cp, tp) of n ranks with cp in {2, 4} whose block size splits into
    2*cp chunks, cp=2 meshes first."""
    meshes = []
    for cp in CP_SIZES:
        if n % cp or block_size % (2 * cp):
            continue
        rest = n // cp
        for pp in _divisors(rest):
            for dp in _divisors(rest // pp):
                meshes.append(dict(pp=pp, dp=dp, cp=cp, tp=rest // (pp * dp)))
    return meshes


def mesh_name(sizes: dict[str, int]) -> str:
    """"dp=2,cp=2,pp=2": the axes of size > 1, in the order dp, cp, tp, pp."""
    return ",".join(f"{a}={sizes[a]}" for a in ("dp", "cp", "tp", "pp") if sizes[a] > 1)


@attrs.frozen
class MatrixCase:
    """One whole-training parity run: a cp mesh with one recompute mode and sp on or off,
    and the schedule, micro-batches and ZeRO stage the rotation gave it."""

    sizes: dict[str, int] = attrs.field(eq=False)
    recompute: str
    sp: bool
    schedule: str
    micro_batches: int
    zero: int

    @property
    def mesh(self) -> str:
        return mesh_name(self.sizes)

    @property
    def virtual_stages(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def id(self) -> str:
        sp = "-sp" if self.sp else ""
        return f"{self.mesh}{sp}-{self.recompute}-{self.schedule}-m{self.micro_batches}-zero{self.zero}"


def parity_matrix(n: int) -> list[MatrixCase]:
    """The cases of an n-rank suite. Every mesh of `cp_meshes(n)` meets every recompute mode,
    with and without sp where tp > 1; the schedule rotates over SCHEDULES through the pp > 1
    cases (interleaved with 2 virtual stages: n_layer = 2*pp layers make one layer per chunk)
    and the ZeRO stage over ZERO_ROTATION through the dp > 1 cases, so each suite sees many
    combinations for one run per (mesh, mode, sp). A suite whose pp meshes have fewer cases
    than there are schedules gets the missing schedules as extra runs without recomputation."""
    cases: list[MatrixCase] = []
    n_pp = n_dp = 0
    for sizes in cp_meshes(n):
        pp, dp = sizes["pp"], sizes["dp"]
        for mode in MODES:
            for sp in (False, True) if sizes["tp"] > 1 else (False,):
                schedule, zero = "1f1b", 0
                if pp > 1:
                    schedule, n_pp = SCHEDULES[n_pp % len(SCHEDULES)], n_pp + 1
                if dp > 1:
                    zero, n_dp = ZERO_ROTATION[n_dp % len(ZERO_ROTATION)], n_dp + 1
                two = len(cases) % 2 and BATCH % (2 * dp) == 0  # accumulation over micro-batches without pp too
                m = pp if pp > 1 else (2 if two else 1)  # interleaved needs m a multiple of pp
                cases.append(MatrixCase(sizes, mode, sp, schedule, m, zero))
    seen = {c.schedule for c in cases if c.sizes["pp"] > 1}
    pp_meshes = [s for s in cp_meshes(n) if s["pp"] > 1]
    for i, schedule in enumerate(s for s in SCHEDULES if pp_meshes and s not in seen):
        sizes = pp_meshes[i % len(pp_meshes)]
        cases.append(MatrixCase(sizes, "none", False, schedule, sizes["pp"], 0))
    return cases


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in parity_matrix(WORLD.Get_size())])
def test_training_matches_one_rank(shared_dataset: Path, shared_tmp: Path, case: MatrixCase) -> None:
    """A whole float64 run on a cp mesh, with recomputation, sp, a pipeline schedule and ZeRO
    as the case says, equals the plain 1-rank run to 1e-10."""
    cfg = run_config(shared_dataset, shared_tmp / f"cp-{case.id}", case.mesh, case.schedule, case.micro_batches,
                     case.zero, case.sp, recompute=case.recompute, virtual_stages=case.virtual_stages)
    assert_same_run(train_records(cfg, WORLD), plain_reference(cfg))


def test_parity_matrix_covers_the_brief() -> None:
    """Issue #15's matrix, counted independently of `cp_meshes`: every factorisation of the
    world size with cp in {2, 4} appears with every recompute mode, with and without sp where
    tp > 1, exactly once; every pp mesh runs a pipeline schedule and every schedule runs with
    cp; ZeRO stages spread over the dp meshes; every case passes the start-up checks."""
    n = WORLD.Get_size()
    cases = parity_matrix(n)
    want = set()
    for pp, dp, cp, tp in itertools.product(*[range(1, n + 1)] * 4):
        if pp * dp * cp * tp == n and cp in (2, 4):
            sizes = dict(pp=pp, dp=dp, cp=cp, tp=tp)
            want |= {(mesh_name(sizes), mode, sp) for mode in MODES for sp in ((False, True) if tp > 1 else (False,))}
    got = [(c.mesh, c.recompute, c.sp) for c in cases]
    assert set(got) == want
    repeats = [g for g, k in Counter(got).items() if k > 1]  # only the extra runs a missing schedule adds
    assert all(mode == "none" and not sp for _, mode, sp in repeats)
    with_pp = [c for c in cases if c.sizes["pp"] > 1]
    assert all(c.schedule in SCHEDULES for c in with_pp)
    if with_pp:
        assert {c.schedule for c in with_pp} == set(SCHEDULES)
        assert {c.mesh for c in with_pp} == {mesh_name(s) for s in cp_meshes(n) if s["pp"] > 1}
    if n in (2, 4, 8):  # the suites' sizes: the issue's meshes by name, and the ZeRO stages each meets
        named = {2: {"cp=2"}, 4: {"cp=4", "dp=2,cp=2", "cp=2,tp=2", "cp=2,pp=2"},
                 8: {"dp=2,cp=2,tp=2", "cp=2,tp=2,pp=2", "cp=4,tp=2", "dp=2,cp=4", "cp=2,tp=4", "cp=4,pp=2",
                     "cp=2,pp=4", "dp=2,cp=2,pp=2", "dp=4,cp=2"}}[n]
        assert named == {m for m, _, _ in want}  # the list (and dp=4,cp=2, which it left out)
        zeros = {c.zero for c in cases if c.sizes["dp"] > 1}
        assert zeros == {2: set(), 4: {1, 3}, 8: {0, 1, 2, 3}}[n]
        assert len(cases) == {2: 2, 4: 12, 8: 26}[n]
    for c in cases:
        cfg = run_config(Path("unused"), Path("unused"), c.mesh, c.schedule, c.micro_batches, c.zero, c.sp,
                         recompute=c.recompute, virtual_stages=c.virtual_stages)
        check_layout(cfg, n, vocab_size=11)  # cp x gpipe, interleaved and zb-h1 are accepted


def byte_cases() -> list:
    n = WORLD.Get_size()
    cases = {2: [("cp=2", 0), ("cp=2", 2)], 4: [("dp=2,cp=2", 0), ("dp=2,cp=2", 1), ("cp=2,pp=2", 3)],
             8: [("dp=2,cp=2,tp=2", 3), ("cp=2,tp=2,pp=2", 0)]}
    return [pytest.param(mesh, zero, id=f"{mesh}-zero{zero}") for mesh, zero in cases.get(n, [])]


@pytest.mark.parametrize("mesh, zero", byte_cases())
def test_bytes_per_step_follow_the_formula(shared_dataset: Path, shared_tmp: Path, mesh: str, zero: int) -> None:
    """The byte counter after one optimiser step equals `formulas.step_bytes` on every axis,
    cp included: K and V blocks forward, K, V, dK and dV backward, per layer and micro-batch."""
    cfg = attrs.evolve(run_config(shared_dataset, shared_tmp / f"cpbytes-{mesh}-{zero}", mesh, "1f1b", 2, zero),
                       dtype="float32")
    trainer = Trainer(cfg, WORLD)
    trainer.train_step()
    counter = trainer.mesh.counter
    counter.reset()
    trainer.train_step()
    shape, units = trainer.mesh.shape, trainer.opt.units
    pp_rank = trainer.mesh.index("pp")
    holds_tied = shape["pp"] > 1 and pp_rank in (0, shape["pp"] - 1)
    want = formulas.step_bytes(
        formulas.StepShape(shape, zero, cfg.micro_batches, cfg.batch_size // (shape["dp"] * cfg.micro_batches),
                           cfg.block_size, cfg.n_embd, 4, trainer.schedule.split_backward),
        formulas.RankUnits(
            [formulas.Chunk(len(s.blocks), s.first, s.last) for s in trainer.pipeline.stages],
            sum(u.padded for k, u in units.items() if not k.is_outer), units[OUTER].padded,
            trainer.model.padded_vocab(shape["tp"]) // shape["tp"] * cfg.n_embd * 4 if holds_tied else 0),
    )
    got = {("+".join(axes), op): v for (axes, op), v in counter.payload.items() if v}
    if holds_tied:  # the counter books the tied-embedding group under its axis, with the norm's scalar
        tied = want.pop((f"pp[0,{shape['pp'] - 1}]", "all_reduce"))
        want[("pp", "all_reduce")] = want.get(("pp", "all_reduce"), 0) + tied
    assert got == want
    assert want[("cp", "send")] > 0


def bad_combinations(n: int) -> list:
    """(config overrides, the one line it must fail with) for a cp mesh of n ranks."""
    cases = [
        (dict(mesh=f"cp={n}", block_size=12 if n > 2 else 6),
         rf"block_size={12 if n > 2 else 6} does not split into 2\*cp={2 * n} equal chunks "
         rf"\(context parallelism's load balance\): use a --block-size that is a multiple of {2 * n} or a smaller cp"),
        (dict(mesh=f"cp={n}", sequence_parallel=True),
         r"--sequence-parallel splits the sequence over tp, which is 1 in this mesh: add tp=N \(N > 1\) to --mesh or "
         r"drop --sequence-parallel"),
    ]
    if n >= 4:  # interleaved is accepted with cp; its layer count is checked as without
        cases.append((dict(mesh=f"cp={n // 2},pp=2", schedule="interleaved", virtual_stages=2, n_layer=2,
                           micro_batches=2), r"n_layer=2 is not divisible by pp x virtual stages"))
    if n == 8:
        cases.append((dict(mesh="cp=2,tp=4", sequence_parallel=True, block_size=12),
                       r"--sequence-parallel with cp splits a cp rank's block_size/cp tokens over tp: "
                       r"use a --block-size that is a multiple of cp\*tp=8"))
    return cases


@pytest.mark.parametrize("overrides, match", [pytest.param(*c, id=f"case{i}") for i, c in
                                              enumerate(bad_combinations(WORLD.Get_size()))])
def test_bad_combinations_fail_at_start_up(shared_dataset: Path, shared_tmp: Path, overrides: dict, match: str) -> None:
    """Every rank raises the same one-line ConfigError before any collective (a rank that
    got past validation would wait in the mesh's set-up for the others)."""
    cfg = attrs.evolve(run_config(shared_dataset, shared_tmp / "cp-bad", f"cp={WORLD.Get_size()}", "1f1b", 1, 0),
                       **overrides)
    with pytest.raises(ConfigError, match=match) as err:
        Trainer(cfg, WORLD)
    assert "\n" not in str(err.value)
    assert not (shared_tmp / "cp-bad").exists()


def test_sampling_a_cp_checkpoint(shared_dataset: Path, shared_tmp: Path) -> None:
    """`numesh sample` refuses a cp mesh with one line, and a checkpoint trained on a cp mesh
    samples on a mesh without cp the text the 1-rank run's checkpoint samples."""
    from numesh.run.sample import SampleConfig, sample
    from numesh.run.train import train

    n = WORLD.Get_size()
    cfg = run_config(shared_dataset, shared_tmp / "cp-sample", f"cp={n}", "1f1b", 1, 0)
    ckpt = train(cfg, WORLD).checkpoint
    ask = SampleConfig(ckpt=ckpt, prompt="the ", max_new_tokens=24, seed=3, num_samples=2)
    with pytest.raises(ConfigError, match=r"^sampling does not run with context parallelism: use a mesh without cp, "
                                          r"e\.g\. --mesh tp=N$"):
        sample(attrs.evolve(ask, mesh=f"cp={n}"), WORLD)
    if WORLD.Get_rank() == 0:
        serial = train(attrs.evolve(cfg, mesh="", out=str(shared_tmp / "cp-sample-serial")), MPI.COMM_SELF)
        got = sample(ask, MPI.COMM_SELF)
        assert got == sample(attrs.evolve(ask, ckpt=serial.checkpoint), MPI.COMM_SELF)
        assert [len(t) for t in got] == [len("the ") + 24] * 2
    WORLD.Barrier()


