"""What the benchmark scripts share: where the corpus is, a temporary dataset made from it,
and the model presets of the default and baby nanoGPT runs.

Importing this module has no side effect (the scripts import numesh first themselves, for
its OpenBLAS set-up); numesh is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# ../shared beside the repository, whatever the working directory
DEFAULT_SRC = str(Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt")

# Model and batch of each preset (the optimiser hyper-parameters are TrainConfig's defaults,
# which are nanoGPT's Shakespeare-char ones: lr 1e-3, betas (0.9, 0.99), wd 0.1, clip 1.0).
PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's "I only have a macbook" Shakespeare-char quick start
    "default": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12),
    # nanoGPT's train_shakespeare_char.py ("baby GPT")
    "baby": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=12),
}

# SmolLM2-135M's block (HuggingFaceTB/SmolLM2-135M's config.json) as `numesh train` options:
# 576 wide, 9 query heads sharing 3 key/value heads, SwiGLU of 1,536, RMSNorm eps 1e-5,
# rotary theta 1e5, the LM head tied to the embedding, no biases. Its 30 layers are cut to
# what a benchmark can step (bench_llama.py's --layers).
SMOLLM2 = dict(arch="llama", n_embd=576, n_head=9, n_kv_head=3, ffn_hidden=1536, norm="rmsnorm", norm_eps=1e-5,
               positions="rotary", rope_theta=1e5, mlp="swiglu", tie_embeddings=True, bias=False, dropout=0.0)
# Llama-family presets of the numesh-only scripts (profile_train.py); the nanoGPT ones above
# are also the PyTorch reference model's (bench_train.py), which has no Llama block.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-4": dict(SMOLLM2, n_layer=4, block_size=512, batch_size=4),  # bench_llama.py's first row
}


@contextlib.contextmanager
def dataset_dir(data: str | None, src: str, comm: Any = None,
                log: Callable[[str], None] | None = None) -> Iterator[str]:
    """Yield a dataset directory: `data` if it holds a prepared dataset (`numesh data`), else
    a temporary one prepared from the text file `src` and removed afterwards.

    With an MPI communicator `comm`, rank 0 prepares it and every rank gets its path; it is
    removed after a barrier when the block ends normally, and left behind when it raises
    (another rank may be inside a collective then, and a barrier would hang: the script's
    `numesh.host.runtime.guarded` aborts the job instead). `log` gets one line about what was done
    (on rank 0)."""
    if data is not None and (Path(data) / "meta.json").is_file():
        yield str(data)
        return
    root = comm is None or comm.Get_rank() == 0
    tmp = None
    if root:
        from numesh.data.char import prepare_char_dataset, read_source

        if data is not None and log is not None:
            log(f"note: no dataset at {data}; preparing a temporary one from {src}")
        tmp = tempfile.mkdtemp(prefix="numesh-bench-")
        try:
            info = prepare_char_dataset(read_source(src), tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if log is not None:
            log(f"prepared {info['train_tokens']:,} train tokens (vocab {info['vocab_size']}) in {tmp}")
    if comm is not None:
        tmp = comm.bcast(tmp, root=0)
    if comm is None or comm.Get_size() == 1:
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    yield tmp
    comm.Barrier()
    if root:
        shutil.rmtree(tmp, ignore_errors=True)
