"""Text generation from a trained checkpoint, on any tensor-parallel mesh.

Every rank computes the same full-vocabulary logits (gathered over tp) and draws from
the same random stream, so all ranks agree on every token without extra communication.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Callable, Collection

import attrs
import numpy as np
from mpi4py import MPI

from numesh.base.errors import CheckpointError, ConfigError, check_path, check_scalar
from numesh.base.files import json_object_or_none
from numesh.base.tree import tree_leaves_with_path, tree_map
from numesh.checkpoint import import_nanogpt, read_global
from numesh.checkpoint.format import checkpoint_path
from numesh.checkpoint.hf_files import open_weights, weights_dtype
from numesh.checkpoint.hf_llama import check_has_config, is_pretrained_dir, model_type, pieces, read_pretrained
from numesh.checkpoint.hf_source import generation_ids, max_positions, recorded_source
from numesh.checkpoint.model import shard_params
from numesh.data.tokenizer import CharTokenizer, HFTokenizer, directory_tokenizer, read_tokenizer_file
from numesh.mesh import Mesh
from numesh.mesh.mesh import parse_axis_sizes
from numesh.nn.decode import logits_cached, logits_last, new_kv_cache
from numesh.nn.gpt import GPT, GPTConfig
from numesh.nn.inputs import check_inputs

__all__ = ["Checkpoint", "CheckpointError", "SampleConfig", "generate", "load_checkpoint", "sample"]


@attrs.frozen
class Checkpoint:
    """A checkpoint loaded whole for generation (`load_checkpoint`): whatever mesh wrote it,
    its parameters are the global arrays, ready to shard onto any mesh.

    Attributes:
        model: the model's shape.
        tokenizer: the tokenizer of the dataset it was trained on.
        params: global arrays, vocabulary unpadded.
        dtype: the parameters' dtype name (float32 or float64).
        step: the training step it was saved at (0 for a transformers directory).
        max_positions: the longest context its positions allow when that is more than
            `model.block_size` (a rotary model from a transformers directory, or a run
            fine-tuned from one: its source's), else None.
        stop: the ids that end a sample, as transformers' `generate` stops at its
            generation config's eos_token_id (`stop_ids`); () for a character model.
    """

    model: GPTConfig
    tokenizer: CharTokenizer | HFTokenizer
    params: GPT
    dtype: str
    step: int
    max_positions: int | None = None
    stop: tuple[int, ...] = ()


NO_CP = "sampling does not run with context parallelism: use a mesh without cp, e.g. --mesh tp=N"
NO_SP = "generation does not use sequence parallelism: make its mesh without sequence_parallel"

def load_checkpoint(path: str | Path, comm: MPI.Comm | None = None) -> Checkpoint:
    """Whole parameters of a checkpoint directory (e.g. RUN/ckpt/latest), of a `numesh
    export`ed nanoGPT .safetensors file or of a transformers directory (no pickle any way).
    With `comm`, every rank of it gets the same step of a checkpoint directory (a collective)."""
    p = checkpoint_path(path)  # None or '' (the current directory) is one line
    if is_pretrained_dir(p):
        return load_pretrained(p)
    check_has_config(p)  # a transformers directory without config.json: not "meta.json is missing"
    source = None
    if p.is_file() or p.suffix == ".safetensors":
        model, tok, params, dtype, step = import_nanogpt(p)
        fix = "export it again from a checkpoint that records its dataset's tokenizer"
    else:
        meta, params = read_global(p, comm)  # one step directory, even while a job moves `latest` on
        model, tok, dtype, step = meta.model, meta.tokenizer(), meta.dtype, meta.step
        source = recorded_source(meta.raw, meta.root)
        fix = (f"save it again with its dataset's tokenizer: `numesh train --resume {p} --data DATASET "
               f"--max-iters {step} --out NEW_RUN`")
    if tok is None:
        raise CheckpointError(f"{p} holds no tokenizer, so its token ids cannot be turned into text: {fix}")
    eot = tok.eot_id if isinstance(tok, HFTokenizer) else None
    # a run from a transformers directory ends samples where its source's generate would; one
    # from scratch at its dataset's end-of-text token, which ends each of its documents
    stop = stop_ids(generation_ids(source, eot).get("eos_token_id"), tok.vocab_size)
    # and takes its source's context, as its export and transformers do (rotary positions have
    # no table to outgrow); a run from scratch knows only the block size it trained at
    longest = max_positions(source, model.block_size) if source and model.positions == "rotary" else None
    return Checkpoint(model, tok, params, dtype, step, max_positions=longest, stop=stop)


def stop_ids(eos: Any, tokens: int) -> tuple[int, ...]:
    """The ids an eos_token_id entry names (an int, a list of them, or None), sorted, those
    a tokenizer of `tokens` entries can produce: `generate` never draws the others."""
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(sorted({i for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tokens}))


def directory_stop(directory: Path, tokens: int) -> tuple[int, ...]:
    """The eos ids transformers' `generate` stops at for a model directory: its
    generation_config.json's where it has one (none if that file names none), else
    config.json's, from which transformers builds the generation config it lacks."""
    obj = json_object_or_none(directory / "generation_config.json")
    if obj is None:
        obj = json_object_or_none(directory / "config.json") or {}
    return stop_ids(obj.get("eos_token_id"), tokens)


# a transformers model's context as generation holds it: its max_position_embeddings, at most
# this (the KV cache is [layers, batch, kv heads, context, head size]; Llama 3.2's 131,072
# positions would be 16 GiB of it). `sample` widens it to what a prompt and its tokens need.
PRETRAINED_CONTEXT = 2048


def load_pretrained(directory: Path) -> Checkpoint:
    """A transformers directory (Llama, Mistral, Mixtral or GPT-2) as a checkpoint for
    generation, its tokenizer.json (ending documents with the directory's eos token) with
    it; float64 weights stay float64, any other float32. The model may have more rows than
    the tokenizer has entries (a padded embedding): `sample` never draws those ids."""
    from numesh.checkpoint.hf import import_hf

    if model_type(directory) == "gpt2":
        model, text, params = import_hf(directory)
        tok = CharTokenizer.from_hf_json(text) or HFTokenizer.from_json(text, directory / "tokenizer.json", None)
        ck = Checkpoint(model, tok, params, params.wte.dtype.name, 0)
    else:
        dtype = np.float64 if weights_dtype(open_weights(directory)) == "float64" else np.float32
        pre, model, params = read_pretrained(directory, dtype, 1)
        model = attrs.evolve(model, block_size=min(pre.max_positions, PRETRAINED_CONTEXT))
        ck = Checkpoint(model, _pretrained_tokenizer(directory), params, np.dtype(dtype).name, 0, pre.max_positions)
    ck = attrs.evolve(ck, stop=directory_stop(directory, ck.tokenizer.vocab_size))
    rows = ck.model.vocab_size
    if ck.tokenizer.vocab_size > rows:
        raise CheckpointError(f"{directory}: its tokenizer.json has {ck.tokenizer.vocab_size} entries but "
                              f"config.json's vocab_size is only {rows}: ids from {rows} on have no embedding row; "
                              "use the model's own tokenizer.json and config.json")
    return ck


def _pretrained_tokenizer(directory: Path) -> CharTokenizer | HFTokenizer:
    """A Llama-family directory's tokenizer.json: a character model's export's vocabulary,
    or a Hugging Face tokenizer ending documents with the directory's eos token. Without
    one, one line saying to copy it there (sample has no option naming a tokenizer)."""
    file = directory_tokenizer(directory, "it turns the prompt into token ids and the samples back into text; "
                                          "copy the model's tokenizer.json into it from its source", CheckpointError)
    text = read_tokenizer_file(file)  # once: the character check and the tokenizer read the same text
    return CharTokenizer.from_hf_json(text) or HFTokenizer.from_json(text, file, None)


def pick(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
    """Next token per row: argmax when temperature is 0, else a draw from the tempered top-k softmax."""
    if temperature == 0.0:
        return logits.argmax(axis=-1)
    # the largest logit subtracted before dividing: a tiny temperature (1e-320) then sends the
    # others to -inf and keeps the best at 0, where dividing first made inf - inf = NaN and a
    # draw of token 0 (a newline, for a character model), whatever the logits
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        z /= temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((z.shape[0], 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), z.shape[-1] - 1)


def _check_settings(max_new_tokens: int, temperature: float, top_k: int | None, seed: int,
                    tokens: int | None) -> None:
    """One ConfigError line for a `generate` setting of the wrong type or range (numpy's
    own errors for them were a TypeError deep in a draw, or nothing: a negative count
    returned the prompt)."""
    counts = {"max_new_tokens": (max_new_tokens, 0), "seed": (seed, 0), "top_k": (top_k, 1), "tokens": (tokens, 1)}
    for name, (value, least) in counts.items():
        if value is None and name in ("top_k", "tokens"):
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ConfigError(f"{name} must be an int, got {value!r}")
        if value < least:
            raise ConfigError(f"{name} must be >= {least}, got {value}")
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature must be >= 0 and finite (a number), got {temperature!r}")


def generate(
    params: GPT,
    model: GPTConfig,
    mesh: Mesh,
    prompt: np.ndarray,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 200,
    seed: int = 1337,
    kv_cache: bool = True,
    tokens: int | None = None,
    stop: Collection[int] = (),
    on_token: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """Extend `prompt` [B, T0] by `max_new_tokens` tokens; the context is the last block_size tokens.
    Only ids below `tokens` are drawn (None: every id of the model): a tokenizer may have
    fewer entries than a padded embedding has rows, and the ids past it mean no text.

    A row that draws one of the `stop` ids (transformers' eos_token_id) ends there, as
    `generate` ends it: its later columns repeat that id, and generation ends when every
    row has ended, so fewer columns may come back. The draws are those without `stop` up to
    there. `on_token` is called with the ids so far [B, T0 + n] after each new token (to
    show a sample as it grows).

    With the KV cache each new token costs one position until the context is full; after
    that the window slides and, positions being absolute, the window is recomputed. A
    ConfigError line for params not of `model` and `mesh`, or a prompt that is not int ids
    [B, T] in [0, vocab_size)."""
    _check_settings(max_new_tokens, temperature, top_k, seed, tokens)
    if mesh.size("cp") > 1:  # the prompt was read as zigzag chunks: a broadcast error deep in the model
        raise ConfigError(NO_CP)
    if mesh.sequence_parallel:  # before check_inputs, whose T check would ask for another prompt length
        raise ConfigError(NO_SP)
    idx, _ = check_inputs(params, prompt, None, model, mesh, "prompt")
    idx = idx.copy() if idx is prompt else idx  # what is returned is never the caller's array
    rng = np.random.default_rng(seed)
    # generation runs dropless: a capacity ranks a whole sequence's tokens, later ones
    # included, which a token generated one at a time cannot see (docs/moe.md)
    model = attrs.evolve(model, moe_capacity_factor=0.0)
    bs = model.block_size
    cache = new_kv_cache(model, mesh, idx.shape[0], params.wte.dtype) if kv_cache else None
    ends = _stop_array(stop)
    ended = np.zeros(idx.shape[0], bool)
    for _ in range(max_new_tokens):
        if cache is None:
            logits = logits_last(params, idx[:, -bs:], model, mesh)
        elif cache.length == 0 or cache.length >= bs:
            cache.length = 0
            logits = logits_cached(params, idx[:, -bs:], cache, model, mesh)
        else:
            logits = logits_cached(params, idx[:, -1:], cache, model, mesh)
        nxt = pick(logits[:, :tokens], temperature, top_k, rng)
        nxt = np.where(ended, idx[:, -1], nxt)  # an ended row repeats its stop id
        idx = np.concatenate([idx, nxt[:, None]], axis=1)
        if on_token is not None:
            on_token(idx)
        ended |= np.isin(nxt, ends)
        if ended.all():
            break
    return idx


def _stop_array(stop: Collection[int]) -> np.ndarray:
    """`generate`'s stop ids as an int array; one line for anything but ints."""
    ids = list(stop) if isinstance(stop, Collection) and not isinstance(stop, (str, bytes)) else None
    if ids is None or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"stop must be a collection of token ids (ints), got {stop!r}")
    return np.asarray(ids, np.int64)


@attrs.frozen
class SampleConfig:
    """What `numesh sample` asks for; `validate` checks it before any file is read.

    Attributes:
        ckpt: a checkpoint directory (e.g. runs/x/ckpt/latest), a `numesh export`ed
            .safetensors file or a transformers model directory (`load_pretrained`).
        prompt: the text to continue (`prompt_ids`: empty is the tokenizer's start token alone).
        max_new_tokens: tokens to generate.
        temperature: the softmax temperature; 0 = greedy.
        top_k: sample among the k most likely tokens; None = all.
        seed: the random seed of the draws (sample i uses seed + i).
        num_samples: independent samples.
        mesh: a tensor-parallel mesh, e.g. tp=2 (under mpirun); "" = one rank.
        kv_cache: reuse the keys and values of earlier positions instead of recomputing them.
        ignore_eos: draw all `max_new_tokens` tokens, past the end-of-sequence token where
            a sample otherwise ends (`Checkpoint.stop`), as transformers' `generate` does.
    """

    ckpt: str
    prompt: str = "\n"
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = 200
    seed: int = 1337
    num_samples: int = 1
    mesh: str = ""
    kv_cache: bool = True
    ignore_eos: bool = False

    def validate(self) -> None:
        self._validate_types()
        try:  # a shell's bytes that are no UTF-8 reach Python as lone surrogates, which no tokenizer takes
            self.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = self.prompt[e.start].encode("utf-8", "surrogateescape")
            raise ConfigError(f"--prompt is not UTF-8 text (byte 0x{bad.hex()} at character {e.start}): "
                              "pass the prompt in UTF-8") from None
        if self.max_new_tokens < 0:
            raise ConfigError(f"--max-new-tokens must be >= 0, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ConfigError(f"--num-samples must be >= 1, got {self.num_samples}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN compares False: check it too
            raise ConfigError(f"--temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"--top-k must be >= 1 (0 on the command line, None in SampleConfig: all), "
                              f"got {self.top_k}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be >= 0, got {self.seed}")
        sizes = parse_axis_sizes(self.mesh or "")
        if sizes.get("cp", 1) != 1:  # generation adds one token at a time: nothing to split
            raise ConfigError(NO_CP)
        if any(sizes.get(a, 1) != 1 for a in ("pp", "dp", "ep")):  # before the rank count, which would say "mpirun"
            raise ConfigError("sampling runs on a tensor-parallel mesh only: use --mesh tp=N")


    def _validate_types(self) -> None:
        """Each count an integer (top_k=2.5 sampled among 2.5 tokens), the temperature a
        number (a string was a TypeError in the range check), mesh a string."""
        for name in ("max_new_tokens", "seed", "num_samples") + (("top_k",) if self.top_k is not None else ()):
            check_scalar(f"--{name.replace('_', '-')}", getattr(self, name), int)
        t = self.temperature
        if not isinstance(t, numbers.Real) or isinstance(t, bool):  # NaN is a number: refused below, with the range
            raise ConfigError(f"--temperature must be a number, got {t!r}")
        check_path("--ckpt", self.ckpt, hint="pass a checkpoint directory, export file or transformers directory")
        check_scalar("--mesh", self.mesh or "", str)
        check_scalar("--prompt", self.prompt, str)
        check_scalar("kv_cache", self.kv_cache, bool)
        check_scalar("ignore_eos", self.ignore_eos, bool)


def prompt_ids(tok: CharTokenizer | HFTokenizer, prompt: str) -> np.ndarray:
    """`prompt`'s ids as the model's tokenizer gives them by default: a Hugging Face
    tokenizer's within its template's special tokens (Llama's BOS first), as transformers'
    `tokenizer(prompt)` and so `generate` have them; a character vocabulary's as they are.
    An empty prompt is then the template's start token alone, from which the model samples
    as from a document's start; with no template it is refused: no token to start from."""
    ids = tok.encode_default(prompt) if isinstance(tok, HFTokenizer) else tok.encode(prompt)
    if ids.size == 0:
        raise ConfigError(f"the prompt {prompt!r} gives no tokens and its tokenizer adds no start token: "
                          "pass at least one character with --prompt")
    return ids


def shown(tok: CharTokenizer | HFTokenizer, ids: np.ndarray) -> str:
    """The text of a sample's `ids` (`prompt_ids`' then the generated), without the start
    tokens the template put before the prompt: the prompt as typed, then its continuation."""
    start = tok.template[0] if isinstance(tok, HFTokenizer) else ()
    skip = len(start) if tuple(int(i) for i in ids[:len(start)]) == start else 0
    return tok.decode(ids[skip:])


def check_split(model: GPTConfig, tp: int) -> None:
    """A ConfigError when `model` does not split over `tp`, naming the tp sizes that do:
    sampling changes the mesh, never the model (train's fix, --ffn-hidden, is no option here)."""
    model.check_tp_of_fixed_model(tp, "sample on another mesh, --mesh tp=N with N {sizes} (and as many ranks)")


SEPARATOR = "\n---------------\n"  # between samples, as `numesh sample` prints them


def sample(cfg: SampleConfig, comm: MPI.Comm | None = None,
           show: Callable[[str], None] | None = None) -> list[str]:
    """Generate `num_samples` texts (prompt included, as `shown`) from a checkpoint, the
    prompt's ids as its tokenizer gives them by default (`prompt_ids`), each ending at the
    checkpoint's end-of-sequence token (`Checkpoint.stop`) unless `cfg.ignore_eos`. `show`
    is handed the text as it grows, SEPARATOR between samples (what `numesh sample` prints)."""
    cfg.validate()
    ck = load_checkpoint(cfg.ckpt, MPI.COMM_WORLD if comm is None else comm)  # every rank the same step
    prompt = prompt_ids(ck.tokenizer, cfg.prompt)[None, :]
    mesh = Mesh.parse(cfg.mesh, comm)
    if mesh.size(("pp", "dp", "ep")) > 1:
        raise ConfigError("sampling runs on a tensor-parallel mesh only: use --mesh tp=N")
    check_split(ck.model, mesh.size("tp"))
    check_weights_finite(ck.params, ck.model, cfg.ckpt)
    dtype = np.float64 if ck.dtype == "float64" else np.float32
    params = shard_params(tree_map(lambda x: x.astype(dtype), ck.params), ck.model, mesh)
    model = ck.model
    if ck.max_positions is not None:  # rotary: the context may grow to what the prompt and its tokens need
        need = min(ck.max_positions, prompt.shape[1] + cfg.max_new_tokens)
        model = attrs.evolve(model, block_size=max(model.block_size, need))
    out = []
    for i in range(cfg.num_samples):
        growing = None if show is None else _Growing(ck.tokenizer, show)
        if show is not None and i:
            show(SEPARATOR)
        if growing is not None:
            growing(prompt)
        ids = generate(params, model, mesh, prompt, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                       seed=cfg.seed + i, kv_cache=cfg.kv_cache, tokens=ck.tokenizer.vocab_size,
                       stop=() if cfg.ignore_eos else ck.stop, on_token=growing)
        out.append(shown(ck.tokenizer, ids[0]))
        if growing is not None:
            growing.finish(out[-1])
    return out


def check_weights_finite(params: GPT, model: GPTConfig, where: str) -> None:
    """One CheckpointError line naming the first weight that holds NaN or inf (every logit is
    then NaN, and each draw falls to the last id): by its transformers name in a transformers
    directory (whose files to get again), else by numesh's (a run that diverged before it saved)."""
    pretrained = is_pretrained_dir(Path(where))
    for name, leaf in tree_leaves_with_path(params):
        if not np.isfinite(leaf).all():
            if pretrained and model.positions == "rotary":  # a Llama-family file: its tensors' names
                name = next(pc.name for pc in pieces(name, model) if not np.isfinite(leaf[pc.index]).all())
            fix = ("get the model's weight files again" if pretrained else
                   "sample an earlier checkpoint, saved before its run diverged")
            raise CheckpointError(f"{where}: its weight {name} holds NaN or inf values, so no token can be drawn "
                                  f"from it: {fix}")


class _Growing:
    """`generate`'s `on_token` for one sample: hands `show` the text its new tokens add, a
    word at a time (up to the last whitespace), as transformers' TextStreamer does: a
    decoder may change a word's text while its tokens come (a byte-level token ending
    inside a character decodes as U+FFFD until its next bytes; a byte-fallback or
    leading-space rule rewrites the last word), never the words before it."""

    def __init__(self, tok: CharTokenizer | HFTokenizer, show: Callable[[str], None]) -> None:
        self.tok, self.show, self.done = tok, show, ""

    def __call__(self, ids: np.ndarray) -> None:
        text = shown(self.tok, ids[0])
        self._extend(text[:max(text.rfind(" "), text.rfind("\n"), text.rfind("\t")) + 1])

    def _extend(self, text: str) -> None:
        if text.startswith(self.done) and len(text) > len(self.done):
            self.show(text[len(self.done):])
            self.done = text

    def finish(self, text: str) -> None:
        """The sample's whole text: what was not shown yet (all of it again, on a new line,
        where the decoder changed a word already shown)."""
        if text.startswith(self.done):
            self._extend(text)
        else:
            self.show("\n" + text)
