"""Checkpoints across meshes: train k steps on mesh A, checkpoint, resume on mesh B for k
more, and get the 2k-step run on A (float64, 1e-10). Also: every rank writes only its own
blocks, reads only the files it needs, and raises the same error when one file is bad.

Runs under `mpirun -n N python -m mpi4py -m pytest --with-mpi -m mpi -p no:cacheprovider`;
a mesh needing fewer ranks than N runs on the first ranks (a `Split` sub-communicator),
one needing more is skipped.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_close, on_first, on_root
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import (
    CheckpointError,
    TrainState,
    gpt_leaves,
    read_local_state,
    read_meta,
    read_state,
    reshard,
    save_checkpoint,
)
from numesh.checkpoint import format as fmt
from numesh.checkpoint.format import leaf_blocks
from numesh.checkpoint.save import point_latest
from numesh.data.char import prepare_char_dataset
from numesh.mesh import parse_mesh
from numesh.nn.units import join_units, split_units
from numesh.run.config import TrainConfig, config_from
from numesh.run.train import Trainer, restore, train, train_state

pytestmark = pytest.mark.mpi(min_size=2)

TEXT = "".join("abcdefghij"[i % 10 :] + "abcdefghij"[: i % 10] + "\n" for i in range(60))  # vocabulary 11
KEYS = ("loss", "grad_norm", "lr", "train_loss", "val_loss")
K = 2


@pytest.fixture(scope="module")
def data(shared_tmp: Path) -> Path:
    out = shared_tmp / "ckpt-data"
    if WORLD.Get_rank() == 0:
        prepare_char_dataset(TEXT, out)
    WORLD.Barrier()
    return out


def config(data: Path, out: Path, mesh: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=8, max_iters=2 * K, dropout=0.1, bias=True,
        learning_rate=1e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=8, eval_interval=2, eval_iters=1,
        data=str(data), out=str(out), mesh=mesh, seed=3, dtype="float64",
        peak_flops=1e12,  # MFU's denominator given: these runs check state, and each start measured it again
    )
    base.update(kw)
    return config_from(base)


def _prod(mesh: str) -> int:
    """Ranks a mesh string with explicit sizes needs."""
    return math.prod(int(part.split("=")[1]) for part in mesh.split(",") if part)


def records_of(cfg: TrainConfig, comm: MPI.Comm) -> list[dict]:
    records: list[dict] = []
    train(cfg, comm, on_step=lambda s, r: records.append({"step": s, **{k: r[k] for k in KEYS if k in r}}))
    return records


_UNINTERRUPTED: dict[str, tuple[Path, list[dict]]] = {}


def uninterrupted(data: Path, shared_tmp: Path, mesh: str, kw: dict) -> tuple[Path, list[dict]]:
    """Run A of a resume case: 2k steps on `mesh`, checkpointing at step k; (its run
    directory, its records). Once per mesh and options for the module: the cases that resume
    the same A on other meshes share it."""
    tag = f"{mesh}-{sorted(kw.items())}"
    if tag not in _UNINTERRUPTED:
        out = shared_tmp / f"resume-a-{len(_UNINTERRUPTED)}"
        cfg = config(data, out, mesh, ckpt_interval=K, **kw)
        _UNINTERRUPTED[tag] = (out, on_first(_prod(mesh), lambda comm: records_of(cfg, comm)))
    return _UNINTERRUPTED[tag]


@pytest.mark.parametrize(
    "mesh_a, kw_a, mesh_b, kw_b",
    [
        pytest.param("tp=2", {}, "tp=1", {}, id="tp2-to-tp1"),
        pytest.param("dp=2", {"zero": 2}, "dp=4", {"zero": 1}, id="dp2zero2-to-dp4zero1"),
        pytest.param("tp=1", {}, "tp=4", {}, id="tp1-to-tp4"),
        pytest.param("pp=2", {"micro_batches": 2}, "pp=1", {}, id="pp2-to-pp1"),
        pytest.param("dp=2,tp=2,pp=2", {"micro_batches": 2, "zero": 1}, "tp=4", {}, id="dp2tp2pp2-to-tp4"),
        # sequence parallelism changes no file: a checkpoint saved with it loads without, and back
        pytest.param("tp=2", {"sequence_parallel": True}, "tp=2", {}, id="tp2sp-to-tp2"),
        pytest.param("tp=2", {}, "tp=2", {"sequence_parallel": True}, id="tp2-to-tp2sp"),
        pytest.param("tp=4", {"sequence_parallel": True}, "tp=2", {"sequence_parallel": True}, id="tp4sp-to-tp2sp"),
        pytest.param("cp=2", {}, "dp=2", {"zero": 1}, id="cp2-to-dp2zero1"),
        pytest.param("tp=1", {}, "cp=2,tp=2", {}, id="tp1-to-cp2tp2"),
        pytest.param("dp=2,cp=2", {"zero": 3}, "cp=4", {}, id="dp2cp2zero3-to-cp4"),
    ],
)
def test_resume_on_another_mesh(data: Path, shared_tmp: Path, mesh_a: str, kw_a: dict, mesh_b: str, kw_b: dict) -> None:
    need = max(_prod(mesh_a), _prod(mesh_b))
    if WORLD.Get_size() < need:
        pytest.skip(f"{mesh_a} -> {mesh_b} needs {need} ranks, the job has {WORLD.Get_size()}")
    tags = ["sp" if kw.get("sequence_parallel") else "" for kw in (kw_a, kw_b)]
    base = shared_tmp / f"resume-{mesh_a}{tags[0]}-{mesh_b}{tags[1]}".replace(",", "_").replace("=", "")
    # A: 2k uninterrupted steps, which also checkpoint at step k
    run_a, whole = uninterrupted(data, shared_tmp, mesh_a, kw_a)
    # B: a fresh job on another mesh continues from A's step-k checkpoint
    resume = run_a / "ckpt" / f"step_{K:06d}"
    cfg_b = config(data, base / "b", mesh_b, resume=str(resume), **kw_b)
    resumed = on_first(_prod(mesh_b), lambda comm: records_of(cfg_b, comm))
    on_root(lambda: check_resumed(run_a, whole, base / "b", resumed, mesh_b))


def check_resumed(run_a: Path, whole: list[dict], run_b: Path, resumed: list[dict], mesh_b: str) -> None:
    """Run B, resumed at step K on `mesh_b`, logged the steps of A's uninterrupted run from
    K on and ended with A's parameters and optimiser state (1e-10)."""
    want = [r for r in whole if r["step"] >= K]
    assert [r["step"] for r in resumed] == [r["step"] for r in want]
    for a, b in zip(resumed, want):
        assert a.keys() == b.keys(), (a, b)
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-10, abs=0), (a["step"], key, a[key], b[key])
    meta_a, state_a = read_state(run_a / "ckpt" / "latest")
    meta_b, state_b = read_state(run_b / "ckpt" / "latest")
    assert meta_a.step == meta_b.step == meta_b.opt_step == 2 * K
    assert meta_b.raw["mesh"] == parse_mesh(mesh_b, _prod(mesh_b))
    assert meta_b.model == meta_a.model
    for group in ("params", "m", "v"):
        for (path, x), (_, y) in zip(tree_leaves_with_path(state_b[group]), tree_leaves_with_path(state_a[group])):
            assert_close(x, y, 1e-10, f"{group}/{path}")


# the Llama kind: rotary, SwiGLU, RMSNorm, an untied vocab-parallel head, 2 kv heads for the 4
# query heads (k and v replicated over tp, so tp=4 exceeds them), no biases
LLAMA = dict(arch="llama", n_kv_head=2, bias=False, norm_eps=1e-6, rope_theta=500.0)


@pytest.mark.parametrize("mesh_a, kw_a, to", [
    pytest.param("tp=2", {}, "tp=1", id="llama-tp2-to-tp1"),
    pytest.param("tp=2", {}, "tp=4", id="llama-tp2-to-tp4"),
    pytest.param("pp=2", {"micro_batches": 2}, "pp=1,tp=2", id="llama-pp2-to-tp2"),  # lm_head: the last stage's
])
def test_a_llama_checkpoint_reshards_and_resumes_exactly(data: Path, shared_tmp: Path, mesh_a: str, kw_a: dict,
                                                         to: str) -> None:
    """A's step-K checkpoint rewritten by `numesh reshard --to` for mesh B, then resumed there."""
    need = max(_prod(mesh_a), _prod(to))
    if WORLD.Get_size() < need:
        pytest.skip(f"{mesh_a} -> {to} needs {need} ranks, the job has {WORLD.Get_size()}")
    base = shared_tmp / f"llama-{mesh_a}-{to}".replace("=", "").replace(",", "_")
    run_a, whole = uninterrupted(data, shared_tmp, mesh_a, kw_a | LLAMA)
    src = run_a / "ckpt" / f"step_{K:06d}"
    moved = Path(on_first(1, lambda _comm: str(reshard(src, to, base / "resharded"))))
    cfg_b = config(data, base / "b", to, resume=str(moved), **LLAMA)
    resumed = on_first(_prod(to), lambda comm: records_of(cfg_b, comm))

    def check() -> None:
        assert read_meta(moved).raw["mesh"] == parse_mesh(to, _prod(to))
        check_resumed(run_a, whole, base / "b", resumed, to)

    on_root(check)


def test_each_rank_writes_its_own_blocks_once(data: Path, shared_tmp: Path) -> None:
    n = WORLD.Get_size()
    mesh = f"dp={n // 2},tp=2" if n % 2 == 0 else f"dp={n}"
    out = shared_tmp / "blocks-once"
    cfg = config(data, out, mesh, zero=1, max_iters=1)

    def save(comm: MPI.Comm) -> str:
        t = Trainer(cfg, comm)
        t.train_step()
        paths = comm.allgather(str(save_checkpoint(train_state(t), out)))
        assert len(set(paths)) == 1
        return paths[0]

    step_dir = Path(on_first(n, save))

    def check() -> None:
        meta = read_meta(step_dir)
        sizes = parse_mesh(mesh, n)
        for group in ("params", "m", "v"):
            for path, leaf in gpt_leaves(meta.model).items():
                files = meta.leaves[f"{group}/{path}"].files
                want = leaf_blocks(leaf.shape, leaf.padded_shape(sizes), leaf.spec, sizes)
                assert [r.region for r in files] == [r for _, r in want], path
                assert len({r.file for r in files}) == len(files)
        assert sorted(p.name for p in step_dir.parent.iterdir()) == ["latest", "step_000001"]

    on_root(check)


def test_bad_file_seen_by_one_rank_fails_on_every_rank(data: Path, shared_tmp: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On tp=2, tp rank 1 alone reads the tp1 blocks; when one of them is corrupt, both
    ranks raise the same CheckpointError (no hang), and each rank hashes only its files."""
    out = shared_tmp / "bad-one-rank"
    cfg = config(data, out, "tp=2")
    hashed: list[str] = []
    real = fmt.sha256_file

    def spy(path: Path, chunk: int = 1 << 20) -> str:
        hashed.append(path.name)
        return real(path, chunk)

    monkeypatch.setattr(fmt, "sha256_file", spy)

    def go(comm: MPI.Comm) -> list[Any]:
        t = Trainer(cfg, comm)
        step_dir = save_checkpoint(train_state(t), out)
        restore(Trainer(cfg, comm), step_dir)
        mine = t.mesh.index("tp")
        seen = comm.allgather((mine, sorted(set(hashed))))
        comm.Barrier()
        if comm.Get_rank() == 0:
            f = step_dir / "v" / "blocks.1.mlp.fc.w.tp1.npy"
            raw = bytearray(f.read_bytes())
            raw[-1] ^= 0xFF
            f.write_bytes(bytes(raw))
        comm.Barrier()
        try:
            restore(t, step_dir)
            msg = None
        except CheckpointError as e:
            msg = str(e)
        return [seen, comm.allgather(msg)]

    seen, messages = on_first(2, go)
    for tp_rank, files in seen:
        other = f"tp{1 - tp_rank}"
        assert files and not any(other in name for name in files), (tp_rank, files)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert "v/blocks.1.mlp.fc.w.tp1.npy is corrupted" in messages[0]


def test_ranks_resuming_from_a_pruned_latest_read_one_step_together(data: Path, shared_tmp: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 follows `latest` for every rank; when a job prunes the step being read (the
    first file any rank hashes moves `latest` on and removes the old step), every rank
    reads the next step together (issue 31)."""
    out = shared_tmp / "pruned-latest"
    cfg = config(data, out, "tp=2", max_iters=4, ckpt_interval=2)
    real = fmt.sha256_file
    first: list[Path] = []

    def go(comm: MPI.Comm) -> list[int]:
        train(cfg, comm)
        if comm.Get_rank() == 0:
            point_latest(out / "ckpt", "step_000002")
        comm.Barrier()

        def prune_once(path: Path, chunk: int = 1 << 20) -> str:
            if not first:  # every rank hashes a file before it reads one
                first.append(path)
                comm.Barrier()
                if comm.Get_rank() == 0:
                    point_latest(out / "ckpt", "step_000004")
                    shutil.rmtree(out / "ckpt" / "step_000002")
                comm.Barrier()
            return real(path, chunk)

        monkeypatch.setattr(fmt, "sha256_file", prune_once)
        t = Trainer(cfg, comm)
        restore(t, out / "ckpt" / "latest")
        return comm.allgather(t.step)

    assert on_first(2, go) == [4, 4]


def _stage_state(model: Any, layout: Any, mesh: Any, state: dict) -> dict:
    """This rank's pipeline-stage, tp-local trees of global (unpadded) state."""
    from numesh.base.tree import tree_map
    from numesh.mesh import shard
    from numesh.nn.gpt import gpt_specs
    from numesh.pipeline.stages import stage_tree

    out = {}
    for group, tree in state.items():
        wte = np.zeros((model.padded_vocab(mesh.size("tp")), model.n_embd))
        wte[: model.vocab_size] = tree.wte
        full = tree_map(lambda x, s: shard(x, s, mesh), type(tree)(wte, tree.wpe, tree.blocks, tree.ln_f),
                        gpt_specs(model))
        out[group] = stage_tree(full, layout, mesh.index("pp"))
    return out


def _stage_trainer(cfg: TrainConfig, comm: MPI.Comm, mesh_spec: str, v: int, state: dict | None, step: int) -> Any:
    """A stand-in for a pipeline Trainer: a ZeroOptimizer over this stage's trees."""
    from types import SimpleNamespace

    from numesh.base.tree import tree_map
    from numesh.mesh import Mesh
    from numesh.nn.gpt import gpt_specs
    from numesh.nn.units import split_units
    from numesh.optim.zero import ZeroOptimizer
    from numesh.pipeline.stages import StageLayout, stage_tree

    model = cfg.model(11)
    mesh = Mesh(parse_mesh(mesh_spec, comm.Get_size()), comm)
    layout = StageLayout(model.n_layer, mesh.size("pp"), v)
    if state is None:
        state = {g: tree_map(np.zeros_like, _zero_state(model)) for g in ("params", "m", "v")}
    local = _stage_state(model, layout, mesh, state)
    specs = stage_tree(gpt_specs(model), layout, mesh.index("pp"))
    opt = ZeroOptimizer(split_units(local["params"]), split_units(specs), mesh, 1)
    opt.load_state_trees({g: split_units(t) for g, t in local.items()}, step)
    return SimpleNamespace(cfg=cfg, model=model, mesh=mesh, opt=opt, step=step, layout=layout, dtype=np.float64)


def _zero_state(model: Any) -> Any:
    from numesh.base.tree import tree_map
    from numesh.nn.gpt import gpt_global_shapes

    return tree_map(lambda s: np.zeros(s), gpt_global_shapes(model, 1))


def test_pipeline_stage_trees_save_and_load(data: Path, shared_tmp: Path) -> None:
    """Pipeline ranks write their own layers under global names (interleaved, v=2: rank 0
    owns layers 0 and 2), wte only from the first stage; any other layout reads them back,
    the last stage's tied wte included."""
    from numesh.base.tree import tree_map

    n = 4 if WORLD.Get_size() >= 4 else 2
    mesh_a = "pp=2,tp=2" if n == 4 else "pp=2"
    cfg = config(data, shared_tmp / "pp-stages", mesh_a, n_layer=4)
    rng = np.random.default_rng(0)
    state = {g: tree_map(lambda z: rng.standard_normal(z.shape), _zero_state(cfg.model(11)))
             for g in ("params", "m", "v")}

    def go(comm: MPI.Comm) -> str:
        t = _stage_trainer(cfg, comm, mesh_a, 2, state, 7)
        step_dir = save_checkpoint(TrainState(t.mesh, t.model, t.layout,
                                              {g: join_units(x) for g, x in t.opt.state_trees().items()},
                                              t.step, t.opt.opt_step, cfg.dtype, cfg.seed), cfg.out)
        for spec, v in ((f"pp=2,dp={n // 2}", 1), (f"dp={n}", 1), (mesh_a, 2)):
            u = _stage_trainer(cfg, comm, spec, v, None, 0)
            got = read_local_state(step_dir, u.mesh, u.model, u.layout, u.dtype)
            u.opt.load_state_trees({g: split_units(x) for g, x in got.trees.items()}, got.opt_step)
            u.step = got.step
            assert u.step == 7 and u.opt.opt_step == 7
            want = _stage_state(u.model, u.layout, u.mesh, state)
            got = {g: join_units(t) for g, t in u.opt.state_trees().items()}
            for g in ("params", "m", "v"):
                for (p, x), (_, y) in zip(tree_leaves_with_path(got[g]), tree_leaves_with_path(want[g])):
                    np.testing.assert_array_equal(x, y, err_msg=f"{spec} v={v} {g}/{p}")
        return str(step_dir)

    step_dir = Path(on_first(n, go))

    def check() -> None:
        meta, got = read_state(step_dir)
        assert meta.raw["mesh"]["pp"] == 2 and meta.raw["virtual_stages"] == 2
        for g in ("params", "m", "v"):
            for (p, x), (_, y) in zip(tree_leaves_with_path(got[g]), tree_leaves_with_path(state[g])):
                np.testing.assert_array_equal(x, y, err_msg=f"{g}/{p}")
        assert len(meta.leaves["params/wte"].files) == (2 if n == 4 else 1)

    on_root(check)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mesh", ["dp=2", "tp=2"])
def test_resume_on_another_vocabulary_fails_alike_on_every_rank(data: Path, shared_tmp: Path, mesh: str) -> None:
    """A dataset with the same number of characters but other ones: every rank raises the
    same CheckpointError before any step, and nothing is written into the run."""
    base = shared_tmp / f"vocab-{mesh.replace('=', '')}"
    other = base / "other-data"
    if WORLD.Get_rank() == 0:
        prepare_char_dataset(TEXT.replace("a", "k"), other)  # 11 characters, 'a' -> 'k'
    WORLD.Barrier()
    on_first(2, lambda comm: records_of(config(data, base / "run", mesh, max_iters=K), comm))
    before = sorted(str(p) for p in (base / "run").rglob("*"))
    cfg = config(other, base / "run", mesh, max_iters=2 * K, resume=str(base / "run" / "ckpt" / "latest"))

    def go(comm: MPI.Comm) -> list[str]:
        try:
            records_of(cfg, comm)
            msg = "no error"
        except CheckpointError as e:
            msg = str(e)
        return comm.allgather(msg)

    messages = on_first(2, go)
    want = f"step_{K:06d} was trained on another vocabulary than dataset {other}"

    def check() -> None:
        assert len(set(messages)) == 1 and want in messages[0], messages
        assert "id 1 is 'a' in the checkpoint, 'b' in the dataset; vocab 11 vs 11" in messages[0]
        assert sorted(str(p) for p in (base / "run").rglob("*")) == before

    on_root(check)
