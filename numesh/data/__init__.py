"""Datasets, from text to the tokens of a step.

Bottom to top: tokenizers (`tokenizer`), corpora streamed from .txt/.jsonl/.parquet (`corpus`),
token shard files (`shards`), each file's record in meta.json (`check`), a dataset staged and
renamed into place whole (`write`), a dataset opened and verified as one snapshot (`dataset`),
character datasets and the default one (`char`), corpora tokenised into shards (`sharded`), and
mesh-independent batches (`batches`). No MPI here.
"""
