"""`--mesh auto` (issue 33): the planner's fastest layout that fits, for the ranks the job has.

The MPI half (4 ranks preempted, continued on 2 and on 1) is tests/test_mpi_preempt.py.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from mpi4py import MPI

from conftest import cli
from numesh.base.errors import ConfigError
from numesh.host.threads import threads
from numesh.plan import auto
from numesh.run.config import config_from
from numesh.run.train import train


@pytest.fixture(autouse=True)
def uncalibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No calibrated profile of this machine: the CPU profile, whatever the user's cache holds."""
    monkeypatch.setenv("NUMESH_PROFILE_DIR", str(tmp_path / "profiles"))


def _config(data: Path, **kw: object):
    base: dict = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=2, eval_iters=1,
                      data=str(data), out="unused", mesh="auto", peak_flops=1e12)
    base.update(kw)
    return config_from(base)


def test_the_pick_is_the_fastest_that_fits_and_names_a_runner_up_on_another_mesh(char_dataset: Path) -> None:
    cfg, line = auto.pick(_config(char_dataset), world=4, ranks_on_node=4)
    flags = f"--mesh {cfg.mesh} --zero {cfg.zero} --schedule {cfg.schedule} --micro-batches {cfg.micro_batches}"
    assert line.startswith(f"--mesh auto on 4 ranks, profile this-cpu-uncalibrated: {flags}")
    runner_up = line.split("runner-up: ")[1]
    assert runner_up.startswith("--mesh ") and not runner_up.startswith(f"--mesh {cfg.mesh} ")
    assert "\n" not in line
    first, second = (float(part.split(" us a step")[0].rsplit("(", 1)[1]) for part in line.split("runner-up"))
    assert first <= second


def test_options_set_are_kept(char_dataset: Path) -> None:
    cfg, _ = auto.pick(_config(char_dataset, zero=2, micro_batches=2), world=4, ranks_on_node=4)
    assert (cfg.zero, cfg.micro_batches) == (2, 2) and cfg.mesh != "dp=1,tp=1,pp=4"  # ZeRO needs dp > 1
    assert auto.kept_options(_config(char_dataset, zero=2, micro_batches=2)) == {"zero": 2, "micro_batches": 2}
    # not a memory problem (it said "fits in memory"): no layout of 1 rank has the dp ZeRO needs
    with pytest.raises(ConfigError, match="no layout of this model on these ranks runs with --zero 2: leave it out"):
        auto.pick(_config(char_dataset, zero=2), world=1, ranks_on_node=1)
    with pytest.raises(ConfigError, match="runs with --sequence-parallel: leave it out"):  # not "... True"
        auto.pick(_config(char_dataset, sequence_parallel=True), world=1, ranks_on_node=1)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_schedule_is_kept_on_one_rank_where_every_schedule_is_accumulation(char_dataset: Path,
                                                                              schedule: str) -> None:
    """One rank runs one stage: `--mesh pp=1 --schedule gpipe` trains, so auto takes it too
    (it said no layout ran with it); the interleaved schedule needs stages and is refused."""
    cfg, line = auto.pick(_config(char_dataset, schedule=schedule, micro_batches=4), world=1, ranks_on_node=1)
    assert (cfg.mesh, cfg.schedule, cfg.micro_batches) == ("dp=1,tp=1,pp=1", schedule, 4)
    assert f"--schedule {schedule}" in line.split("runner-up")[0]
    # predicted as that schedule, not 1F1B's prediction relabelled: GPipe's one stage holds all
    # 4 micro-batches' activations, 1F1B's one
    _, plain = auto.pick(_config(char_dataset, micro_batches=4), world=1, ranks_on_node=1)
    assert _rank_bytes(line) > _rank_bytes(plain) if schedule == "gpipe" else _rank_bytes(line) >= _rank_bytes(plain)
    with pytest.raises(ConfigError, match="runs with --schedule interleaved"):
        auto.pick(_config(char_dataset, schedule="interleaved", virtual_stages=2), world=1, ranks_on_node=1)


def _rank_bytes(line: str) -> float:
    """The chosen layout's bytes a rank, read back from auto's line ("..., 241.9 KiB a rank)")."""
    number, unit = line.split(" a rank")[0].rsplit(", ", 1)[1].split()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _predictions(data: Path, memory_per_rank: float) -> list:
    base = attrs.evolve(_config(data), mesh="")
    prof = auto.cpu_profile("float32", 1e12 / (4 * threads()), threads(), 4, 4 * memory_per_rank)
    return auto.plan(base, auto.model_spec(base, None, None), 4, prof, memory_per_rank, 4, threads()).fitting


def _layout_of(cfg) -> tuple:
    return (cfg.mesh, cfg.zero, cfg.schedule, cfg.micro_batches, cfg.virtual_stages, cfg.recompute,
            cfg.sequence_parallel)


def test_memory_must_fit(char_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fastest = _predictions(char_dataset, 0)[0]  # 0: no limit
    limit = fastest.memory.total - 1
    monkeypatch.setattr(auto, "node_memory", lambda: 4 * limit)
    cfg, _ = auto.pick(_config(char_dataset), world=4, ranks_on_node=4)
    base = _config(char_dataset)
    assert _layout_of(cfg) != _layout_of(auto.train_config(base, fastest.layout))
    fitting = [p for p in _predictions(char_dataset, limit) if p.fits]
    assert _layout_of(cfg) == _layout_of(auto.train_config(base, fitting[0].layout))
    monkeypatch.setattr(auto, "node_memory", lambda: 4 * 1e3)
    with pytest.raises(ConfigError, match="no layout of this model on these ranks fits in memory"):
        auto.pick(_config(char_dataset), world=4, ranks_on_node=4)


def test_a_named_mesh_is_left_alone_and_the_library_asks_for_the_pick(char_dataset: Path, tmp_path: Path) -> None:
    named = _config(char_dataset, mesh="dp=1")
    assert auto.auto_layout(named, MPI.COMM_SELF) is named
    with pytest.raises(ConfigError, match="--mesh auto is chosen before training, by `numesh train`"):
        train(_config(char_dataset, out=str(tmp_path / "o")), MPI.COMM_SELF)


def test_numesh_train_mesh_auto_says_what_it_chose(char_dataset: Path, tmp_path: Path) -> None:
    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--mesh", "auto", "--n-layer", "2",
              "--n-head", "4", "--n-embd", "16", "--block-size", "8", "--batch-size", "8", "--max-iters", "2",
              "--eval-iters", "1", "--peak-flops", "1e12")
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stderr.splitlines() if x.startswith("--mesh auto")]
    assert lines == ["--mesh auto on 1 rank, profile this-cpu-uncalibrated: --mesh dp=1,tp=1,pp=1 --zero 0 "
                     "--schedule 1f1b --micro-batches 1 (" + lines[0].split("micro-batches 1 (")[1]]
    assert lines[0].endswith("runner-up: none")


def test_an_moe_model_may_get_ep_and_a_dense_one_never(char_dataset: Path) -> None:
    """ep is one more axis of the choice for a model with experts: on 4 ranks, 16 experts of a
    2-block model, ep = 4 holds a quarter of them and runs each expert's GEMMs on 4x the rows
    of dp = 4 (the uncalibrated CPU profile at --peak-flops 1e12 predicts it fastest)."""
    moe, _ = auto.pick(_config(char_dataset, n_embd=32, moe_experts=16), world=4, ranks_on_node=4)
    assert "ep=" in moe.mesh
    preds = _predictions(char_dataset, 0)
    assert {p.layout.ep for p in preds} == {1}


@pytest.mark.parametrize("heads, kv_heads, n_embd, tps", [
    (4, 2, 16, {1, 2, 4}),  # tp = 4 > kv heads: two ranks per kv head (k and v replicated over tp)
    (6, 3, 24, {1}),  # tp = 2 or 4 would split the 3 kv heads' query groups: GPTConfig.validate refuses them
])
def test_a_llama_model_is_planned_with_its_parts_and_the_tp_its_kv_heads_allow(
        char_dataset: Path, heads: int, kv_heads: int, n_embd: int, tps: set) -> None:
    """--mesh auto plans a Llama model (RMSNorm, rotary, SwiGLU, grouped-query attention,
    untied head) with its own sizes, and never a tp that training refuses."""
    cfg = _config(char_dataset, arch="llama", n_head=heads, n_kv_head=kv_heads, n_embd=n_embd)
    base = attrs.evolve(cfg, mesh="")
    model = auto.model_spec(base, None, None)
    assert model.parts.kv_heads == kv_heads and model.parts.gated and not model.parts.tied
    prof = auto.cpu_profile("float32", 1e12 / (4 * threads()), threads(), 4, 0)
    preds = auto.plan(base, model, 4, prof, 0, 4, threads())
    assert {p.layout.tp for p in preds.fitting} == tps
    chosen, line = auto.pick(cfg, world=4, ranks_on_node=4)
    assert f"--mesh {chosen.mesh} " in line and chosen.arch == "llama" and chosen.n_kv_head == kv_heads


def test_numesh_train_mesh_auto_trains_a_llama_model(char_dataset: Path, tmp_path: Path) -> None:
    res = cli("train", "--data", str(char_dataset), "--out", str(tmp_path / "o"), "--mesh", "auto", "--arch", "llama",
              "--n-kv-head", "2", "--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "8",
              "--batch-size", "8", "--max-iters", "2", "--eval-iters", "1", "--peak-flops", "1e12")
    assert res.exit_code == 0, res.output
    assert [x for x in res.stderr.splitlines() if x.startswith("--mesh auto on 1 rank")]
    assert (tmp_path / "o" / "metrics.jsonl").read_text().count('"step"') >= 2


def _one_rank_calibration(path: Path, dtype: str = "float32") -> None:
    """A profile as `numesh plan --calibrate` on one process leaves it: kernels timed, no collectives."""
    from numesh.plan.calibrate import KERNELS
    from numesh.plan.hardware import Measured, Profile, save_profile

    meas = Measured(1, 1, {}, ((1e3, 1e-7), (1e9, 1e-2)), {k: ((10.0, 1e-7), (1e6, 1e-3)) for k in KERNELS}, {})
    save_profile(Profile(name="local", source="calibrated", dtype=dtype, itemsize=4, cores=2, measured={1: meas}),
                 path)


def test_a_one_rank_calibration_does_not_stop_mesh_auto_on_more_ranks(
        char_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One `numesh plan --calibrate` on one process made every later multi-rank `--mesh auto`
    job exit 2 ("do not requeue"), naming --hardware, which `numesh train` lacks. Such a job
    is now planned uncalibrated, as when no profile exists, and its line says why; a
    single-rank job still plans on the calibration."""
    profiles = tmp_path / "cache"
    monkeypatch.setenv("NUMESH_PROFILE_DIR", str(profiles))
    _one_rank_calibration(profiles / "local.json")
    for world, on_node in [(4, 4), (2, 1)]:  # one node, and two nodes of one rank each
        cfg, line = auto.pick(_config(char_dataset), world=world, ranks_on_node=on_node)
        assert line.startswith(
            f"--mesh auto on {world} ranks, profile this-cpu-uncalibrated (this machine's calibration is not used: "
            f"{profiles / 'local.json'} was calibrated on one rank, which times no communication; "
            f"`mpirun -n {world} numesh plan --calibrate` measures it): --mesh {cfg.mesh} "), line
        assert "\n" not in line and "--hardware" not in line
    _, line = auto.pick(_config(char_dataset), world=1, ranks_on_node=1)
    assert line.startswith("--mesh auto on 1 rank, profile local: --mesh dp=1,tp=1,pp=1 "), line
    _one_rank_calibration(profiles / "local.json", dtype="float64")
    _, line = auto.pick(_config(char_dataset), world=1, ranks_on_node=1)
    assert "profile this-cpu-uncalibrated (this machine's calibration is not used: " in line
    assert "was calibrated in float64, not float32" in line

