"""`lowband prepare SRC -o DIR --tokenizer PATH`: text, JSONL or Parquet files into the token
shards that `lowband train --data DIR` reads (the pipeline: prepare.py; the format: docs/data.md)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from lowband.data.prepare import TEXT_SUFFIXES, cores, prepare_files, source_files
from lowband.data.tokenizer import load_tokenizer
from lowband.data.tokens import META
from lowband.options import ArgParser, ConfigError


def parse_count(value: str) -> int:
    """An integer count from '100M', '250k', '1G', '1e6' or '5000'."""
    m = re.fullmatch(r"\s*(\d+\.?\d*(?:[eE]\d+)?)\s*([kKmMgG]?)\s*", str(value))
    n = int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]) if m else 0
    if n < 1:
        raise ConfigError(f"--shard-tokens '{value}' is not a positive count: write it like 100M, "
                          "250k or 5000.")
    return n


def parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="lowband prepare", description="Tokenize text, JSONL or Parquet files into "
                  "token shards that `lowband train --data DIR` reads (docs/data.md). Resumable: "
                  "rerun the same command after an interruption.")
    p.add_argument("src", metavar="SRC", help="a file or a directory of text "
                   f"({', '.join(TEXT_SUFFIXES)}), JSONL (.jsonl) and Parquet (.parquet) files")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the shard directory")
    p.add_argument("--tokenizer", required=True, metavar="PATH", help="a tokenizer.json file or a "
                   "directory saved with save_pretrained (local files only)")
    p.add_argument("--text-field", default="text", metavar="NAME", help="the field (JSONL) or column (Parquet) "
                   "holding the text (default: text)")
    p.add_argument("--shard-tokens", default="100M", metavar="N", help="tokens per shard (default: 100M)")
    p.add_argument("--workers", type=int, default=cores(), metavar="N",
                   help="tokenizing processes (default: the cores, %(default)s here)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar on stderr, when it is a terminal (default: on)")
    p.add_argument("--overwrite", action="store_true", help="prepare DIR again when it holds "
                   "another preparation (other sources, tokenizer or settings)")
    return p


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    if a.workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {a.workers}.")
    shard_tokens = parse_count(a.shard_tokens)
    tok = load_tokenizer(a.tokenizer)
    src = Path(a.src)
    files = source_files(src)
    if tok.eos_id is None:
        print(f"lowband: note: tokenizer '{a.tokenizer}' names no end-of-text token, so documents "
              "are joined without a separator.", file=sys.stderr)
    t0, done = time.perf_counter(), not a.overwrite and (Path(a.output) / META).exists()
    try:
        meta = prepare_files(files, src, Path(a.output), tok, text_field=a.text_field,
                             shard_tokens=shard_tokens, workers=a.workers, progress=a.progress,
                             overwrite=a.overwrite)
    except KeyboardInterrupt:
        print("lowband: interrupted; the shards done are kept: rerun the same command to "
              "resume.", file=sys.stderr)
        return 130
    dt = time.perf_counter() - t0
    if done:
        print(f"{a.output} is prepared already, from the same sources and tokenizer: "
              f"{meta['tokens']:,} tokens in {len(meta['shards'])} shards.")
        return 0
    print(f"{a.output}: {meta['tokens']:,} tokens in {len(meta['shards'])} shards ({meta['dtype']}, "
          f"vocabulary {meta['vocab_size']}) from {len(files)} files in {dt:.1f} s "
          f"({meta['tokens'] / max(dt, 1e-9):,.0f} tokens/s)")
    return 0
