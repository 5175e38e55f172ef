"""Peak memory of `--init-from` a ~1 GB transformers Llama directory (issue 41).

Writes a float32 Llama of 245 M parameters (0.98 GB: 16 layers x 1024, 16 heads, 4 kv heads,
SwiGLU 2816, vocabulary 32,000, untied head) as transformers lays it out, in 3 safetensors
shards with an index, streaming one tensor at a time (random values; nothing here needs
transformers). Then, in fresh processes, times nothing and measures each rank's peak RSS
(`ru_maxrss`) around `numesh.checkpoint.init_from.initial_shards`, what `numesh train
--init-from` runs: on 1 rank (its shards are the whole model) and on tp=2 and pp=2 under
mpiexec (each rank's shards about half). The model's bytes and its largest tensor are
printed beside: a rank must hold no more than its shards and about one tensor more.

    python benchmarks/bench_import_memory.py [--dir /tmp/numesh-1gb]
"""

from __future__ import annotations

import argparse
import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPE = dict(vocab=32000, C=1024, layers=16, heads=16, kv=4, F=2816)


def tensors() -> dict[str, tuple[int, ...]]:
    """transformers' names and [out, in] shapes of the model."""
    V, C, L, kv, F = SHAPE["vocab"], SHAPE["C"], SHAPE["layers"], SHAPE["kv"] * SHAPE["C"] // SHAPE["heads"], SHAPE["F"]
    out = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for i in range(L):
        h = f"model.layers.{i}."
        out.update({h + "input_layernorm.weight": (C,), h + "post_attention_layernorm.weight": (C,),
                    h + "self_attn.q_proj.weight": (C, C), h + "self_attn.k_proj.weight": (kv, C),
                    h + "self_attn.v_proj.weight": (kv, C), h + "self_attn.o_proj.weight": (C, C),
                    h + "mlp.gate_proj.weight": (F, C), h + "mlp.up_proj.weight": (F, C),
                    h + "mlp.down_proj.weight": (C, F)})
    return out


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> None:
    """One safetensors file, its tensors generated and written one at a time."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            (rng.standard_normal(shape, dtype=np.float32) * 0.02).tofile(f)


def write_model(d: Path) -> None:
    from tokenizers import Tokenizer, models

    d.mkdir(parents=True, exist_ok=True)
    names = list(tensors().items())
    parts = [dict(names[i::3]) for i in range(3)]
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        write_shard(d / file, part, rng)
        weight_map.update(dict.fromkeys(part, file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": SHAPE["vocab"], "hidden_size": SHAPE["C"],
        "intermediate_size": SHAPE["F"], "num_hidden_layers": SHAPE["layers"], "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": SHAPE["kv"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "eos_token_id": 1}))
    vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, SHAPE["vocab"])}}
    (d / "tokenizer.json").write_text(Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).to_str())


def measure(d: Path, mesh: str) -> None:
    """One rank's peak RSS before and after reading its shards (printed as JSON)."""
    from mpi4py import MPI

    from numesh.base.tree import tree_leaves
    from numesh.checkpoint.hf_llama import pretrained
    from numesh.checkpoint.init_from import initial_shards
    from numesh.data.tokenizer import HFTokenizer
    from numesh.mesh import Mesh
    from numesh.pipeline.stages import StageLayout

    model = pretrained(d).model(256)
    tok = HFTokenizer((d / "tokenizer.json").read_text(), "</s>")
    m = Mesh.parse(mesh, MPI.COMM_WORLD)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    shards = initial_shards(d, model, tok, m, StageLayout(model.n_layer, m.size("pp"), 1), np.float32)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    held = sum(x.nbytes for x in tree_leaves(shards)) / 2**20
    print(json.dumps({"mesh": mesh or "1 rank", "rank": m.world.Get_rank(), "rss_before_mb": round(before),
                      "peak_mb": round(peak), "shards_mb": round(held),
                      "peak_minus_before_minus_shards_mb": round(peak - before - held)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/numesh-1gb-llama")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    d = Path(args.dir)
    if args.measure is not None:
        return measure(d, args.measure)
    if not (d / "config.json").exists():
        write_model(d)
    sizes = {n: int(np.prod(s)) * 4 for n, s in tensors().items()}
    print(f"model: {sum(sizes.values()) / 2**20:.0f} MiB in {len(sizes)} tensors, the largest "
          f"{max(sizes.values()) / 2**20:.0f} MiB", flush=True)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    for n, mesh in ((1, ""), (2, "tp=2"), (2, "pp=2")):
        cmd = [sys.executable, __file__, "--dir", str(d), "--measure", mesh]
        subprocess.run([mpiexec, "-n", str(n), *cmd] if n > 1 else cmd, check=True)


if __name__ == "__main__":
    main()
