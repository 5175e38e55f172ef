"""Tokenizers: one interface over numesh's character vocabulary and Hugging Face tokenizers.

`CharTokenizer` maps each character of a text to its index (nanoGPT's shakespeare_char).
`HFTokenizer` runs a Hugging Face `tokenizers` file (`tokenizer.json`): a byte-level BPE
that `numesh data bpe` trains, or any existing one (GPT-2's, say) that `numesh data
tokenize` uses; documents are separated by its end-of-text token, and framed as its
post-processor frames a text (`template`: Llama's BOS before each). Both give `encode`
(uint32-safe int arrays), `decode`, `vocab_size` and `to_meta`, the JSON a dataset's
`meta.json` and a checkpoint keep, from which `tokenizer_from_meta` rebuilds either kind.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import attrs
import numpy as np

from numesh.base.errors import DataError, Interrupted, UserError
from numesh.base.files import json_object_or_none

TOKEN_DTYPE = np.dtype("<u2")  # a character dataset's ids: uint16, as nanoGPT's .bin files
_MAX_VOCAB = int(np.iinfo(TOKEN_DTYPE).max) + 1
EOT = "<|endoftext|>"  # the end-of-text token `numesh data bpe` adds (GPT-2's)


class Tokenizer(Protocol):
    """What every command that reads a dataset needs from its tokenizer."""

    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, s: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def to_meta(self) -> dict[str, Any]: ...


def _check_chars(instance: Any, attribute: Any, chars: tuple[str, ...]) -> None:
    """attrs validator: distinct single characters, few enough for uint16 ids."""
    if not isinstance(chars, tuple):
        raise DataError(
            f"tokenizer chars must be a tuple of 1-character strings, got {type(chars).__name__}"
        )
    for c in chars:
        if not isinstance(c, str) or len(c) != 1:
            raise DataError(
                f"tokenizer chars must be 1-character strings, got {c!r}: regenerate the dataset"
            )
    if len(set(chars)) != len(chars):
        raise DataError("tokenizer chars contain duplicates: regenerate the dataset")
    if len(chars) > _MAX_VOCAB:
        raise DataError(
            f"{len(chars)} distinct characters do not fit uint16 ids: "
            f"use a text with at most {_MAX_VOCAB}"
        )


@attrs.frozen
class CharTokenizer:
    """Maps each character to its index in `chars` (nanoGPT shakespeare_char style)."""

    kind = "char"
    chars: tuple[str, ...] = attrs.field(converter=tuple, validator=_check_chars)
    # Code points in id order and the permutation that sorts them: lets encode/decode run
    # as NumPy array operations instead of a Python loop per character.
    _codes: np.ndarray = attrs.field(init=False, eq=False, repr=False)
    _order: np.ndarray = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # runs after the validator, so every entry of chars is one character here
        codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)
        object.__setattr__(self, "_codes", codes)
        object.__setattr__(self, "_order", np.argsort(codes, kind="stable"))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The sorted set of characters of `text` as the vocabulary."""
        if not text:
            raise DataError("cannot build a vocabulary from an empty text: pass a non-empty --src file")
        return cls(tuple(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> np.ndarray:
        """uint16 ids of the characters of `s`; an unknown character raises DataError."""
        if not s:
            return np.zeros(0, dtype=TOKEN_DTYPE)
        points = np.frombuffer(s.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        sorted_codes = self._codes[self._order]
        pos = np.searchsorted(sorted_codes, points)
        pos_clipped = np.minimum(pos, len(sorted_codes) - 1)
        known = sorted_codes[pos_clipped] == points
        if not known.all():
            bad = chr(int(points[np.argmin(known)]))
            raise DataError(
                f"character {bad!r} is not in the {self.vocab_size}-character vocabulary: "
                "use only characters from the training text"
            )
        return self._order[pos_clipped].astype(TOKEN_DTYPE)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The string for a sequence of ids; an id outside the vocabulary raises DataError."""
        arr = np.asarray(ids)
        if arr.size == 0:
            return ""
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
        arr = arr.reshape(-1).astype(np.int64)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise DataError(
                f"token id {int(bad[0])} is outside the vocabulary of size {self.vocab_size}: "
                "decode ids produced with this tokenizer"
            )
        return self._codes[arr].astype("<u4").tobytes().decode("utf-32-le", errors="surrogatepass")

    def to_hf_json(self) -> str:
        """The same vocabulary as a Hugging Face `tokenizers` file: a BPE over these
        characters with no merges (each character one token, one id) and a decoder that
        joins them, which transformers' `PreTrainedTokenizerFast` loads."""
        from tokenizers import Tokenizer as Raw
        from tokenizers import decoders, models

        tok = Raw(models.BPE(vocab={c: i for i, c in enumerate(self.chars)}, merges=[]))
        tok.decoder = decoders.Fuse()
        return tok.to_str()

    @classmethod
    def from_hf_json(cls, json_text: str) -> CharTokenizer | None:
        """The character vocabulary a `to_hf_json` file holds (a character model's
        `numesh export --format hf` tokenizer: a BPE with no merges over single characters,
        ids 0..V-1), or None when `json_text` is another tokenizer."""
        try:
            model = json.loads(json_text).get("model")
        except (ValueError, AttributeError):
            return None
        vocab = model.get("vocab") if isinstance(model, dict) else None
        if (not isinstance(model, dict) or model.get("type") != "BPE" or model.get("merges") or not vocab
                or not isinstance(vocab, dict) or sorted(vocab.values()) != list(range(len(vocab)))
                or not all(isinstance(c, str) and len(c) == 1 for c in vocab)):
            return None
        return cls(tuple(sorted(vocab, key=vocab.__getitem__)))

    def to_meta(self) -> dict[str, Any]:
        """JSON-ready description: {"vocab_size": V, "chars": [...]} (no "kind": what
        datasets and checkpoints written before other kinds existed hold)."""
        return {"vocab_size": self.vocab_size, "chars": list(self.chars)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> CharTokenizer:
        """Inverse of `to_meta`; checks vocab_size agrees with chars."""
        if not isinstance(meta, dict) or not isinstance(meta.get("chars"), list):
            raise DataError("dataset metadata has no 'chars' list: regenerate the dataset with `numesh data`")
        tok = cls(tuple(meta["chars"]))
        if "vocab_size" in meta and meta["vocab_size"] != tok.vocab_size:
            raise DataError(
                f"dataset metadata says vocab_size {meta['vocab_size']} but lists {tok.vocab_size} "
                "characters: regenerate the dataset with `numesh data`"
            )
        return tok


def read_tokenizer_file(path: str | Path) -> str:
    """The text of a tokenizer.json; an unreadable one is a DataError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read tokenizer {path} ({getattr(e, 'strerror', None) or e}): "
                        "pass a readable tokenizer.json") from None


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json a --tokenizer option names: the file itself, or the one in the
    directory `path` (a transformers model's, or a `numesh export --format hf` one)."""
    p = Path(path)
    if not p.is_dir():
        return p
    return directory_tokenizer(p, "pass a directory holding one (a transformers model's) or the file itself")


def directory_tokenizer(directory: str | Path, fix: str, error: type[UserError] = DataError) -> Path:
    """`directory`'s tokenizer.json; where it has none, `error` in one line ending with `fix`:
    what the command lets the user change (another --tokenizer, or, where no option names a
    tokenizer, the model's file copied in), so each caller says its own."""
    file = Path(directory) / "tokenizer.json"
    if not file.exists():
        raise error(f"{directory} has no tokenizer.json: {fix}")
    return file


def char_route(what: str, path: str) -> str:
    """Why a character vocabulary cannot tokenise a corpus into shards, and what does."""
    return (f"{what} is a character vocabulary (a character model's export), with no end-of-text token to "
            f"separate documents: prepare the corpus as a character dataset with its vocabulary, "
            f"`numesh data char --tokenizer {path} --src FILE --out DIR`")


@attrs.frozen
class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer, kept as its `tokenizer.json` text (so a
    dataset or checkpoint that holds it is self-contained), with its end-of-text token."""

    kind = "hf"
    json_text: str = attrs.field(repr=False)
    eot: str = EOT
    _tok: Any = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        from tokenizers import Tokenizer as Raw

        try:
            tok = Raw.from_str(self.json_text)
        except Exception as e:  # tokenizers raises its own exception types
            raise DataError(f"not a Hugging Face tokenizer file ({str(e).splitlines()[0][:120]}): "
                            "pass a tokenizer.json written by `tokenizers` or `transformers`") from None
        if tok.token_to_id(self.eot) is None:
            if CharTokenizer.from_hf_json(self.json_text) is not None:
                raise DataError(char_route("the tokenizer", "TOKENIZER.json"))
            raise DataError(f"the tokenizer has no end-of-text token {self.eot!r}: add it as a special token "
                            "or pass the one it has")
        if tok.get_vocab_size(with_added_tokens=True) > np.iinfo(np.uint32).max:
            raise DataError("the tokenizer's vocabulary does not fit uint32 token ids")
        object.__setattr__(self, "_tok", tok)

    @classmethod
    def from_file(cls, path: str | Path, eot: str | None = EOT) -> HFTokenizer:
        """The tokenizer.json at `path`, or in the transformers directory `path` (a model's:
        `numesh data tokenize --tokenizer DIR`). `eot` None: the directory's end-of-sequence
        token (`directory_eos`), else `EOT`."""
        file = tokenizer_file(path)
        text = read_tokenizer_file(file)
        if CharTokenizer.from_hf_json(text) is not None:
            raise DataError(char_route(str(path), str(path)))
        return cls.from_json(text, file, eot)

    @classmethod
    def from_json(cls, text: str, file: Path, eot: str | None = EOT) -> HFTokenizer:
        """The tokenizer.json `text` already read from `file` (which errors name, and whose
        directory gives the end-of-sequence token where `eot` is None, as in `from_file`)."""
        try:
            return cls(text, eot if eot is not None else directory_eos(file.parent, text) or EOT)
        except DataError as e:  # which file: a model directory's, say, not the one the user named
            raise DataError(f"{file}: {e}") from None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eot_id(self) -> int:
        return int(self._tok.token_to_id(self.eot))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()

    def encode(self, s: str) -> np.ndarray:
        """The ids of the text `s` alone: no special token of the post-processor's template."""
        return np.asarray(self._tok.encode(s, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_default(self, s: str) -> np.ndarray:
        """The ids of `s` as transformers' `tokenizer(s)["input_ids"]` gives them: within
        the special tokens the post-processor's template puts around a text (Llama's BOS)."""
        return np.asarray(self._tok.encode(s, add_special_tokens=True).ids, dtype=np.uint32)

    @property
    def template(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text by default (Llama 2's
        and TinyLlama's `<s> $A`: ((bos,), ())); ((), ()) for a tokenizer without such a
        template (GPT-2's, `numesh data bpe`'s)."""
        return template_ends(self._tok)

    @property
    def cuts_between_words(self) -> bool:
        """Whether a text's ids are those of its `text_pieces` one after the other (but for
        runs longer than MAX_RUN): GPT-2's byte-level pre-tokenisation with no prefix space,
        no normaliser and no added token but special ones, as `numesh data bpe` writes and
        GPT-2's own tokenizer is. Others see whole documents."""
        spec = json.loads(self.json_text)
        pre = spec.get("pre_tokenizer") or {}
        return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                and not pre.get("add_prefix_space", False)
                and all(t.get("special") for t in spec.get("added_tokens") or []))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's ids, tokenised in parallel on all cores (`tokenizers`' batch
        encoding), with special tokens read as plain text: a document that quotes
        `<|endoftext|>` keeps it as text, and only the writer's own end-of-text ids separate
        documents."""
        self._tok.encode_special_tokens = True
        try:
            out = self._tok.encode_batch(texts, add_special_tokens=False)
        finally:
            self._tok.encode_special_tokens = False
        return [np.asarray(e.ids, dtype=np.uint32) for e in out]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise DataError(f"token id {bad} is outside the vocabulary of size {self.vocab_size}: "
                            "decode ids produced with this tokenizer")
        return self._tok.decode([int(i) for i in arr], skip_special_tokens=False)

    def to_meta(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eot": self.eot, "eot_id": self.eot_id,
                "sha256": self.sha256, "json": self.json_text}


def template_ends(tok: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special ids the `tokenizers` Tokenizer `tok`'s post-processor adds before and
    after a single text, read off a probe text's encoding: the ids around its own (those
    with a sequence id). A probe the tokenizer gives no ids of its own leaves every added
    id before the text (a template adds a start token far more often than an end one)."""
    try:
        enc = tok.encode("a", add_special_tokens=True)
    except Exception as e:  # tokenizers raises its own types (a WordLevel model without its unk token)
        raise DataError(f"the tokenizer cannot encode a text ({e}): fix its tokenizer.json or use another") from None
    own = [i for i, s in enumerate(enc.sequence_ids) if s is not None]
    if not own:
        return tuple(enc.ids), ()
    return tuple(enc.ids[:own[0]]), tuple(enc.ids[own[-1] + 1:])


def directory_eos(directory: Path, json_text: str) -> str | None:
    """The end-of-sequence token a transformers directory names: tokenizer_config.json's
    eos_token, else the token of config.json's eos_token_id; None when it names none (or
    the files are unreadable: the caller's default then applies)."""
    def read(name: str) -> dict[str, Any]:
        return json_object_or_none(directory / name) or {}

    eos = read("tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and eos:
        return eos
    eos_id = read("config.json").get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    if isinstance(eos_id, int) and not isinstance(eos_id, bool):
        from tokenizers import Tokenizer as Raw

        try:
            return Raw.from_str(json_text).id_to_token(eos_id)
        except Exception:  # tokenizers raises its own types; HFTokenizer reports a bad file
            return None
    return None


def check_bpe_size(vocab_size: int) -> None:
    """A DataError when a byte-level BPE cannot have `vocab_size` entries: fewer than its
    256 bytes and end-of-text token, or more than uint32 ids hold."""
    base = 256 + 1
    if vocab_size < base:
        raise DataError(f"--vocab-size {vocab_size} is below the {base} entries a byte-level BPE starts with "
                        f"(256 bytes and {EOT}): use at least {base}")
    if vocab_size > np.iinfo(np.uint32).max:
        raise DataError(f"--vocab-size {vocab_size} does not fit uint32 token ids")


MAX_RUN = 1_000  # characters: a longer run without whitespace (or of whitespace alone) is cut into runs this long
TEXT_PIECE = 1 << 16  # characters: a longer text reaches `tokenizers` in pieces about this long
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN + 1},}}|(?<!\s)\s{{{MAX_RUN + 1},}}")
_RUN_START = re.compile(r"(?<=\S)\s")  # where a run of whitespace starts: GPT-2's pre-tokens never span it


def text_pieces(text: str) -> Iterator[str]:
    """`text` as pieces that bound what `tokenizers` holds at once, whatever the text: cut
    where a run of whitespace starts, every TEXT_PIECE characters or so, where no
    pre-token (word) of GPT-2's byte-level pre-tokenisation ever spans (so the words, the
    BPE trained on them and every id are those of the whole text), and any run of more than
    MAX_RUN characters without whitespace (or of whitespace only) cut into runs of MAX_RUN.
    A word is such a run at most, so a 20 MB line without a space, once one 20 MB word,
    which BPE training merges in time quadratic in its length (hours) and memory many times
    it (GBs), is 20,000 words of 1,000 characters; no word of a real text is that long."""
    if len(text) <= TEXT_PIECE:
        yield text
        return
    at = 0
    for run in _LONG_RUN.finditer(text):
        yield from _cut_between_words(text[at:run.start()])
        yield from (text[i:i + MAX_RUN] for i in range(run.start(), run.end(), MAX_RUN))
        at = run.end()
    yield from _cut_between_words(text[at:])


def _cut_between_words(text: str) -> Iterator[str]:
    """`text_pieces` of a text with no run longer than MAX_RUN: cut at the last start of a
    whitespace run before each TEXT_PIECE characters (one lies in any 2·MAX_RUN + 2 of them)."""
    while len(text) > TEXT_PIECE:
        cut = TEXT_PIECE
        for start in _RUN_START.finditer(text, TEXT_PIECE - 2 * MAX_RUN - 2, TEXT_PIECE + 1):
            cut = start.start()
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenisation and byte alphabet, `EOT` as its one
    special token) trained on `texts` (as `text_pieces`) to `vocab_size` entries, or fewer
    where the texts hold fewer merges. The same texts in the same order give the same
    tokenizer. `show_progress`: `tokenizers`' own bars on stderr (drawn on a terminal only)."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_size(vocab_size)
    tok = Raw(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    train_interruptibly(tok, (piece for text in texts for piece in text_pieces(text)), trainer)
    return HFTokenizer(tok.to_str(), EOT)


class _Stopped(Exception):
    """Raised into `tokenizers`' feed to end it: the main thread was interrupted."""


REPEAT_S = 0.5  # a second SIGINT this soon after the first is the same Ctrl-C delivered twice (launcher and terminal)


def _leave_at_once() -> None:
    """End the process now, as `numesh.host.runtime.guarded` ends an interrupted one (one
    line, 130), but without Python's finalisation: a thread still inside `tokenizers` that
    reaches for the GIL then is ended with pthread_exit, whose unwinding through Rust frames
    aborts the process ("FATAL: exception not rethrown", exit 134). Nothing is staged yet:
    the dataset is written after training."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(Interrupted.EXIT_CODE)


def sigint_stops(stop: threading.Event, leave: Callable[[], None] = _leave_at_once,
                 clock: Callable[[], float] = time.monotonic) -> Callable[[int, Any], None]:
    """A SIGINT handler that raises nothing: the first Ctrl-C sets `stop`, a second (more
    than REPEAT_S later) calls `leave`. An exception raised in the main thread while a
    worker trains would leave the worker running in Rust while Python exits (see
    `_leave_at_once`)."""
    first: list[float] = []

    def handler(signum: int, frame: Any) -> None:
        if not first:
            first.append(clock())
            stop.set()
        elif clock() - first[0] > REPEAT_S:
            leave()

    return handler


def _raise_interrupt() -> None:
    """A library caller's second Ctrl-C: KeyboardInterrupt, as Python's own handler raises
    it; the training thread is left to end at its next piece (the feed is stopped)."""
    raise KeyboardInterrupt


# whether a second Ctrl-C may end the process (`ctrl_c_may_exit`): only where numesh owns it
_MAY_EXIT: contextvars.ContextVar[bool] = contextvars.ContextVar("numesh_bpe_ctrl_c_may_exit", default=False)


@contextlib.contextmanager
def ctrl_c_may_exit() -> Iterator[None]:
    """Within it a second Ctrl-C while a BPE trains ends the process at once
    (`_leave_at_once`): the `numesh data` commands, which own their process. Elsewhere (a
    script's or a notebook's call) it raises KeyboardInterrupt (`_raise_interrupt`): their
    process is theirs to end."""
    token = _MAY_EXIT.set(True)
    try:
        yield
    finally:
        _MAY_EXIT.reset(token)


def second_ctrl_c() -> Callable[[], None]:
    """What a second Ctrl-C does here: `_leave_at_once` within `ctrl_c_may_exit`, else `_raise_interrupt`."""
    return _leave_at_once if _MAY_EXIT.get() else _raise_interrupt


@contextlib.contextmanager
def _ctrl_c_stops(stop: threading.Event) -> Iterator[None]:
    """`sigint_stops(stop, second_ctrl_c())` as the SIGINT handler for the block, where
    Python's own handler (which raises KeyboardInterrupt) is the one installed on the main
    thread; another (ignored, or a caller's own) is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    before = signal.signal(signal.SIGINT, sigint_stops(stop, second_ctrl_c()))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def train_interruptibly(tok: Any, pieces: Iterator[str], trainer: Any) -> None:
    """`tok.train_from_iterator(pieces, trainer)`, on a worker thread that the main thread
    waits for. `tokenizers` trains with the GIL released and pulls `pieces` on threads of
    its own, so a Ctrl-C, whose Python handler runs on the main thread alone, was seen only
    when training ended (minutes on a large corpus). Here the wait takes it at once (a
    handler that raises nothing, `sigint_stops`); the feed then ends at its next piece, the
    merges of what was read finish (a fraction of the pass), and KeyboardInterrupt goes on
    once the worker is done. A second Ctrl-C ends the process at once (`second_ctrl_c`).
    numesh raises no KeyboardInterrupt while the worker runs: Python 3.11's Thread.join,
    interrupted, took a running thread for ended (its bpo-45274 fix releases the thread's
    own lock), so Python exited under it and aborted with code 134. Where something else
    raises in the wait (a caller's own handler, a library caller's second Ctrl-C), the feed
    is stopped and the thread waited for before it goes on, as after a first Ctrl-C."""
    stop, done, failed = threading.Event(), threading.Event(), []

    def feed() -> Iterator[str]:
        for piece in pieces:
            if stop.is_set():
                raise _Stopped
            yield piece

    def work() -> None:
        try:
            tok.train_from_iterator(feed(), trainer)
        except BaseException as e:  # raised again on the main thread
            failed.append(e)
        finally:
            done.set()

    with _ctrl_c_stops(stop):
        try:  # the thread's start too: tokenizers may pull the corpus (which may signal) before start returns
            threading.Thread(target=work, name="numesh-bpe-train", daemon=True).start()
            while not done.wait(0.25):  # a timeout: the main thread runs the handler even if another thread took it
                pass
        except BaseException:
            stop.set()
            done.wait()  # the merges of what was read (another interrupt here goes on at once)
            raise
    if stop.is_set():
        raise KeyboardInterrupt
    if failed:
        raise failed[0]


def tokenizer_from_meta(meta: dict[str, Any]) -> CharTokenizer | HFTokenizer:
    """The tokenizer a `to_meta` dict describes (no "kind": a character vocabulary)."""
    if not isinstance(meta, dict):
        raise DataError("tokenizer metadata is not a JSON object: regenerate the dataset with `numesh data`")
    kind = meta.get("kind", "char")
    if kind == "char":
        return CharTokenizer.from_meta(meta)
    if kind == "hf":
        if not isinstance(meta.get("json"), str):
            raise DataError("tokenizer metadata of kind hf has no tokenizer json: regenerate the dataset")
        tok = HFTokenizer(meta["json"], meta.get("eot", EOT))
        if meta.get("sha256") not in (None, tok.sha256):
            raise DataError("tokenizer metadata's sha256 does not match its tokenizer json: the file was edited; "
                            "regenerate the dataset")
        return tok
    raise DataError(f"unknown tokenizer kind {kind!r} in metadata: this numesh knows char and hf")
