"""Shared helpers for the numesh test suite.

Everything:      pytest   (the single-process tests, then test_mpi_suite[n=2|4|8] launches
                 the MPI suite below as a subprocess: tests/test_mpi_suites.py)
MPI (N ranks):   mpirun -n N python -m mpi4py -m pytest --with-mpi -m mpi -p no:cacheprovider -q

Under mpirun with more than one rank only the tests marked `@pytest.mark.mpi` run (the
others are skipped here: they are single-process tests that the plain `pytest` run covers,
and running them on every oversubscribed rank would only cost time).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from numesh.base.tree import tree_map
from numesh.host import threads
from numesh.mesh import Mesh, unshard
from numesh.nn.gpt import GPT, GPTConfig, gpt_specs, init_gpt

WORLD = MPI.COMM_WORLD

# MFU's per-core peak is cached per machine (numesh.host.runtime.peak_cache_path): the suite and
# the jobs it launches keep theirs in a temporary directory, never the user's cache.
if "NUMESH_CACHE_DIR" not in os.environ:
    os.environ["NUMESH_CACHE_DIR"] = tempfile.mkdtemp(prefix="numesh-test-cache-")
    atexit.register(shutil.rmtree, os.environ["NUMESH_CACHE_DIR"], True)

if WORLD.Get_size() > 1:
    # ranks x BLAS threads = cores, so oversubscribed MPI runs do not thrash
    from numesh.host.runtime import set_blas_threads

    set_blas_threads()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if WORLD.Get_size() == 1:
        return
    skip = pytest.mark.skip(reason="single-process test: run it with plain pytest, not under mpirun")
    for item in items:
        if "mpi" not in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------
# models and meshes


def tiny_config(**overrides: Any) -> GPTConfig:
    """A model small enough for finite differences: 2 layers, width 8, 2 heads, block 8."""
    kw: dict[str, Any] = dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, bias=True)
    kw.update(overrides)
    return GPTConfig(**kw)


@pytest.fixture
def tiny_cfg() -> GPTConfig:
    return tiny_config()


def self_mesh() -> Mesh:
    """The 1x1x1 mesh on MPI.COMM_SELF: every collective is the identity."""
    return Mesh.create(comm=MPI.COMM_SELF)


@pytest.fixture
def mesh1() -> Mesh:
    return self_mesh()


def model_config(**overrides: Any) -> GPTConfig:
    """The MPI parity suites' model: `tiny_config` 16 wide with 4 heads (tp up to 4 splits
    every kind of leaf), dropout and biases on."""
    kw: dict[str, Any] = dict(vocab_size=11, n_head=4, n_embd=16, dropout=0.1, bias=True)
    kw.update(overrides)
    return tiny_config(**kw)


def random_batch(cfg: GPTConfig, rows: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Input ids and targets of `rows` whole sequences, the same on every rank for a seed."""
    rng = np.random.default_rng(seed)
    shape = (rows, cfg.block_size)
    return rng.integers(0, cfg.vocab_size, shape), rng.integers(0, cfg.vocab_size, shape)


def mesh_for_world(meshes: dict[int, list[str]], i: int = 0, why: str = "") -> str:
    """The `i`-th mesh `meshes` lists for COMM_WORLD's size; the test is skipped where there
    is none (`why` says what the suite covers instead)."""
    listed = meshes.get(WORLD.Get_size(), [])
    if i >= len(listed):
        pytest.skip(why or f"no mesh {i} on {WORLD.Get_size()} ranks")
    return listed[i]


def world_mesh(spec: str, sequence_parallel: bool = False) -> Iterator[Mesh]:
    """The mesh `spec` over COMM_WORLD, for a fixture to `yield from`: freed after the test."""
    mesh = Mesh.parse(spec, WORLD, sequence_parallel)
    yield mesh
    mesh.free()


def gather_tree(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """The global arrays of a sharded tree (a collective on every axis a spec splits)."""
    return tree_map(lambda x, s: unshard(x, s, mesh), tree, specs)


def random_global_params(cfg: GPTConfig, seed: int, scale: float = 0.3) -> GPT:
    """Unpadded global float64 parameters with every entry random (biases and LN included),
    the same on every rank for the same seed."""
    base = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    rng = np.random.default_rng(seed)
    return tree_map(lambda x: x + scale * rng.standard_normal(x.shape), base)


def shard_params(global_params: GPT, cfg: GPTConfig, mesh: Mesh) -> GPT:
    """This rank's shards of unpadded global parameters (wte padded with zero rows for tp)."""
    from numesh.mesh import shard

    v = cfg.padded_vocab(mesh.size("tp"))

    def pad(x: np.ndarray | None) -> np.ndarray | None:
        if x is None:
            return None
        out = np.zeros((v, x.shape[1]), dtype=x.dtype)
        out[: cfg.vocab_size] = x[: cfg.vocab_size]
        return out

    padded = attrs.evolve(global_params, wte=pad(global_params.wte), lm_head=pad(global_params.lm_head))
    return tree_map(lambda x, s: shard(x, s, mesh), padded, gpt_specs(cfg))


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float, what: str = "") -> None:
    """max |got - want| <= rtol * max |want| (relative to the tensor's scale)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-300)
    err = float(np.max(np.abs(got - want), initial=0.0))
    assert err <= rtol * scale, f"{what}: max abs diff {err:.3e} > {rtol:g} x {scale:.3e}"


@attrs.frozen
class OneStep:
    """One forward and backward of `model_config` on a mesh, and the same on one rank."""

    cfg: GPTConfig
    loss: float  # the mesh's loss (this rank's share summed over cp)
    grads: GPT  # this rank's gradients, as the walk gives them
    full: GPT  # the global gradients: summed over cp, gathered over every other axis
    tokens: np.ndarray  # this rank's per-token evaluation losses
    want_loss: float
    want: GPT
    want_tokens: np.ndarray  # the one-rank per-token losses of this rank's tokens


def one_step(mesh: Mesh, dropout: float, **overrides: Any) -> OneStep:
    """`loss_and_grads` and `forward_loss` of random parameters on a batch of 4 sequences, each
    rank given its cp chunks of them (the zigzag layout), beside the one-rank results: the
    layer parity check of tp, sp and cp (`assert_one_step_matches`)."""
    from numesh.mesh import psum, psum_scalar
    from numesh.mesh.zigzag import take_local
    from numesh.nn.dropout import DropoutKey
    from numesh.nn.walk import forward_loss, loss_and_grads

    cfg = model_config(dropout=dropout, **overrides)
    gp = random_global_params(cfg, seed=21)
    idx, tgt = random_batch(cfg)
    scale = 1.0 / idx.size
    drop = DropoutKey(dropout, seed=5, step=2, row0=0, global_rows=idx.shape[0]) if dropout else None
    cp, r = mesh.size("cp"), mesh.index("cp")
    mine = take_local(idx, cp, r), take_local(tgt, cp, r)
    local = shard_params(gp, cfg, mesh)
    loss, grads = loss_and_grads(local, *mine, cfg, mesh, scale, drop)
    summed = tree_map(lambda g: psum(np.ascontiguousarray(g), mesh, "cp"), grads)
    want_loss, want = loss_and_grads(gp, idx, tgt, cfg, self_mesh(), scale, drop)
    want_tokens = forward_loss(gp, idx, tgt, cfg, self_mesh()).reshape(idx.shape)
    return OneStep(cfg, psum_scalar(loss, mesh, "cp"), grads, gather_tree(summed, gpt_specs(cfg), mesh),
                   forward_loss(local, *mine, cfg, mesh), want_loss, want, take_local(want_tokens, cp, r).ravel())


def assert_one_step_matches(step: OneStep) -> None:
    """The mesh's loss, per-token losses and every gradient leaf equal one rank's to 1e-10
    (wte and an untied lm_head without the rows that pad the vocabulary over tp)."""
    from numesh.base.tree import tree_leaves, tree_leaves_with_path

    assert step.loss == pytest.approx(step.want_loss, rel=1e-10, abs=0)
    assert_close(step.tokens, step.want_tokens, 1e-10, "per-token losses")
    for (path, got), w in zip(tree_leaves_with_path(step.full), tree_leaves(step.want)):
        assert_close(got[: step.cfg.vocab_size] if path in ("wte", "lm_head") else got, w, 1e-10, what=path)


# ---------------------------------------------------------------------------------------
# data


SYNTH_TEXT = "".join(
    # a learnable, deterministic character stream with a small vocabulary
    "the cat sat on a mat. " if i % 3 else "a hat, a bat; the end!\n"
    for i in range(120)
)


def make_dataset(out_dir: Path) -> Path:
    from numesh.data.char import prepare_char_dataset

    prepare_char_dataset(SYNTH_TEXT, out_dir)
    return out_dir


@pytest.fixture
def char_dataset(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "data")


def scratch_dir() -> str | None:
    """Where the MPI suites write their runs: /dev/shm where it is writable with 2 GiB free
    (a tmpfs, where a checkpoint's fsync of every file costs nothing: on this 2-core VM's
    disk, saving and reading checkpoints took 35 s of the MoE parity matrix's 93 s on rank
    0), else the system's temporary directory (None)."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 << 30:
            return str(shm)
    except OSError:
        pass
    return None


@pytest.fixture(scope="session")
def shared_tmp() -> Any:
    """A directory shared by every rank of COMM_WORLD (made by rank 0, path broadcast; all
    ranks run on this machine, as for any temporary directory)."""
    path = tempfile.mkdtemp(prefix="numesh-test-", dir=scratch_dir()) if WORLD.Get_rank() == 0 else None
    path = WORLD.bcast(path, root=0)
    yield Path(path)
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_dataset(shared_tmp: Path) -> Path:
    """The synthetic character dataset in a directory every rank can read."""
    out = shared_tmp / "data"
    if WORLD.Get_rank() == 0:
        make_dataset(out)
    WORLD.Barrier()
    return out


# ---------------------------------------------------------------------------------------
# work on some ranks of COMM_WORLD


def on_first(n: int, fn: Callable[[MPI.Comm], Any]) -> Any:
    """Run `fn` on a communicator of WORLD's first n ranks; every rank gets rank 0's result
    (errors too, so a failure never leaves the other ranks waiting)."""
    color = 0 if WORLD.Get_rank() < n else MPI.UNDEFINED
    comm = WORLD.Split(color, WORLD.Get_rank())
    result = None
    if comm != MPI.COMM_NULL:
        try:
            result = ("ok", fn(comm))
        except Exception as e:  # noqa: BLE001
            result = ("error", f"{type(e).__name__}: {e}")
        finally:
            comm.Free()
    status, value = WORLD.bcast(result, root=0)
    WORLD.Barrier()  # rank 0 leaves a bcast before the others finish `fn` (e.g. remove their flight files)
    if status != "ok":
        raise AssertionError(f"rank 0 failed: {value}")
    return value


def on_root(check: Callable[[], None]) -> None:
    """Run assertions on rank 0 and fail on every rank with its message."""
    err = None
    if WORLD.Get_rank() == 0:
        try:
            check()
        except AssertionError as e:
            err = str(e) or "assertion failed"
    err = WORLD.bcast(err, root=0)
    assert err is None, err


# ---------------------------------------------------------------------------------------
# training runs for the parity tests

PARITY_KEYS = ("loss", "grad_norm", "lr", "train_loss", "val_loss", "moe_aux_loss", "moe_z_loss", "moe_tokens_min",
               "moe_tokens_max", "moe_dropped")


def train_records(cfg: Any, comm: MPI.Comm) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Run `numesh.run.train.train` on `comm`: (the deterministic part of every metrics record,
    the final global parameters read back from the checkpoint)."""
    from numesh.checkpoint import read_params_dict
    from numesh.run.train import train

    records: list[dict] = []

    def on_step(step: int, rec: dict) -> None:
        records.append({"step": step, **{k: rec[k] for k in PARITY_KEYS if k in rec}})

    result = train(cfg, comm, on_step=on_step)
    return records, read_params_dict(result.checkpoint)


_SERIAL: dict[Any, tuple[str, Any]] = {}  # key -> ("ok", (records, parameters)) or ("error", why)


def _serial_key(cfg: Any) -> Any:
    return attrs.evolve(cfg, mesh="", out="", sequence_parallel=False)


def _serial_run(key: Any) -> tuple[str, Any]:
    """("ok", (records, parameters)) of `key` trained on this rank alone, or ("error", why)."""
    out = Path(tempfile.mkdtemp(prefix="numesh-serial-", dir=scratch_dir()))
    try:
        return "ok", train_records(attrs.evolve(key, out=str(out)), MPI.COMM_SELF)
    except Exception as e:  # every rank must learn of it, or the others would wait forever
        return "error", f"rank {WORLD.Get_rank()}: {e!r}"
    finally:
        shutil.rmtree(out, ignore_errors=True)


def prefetch_serial(cfgs: Any) -> None:
    """The serial references of `cfgs` not cached yet, each trained by one rank of COMM_WORLD
    (in turn) and shared with all. Collective. A parity matrix asks for a reference per case,
    and one rank ran them one by one while the others waited (MoE's 4-rank matrix: 8 runs,
    21 s of its 93 s); here the ranks run them side by side."""
    keys = list(dict.fromkeys(k for k in map(_serial_key, cfgs) if k not in _SERIAL))
    n, r = WORLD.Get_size(), WORLD.Get_rank()
    every = WORLD.allgather([_serial_run(k) for k in keys[r::n]])
    for i, key in enumerate(keys):
        _SERIAL[key] = every[i % n][i // n]


def serial_reference(cfg: Any) -> tuple[list[dict], dict[str, np.ndarray]]:
    """The dp=1,tp=1,pp=1 run of `cfg` (mesh, out and sequence parallelism ignored), the same
    on every rank: trained on rank 0 unless `prefetch_serial` ran it, cached for the session.
    Collective when not cached."""
    key = _serial_key(cfg)
    if key not in _SERIAL:
        prefetch_serial([cfg])
    status, payload = _SERIAL[key]
    if status != "ok":
        raise RuntimeError(f"the serial reference run failed on {payload}")
    return payload


def assert_same_run(got: tuple[list[dict], dict], want: tuple[list[dict], dict], rtol: float = 1e-10) -> None:
    """Every logged number and every final parameter equal to `rtol` relative."""
    rec_got, par_got = got
    rec_want, par_want = want
    assert [r["step"] for r in rec_got] == [r["step"] for r in rec_want]
    for a, b in zip(rec_got, rec_want):
        assert a.keys() == b.keys(), (a, b)
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=rtol, abs=0), (a["step"], k, a[k], b[k])
    assert par_got.keys() == par_want.keys()
    for k in par_want:
        assert_close(par_got[k], par_want[k], rtol, what=k)


SMALL_BATCH = 8


def small_run_config(data: Path, out: Path, mesh: str, **kw: object) -> Any:
    """A tiny float64 training run with dropout and biases (every code path), for parity tests."""
    from numesh.run.config import config_from

    base: dict = dict(
        n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=SMALL_BATCH, max_iters=4, dropout=0.1, bias=True,
        learning_rate=3e-2, min_lr=1e-3, warmup_iters=1, lr_decay_iters=4, grad_clip=0.5,
        eval_interval=2, eval_iters=1, data=str(data), out=str(out), mesh=mesh, seed=11, dtype="float64",
        peak_flops=1e12,  # MFU's denominator given: parity ignores MFU, and measuring it took a third of a run
    )
    base.update(kw)
    return config_from(base)


def cli(*args: str) -> Any:
    """Run the `numesh` command line in-process (typer's CliRunner); stderr kept apart."""
    from typer.testing import CliRunner

    from numesh.cli.app import app

    return CliRunner().invoke(app, list(args))


def one_error_line(res: Any) -> str:
    """The single `error: ...` line a user error prints (exit status 2), asserted to be alone."""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture
def with_threads():
    """Run a test body once per thread count, restoring the count afterwards. The rank may
    use 16 cores, whatever this machine has, so the work is cut as finely as on a node."""
    before, spin, cores = threads.threads(), threads._spin, threads.cores()
    threads.set_cores(16)
    yield threads.set_threads
    threads.set_threads(before, spin=spin)
    threads.set_cores(cores)
