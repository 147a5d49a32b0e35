"""What the trainer reads: the corpus (`load_corpus`: --data, with --tokenizer prepared once
into a cache) and deterministic, disjoint per-rank batches with a held-out split (`Batches`).

The last `val_fraction` of the token array is the validation split; the rest is cut into `world`
contiguous, disjoint shards, one per global rank. A batch is a pure function of
(seed, rank, step, micro): reproducible, resumable, and never touches another rank's shard or
the validation split.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from lowband.data.prepare import FORMAT, _sources, prepare_files, source_files
from lowband.data.tokenizer import existing, load_tokenizer, tokenizer_sha256
from lowband.data.tokens import META, ShardedTokens, _cache_dir, load_tokens, stdlib_files
from lowband.options import ConfigError


def load_corpus(data: str, tokenizer: str = "", progress: bool = False):
    """The tokens `lowband train` reads: tokens.load_tokens(data) without a tokenizer; with one,
    a prepared directory (which must have been tokenized by it) or text prepared once into a
    cache directory (~/.cache/lowband/tokens-KEY, or $LOWBAND_CACHE)."""
    if not tokenizer:
        return load_tokens(data)
    sha, path = tokenizer_sha256(existing(tokenizer)), Path(data)
    if data != "builtin" and (path / META).exists():
        tokens = ShardedTokens(path)
        if tokens.meta.get("tokenizer_sha256") != sha:
            raise ConfigError(f"'{data}' was prepared with another tokenizer than '{tokenizer}': "
                              "drop --tokenizer (the directory brings its own) or prepare it again.")
        return tokens
    if path.suffix == ".bin":
        raise ConfigError(f"'{data}' holds token ids already: drop --tokenizer, or give text.")
    if data == "builtin":
        root, files = Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    else:
        root, files = path, source_files(path)
    key = json.dumps([FORMAT, sha, str(root.resolve()), _sources(files, root)])
    cached = _cache_dir() / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (cached / META).exists():  # prepared beside, then renamed: ranks may race here
        tok = load_tokenizer(tokenizer)
        tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        if progress:
            print(f"lowband: tokenizing '{data}' with '{tokenizer}' once (cached in {cached})",
                  file=sys.stderr)
        prepare_files(files, root, tmp, tok, progress=progress)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process was first
            shutil.rmtree(tmp, ignore_errors=True)
    return ShardedTokens(cached)


def record_tokenizer(tokens, run_root: Path) -> dict | None:
    """Copy the tokenizer of prepared tokens into RUN/tokenizer/ (what an export ships); its
    record for config.json's meta. None for bytes and .bin files."""
    if not isinstance(tokens, ShardedTokens) or not (tokens.root / "tokenizer").is_dir():
        return None
    dest = Path(run_root) / "tokenizer"
    if not dest.is_dir():  # every rank gets here: one copies, whole, by renaming its copy
        tmp = dest.with_name(f"tokenizer.{os.getpid()}.tmp")
        shutil.copytree(tokens.root / "tokenizer", tmp, dirs_exist_ok=True)
        try:
            os.rename(tmp, dest)
        except OSError:  # another rank's copy landed first
            shutil.rmtree(tmp, ignore_errors=True)
    return {"sha256": tokens.meta.get("tokenizer_sha256"), "path": tokens.meta.get("tokenizer_path"),
            "data": str(tokens.root.resolve()), "vocab_size": tokens.vocab_size, "eos_id": tokens.meta.get("eos_id")}


class Batches:
    """Training and validation batches for one global rank."""

    def __init__(self, tokens: np.ndarray, *, rank: int, world: int, seq_len: int,
                 batch_size: int, seed: int, val_fraction: float, device: str = "cpu"):
        """device: where batches are delivered (from pinned memory, asynchronously, on CUDA)."""
        self.tokens, self.rank, self.world = tokens, rank, world
        self.device = torch.device(device)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        n = len(tokens)
        self.val_start = n - max(int(n * val_fraction), seq_len + 1)
        shard = self.val_start // world
        if shard < seq_len + 1 or self.val_start < 0:
            raise ConfigError(f"the corpus ({n} tokens) is too small for {world} shards of "
                              f"sequences of {seq_len} tokens: use more data, fewer ranks or a "
                              "shorter --seq-len.")
        self.lo, self.hi = rank * shard, (rank + 1) * shard  # this rank's shard [lo, hi)

    def _windows(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        chunk = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        if self.device.type == "cuda":  # page-locked, so the copy overlaps the GPU's work
            chunk = chunk.pin_memory().to(self.device, non_blocking=True)
        else:
            chunk = chunk.to(self.device)
        return chunk[:, :-1], chunk[:, 1:]

    def train_starts(self, step: int, micro: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, step, micro])
        return rng.integers(self.lo, self.hi - self.seq_len, size=self.batch_size)

    def train(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (batch_size, seq_len), from this rank's shard."""
        return self._windows(self.train_starts(step, micro))

    def val(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch i: the same on every rank, only from the held-out split."""
        rng = np.random.default_rng([self.seed, 1 << 20, i])
        starts = rng.integers(self.val_start, len(self.tokens) - self.seq_len, size=self.batch_size)
        return self._windows(starts)
