"""Foundations every other package stands on: pytrees of frozen attrs classes (`tree`), every
error numesh raises on purpose (`errors`), rounding up (`padding`), writing a file whole
(`files`) and this host's processes (`process`). Nothing here imports the rest of numesh."""
