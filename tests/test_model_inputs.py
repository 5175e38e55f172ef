"""The model's library calls check what they are given, in one line (`numesh.nn.inputs`):
token ids and targets outside [0, vocab_size) (a -1 once wrapped to the last row on one rank
and was zeroed on tp=2, so the meshes' losses differed), ids that are not int [B, T]
arrays, and parameters of another config, mesh or dtype (raw IndexErrors and numba typing
errors from deep inside). `init_gpt` and the ZeRO optimiser refuse dtypes other than
float32 and float64."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from conftest import self_mesh, tiny_config
from numesh.base.errors import ConfigError
from numesh.base.tree import tree_map
from numesh.nn.gpt import gpt_specs, init_gpt
from numesh.nn.units import split_units
from numesh.nn.walk import forward_loss, loss_and_grads
from numesh.optim.zero import ZeroOptimizer
from numesh.run.sample import generate

CFG = tiny_config()


def _batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, CFG.vocab_size, (2, 2, CFG.block_size))


def _params(dtype=np.float64):
    return init_gpt(CFG, self_mesh(), seed=0, dtype=dtype)


@pytest.mark.parametrize("shift, which, match", [
    (-1, "idx", r"idx holds ids from -1 to .*, outside \[0, 11\)"),   # wrapped to the last row
    (CFG.vocab_size, "idx", r"idx holds ids from 11 "),               # IndexError on 1 rank, a loss on tp=2
    (CFG.vocab_size, "targets", r"targets holds ids from 11 "),       # a finite loss on 1 rank, inf on tp=2
    (-1, "targets", r"targets holds ids from -1 "),                   # counted as a loss
])
def test_ids_and_targets_outside_the_vocabulary_are_one_error(shift: int, which: str, match: str) -> None:
    idx, tgt = _batch()
    bad = np.full_like(idx, shift)
    args = (bad, tgt) if which == "idx" else (idx, bad)
    with pytest.raises(ConfigError, match=match):
        loss_and_grads(_params(), *args, CFG, self_mesh(), 1.0)
    with pytest.raises(ConfigError, match=match):
        forward_loss(_params(), *args, CFG, self_mesh())


def test_the_last_id_of_the_vocabulary_is_fine() -> None:
    idx, tgt = _batch()
    loss, _ = loss_and_grads(_params(), np.full_like(idx, CFG.vocab_size - 1), tgt, CFG, self_mesh(), 1.0)
    assert np.isfinite(loss)


@pytest.mark.parametrize("prompt, match", [
    (np.array([[1, 2, 100]]), r"prompt holds ids from 1 to 100, outside \[0, 11\)"),
    (np.array([[-1, 2]]), r"prompt holds ids from -1 "),
    (np.array([1, 2, 3]), r"prompt must be \[B, T\]"),
    (np.array([[1.7, 2.2]]), "prompt must be an int numpy array"),
])
def test_generate_refuses_a_prompt_that_is_not_ids_of_the_vocabulary(prompt: np.ndarray, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        generate(_params(), CFG, self_mesh(), prompt, 2)


def test_generate_refuses_no_tokens_to_draw_from() -> None:
    with pytest.raises(ConfigError, match=r"tokens must be >= 1, got 0"):
        generate(_params(), CFG, self_mesh(), np.array([[1, 2]]), 2, tokens=0)


@pytest.mark.parametrize("settings, match", [
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0, got -1"),  # returned the prompt unchanged
    (dict(max_new_tokens=2.0), "max_new_tokens must be an int, got 2.0"),
    (dict(seed=-1), "seed must be >= 0, got -1"),
    (dict(top_k=2.5), "top_k must be an int, got 2.5"),
    (dict(tokens=2.5), "tokens must be an int, got 2.5"),
    (dict(temperature=None), "temperature must be >= 0 and finite"),
])
def test_generate_refuses_settings_of_the_wrong_type_or_range_in_one_line(settings: dict, match: str) -> None:
    kw = {"max_new_tokens": 2, **settings}
    with pytest.raises(ConfigError, match=match):
        generate(_params(), CFG, self_mesh(), np.array([[1, 2]]), kw.pop("max_new_tokens"), **kw)


@pytest.mark.parametrize("prompt", [np.zeros((0, 3), np.int64), np.zeros((1, 0), np.int64)])
def test_generate_refuses_an_empty_prompt_without_naming_a_cli_option(prompt: np.ndarray) -> None:
    with pytest.raises(ConfigError, match=r"the prompt is empty \(shape") as e:
        generate(_params(), CFG, self_mesh(), prompt, 2)
    assert "--prompt" not in str(e.value)


def test_generate_takes_its_settings_by_name() -> None:
    """Nine positional settings were easy to misorder (a seed passed as top_k drew silently)."""
    with pytest.raises(TypeError):
        generate(_params(), CFG, self_mesh(), np.array([[1, 2]]), 2, 0.0)  # type: ignore[misc]


@pytest.mark.parametrize("change, match", [
    (lambda i, t: (i.astype(float), t), "idx must be an int numpy array of token ids"),
    (lambda i, t: (i[0], t[0]), r"idx must be \[B, T\] .* got shape \(8,\)"),
    (lambda i, t: (i, t[:, :4]), r"targets \(2, 4\) and idx \(2, 8\) must have one shape"),
])
def test_ids_must_be_int_arrays_of_one_shape(change, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        loss_and_grads(_params(), *change(*_batch()), CFG, self_mesh(), 1.0)


@pytest.mark.parametrize("idx, tgt, match", [
    (np.zeros((0, 8), np.int64), np.zeros((0, 8), np.int64), r"the idx is empty \(shape \(0, 8\)\)"),  # max() of []
    (np.zeros((2, 0), np.int64), np.zeros((2, 0), np.int64), r"the idx is empty \(shape \(2, 0\)\)"),  # ZeroDivision
    (np.ones((2, 8), np.int64), None, r"targets must be an int numpy array .*, got None"),  # an AttributeError
], ids=["B=0", "T=0", "no-targets"])
def test_empty_ids_or_no_targets_are_one_error(idx: np.ndarray, tgt, match: str) -> None:
    for call in (lambda: loss_and_grads(_params(), idx, tgt, CFG, self_mesh(), 1.0),
                 lambda: forward_loss(_params(), idx, tgt, CFG, self_mesh())):
        with pytest.raises(ConfigError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("cfg, match", [
    (attrs.evolve(CFG, n_layer=3), "params have 2 blocks but the config has n_layer=3"),
    (attrs.evolve(CFG, n_embd=16), r"params' wte is \(11, 8\) but n_embd=16, tp=1 and ep=1 make it \(11, 16\)"),
    (attrs.evolve(CFG, bias=False), r"params have 28 leaves, the config expects 15 \(the first to differ: params "
                                    r"have blocks.0.ln1.b where the config has blocks.0.attn.qkv.w\)"),
])
def test_params_of_another_config_are_one_error(cfg, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        loss_and_grads(_params(), *_batch(), cfg, self_mesh(), 1.0)


def _middle(change) -> tuple:
    """Params of a 3-layer model whose middle block's ln1 is `change`d, and that config."""
    cfg = attrs.evolve(CFG, n_layer=3)
    params = init_gpt(cfg, self_mesh(), seed=0, dtype=np.float64)
    mid = params.blocks[1]
    blocks = (params.blocks[0], attrs.evolve(mid, ln1=change(mid.ln1)), params.blocks[2])
    return attrs.evolve(params, blocks=blocks), cfg


@pytest.mark.parametrize("change, match", [
    (lambda ln: attrs.evolve(ln, w=ln.w[:4]),
     r"params' blocks.1.ln1.w is \(4,\) but n_embd=8, tp=1 and ep=1 make it \(8,\)"),  # a loss from garbage
    (lambda ln: attrs.evolve(ln, b=None),
     r"params have 39 leaves, the config expects 40 \(the first to differ: params have blocks.1.attn.qkv.w "
     r"where the config has blocks.1.ln1.b\)"),
], ids=["short-w", "no-b"])
def test_a_middle_blocks_wrong_leaf_is_one_error_naming_it(change, match: str) -> None:
    """The check compared the outer parts and the first and last block only: a middle
    block's short ln1.w went through to the fused LayerNorm, which read past its end."""
    params, cfg = _middle(change)
    idx, tgt = _batch()
    for call in (lambda: loss_and_grads(params, idx, tgt, cfg, self_mesh(), 1.0),
                 lambda: forward_loss(params, idx, tgt, cfg, self_mesh())):
        with pytest.raises(ConfigError, match=match):
            call()


def test_params_of_a_tp_mesh_on_a_mesh_without_tp_are_one_error() -> None:
    tp2 = attrs.evolve(_params(), wte=_params().wte[:6])  # what rank 0 of tp=2 holds of the padded 12 rows
    with pytest.raises(ConfigError, match=r"params' wte is \(6, 8\) but .* tp=1 .* make it \(11, 8\)"):
        loss_and_grads(tp2, *_batch(), CFG, self_mesh(), 1.0)


@pytest.mark.parametrize("dtype", [np.float16, np.int64])
def test_params_of_another_dtype_are_one_error(dtype) -> None:
    params = tree_map(lambda x: x.astype(dtype), _params())
    with pytest.raises(ConfigError, match=f"dtype must be float32 or float64, got params of {np.dtype(dtype).name}"):
        loss_and_grads(params, *_batch(), CFG, self_mesh(), 1.0)


def test_params_of_mixed_dtypes_are_one_error() -> None:
    params = _params()
    params = attrs.evolve(params, ln_f=tree_map(lambda x: x.astype(np.float32), params.ln_f))
    with pytest.raises(ConfigError, match="params mix dtypes: ln_f.w is float32, wte float64"):
        loss_and_grads(params, *_batch(), CFG, self_mesh(), 1.0)


@pytest.mark.parametrize("dtype", [np.int32, np.float16, "bfloat16"])
def test_init_gpt_refuses_a_dtype_other_than_float32_and_float64(dtype) -> None:
    with pytest.raises(ConfigError, match="dtype must be float32 or float64"):
        init_gpt(CFG, self_mesh(), dtype=dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.float16])
def test_the_zero_optimiser_refuses_parameters_other_than_float32_and_float64(dtype) -> None:
    units = split_units(tree_map(lambda x: x.astype(dtype), _params()))
    with pytest.raises(ConfigError, match="the parameters' dtype must be float32 or float64"):
        ZeroOptimizer(units, split_units(gpt_specs(CFG)), self_mesh(), 1)
