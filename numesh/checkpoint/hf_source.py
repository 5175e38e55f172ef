"""What a checkpoint keeps of the transformers directory its run started from (`--init-from`),
so that `numesh export --format hf` gives the model back with what its source said of it.

A run's dataset records only the tokenizer.json and its end-of-text token, and its model
only the training block size: exported from those alone, a fine-tuned Llama had its bos
and unk tokens set to its eos, no pad token nor chat template, and a context cut to the
block size (a later `--init-from EXPORT` at the source's longer context was refused, though
rotary positions have no table to outgrow). So when a run starts from a directory, its
checkpoints record a small `Source` in meta.json (`SOURCE_KEY`), carried on by every resume:
tokenizer_config.json's special tokens, `model_max_length` and chat template (a
`chat_template.jinja` beside it first, as transformers reads it), config.json's and
generation_config.json's token ids, and a Llama-family model's `max_position_embeddings`.
The export writes them back (`tokenizer_fields`, `config_ids`, `generation_ids`,
`max_positions`); a model trained from scratch has no record and exports as before.

The source's files are read leniently, as `numesh data tokenize` reads them: one that is
missing, unreadable or not a JSON object records nothing (the run does not need it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from numesh.base.errors import CheckpointError
from numesh.base.files import json_object_or_none
from numesh.checkpoint.hf_llama import MODEL_TYPES, pretrained

SOURCE_KEY = "init_source"  # meta.json's key of the record
TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers 5's file of a tokenizer's one chat template


def _is_token(value: Any) -> bool:
    """A special token as tokenizer_config.json spells it: its text, or an AddedToken object."""
    return isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("content"), str))


def _is_id(value: Any) -> bool:
    """A token id as config files spell it: an int, or a list of them (several eos ids)."""
    ints = value if isinstance(value, list) else [value]
    return bool(ints) and all(isinstance(i, int) and not isinstance(i, bool) for i in ints)


def _ids(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """The token ids a config.json or generation_config.json names (None: no such file)."""
    return None if obj is None else {k: obj[k] for k in IDS if _is_id(obj.get(k))}


def _tokenizer(directory: Path) -> dict[str, Any] | None:
    """tokenizer_config.json's special tokens, model_max_length and chat template (None: no
    such file); the chat template from chat_template.jinja where there is one."""
    cfg = json_object_or_none(directory / "tokenizer_config.json")
    if cfg is None:
        return None
    out: dict[str, Any] = {k: cfg[k] for k in TOKENS if _is_token(cfg.get(k))}
    if isinstance(cfg.get("model_max_length"), int) and cfg["model_max_length"] > 0:
        out["model_max_length"] = cfg["model_max_length"]
    try:
        template: Any = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        template = cfg.get("chat_template")
    if isinstance(template, (str, list)) and template:
        out["chat_template"] = template
    return out


def read_source(path: str | Path) -> dict[str, Any] | None:
    """The record of the transformers directory `path` a run starts from (the module
    docstring's), JSON-ready; None for a `numesh export` file, which has none to give."""
    p = Path(path)
    config = json_object_or_none(p / "config.json") if p.is_dir() else None
    if config is None:
        return None
    record: dict[str, Any] = {"config_ids": _ids(config), "tokenizer": _tokenizer(p),
                              "generation_ids": _ids(json_object_or_none(p / "generation_config.json"))}
    if config.get("model_type") in MODEL_TYPES:
        record["max_position_embeddings"] = pretrained(p).max_positions  # the class's default where it is left out
    return record


def recorded_source(meta: dict[str, Any], where: Path) -> dict[str, Any] | None:
    """The record in the meta.json document `meta` (of the checkpoint `where`), None when its
    run did not start from a transformers directory; one line if it is malformed."""
    record = meta.get(SOURCE_KEY)
    if record is None:
        return None
    parts_ok = isinstance(record, dict) and all(
        isinstance(record.get(k), (dict, type(None))) for k in ("config_ids", "tokenizer", "generation_ids"))
    if not parts_ok or not isinstance(record.get("max_position_embeddings", 0), int):
        raise CheckpointError(f"{where}/meta.json: {SOURCE_KEY} is not the record numesh writes of a run's "
                              "--init-from directory: the file was edited; restore it")
    return record


def max_positions(source: dict[str, Any] | None, block_size: int) -> int:
    """A Llama-family export's max_position_embeddings: its source's (at least the block size
    it was trained at), else the block size."""
    theirs = (source or {}).get("max_position_embeddings")
    return max(theirs, block_size) if isinstance(theirs, int) else block_size


def tokenizer_fields(source: dict[str, Any] | None, eot: str | None, max_length: int) -> dict[str, Any]:
    """tokenizer_config.json's special tokens, model_max_length and chat template: the source's
    where it had a tokenizer_config.json (its eos, if it named none, the dataset's `eot`),
    else the end-of-text token `eot` in every role (None: a character tokenizer's, none)."""
    theirs = (source or {}).get("tokenizer")
    if theirs is None:
        special = {} if eot is None else {"bos_token": eot, "eos_token": eot, "unk_token": eot}
        return {"model_max_length": max_length, **special}
    fields = {"model_max_length": max_length, **({} if eot is None else {"eos_token": eot})}
    return fields | theirs


def config_ids(source: dict[str, Any] | None, eot_id: int | None) -> dict[str, Any]:
    """config.json's token ids: the source's over the end-of-text id as eos; a model trained
    from scratch has it as bos too (a source that names no bos keeps none)."""
    if source is None:
        return {"bos_token_id": eot_id, "eos_token_id": eot_id}
    return {"eos_token_id": eot_id} | (source.get("config_ids") or {})


def generation_ids(source: dict[str, Any] | None, eot_id: int | None) -> dict[str, Any]:
    """generation_config.json's token ids: the source's own file's alone where it had one,
    else config.json's (`config_ids`). transformers reads the file alone where there is one
    (an eos it leaves out is no eos: `generate` runs on), and builds one from config.json
    where there is none; a merge of the two made an export stop where its source did not."""
    theirs = (source or {}).get("generation_ids")
    return dict(theirs) if theirs is not None else config_ids(source, eot_id)
