"""Muon and the optimiser interface on one process: numesh's Muon step against
torch.optim.Muon (to bfloat16 rounding: PyTorch iterates Newton–Schulz in bfloat16), the AdamW
part against torch.optim.AdamW, the iteration itself, which leaves are Muon's, how leaves
are cut into matrices and dealt to ranks, ZeroOptimizer's Muon on every ZeRO stage against
the update written out, its state through checkpoints, and the one-line errors.
(Every mesh against one rank: tests/test_mpi_muon.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import cli, one_error_line, self_mesh, tiny_config
from numesh.base.errors import ConfigError
from numesh.base.tree import tree_leaves, tree_leaves_with_path
from numesh.mesh import P
from numesh.nn.gpt import gpt_global_shapes, gpt_specs, init_gpt
from numesh.nn.units import split_units
from numesh.optim import Leaf, make_optimizer
from numesh.optim.adamw import AdamWConfig, AdamWState, adamw_step
from numesh.optim.interface import matrix_view
from numesh.optim.matrices import assign_owners, deal_matrices, pieces, replica_owners
from numesh.optim.muon import MuonConfig, is_hidden_matrix, lr_factor, momentum_direction, orthogonalise
from numesh.optim.registry import describe
from numesh.optim.zero import ZeroOptimizer

# bfloat16 keeps 8 significant bits: one rounding is 2^-9 relative, and torch rounds the
# iteration's input and every product of its 5 steps; measured 1-2 % of the update's
# largest value, so the test allows 3 % of the parameters' change
BF16_RTOL = 0.03


def torch_or_fail():
    try:
        import torch
    except ImportError:
        pytest.fail("this test compares with torch.optim.Muon and AdamW: pip install torch==2.13.0")
    return torch


# ---------------------------------------------------------------------------------------
# against PyTorch


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 40)])
def test_muon_steps_equal_torch_optim_muon_to_bfloat16_rounding(adjust: str, shape: tuple[int, int]) -> None:
    """Three steps of one matrix stored [in, out] (torch is given the nn.Linear weight
    [out, in]): momentum, Nesterov, Newton–Schulz, the lr adjustment and weight decay."""
    torch = torch_or_fail()
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(shape) * 0.1
    lr, wd = 0.02, 0.1
    cfg = MuonConfig(adjust_lr=adjust, weight_decay=wd)
    param = torch.nn.Parameter(torch.tensor(w0.T.copy(), dtype=torch.float32))
    opt = torch.optim.Muon([param], lr=lr, weight_decay=wd, adjust_lr_fn=adjust)
    p, buf = w0.copy(), np.zeros_like(w0)
    for _ in range(3):
        g = rng.standard_normal(shape)
        param.grad = torch.tensor(g.T.copy(), dtype=torch.float32)
        opt.step()
        momentum_direction(g, buf, cfg)
        p *= 1 - lr * wd
        p -= lr * lr_factor(*shape, adjust) * orthogonalise(g, cfg)
    want = param.detach().double().numpy().T
    moved = np.abs(want - w0).max()
    assert moved > 0.01  # the optimiser moved the matrix: the comparison means something
    assert np.abs(p - want).max() <= BF16_RTOL * moved
    # the same steps in float64 here differ from torch by bfloat16's rounding, not by nothing
    assert np.abs(p - want).max() > 1e-6 * moved


def muon_opt(**options):
    return make_optimizer("muon", {"learning_rate": 1e-2, **options})


def test_the_adamw_part_equals_torch_optim_adamw_and_the_matrices_are_muons() -> None:
    """Muon's optimiser on a GPT's units (ZeRO 0, one rank): the embeddings, norms and biases
    follow torch.optim.AdamW exactly (float64), the matrices do not (they are Muon's)."""
    torch = torch_or_fail()
    cfg = tiny_config()
    params = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    units = split_units(params)
    opt = ZeroOptimizer(units, split_units(gpt_specs(cfg)), self_mesh(), optimizer=muon_opt(beta2=0.95),
                        paths={u: "" if u.is_outer else f"{u}." for u in units})
    leaves = {f"{'' if u.is_outer else f'{u}.'}{p}": x.copy() for u, t in units.items()
              for p, x in tree_leaves_with_path(t)}
    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in leaves.items()}
    adamw_leaves = [k for k in leaves if not k.startswith("blocks.") or not k.endswith(".w") or leaves[k].ndim < 2]
    decay = [tparams[k] for k in adamw_leaves if leaves[k].ndim >= 2 and not k.endswith(".b")]
    nodecay = [tparams[k] for k in adamw_leaves if not (leaves[k].ndim >= 2 and not k.endswith(".b"))]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(2)
    for _ in range(3):
        grads = {u: [rng.standard_normal(np.shape(x)) for x in tree_leaves(t)] for u, t in units.items()}
        opt.begin_step(1)
        for u in units:
            opt.grads_ready(u, grads[u])
        for (u, g), k in zip([(u, g) for u in units for g in grads[u]], leaves):
            tparams[k].grad = torch.tensor(g)
        opt.step(1e-2)
        topt.step()
    got = {f"{'' if u.is_outer else f'{u}.'}{p}": x for u, t in opt.local_params().items()
           for p, x in tree_leaves_with_path(t)}
    for k in leaves:
        want = tparams[k].detach().numpy()
        if k in adamw_leaves:
            np.testing.assert_allclose(got[k], want, rtol=1e-12, atol=1e-14, err_msg=k)
        else:
            assert np.abs(got[k] - want).max() > 1e-4, k  # Muon's, not AdamW's
    assert set(adamw_leaves) == {k for k in leaves if not is_hidden_matrix(Leaf(k, leaves[k].shape))}


# ---------------------------------------------------------------------------------------
# the iteration and the leaves


def test_newton_schulz_pushes_singular_values_towards_one_in_the_run_dtype() -> None:
    rng = np.random.default_rng(3)
    u = np.linalg.qr(rng.standard_normal((24, 12)))[0]
    v = np.linalg.qr(rng.standard_normal((20, 12)))[0]
    x = (u * np.geomspace(0.05, 1.0, 12)) @ v.T  # [24, 20] of rank 12, singular values over 1.3 decades
    for dtype in (np.float32, np.float64):
        o = orthogonalise(x.astype(dtype))
        assert o.dtype == dtype and o.shape == x.shape
        s = np.linalg.svd(o.astype(np.float64), compute_uv=False)
        # the quintic's 5 steps leave every singular value in about [0.7, 1.2], not at 1, and
        # the null space stays null
        assert s[:12].max() < 1.25 and s[:12].min() > 0.6 and s[12:].max() < 1e-4, s
    # each orientation is iterated as torch iterates the [out, in] weight: transposing the
    # input transposes the output exactly for a non-square matrix
    np.testing.assert_array_equal(orthogonalise(x.T.copy()), orthogonalise(x).T)
    assert not orthogonalise(np.zeros((4, 6))).any()  # eps keeps a zero gradient finite


@pytest.mark.parametrize("x, message", [
    (np.arange(12).reshape(3, 4), "got a matrix of int64"),  # came back all zeros
    (np.ones(4), r"got a 1-D array of shape \(4,\)"),  # an IndexError
    (np.ones((2, 3, 4)), r"got a 3-D array of shape \(2, 3, 4\)"),  # a matmul error
    ([[1.0, 2.0]], "got list"),
])
def test_orthogonalise_of_anything_but_a_float_matrix_is_one_line(x, message: str) -> None:
    with pytest.raises(ValueError, match=r"orthogonalise takes a float matrix \(a 2-D float array\), " + message):
        orthogonalise(x)


def test_muon_takes_the_block_matrices_by_path_and_shape_whatever_the_model() -> None:
    cfg = tiny_config(moe_experts=4, moe_every=2)
    shapes = dict(tree_leaves_with_path(gpt_global_shapes(cfg)))
    specs = dict(tree_leaves_with_path(gpt_specs(cfg)))
    muon = {p for p in shapes if is_hidden_matrix(Leaf(p, shapes[p], specs[p]))}
    assert muon == {f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv.w", "attn.proj.w")} | {
        "blocks.0.mlp.router.w", "blocks.0.mlp.fc.w", "blocks.0.mlp.proj.w", "blocks.1.mlp.fc.w", "blocks.1.mlp.proj.w"}
    # a Llama's leaves (separate q, k, v; gate and up; RMSNorm weights; an untied head) fall in place
    llama = {"blocks.0.attn.q.w": ((16, 16), P(None, "tp")), "blocks.0.attn.k.w": ((16, 8), P()),
             "blocks.0.mlp.gate.w": ((16, 48), P(None, "tp")), "blocks.0.ln1.w": ((16,), P()),
             "blocks.0.mlp.gate.b": ((48,), P("tp")), "lm_head": ((64, 16), P("tp", None)), "wte": ((64, 16), P())}
    assert {p for p, (s, sp) in llama.items() if is_hidden_matrix(Leaf(p, s, sp))} == {
        "blocks.0.attn.q.w", "blocks.0.attn.k.w", "blocks.0.mlp.gate.w"}


def test_a_leaf_is_cut_into_its_matrices() -> None:
    qkv = matrix_view(Leaf("blocks.0.attn.qkv.w", (16, 3, 8), P(None, None, "tp")))
    assert (qkv.batch, qkv.shape, qkv.tp_dim, qkv.matrices_per_slab) == (1, (16, 3, 8), 2, 3)
    slab = np.arange(16 * 3 * 8.0).reshape(16, 3, 8)
    q, k, v = qkv.matrices(slab)
    np.testing.assert_array_equal(k, slab[:, 1, :])  # separate q, k and v, whatever their storage
    experts = matrix_view(Leaf("blocks.0.mlp.fc.w", (2, 16, 32), P("ep", None, "tp")))
    assert (experts.batch, experts.shape, experts.tp_dim, experts.matrices_per_slab) == (2, (16, 32), 1, 1)
    proj = matrix_view(Leaf("blocks.0.mlp.proj.w", (64, 16), P("tp", None)))
    assert proj.tp_dim == 0 and proj.batch == 1
    assert experts.experts and not proj.experts
    with pytest.raises(ValueError, match="no matrix"):
        matrix_view(Leaf("blocks.0.mlp.fc.w", (2, 16), P("ep", None)))


def test_slabs_are_dealt_by_cost_and_cut_by_shards() -> None:
    assert assign_owners([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    assert assign_owners([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert assign_owners([3, 3], 1) == [0, 0]
    assert pieces(5, 10, 8, 2) == [(5, 8), (8, 15)]
    assert pieces(0, 4, 8, 2) == [(0, 4), (8, 8)]  # nothing in rank 1's shard
    assert assign_owners([1, 1], 2, loads=[5.0, 0.0]) == [1, 1]


def test_an_owners_slabs_are_dealt_over_its_replicas() -> None:
    """Replicas (ep, cp, tp) = (r // (cp·tp), r // tp % cp, r % tp): an expert's slab goes to
    a replica of its own ep rank, every ep rank dealing its experts alike; the others over
    all of them, after the experts' loads."""
    costs, experts = [4.0, 4.0, 1.0, 1.0, 1.0, 1.0], [True, True, False, False, False, False]
    for ep_rank in (0, 1):  # ep=2, cp=1, tp=2
        got = replica_owners(costs, experts, 2, 1, 2, ep_rank)
        assert got[:2] == [2 * ep_rank, 2 * ep_rank + 1]  # the experts: this ep rank's two tp ranks
        assert got[2:] == [0, 1, 2, 3]  # the others alike on both: from loads 4 everywhere, one each
    assert replica_owners([1.0, 1.0, 1.0], [False] * 3, 1, 2, 2, 0) == [0, 1, 2]  # cp x tp, no ep
    assert replica_owners([2.0, 1.0], [False, False], 1, 1, 1, 0) == [0, 0]  # one replica: all its own


def test_start_up_lines_name_each_rules_leaves() -> None:
    cfg = tiny_config()
    shapes = dict(tree_leaves_with_path(gpt_global_shapes(cfg)))
    specs = dict(tree_leaves_with_path(gpt_specs(cfg)))
    lines = describe(muon_opt(), {p: Leaf(p, shapes[p], specs[p]) for p in shapes})
    text = "\n".join(lines)
    assert "blocks.*.attn.qkv.w [8, 3, 8] x2: 3 matrices [8, 8]" in text
    assert lines.index("  muon: 8 leaves") > lines.index("    wte [11, 8]")


def test_start_up_lines_give_each_shape_its_own_row() -> None:
    """With --moe-every 2 the dense block's MLP was listed under the expert block's shape
    and matrix count (the first block's, for all)."""
    cfg = tiny_config(moe_experts=2, moe_every=2)
    shapes = dict(tree_leaves_with_path(gpt_global_shapes(cfg)))
    specs = dict(tree_leaves_with_path(gpt_specs(cfg)))
    lines = describe(muon_opt(), {p: Leaf(p, shapes[p], specs[p]) for p in shapes})
    assert "    blocks.*.mlp.fc.w [2, 8, 32]: 2 matrices [8, 32]" in lines
    assert "    blocks.*.mlp.fc.w [8, 32]: 1 matrix [8, 32]" in lines
    assert "    blocks.*.attn.qkv.w [8, 3, 8] x2: 3 matrices [8, 8]" in lines


# ---------------------------------------------------------------------------------------
# ZeroOptimizer


def written_out(p: dict, g: dict, lr: float, steps: int, cfg: MuonConfig) -> dict:
    """Muon on whole leaves, `steps` times with the same gradients: each matrix of a leaf
    orthogonalised apart; AdamW (defaults, decay on ndim >= 2 but biases) elsewhere."""
    p = {k: v.copy() for k, v in p.items()}
    buf = {k: np.zeros_like(v) for k, v in p.items()}
    adam = {k: AdamWState(np.zeros(v.size), np.zeros(v.size)) for k, v in p.items()}
    for _ in range(steps):
        for k in p:
            leaf = Leaf(k, p[k].shape)
            if not is_hidden_matrix(leaf):
                flat = p[k].reshape(-1)
                adamw_step(flat, g[k].reshape(-1).copy(), adam[k], lr, AdamWConfig(),
                           np.full(flat.size, float(p[k].ndim >= 2 and not k.endswith(".b"))))
                continue
            u = g[k].copy()
            momentum_direction(u, buf[k], cfg)
            view = matrix_view(leaf)
            o = np.stack([orthogonalise(m, cfg) for m in view.matrices(u)], axis=1).reshape(u.shape)
            p[k] *= 1 - lr * cfg.weight_decay
            p[k] -= lr * lr_factor(u.shape[0], u.shape[-1], cfg.adjust_lr) * o
    return p


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_optimizer_muon_equals_the_update_written_out(stage: int) -> None:
    cfg = tiny_config()
    params = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    units = split_units(params)
    names = {u: "" if u.is_outer else f"{u}." for u in units}
    opt = ZeroOptimizer(units, split_units(gpt_specs(cfg)), self_mesh(), stage=stage, optimizer=muon_opt(),
                        paths=names)
    rng = np.random.default_rng(4)
    grads = {u: [rng.standard_normal(np.shape(x)) for x in tree_leaves(t)] for u, t in units.items()}
    flat = {names[u] + p: x.copy() for u, t in units.items() for p, x in tree_leaves_with_path(t)}
    gflat = dict(zip(flat, [g for u in units for g in grads[u]]))
    for _ in range(2):
        opt.begin_step(1)
        for u in units:
            opt.grads_ready(u, [g.copy() for g in grads[u]])
        opt.step(1e-2)
    want = written_out(flat, gflat, 1e-2, 2, muon_opt().config)
    got = {names[u] + p: x for u, t in opt.local_params().items() for p, x in tree_leaves_with_path(t)}
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)
    # the state: one momentum value per matrix value, two moments for the rest (and padding)
    muon_values = sum(x.size for k, x in flat.items() if is_hidden_matrix(Leaf(k, x.shape)))
    assert opt.state["momentum"].size == muon_values
    assert opt.state["m"].size == opt.state["v"].size == opt.scratch.size - muon_values


def test_muon_state_goes_through_state_trees_by_group() -> None:
    cfg = tiny_config()
    units = split_units(init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64))
    specs = split_units(gpt_specs(cfg))
    names = {u: "" if u.is_outer else f"{u}." for u in units}
    opt = ZeroOptimizer(units, specs, self_mesh(), stage=1, optimizer=muon_opt(), paths=names)
    rng = np.random.default_rng(5)
    opt.begin_step(1)
    for u, t in units.items():
        opt.grads_ready(u, [rng.standard_normal(np.shape(x)) for x in tree_leaves(t)])
    opt.step(1e-2)
    trees = opt.state_trees()
    assert set(trees) == {"params", "momentum", "m", "v"}
    outer = next(u for u in units if u.is_outer)
    assert trees["momentum"][outer].wte is None and trees["m"][outer].wte is not None
    block = next(u for u in units if not u.is_outer)
    assert trees["momentum"][block].attn.qkv.w is not None and trees["m"][block].attn.qkv.w is None
    assert np.abs(trees["momentum"][block].attn.qkv.w).max() > 0
    other = ZeroOptimizer(split_units(init_gpt(cfg, self_mesh(), seed=1, dtype=np.float64)), specs, self_mesh(),
                          stage=3, optimizer=muon_opt(), paths=names)
    other.load_state_trees(trees, opt.opt_step)
    for name in trees:
        for u in units:
            for (p, x), (_, y) in zip(tree_leaves_with_path(other.state_trees()[name][u]),
                                      tree_leaves_with_path(trees[name][u])):
                np.testing.assert_array_equal(x, y, err_msg=f"{name}/{u}.{p}")


# ---------------------------------------------------------------------------------------
# one-line errors


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "sgd"}, "--optimizer must be one of adamw, muon, got 'sgd'"),
    ({"muon_momentum": 1.0}, "muon_momentum must be in [0, 1), got 1.0"),
    ({"muon_ns_steps": 0}, "muon_ns_steps must be between 1 and 99, got 0"),
    ({"muon_adjust_lr": "none"}, "muon_adjust_lr must be one of original, match_rms_adamw, got 'none'"),
    ({"muon_lr": -1.0}, "muon_lr must be >= 0 (0 = --learning-rate), got -1.0"),
    ({"beta1": 1.5}, "beta1 must be in [0, 1), got 1.5"),
])
def test_bad_optimizer_options_are_one_error_line(char_dataset: Path, tmp_path: Path, options: dict,
                                                  message: str) -> None:
    with pytest.raises(ConfigError) as e:
        make_optimizer(options.pop("optimizer", "muon"), options)
    assert str(e.value) == message
    args = ["train", "--data", str(char_dataset), "--out", str(tmp_path / "run"), "--max-iters", "1"]
    for k, v in ({"optimizer": "muon"} | options | ({"optimizer": "sgd"} if "sgd" in message else {})).items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    assert one_error_line(cli(*args)) == f"error: {message}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, options, message", [
    ("adamw", {"beta_1": 0.5},
     "adamw has no option 'beta_1': its options are learning_rate, beta1, beta2, weight_decay"),
    ("adamw", {"muon_momentum": 0.5}, "adamw has no option 'muon_momentum'"),
    ("muon", {"muon_lr": float("nan")}, "--muon-lr must be a finite number, got nan"),  # was: use learning_rate
    ("adamw", {"weight_decay": float("inf")}, "--weight-decay must be a finite number, got inf"),
    ("muon", {"muon_ns_steps": 2.5}, "config key 'muon_ns_steps' must be int, got 2.5"),  # was: truncated to 2
    ("adamw", {"beta1": "0.5"}, "config key 'beta1' must be float, got '0.5'"),
    ("muon", {"muon_lr": 1e-3, "learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),  # was a ZeroDivisionError
    ("adamw", {"learning_rate": -1.0}, "learning_rate must be > 0, got -1.0"),  # was accepted, as a run's is not
    ("muon", {"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
    (["adamw"], {}, "--optimizer must be one of adamw, muon, got ['adamw']"),  # was a TypeError: unhashable
])
def test_the_library_checks_optimizer_options_as_the_cli_does(name: str, options: dict, message: str) -> None:
    """make_optimizer promised a one-line ConfigError for a bad value, but ignored a
    misspelt key and let NaN, inf and a fractional step count through."""
    with pytest.raises(ConfigError) as e:
        make_optimizer(name, options)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("make, message", [
    (lambda: AdamWConfig(beta1=5.0), "beta1 must be in [0, 1), got 5.0"),
    (lambda: AdamWConfig(eps=-1.0), "AdamW's eps must be a finite number > 0, got -1.0"),
    (lambda: MuonConfig(ns_steps=2.5), "muon_ns_steps must be an integer, got 2.5"),
    (lambda: MuonConfig(weight_decay=float("inf")), "weight_decay must be a finite number, got inf"),
    (lambda: MuonConfig(nesterov="no"), "muon_nesterov must be True or False, got 'no'"),  # was truthy: on
    (lambda: MuonConfig(ns_coefficients=(float("nan"), 1.0, 1.0)),
     "each of Muon's ns_coefficients must be a finite number, got nan"),
    (lambda: MuonConfig(ns_coefficients=(1.0, 2.0)), "Muon's ns_coefficients must be three numbers (a, b, c), got "
                                                    "(1.0, 2.0)"),
    (lambda: MuonConfig(momentum="0.9"), "muon_momentum must be a finite number, got '0.9'"),  # were TypeErrors
    (lambda: AdamWConfig(beta1="0.9"), "beta1 must be a finite number, got '0.9'"),
    (lambda: MuonConfig(adamw=None), "MuonConfig's adamw must be an AdamWConfig (AdamWConfig(beta1=...)), got None"),
    (lambda: MuonConfig(adamw={"beta1": 0.9}), "MuonConfig's adamw must be an AdamWConfig (AdamWConfig(beta1=...)), "
                                              "got {'beta1': 0.9}"),  # were accepted
])
def test_optimizer_configs_built_by_hand_are_checked(make, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value) == message


@pytest.mark.parametrize("call, message", [
    (lambda: orthogonalise(np.ones((3, 4)), None), "orthogonalise's cfg must be a MuonConfig (or left out), got None"),
    (lambda: lr_factor(3, 4, "bogus"), "lr_factor's adjust_lr must be one of original, match_rms_adamw, got 'bogus'"),
    (lambda: lr_factor(0, 4, "original"), "lr_factor's fan_in and fan_out must be >= 1, got 0 and 4"),
], ids=["no-cfg", "unknown-adjust", "empty"])
def test_muon_helpers_given_wrong_arguments_are_one_line(call, message: str) -> None:
    """Were an AttributeError, a silent "match_rms_adamw" and a ZeroDivisionError."""
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


def test_numpy_scalars_are_numbers_to_the_optimizer_configs() -> None:
    """MuonConfig(ns_steps=np.int64(5)) said "must be between 1 and 99, got 5", and
    make_optimizer refused np.int64 steps and an np.float32 beta1 (an np.float64 passed)."""
    assert MuonConfig(ns_steps=np.int64(5), momentum=np.float32(0.5)).ns_steps == 5
    assert make_optimizer("muon", {"muon_ns_steps": np.int64(3)}).config.ns_steps == 3
    assert make_optimizer("adamw", {"beta1": np.float32(0.5), "learning_rate": np.int32(1)}).config.beta1 == 0.5
    with pytest.raises(ConfigError, match="^config key 'muon_nesterov' must be bool, got np.True_$"):
        make_optimizer("muon", {"muon_nesterov": np.bool_(True)})  # a bool is True or False, as --muon-nesterov's


def test_resuming_with_another_optimizer_is_one_error_line(char_dataset: Path, tmp_path: Path) -> None:
    base = ["train", "--data", str(char_dataset), "--out", str(tmp_path / "run"), "--n-layer", "1", "--n-embd", "8",
            "--block-size", "8", "--eval-iters", "1", "--peak-flops", "1e12"]
    assert cli(*base, "--max-iters", "1").exit_code == 0
    line = one_error_line(cli(*base, "--max-iters", "2", "--optimizer", "muon", "--resume", "auto"))
    assert "was trained with --optimizer adamw, this run has --optimizer muon: resume with --optimizer adamw" in line
    assert line.endswith(f"or start a new run from its weights with `numesh export {tmp_path / 'run' / 'ckpt'}"
                         "/step_000001 --out F.safetensors`, then --init-from F.safetensors")  # a route that works


def test_matrices_dealt_over_threads_largest_first_to_the_least_loaded() -> None:
    assert deal_matrices([1.0, 8.0, 2.0, 2.0, 3.0], 2) == [[1], [4, 2, 3, 0]]
    assert deal_matrices([5.0, 5.0, 5.0], 3) == [[0], [1], [2]]
    assert deal_matrices([1.0], 2) == [[0], []]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_muon_steps_are_the_same_bits_on_any_thread_count(with_threads, dtype) -> None:
    """Newton–Schulz runs several matrices side by side on the threads (`run_matrices`):
    the parameters after two steps do not depend on how many threads there are."""
    cfg = tiny_config(n_layer=2, n_embd=16, n_head=2)
    got = []
    for n in (1, 2, 3):
        with_threads(n)
        units = split_units(init_gpt(cfg, self_mesh(), seed=0, dtype=dtype))
        opt = ZeroOptimizer(units, split_units(gpt_specs(cfg)), self_mesh(), optimizer=muon_opt(),
                            paths={u: "" if u.is_outer else f"{u}." for u in units})
        rng = np.random.default_rng(3)
        for _ in range(2):
            opt.begin_step(1)
            for u, t in units.items():
                opt.grads_ready(u, [rng.standard_normal(np.shape(x)).astype(dtype) for x in tree_leaves(t)])
            opt.step(1e-2)
        got.append([x.copy() for t in opt.local_params().values() for x in tree_leaves(t)])
    for other in got[1:]:
        for a, b in zip(got[0], other):
            np.testing.assert_array_equal(a, b)


def test_muon_lr_is_relative_to_the_default_learning_rate_when_none_is_given() -> None:
    """Without learning_rate, muon_lr was divided by 1.0: Muon's rate 1000 times too small."""
    from numesh.optim import make_optimizer

    alone = make_optimizer("muon", {"muon_lr": 0.02}).config.lr_ratio
    assert alone == make_optimizer("muon", {"muon_lr": 0.02, "learning_rate": 1e-3}).config.lr_ratio == 20.0


@pytest.mark.parametrize("options, message", [
    ({"muon_lr": 1e308}, r"--muon-lr 1e\+308 over --learning-rate 0.001 is inf"),  # was "lr_ratio must be ..."
    ({"muon_lr": 0.2, "weight_decay": 10.0}, "--weight-decay 10 times --muon-lr 0.2 is 2, not below 1"),
    ({"weight_decay": 2000.0}, "--weight-decay 2000 times --learning-rate 0.001 is 2, not below 1"),
])
def test_muon_refuses_rates_that_overflow_or_decay_past_zero(options: dict, message: str) -> None:
    from numesh.optim import make_optimizer

    with pytest.raises(ConfigError, match=message):
        make_optimizer("muon", options)
