"""`numesh train --init-from`: fine-tuning from a Hugging Face directory or a numesh export.

Export -> --init-from: the run starts from exactly the exported parameters, from either
format, and its first step's loss is the same from both; on tp=2 and pp=2 meshes the run
equals the one-rank run (float64, 1e-10). Another model shape, another tokenizer, a path
that does not exist or --resume beside it: one-line errors.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import attrs
import numpy as np
import pytest
from mpi4py import MPI

from conftest import WORLD, assert_same_run, cli, one_error_line, serial_reference, small_run_config, train_records
from numesh.base.errors import ConfigError, UserError
from numesh.base.tree import tree_leaves_with_path
from numesh.checkpoint import export_hf, export_nanogpt, read_global_params
from numesh.run.train import Trainer, train


def _source(data: Path, out: Path) -> tuple[Path, Path, Path]:
    """A short float64 run with biases and its two exports: (checkpoint, hf dir, nanoGPT file)."""
    ckpt = train(small_run_config(data, out / "src", "", max_iters=2), MPI.COMM_SELF).checkpoint
    return Path(ckpt), export_hf(ckpt, out / "hf"), export_nanogpt(ckpt, out / "model.safetensors")


def _whole(trainer: Trainer) -> dict[str, np.ndarray]:
    from numesh.base.tree import tree_map
    from numesh.mesh import unshard

    return dict(tree_leaves_with_path(tree_map(lambda x, s: unshard(x, s, trainer.mesh), trainer.params,
                                               trainer.specs)))


def test_init_from_either_export_starts_from_its_exact_parameters(shared_dataset: Path, tmp_path: Path) -> None:
    ckpt, hf, file = _source(shared_dataset, tmp_path)
    _, _, want = read_global_params(ckpt)
    want = dict(tree_leaves_with_path(want))
    losses = []
    for src in (hf, file):
        trainer = Trainer(small_run_config(shared_dataset, tmp_path / "ft", "", init_from=str(src)), MPI.COMM_SELF)
        got = _whole(trainer)
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k][: want[k].shape[0]], want[k], err_msg=k)
        losses.append(trainer.train_step()[0])
    assert losses[0] == losses[1]


def test_init_from_refuses_what_does_not_fit(shared_dataset: Path, tmp_path: Path) -> None:
    from numesh.data.char import prepare_char_dataset
    from numesh.data.dataset import load_tokenizer

    _, hf, _ = _source(shared_dataset, tmp_path)
    chars = load_tokenizer(shared_dataset).chars
    other = "".join(chars).replace(chars[-1], "\u00e9")  # as many characters, one of them another
    prepare_char_dataset(other * 50, tmp_path / "other")
    cases = [
        (dict(n_layer=3), "has n_layer 2; this run 3: pass --n-layer 2$"),
        (dict(bias=False), "has bias True; this run False: pass --bias$"),
        (dict(data=str(tmp_path / "other")), "another tokenizer than --data's"),
        (dict(init_from=str(tmp_path / "nowhere")), "does not exist"),
        (dict(resume=str(tmp_path)), "--init-from and --resume both"),
    ]
    for kw, match in cases:
        kw = {"init_from": str(hf), **kw}
        cfg = small_run_config(kw.pop("data", shared_dataset), tmp_path / "ft", "", **kw)
        with pytest.raises(ConfigError, match=match):
            Trainer(cfg, MPI.COMM_SELF)


def test_init_from_names_every_shape_mismatch_at_once(shared_dataset: Path, tmp_path: Path) -> None:
    """A GPT-2 export against a run of another shape named only the first mismatched option
    per attempt (n_layer, then block_size, then n_embd: five runs to get through): one line
    names them all, and the options it gives start the run."""
    _, hf, file = _source(shared_dataset, tmp_path)
    for src in (hf, file):
        run = ["train", "--data", str(shared_dataset), "--init-from", str(src), "--n-layer", "5", "--block-size", "4",
               "--n-embd", "32", "--n-head", "4", "--no-bias", "--out", str(tmp_path / "cli"), "--max-iters", "0",
               "--eval-iters", "1", "--batch-size", "2", "--dtype", "float64"]
        line = one_error_line(cli(*run))
        assert line == (f"error: --init-from {src} has block_size 8, n_layer 2, n_embd 16, bias True; this run 4, 5, "
                        "32, False: pass --block-size 8 --n-layer 2 --n-embd 16 --bias")
        res = cli(*run, *line.split(": pass ")[1].split())  # the options given last win
        assert res.exit_code == 0, res.output
        assert (tmp_path / "cli" / "ckpt" / "latest" / "meta.json").is_file()
        shutil.rmtree(tmp_path / "cli")


def test_a_mesh_refusal_of_a_files_model_points_at_the_model_options(shared_dataset: Path, tmp_path: Path) -> None:
    """An export file's or a GPT-2 directory's model is the user's options (checked against
    the weights when read): an --n-layer that pp does not split is an option to fix, not a
    mesh to change, as it is for a Llama directory that sets the options itself."""
    from numesh.run.config import check_layout

    _, hf, file = _source(shared_dataset, tmp_path)
    for src in (hf, file):
        cfg = small_run_config(shared_dataset, tmp_path / "ft", "pp=2", init_from=str(src), n_layer=3)
        with pytest.raises(ConfigError, match="use an n_layer that is a multiple of 2"):
            check_layout(cfg, 2, 65)


def test_init_from_a_numesh_checkpoint_or_run_says_what_works(shared_dataset: Path, tmp_path: Path) -> None:
    """--init-from runs/x/ckpt/latest said it was not a transformers directory (no
    config.json): it names the checkpoint, --resume for it, and the export that --init-from
    reads; a run directory names its latest checkpoint."""
    run = tmp_path / "src"
    train(small_run_config(shared_dataset, run, "", max_iters=1), MPI.COMM_SELF)
    ckpt = run / "ckpt" / "latest"
    for source, kind in ((ckpt, "checkpoint"), (run, "run")):
        line = one_error_line(cli("train", "--data", str(shared_dataset), "--init-from", str(source), "--n-layer", "2",
                                  "--block-size", "8", "--n-embd", "16", "--n-head", "4", "--bias",
                                  "--out", str(tmp_path / "ft"), "--max-iters", "1"))
        assert line == (f"error: --init-from {source} is a numesh {kind}, not a transformers directory or a `numesh "
                        f"export` file: continue its run with --resume {ckpt}, or start a new run from its weights "
                        f"with `numesh export {ckpt} --out F.safetensors`, then --init-from F.safetensors")
        assert not (tmp_path / "ft").exists()


def test_the_weights_route_names_the_export_that_holds_the_model() -> None:
    """The route offered for a checkpoint's weights (--init-from one, or resuming with
    another optimiser) is the export its kind has: nanoGPT's file for GPT-2's kind,
    transformers' for Llama and Mixtral, none for a GPT-kind mixture of experts (both
    exports refuse it: the message had offered them)."""
    from numesh.checkpoint.hf import weights_route
    from numesh.nn.gpt import GPTConfig

    gpt = GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=16, block_size=8)
    llama = attrs.evolve(gpt, norm="rmsnorm", positions="rotary", mlp="swiglu", tie_embeddings=False)
    assert "`numesh export C --out F.safetensors`, then --init-from F.safetensors" in weights_route(gpt, "C")
    assert "`numesh export C --format hf --out DIR`, then --init-from DIR" in weights_route(llama, "C")
    assert "--format hf" in weights_route(attrs.evolve(llama, moe_experts=4), "C")  # a Mixtral
    assert weights_route(attrs.evolve(gpt, moe_experts=4), "C") == (
        "no export format holds its model (numesh resumes or samples it only)")


@pytest.mark.parametrize("name, text, says", [
    ("tokenizer.json", "{", "is not a transformers directory numesh reads (Expecting"),  # was a JSONDecodeError
    ("tokenizer.json", '{"model": 3}', "another tokenizer than --data's"),  # was an AttributeError
    ("config.json", "[]", "config.json is not a JSON object"),  # was an AttributeError
])
def test_a_broken_transformers_directory_is_one_line(shared_dataset: Path, tmp_path: Path, name: str, text: str,
                                                    says: str) -> None:
    _, hf, _ = _source(shared_dataset, tmp_path)
    (hf / name).write_text(text)
    with pytest.raises(UserError, match=re.escape(says)):
        Trainer(small_run_config(shared_dataset, tmp_path / "ft", "", init_from=str(hf)), MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mesh", ["tp=2", "pp=2"])
def test_init_from_on_a_mesh_equals_one_rank(shared_dataset: Path, shared_tmp: Path, mesh: str) -> None:
    if WORLD.Get_size() != 2:
        pytest.skip("the tp=2 and pp=2 meshes run on 2 ranks")
    hf = shared_tmp / f"init-{mesh}" / "hf"
    if WORLD.Get_rank() == 0:
        _source(shared_dataset, shared_tmp / f"init-{mesh}")
    WORLD.Barrier()
    kw = dict(micro_batches=2) if mesh == "pp=2" else {}
    cfg = small_run_config(shared_dataset, shared_tmp / f"init-{mesh}" / "ft", mesh, init_from=str(hf), **kw)
    got = train_records(cfg, WORLD)
    assert_same_run(got, serial_reference(attrs.evolve(cfg, micro_batches=1)))


@pytest.mark.parametrize("cls", ["GPT2Model", "GPT2LMHeadModel"])
def test_init_from_a_gpt2_transformers_saved(shared_dataset: Path, tmp_path: Path, cls: str) -> None:
    """A fresh GPT-2 saved by transformers itself: GPT2Model's tensors have no `transformer.`
    prefix (refused: "has no tensor 'transformer.wte.weight'"), and a fresh model's biases
    are all zero (read as a model without biases, so a --bias run was refused and a run
    without them dropped them). Both forms now load, with biases, and compute what
    transformers computes."""
    try:
        import torch
        import transformers
    except ImportError:
        pytest.fail("this test saves a GPT-2 with transformers itself: pip install torch==2.13.0 transformers==5.24.0")
    from conftest import self_mesh
    from numesh.checkpoint.hf import import_hf
    from numesh.data.dataset import load_tokenizer
    from numesh.nn.layers import layernorm_fwd
    from numesh.nn.transformer import block_fwd, embed_fwd

    tok = load_tokenizer(shared_dataset)
    config = transformers.GPT2Config(vocab_size=len(tok.chars), n_positions=8, n_embd=16, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    theirs = getattr(transformers, cls)(config).eval()
    hf = tmp_path / "hf"
    theirs.save_pretrained(hf)
    (hf / "tokenizer.json").write_text(tok.to_hf_json())

    trainer = Trainer(small_run_config(shared_dataset, tmp_path / "ft", "", init_from=str(hf)), MPI.COMM_SELF)
    assert trainer.params.blocks[0].attn.qkv.b is not None  # a --bias run takes it, biases and all
    with pytest.raises(ConfigError, match="has bias True; this run False: pass --bias$"):
        Trainer(small_run_config(shared_dataset, tmp_path / "ft2", "", init_from=str(hf), bias=False), MPI.COMM_SELF)

    model, _, params = import_hf(hf)
    idx = np.arange(16).reshape(2, 8) % len(tok.chars)
    x, _ = embed_fwd(params, idx, model, self_mesh())
    for layer, bp in enumerate(params.blocks):
        x, _ = block_fwd(bp, x, model, self_mesh(), layer)
    ours = layernorm_fwd(params.ln_f, x)[0] @ params.wte.T
    with torch.no_grad():
        out = theirs(torch.tensor(idx))
        want = (out.logits if cls == "GPT2LMHeadModel" else out.last_hidden_state @ theirs.wte.weight.T).numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)


def test_a_numesh_export_without_biases_is_still_read_without_them(shared_dataset: Path, tmp_path: Path) -> None:
    """GPT-2 always has biases, so the export writes zeros where numesh has none and says so
    in config.json (`numesh_bias`): that export starts a run without biases, not one with."""
    ckpt = train(small_run_config(shared_dataset, tmp_path / "src", "", max_iters=1, bias=False),
                 MPI.COMM_SELF).checkpoint
    hf = export_hf(ckpt, tmp_path / "hf")
    trainer = Trainer(small_run_config(shared_dataset, tmp_path / "ft", "", init_from=str(hf), bias=False),
                      MPI.COMM_SELF)
    assert trainer.params.blocks[0].attn.qkv.b is None
    with pytest.raises(ConfigError, match="has bias False; this run True: pass --no-bias$"):
        Trainer(small_run_config(shared_dataset, tmp_path / "ft2", "", init_from=str(hf)), MPI.COMM_SELF)
