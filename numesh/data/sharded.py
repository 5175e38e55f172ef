"""Sharded datasets from a corpus and a tokenizer: what `numesh data bpe` and `numesh data
tokenize` write.

The corpus streams by in batches of documents, each tokenised on all cores (`tokenizers`'
batch encoding), framed as the tokenizer frames a text by default (Llama's BOS before it)
and followed by the end-of-text token, into the train or val shards. Documents go to a
split whole, val filled to at most `val_fraction` of the corpus's bytes in the order of a
hash of each one's text (`choose_val`): the same for the same corpus, a document's split
does not hang on where it sits, and one large document cannot take most of the corpus to
val. A corpus of one document (a single text file) is split by position instead, its last
`val_fraction` of characters to val (`split_plan`, decided in a pass over the corpus before
the tokenizer is trained). meta.json records the tokenizer (its JSON and hash, and
the ids its template frames documents with), every corpus file with its size and sha256,
the documents, UTF-8 bytes and tokens of each split (bytes per token give bits per byte),
every file written (its record) and the command that writes it again. The dataset is
written whole (numesh/data/write.py).
"""

from __future__ import annotations

import hashlib
import shlex
from array import array
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs
import numpy as np

from numesh.base.errors import DataError
from numesh.base.files import write_atomic
from numesh.data import write as dw
from numesh.data.corpus import Reading, check_unchanged, describe, documents, expand
from numesh.data.shards import ShardWriter, token_dtype
from numesh.data.tokenizer import EOT, HFTokenizer, check_bpe_size, text_pieces, train_bpe

TOKENIZER_FILE = "tokenizer.json"
BATCH_DOCS = 512  # documents (or pieces) per batch encoding: enough to keep every core busy
BATCH_CHARS = 1 << 22  # characters per batch encoding at most: what it holds at once stays bounded
Progress = Callable[[int, int], None]  # (corpus bytes done, total)
MIN_SPLIT_TOKENS = 2  # a split trains or evaluates on a token and the next: 1 is unusable (as `numesh data char`)


def corpus_documents(paths: Sequence[Path], how: Reading) -> Iterator[str]:
    """Every non-empty document of the corpus, in order."""
    for p in paths:
        for doc in documents(p, how):
            if doc:
                yield doc


def _no_tokens() -> DataError:
    return DataError("the corpus yields no tokens (every document is empty): check --src, --split-on and "
                     "--text-field")


def _empty_split(docs: int, split: str, val_fraction: float) -> DataError:
    return DataError(f"the {docs:,} documents leave the {split} split empty at --val-fraction {val_fraction} "
                     "(documents go to a split whole, and none fits in that share of the bytes): add documents, "
                     "split .txt files into more (--split-on; a .jsonl or .parquet record is one document) or "
                     "raise --val-fraction")


def _short_split(split: str, val_fraction: float) -> DataError:
    """A split of 1 token: one document whose text the tokenizer encodes to no ids (a
    tokenizer that drops whitespace, say), so only its end-of-text token was written. A
    byte-level BPE gives every text ids, so only `numesh data tokenize` meets this."""
    change = "raise" if split == "val" else "lower"
    return DataError(f"the {split} split holds 1 token, the end-of-text token after a document this tokenizer "
                     f"encodes to no ids, and a split needs {MIN_SPLIT_TOKENS} or more (an input and its target): "
                     f"{change} --val-fraction {val_fraction}, or give the corpus text the tokenizer encodes")


@attrs.frozen(eq=False)
class Split:
    """How a corpus splits into train and val: `val[i]` says whether document i goes to val
    whole, or `val` is None for a corpus of one document, cut by position."""

    val: np.ndarray | None

    @property
    def kind(self) -> str:
        """meta.json's "split": "documents" or "position"."""
        return "position" if self.val is None else "documents"

    def is_val(self, index: int) -> bool:
        """Whether document `index` goes to val (one past the corpus read first: to train, and
        the corpus's changed sha256 refuses the dataset at the end)."""
        return self.val is not None and index < len(self.val) and bool(self.val[index])


def document_key(doc: str) -> tuple[int, int]:
    """(a 64-bit hash of the document's UTF-8 bytes, their count): where it stands in the
    order val is filled in, the same wherever it sits in the corpus and whatever else is there."""
    raw = doc.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little"), len(raw)


def choose_val(keys: np.ndarray, sizes: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents go to val: in the order of their `keys` (ties in corpus order), each
    whose `sizes` (bytes) still fit in `val_fraction` of the corpus's. Val so holds at most
    that share of the bytes, short of it by less than the smallest train document, and a
    document added to the corpus moves others only where the share fills up (and a little
    through the room its own bytes add). Where no document fits in the share, the smallest
    goes to val (more than the share: the command warns), so that three or more whole files
    split (two are refused: half of the corpus would be val)."""
    order = np.argsort(keys, kind="stable")
    ordered = np.asarray(sizes, dtype=np.int64)[order]
    room = int(val_fraction * int(ordered.sum()))
    take = np.zeros(len(ordered), dtype=bool)
    fit = int(np.searchsorted(np.cumsum(ordered), room, side="right"))  # these fit together, in order
    take[:fit] = True
    room -= int(ordered[:fit].sum())
    smallest = np.minimum.accumulate(ordered[::-1])[::-1]  # the smallest document from here on
    for j in range(fit, len(ordered)):
        if smallest[j] > room:
            break
        if ordered[j] <= room:
            take[j], room = True, room - int(ordered[j])
    if not take.any() and len(ordered) > 2:  # none fits: the smallest (the first in hash order of those), as
        take[int(np.argmin(ordered))] = True  # a corpus of three or more whole files always had one in val
    val = np.zeros(len(ordered), dtype=bool)
    val[order] = take
    return val


def split_plan(paths: Sequence[Path], how: Reading, val_fraction: float) -> Split:
    """How the corpus splits into train and val, decided before anything is trained, in one
    pass over it that keeps 16 bytes a document: by documents, each whole (`choose_val`), or
    for a corpus of one document (a single text file) by position, its first
    1 - `val_fraction` of the characters to train and the rest to val, as nanoGPT's
    prepare splits its one file. A corpus that leaves val empty, or one document too short
    to cut, is a DataError here, before minutes of training."""
    keys, sizes, first = array("Q"), array("Q"), ""
    for doc in corpus_documents(paths, how):
        key, size = document_key(doc)
        keys.append(key)
        sizes.append(size)
        first = doc if len(keys) == 1 else ""
    if not keys:
        raise _no_tokens()
    if len(keys) == 1:
        cut = _cut(first, val_fraction)
        if cut == 0 or cut == len(first):
            raise DataError(f"the corpus is one document of {len(first):,} characters, too short to split "
                            f"{_percent(1 - val_fraction)}/{_percent(val_fraction)} by position: use a longer text")
        return Split(None)
    val = choose_val(np.frombuffer(keys, np.uint64), np.frombuffer(sizes, np.uint64), val_fraction)
    if not val.any():
        raise _empty_split(len(keys), "val", val_fraction)
    return Split(val)


def _cut(doc: str, val_fraction: float) -> int:
    return int(len(doc) * (1.0 - val_fraction))


def _percent(x: float) -> str:
    return f"{100 * x:g}"


def split_documents(paths: Sequence[Path], how: Reading, val_fraction: float,
                    plan: Split) -> Iterator[tuple[str, str]]:
    """(split, text) of every document of the corpus, as `split_plan`'s `plan` splits it."""
    for index, doc in enumerate(corpus_documents(paths, how)):
        if plan.val is None:
            cut = _cut(doc, val_fraction)
            yield "train", doc[:cut]
            yield "val", doc[cut:]
        else:
            yield ("val" if plan.is_val(index) else "train"), doc


def _check_reading(how: Reading, val_fraction: float) -> None:
    if not 0.0 < val_fraction < 1.0:  # NaN fails this too
        raise DataError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if how.split_on == "":
        raise DataError("--split-on is empty: pass the separator that ends a document, e.g. $'\\n\\n'")
    if not how.text_field:
        raise DataError("--text-field is empty: pass the field that holds the text (default: text)")


def _quote(arg: str) -> str:
    """`arg` for a POSIX shell on one line: shlex's quoting, or bash's $'...' when it holds
    a control character (--split-on $'\\n\\n'), so the command fits in a one-line error."""
    if arg.isprintable():
        return shlex.quote(arg)
    escaped = arg.encode("unicode_escape").decode("ascii").replace("'", "\\'")
    return f"$'{escaped}'"


def rebuild_command(sources: Sequence[str | Path], how: Reading, val_fraction: float,
                    vocab_size: int | None = None, tokenizer: str | Path | None = None, eot: str = EOT) -> str:
    """The `numesh data bpe` (with `vocab_size`) or `numesh data tokenize` (with
    `tokenizer`) command that writes this dataset again, but for its --out (so the same
    inputs give the same meta.json wherever it goes); meta.json keeps it."""
    if tokenizer is not None:
        args = ["numesh", "data", "tokenize", "--tokenizer", str(tokenizer)]
        args += ["--eot", eot] if eot != EOT else []
    else:
        args = ["numesh", "data", "bpe", "--vocab-size", str(vocab_size)]
    for src in sources:
        args += ["--src", str(src)]
    args += ["--split-on", how.split_on] if how.split_on is not None else []
    args += ["--text-field", how.text_field] if how.text_field != "text" else []
    args += ["--val-fraction", repr(val_fraction)] if val_fraction != 0.1 else []
    return " ".join(_quote(a) for a in args)


def _same_inputs(old: dict[str, Any], files: list[dict[str, Any]], how: Reading, val_fraction: float,
                 tokenizer: dict[str, Any] | int) -> bool:
    """Whether an old sharded dataset's meta.json names the same corpus contents, reading,
    split and tokenizer (its sha256, or for a BPE still to train its size)."""
    corpus = old.get("corpus") if isinstance(old.get("corpus"), dict) else {}
    same_files = [(f.get("bytes"), f.get("sha256")) for f in corpus.get("files", []) if isinstance(f, dict)] == [
        (f["bytes"], f["sha256"]) for f in files]
    tok = old.get("tokenizer") if isinstance(old.get("tokenizer"), dict) else {}
    asked = old.get("vocab_size_asked", old.get("vocab_size"))  # a corpus may support fewer entries than asked
    same_tok = (asked == tokenizer if isinstance(tokenizer, int)
                else (tok.get("sha256"), tok.get("eot")) == (tokenizer.get("sha256"), tokenizer.get("eot")))
    return same_files and same_tok and (corpus.get("split_on"), corpus.get("text_field"), corpus.get(
        "val_fraction")) == (how.split_on, how.text_field, val_fraction)


def refuse_early(out: Path, files: list[dict[str, Any]], how: Reading, val_fraction: float,
                 tokenizer: dict[str, Any] | int, overwrite: bool) -> None:
    """Before the corpus is read: a complete sharded dataset in `out` made of other inputs
    (`files`: the corpus as `describe` found it) is replaced only with `overwrite`
    (`numesh.data.write.publish` compares the ids themselves at the end; this spares
    tokenising a corpus only to be refused)."""
    old = None if overwrite else dw.existing(out)
    if old is not None and "shards" in old and not _same_inputs(old, files, how, val_fraction, tokenizer):
        raise dw.refused(out, "other inputs (corpus, --split-on, --text-field, --val-fraction or tokenizer)")


def template_record(tok: HFTokenizer) -> dict[str, Any]:
    """meta.json's record of the ids the tokenizer's template puts before and after each
    document ({"template": {"start": [bos], "end": []}} for Llama's), or nothing for a
    tokenizer without one: its datasets' meta.json stays what it always was."""
    start, end = tok.template
    return {"template": {"start": list(start), "end": list(end)}} if start or end else {}


def refuse_unframed(out: Path, tok: HFTokenizer, overwrite: bool) -> None:
    """Before the corpus is read: a complete dataset in `out` of the same inputs (after
    `refuse_early`) whose documents lack the template's tokens, as a numesh before they
    were added wrote it, is replaced only with `overwrite`: its ids differ from the new."""
    start, end = document_ends(tok)
    if not start.size and end.tolist() == [tok.eot_id]:  # framed as always: an end-of-text token after each
        return
    old = None if overwrite else dw.existing(out)
    if old is not None and "shards" in old and old.get("template") != template_record(tok).get("template"):
        raise dw.refused(out, "documents without the start and end tokens its tokenizer's template adds (an "
                              "older numesh wrote it)")


def prepare_bpe(sources: Sequence[str | Path], vocab_size: int, out: str | Path, how: Reading = Reading(),
                val_fraction: float = 0.1, progress: Progress | None = None,
                overwrite: bool = False, say: Callable[[str], None] | None = None,
                show_progress: bool = False) -> dict[str, Any]:
    """Train a byte-level BPE of `vocab_size` on the corpus (a first pass), then tokenise it
    (a second): OUT/tokenizer.json and the sharded dataset. A corpus with fewer merges than
    `vocab_size` asks gives a smaller vocabulary: `say` (one line) warns of it, and meta.json
    records the size asked ("vocab_size_asked"), which a rerun of the same command compares.
    `say` also announces the training pass, and `show_progress` draws `tokenizers`' bars
    during it (on a terminal)."""
    _check_reading(how, val_fraction)
    check_bpe_size(vocab_size)
    paths, target = expand(sources), dw.target(Path(out))
    files = describe(paths)  # before the first pass: a corpus changed between the two is caught
    refuse_early(target, files, how, val_fraction, vocab_size, overwrite)
    dw.check_writable(target)
    plan = split_plan(paths, how, val_fraction)
    if say is not None:
        size = sum(f["bytes"] for f in files)
        shown = f"{size / 1e6:,.1f} MB" if size >= 100_000 else f"{size / 1e3:,.1f} kB"
        say(f"training a byte-level BPE of {vocab_size:,} entries on {shown} of text ({len(files)} "
            f"file{'s' if len(files) != 1 else ''}; the first of two passes)")
    tok = train_bpe((doc for _, doc in split_documents(paths, how, val_fraction, plan)), vocab_size,
                    show_progress=show_progress)
    if tok.vocab_size < vocab_size and say is not None:
        say(f"warning: the corpus holds merges for {tok.vocab_size:,} entries, not the {vocab_size:,} --vocab-size "
            f"asks: the BPE has {tok.vocab_size:,} (a larger corpus gives more)")
    again = rebuild_command(sources, how, val_fraction, vocab_size=vocab_size)
    return _write_shards(paths, files, tok, target, Path(out), how, val_fraction, progress, overwrite, again,
                         plan, {"vocab_size_asked": vocab_size})


def prepare_tokenized(sources: Sequence[str | Path], tok: HFTokenizer, out: str | Path, how: Reading = Reading(),
                      val_fraction: float = 0.1, progress: Progress | None = None, overwrite: bool = False,
                      rebuild: str | None = None) -> dict[str, Any]:
    """Tokenise the corpus with `tok` into OUT: shards, tokenizer.json, meta.json, written
    whole (numesh/data/write.py); a complete dataset there with other content is
    replaced only with `overwrite`. `rebuild` is the command meta.json keeps to write it
    again, but for --out (default: `numesh data tokenize` with OUT/tokenizer.json)."""
    _check_reading(how, val_fraction)
    paths, target = expand(sources), dw.target(Path(out))
    files = describe(paths)
    refuse_early(target, files, how, val_fraction, tok.to_meta(), overwrite)
    refuse_unframed(target, tok, overwrite)
    plan = split_plan(paths, how, val_fraction)
    rebuild = rebuild or rebuild_command(sources, how, val_fraction, tokenizer=Path(out) / TOKENIZER_FILE,
                                         eot=tok.eot)
    return _write_shards(paths, files, tok, target, Path(out), how, val_fraction, progress, overwrite, rebuild,
                         plan)


def _write_shards(paths: Sequence[Path], files: list[dict[str, Any]], tok: HFTokenizer, target: Path, out: Path,
                  how: Reading, val_fraction: float, progress: Progress | None, overwrite: bool,
                  rebuild: str, plan: Split, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Tokenise the corpus `files` describes into a staging directory, split as `plan`
    says (`split_plan`), check and record it (with `extra` entries in meta.json), and put
    it in place at `target` (`out` as the user named it)."""
    dtype = token_dtype(tok.vocab_size)
    with dw.staging(target) as stage:
        writers = {s: ShardWriter(stage, s, dtype) for s in ("train", "val")}
        stats = _tokenize(split_documents(paths, how, val_fraction, plan), paths, tok, writers, progress)
        shards = {s: w.close() for s, w in writers.items()}
        _check_splits(stats, writers, val_fraction)
        check_unchanged(paths, files)
        meta = _meta(tok, dtype, shards, stats, writers, files, how, val_fraction, plan.kind) | (extra or {}) | {
            "rebuild": rebuild}
        write_atomic(stage / TOKENIZER_FILE, tok.json_text)
        tokens = {s["file"]: s["tokens"] for split in shards.values() for s in split}
        meta = dw.seal(stage, meta, tokens, dtype, tok.vocab_size, others=(TOKENIZER_FILE,))
        dw.publish(stage, target, meta, overwrite)
    return {"vocab_size": tok.vocab_size, "train_tokens": meta["train_tokens"], "val_tokens": meta["val_tokens"],
            "out_dir": str(out), "documents": {s: stats[s]["documents"] for s in stats}, "split": plan.kind,
            "val_fraction": val_fraction, "bytes": {s: stats[s]["bytes"] for s in stats}}


def document_ends(tok: HFTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The ids before and after each document's own: what the tokenizer's template puts
    around a text by default (Llama's BOS before it), then the end-of-text token unless
    the template already ends with it. A tokenizer without a template: nothing before,
    the end-of-text token after, as datasets were always written."""
    start, end = tok.template
    end = end if end[-1:] == (tok.eot_id,) else (*end, tok.eot_id)
    return np.asarray(start, dtype=np.uint32), np.asarray(end, dtype=np.uint32)


def _tokenize(docs: Iterator[tuple[str, str]], paths: Sequence[Path], tok: HFTokenizer,
              writers: dict[str, ShardWriter], progress: Progress | None) -> dict[str, dict[str, int]]:
    """Stream the (split, document) pairs of the corpus `paths` through `tok` into the
    writers; each split's documents and bytes. A batch holds up to BATCH_DOCS documents
    or pieces of them (`text_pieces`, for a byte-level tokenizer that cuts between words)
    and BATCH_CHARS characters, so a 20 MB line costs what 20 MB of short documents do."""
    stats = {s: {"documents": 0, "bytes": 0} for s in writers}
    total, done, batch, chars = sum(p.stat().st_size for p in paths), 0, [], 0
    cut = text_pieces if tok.cuts_between_words else lambda doc: iter((doc,))
    start, end = document_ends(tok)

    def flush() -> None:
        nonlocal done, chars
        for (split, piece, first, last), ids in zip(batch, tok.encode_batch([b[1] for b in batch])):
            writers[split].add(np.concatenate([start if first else start[:0], ids, end if last else end[:0]]))
            n = len(piece.encode("utf-8"))
            stats[split]["documents"] += int(last)
            stats[split]["bytes"] += n
            done += n
        batch.clear()
        chars = 0
        if progress is not None:
            progress(min(done, total), total)

    for split, doc in docs:
        pieces = cut(doc)
        piece, first = next(pieces), True
        for after in pieces:  # each piece once the next is known: the last one ends the document
            batch.append((split, piece, first, False))
            chars, piece, first = chars + len(piece), after, False
            if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
                flush()
        batch.append((split, piece, first, True))
        chars += len(piece)
        if len(batch) == BATCH_DOCS or chars >= BATCH_CHARS:
            flush()
    flush()
    return stats


def _check_splits(stats: dict, writers: dict[str, ShardWriter], val_fraction: float) -> None:
    """Every split holds documents and MIN_SPLIT_TOKENS tokens or more, else a DataError."""
    docs = sum(s["documents"] for s in stats.values())
    if docs == 0:
        raise _no_tokens()
    for split in ("train", "val"):
        if writers[split].tokens == 0:
            raise _empty_split(docs, split, val_fraction)
        if writers[split].tokens < MIN_SPLIT_TOKENS:  # a document ends with a token: 1 is a document without ids
            raise _short_split(split, val_fraction)


def _meta(tok: HFTokenizer, dtype: np.dtype, shards: dict, stats: dict, writers: dict[str, ShardWriter],
          files: list, how: Reading, val_fraction: float, plan: str) -> dict[str, Any]:
    return {
        "format": "shards-1", "vocab_size": tok.vocab_size, "tokenizer": tok.to_meta(),
        "dtype": "uint16" if dtype.itemsize == 2 else "uint32", "shards": shards,
        "train_tokens": writers["train"].tokens, "val_tokens": writers["val"].tokens,
        "splits": {s: stats[s] | {"tokens": writers[s].tokens} for s in stats},
        "corpus": {"name": "files", "files": files, "split_on": how.split_on, "text_field": how.text_field,
                   "val_fraction": val_fraction, "split": plan},
    } | template_record(tok)
