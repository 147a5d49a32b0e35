"""Data: a corpus read as token ids, the trainer's per-rank batches, and `lowband prepare`.

  tokens.py     a corpus as one flat array of token ids: builtin, text, .bin, a prepared shard
                directory (ShardedTokens); load_tokens, vocab_needed
  tokenizer.py  tokenizers from local files (a tokenizer.json or a save_pretrained directory)
  prepare.py    the prepare pipeline: text, JSONL or Parquet into resumable token shards
  batches.py    what the trainer reads: load_corpus (--data, --tokenizer) and Batches
  cli.py        `lowband prepare`

The names below are the public ones; the modules of this package import each other, never this
file.
"""

from lowband.data.batches import Batches, load_corpus, record_tokenizer
from lowband.data.tokens import META, ShardedTokens, builtin_path, load_tokens, stdlib_files, vocab_needed

__all__ = ["META", "Batches", "ShardedTokens", "builtin_path", "load_corpus", "load_tokens",
           "record_tokenizer", "stdlib_files", "vocab_needed"]
