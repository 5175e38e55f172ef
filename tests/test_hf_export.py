"""`numesh export --format hf`: a directory Hugging Face transformers loads offline, with no
custom code, that computes what numesh computes.

For a character run and a BPE run: `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`
load the export; transformers' logits on a validation batch equal numesh's forward to 1e-4
(float32); its greedy `generate` gives the text `numesh sample --temperature 0` gives; the
tokenizers agree on every validation document's ids. Runs when transformers (and torch)
are installed: `.ci/run` installs them.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import cli, one_error_line, self_mesh
from numesh.data.corpus import Reading
from numesh.data.dataset import load_split, load_tokenizer
from numesh.data.sharded import prepare_bpe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TRAIN = ["--max-iters", "30", "--eval-iters", "1", "--eval-interval", "30", "--block-size", "32", "--batch-size", "4",
         "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--learning-rate", "3e-3", "--bias"]


def _numesh_logits(ckpt: Path, idx: np.ndarray) -> np.ndarray:
    """numesh's forward on one rank: logits [B, T, V] of token ids idx [B, T]."""
    from numesh.checkpoint import read_global_params
    from numesh.nn.layers import layernorm_fwd
    from numesh.nn.transformer import block_fwd, embed_fwd

    model, _, params = read_global_params(ckpt)
    mesh = self_mesh()
    x, _ = embed_fwd(params, idx, model, mesh)
    for layer, bp in enumerate(params.blocks):
        x, _ = block_fwd(bp, x, model, mesh, layer)
    xf, _ = layernorm_fwd(params.ln_f, x)
    return xf @ params.wte.T


def _trained(data: Path, out: Path) -> Path:
    res = cli("train", "--data", str(data), "--out", str(out), *TRAIN)
    assert res.exit_code == 0, res.stderr
    return out / "ckpt" / "latest"


@pytest.fixture(params=["char", "bpe"])
def run(request, char_dataset: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(checkpoint, dataset) of a short run on a character or a BPE dataset."""
    data = char_dataset
    if request.param == "bpe":
        text = (char_dataset.parent / "corpus.txt")
        tok = load_tokenizer(char_dataset)
        ids = np.concatenate([np.asarray(load_split(char_dataset, s)) for s in ("train", "val")])
        text.write_text(tok.decode(ids), encoding="utf-8")
        data = tmp_path / "bpe"
        prepare_bpe([text], 300, data, Reading(split_on="\n"), val_fraction=0.2)
    return _trained(data, tmp_path / "run"), data


def test_transformers_loads_the_export_and_computes_the_same(run: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, data = run
    res = cli("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert res.exit_code == 0, res.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu_new"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    ours = load_tokenizer(data)

    val = np.asarray(load_split(data, "val"))
    idx = np.stack([val[i * 32:(i + 1) * 32] for i in range(3)]).astype(np.int64)  # a validation batch
    with torch.no_grad():
        theirs = model(torch.tensor(idx)).logits.numpy()
    np.testing.assert_allclose(theirs, _numesh_logits(ckpt, idx), rtol=1e-4, atol=1e-4)

    text = ours.decode(val[:200])
    assert hf_tok(text)["input_ids"] == ours.encode(text).tolist()
    assert hf_tok.decode(ours.encode(text)) == text

    prompt = ours.decode(val[:5])
    ids = torch.tensor([ours.encode(prompt).tolist()])
    # a sample ends at the end-of-text token as generate ends it (the export's eos), or runs on
    for flags, eos in (([], {}), (["--ignore-eos"], {"eos_token_id": None})):
        res = cli("sample", "--ckpt", str(ckpt), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0",
                  *flags)
        assert res.exit_code == 0, res.stderr
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, **eos)
        assert hf_tok.decode(out[0]) == res.stdout.rstrip("\n")
        # the export itself samples as its checkpoint does (`numesh sample --ckpt DIR`)
        again = cli("sample", "--ckpt", str(tmp_path / "hf"), "--prompt", prompt, "--max-new-tokens", "12",
                    "--temperature", "0", *flags)
        assert again.exit_code == 0, again.stderr
        assert again.stdout == res.stdout


def test_hf_export_refuses_a_file_or_a_full_directory(run: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, _ = run
    (tmp_path / "f").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    for out, match in [(tmp_path / "f", "is a file"), (tmp_path / "full", "is not empty")]:
        res = cli("export", str(ckpt), "--format", "hf", "--out", str(out))
        assert res.exit_code == 2 and match in res.stderr
    assert cli("export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "full"), "--force").exit_code == 0
    res = cli("export", str(ckpt), "--format", "onnx", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2 and "--format must be nanogpt or hf" in res.stderr


def test_hf_export_force_refuses_another_runs_directory_or_checkpoint(run: tuple[Path, Path], tmp_path: Path) -> None:
    """--force replaces a model's files in a directory: in another numesh run's directory it
    replaced the run's config.json (its options, its hyper-parameter changes) with a
    transformers config."""
    import shutil

    ckpt, _ = run
    other = tmp_path / "other"
    shutil.copytree(Path(ckpt).resolve().parents[1], other, symlinks=True)
    config = (other / "config.json").read_text()
    step = other / "ckpt" / Path(ckpt).resolve().name
    for out, what in ((other, "a numesh run's directory"), (step, "a numesh checkpoint")):
        res = cli("export", str(ckpt), "--format", "hf", "--out", str(out), "--force")
        assert res.exit_code == 2 and f"--out {out} is {what}, whose files an export would replace" in res.stderr
    assert (other / "config.json").read_text() == config


@pytest.mark.parametrize("run", ["char"], indirect=True)
def test_hf_export_on_a_full_disk_leaves_nothing_and_the_rerun_needs_no_force(
        run: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills half-way through the weights: the partial temporary file kept the
    disk full and the export directory non-empty, so the rerun demanded --force. Now the
    error says in one line that the disk is full, nothing is left behind (not even the
    directory the export created), and a --force export over an older one keeps the old
    files whole."""
    ckpt, _ = run
    real = Path.write_bytes

    def fills_up(self: Path, data: bytes) -> int:
        real(self, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    out = tmp_path / "exports" / "hf"
    with monkeypatch.context() as m:
        m.setattr(Path, "write_bytes", fills_up)
        res = cli("export", str(ckpt), "--format", "hf", "--out", str(out))
    assert res.exit_code == 2
    assert one_error_line(res) == (f"error: cannot write {out}: No space left on device, the disk is full; "
                                   "nothing of this export was left there")
    assert not out.exists() and list((tmp_path / "exports").iterdir()) == []
    assert cli("export", str(ckpt), "--format", "hf", "--out", str(out)).exit_code == 0  # no --force asked

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with monkeypatch.context() as m:
        m.setattr(Path, "write_bytes", fills_up)
        res = cli("export", str(ckpt), "--format", "hf", "--out", str(out), "--force")
    assert res.exit_code == 2 and "the disk is full" in one_error_line(res)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temp file, the old export whole
