"""A corpus as one flat array of token ids (batches.py cuts it into per-rank batches).

Four sources:
  builtin      the running Python's standard library source (*.py, sorted by path), as bytes;
               cached once under ~/.cache/lowband (or $LOWBAND_CACHE)
  a text file  its bytes; a directory: the bytes of every file under it, sorted by path
  a .bin file  uint16 token ids (nanoGPT style), memory-mapped
  a shard dir  written by `lowband prepare` (prepare.py; docs/data.md): meta.json and token
               shards, each memory-mapped and checked against meta.json (size, sampled sha256);
               read as their concatenation without copying it (ShardedTokens)
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from lowband.options import CACHE_ENV, ConfigError

BYTE_VOCAB = 256
META = "meta.json"  # of a shard directory; its shards are named shard-NNNNN.bin
SAMPLE = 1 << 16  # sample_sha256: the first, middle and last SAMPLE bytes of a shard


def _cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "lowband"))


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _concat_to_cache(files: list[Path], tag: str) -> Path:
    """Concatenate files' bytes into one cached file (atomic: written beside, then renamed)."""
    key = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:16]
    path = _cache_dir() / f"{tag}-{key}.u8"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as out:
            for p in files:
                out.write(p.read_bytes())
        os.replace(tmp, path)
    return path


def builtin_path() -> Path:
    return _concat_to_cache(stdlib_files(), "stdlib-py" + sysconfig.get_python_version())


def load_tokens(data: str) -> np.ndarray:
    """The flat token array of a data source (see the module docstring)."""
    if data == "builtin":
        return np.memmap(builtin_path(), dtype=np.uint8, mode="r")
    path = Path(data)
    if not path.exists():
        raise ConfigError(f"data path '{data}' does not exist: give an existing text file, "
                          "directory or .bin token file, or 'builtin'.")
    if path.is_dir() and (path / META).exists():
        return ShardedTokens(path)
    if path.is_dir() and (any(path.glob("shard-*.bin")) or (path / "progress.json").exists()):
        raise ConfigError(f"'{data}' holds token shards but no {META}: finish it with `lowband "
                          "prepare` (a rerun resumes it) or give a directory of text files.")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise ConfigError(f"data directory '{data}' has no files: put text files in it.")
        return np.memmap(_concat_to_cache(files, "dir"), dtype=np.uint8, mode="r")
    if path.stat().st_size == 0:
        raise ConfigError(f"data file '{data}' is empty: give a file with text or tokens in it.")
    if path.suffix == ".bin":
        if path.stat().st_size % 2:
            raise ConfigError(f"token file '{data}' has an odd number of bytes: a .bin file must "
                              "hold uint16 token ids.")
        return np.memmap(path, dtype=np.uint16, mode="r")
    return np.memmap(path, dtype=np.uint8, mode="r")


def vocab_needed(tokens) -> int:
    if isinstance(tokens, ShardedTokens):
        return tokens.vocab_size  # the tokenizer's, whether or not every id occurs
    return BYTE_VOCAB if tokens.dtype == np.uint8 else int(tokens.max()) + 1


def sample_sha256(path: Path) -> str:
    """sha256 of a file's first, middle and last SAMPLE bytes: cheap enough to check every shard
    at every start (meta.json also holds each shard's full sha256)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for at in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
            f.seek(at)
            h.update(f.read(SAMPLE))
    return h.hexdigest()


class ShardedTokens:
    """The token shards of a `lowband prepare` directory as one flat, read-only array: len()
    and integer-array indexing (what Batches uses), each shard memory-mapped, never loaded whole.
    A window may cross from one shard into the next: the shards are one token stream, cut at
    fixed token counts."""

    def __init__(self, root: Path):
        self.root = Path(root)
        try:
            self.meta = json.loads((self.root / META).read_text())
            self.dtype = np.dtype(self.meta["dtype"])
            self.vocab_size = int(self.meta["vocab_size"])
            shards = self.meta["shards"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{self.root / META} is damaged ({e!r}): prepare the directory "
                              "again with `lowband prepare ... --overwrite`.") from None
        if not shards:
            raise ConfigError(f"{self.root / META} lists no shards: prepare it from a non-empty source.")
        self.shards = []
        for s in shards:
            path = self.root / s["file"]
            size = path.stat().st_size if path.exists() else None
            why = ("is missing" if size is None else
                   f"has {size} bytes where {META} says {s['bytes']}" if size != s["bytes"] else
                   "does not match its sampled sha256" if sample_sha256(path) != s["sample_sha256"]
                   else "")
            if why or s["bytes"] != s["tokens"] * self.dtype.itemsize:
                raise ConfigError(f"shard {path} {why or 'disagrees with ' + META} (corrupt or "
                                  "truncated): prepare the directory again with `lowband prepare "
                                  "... --overwrite`.")
            self.shards.append(np.memmap(path, dtype=self.dtype, mode="r"))
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, slice):
            idx = np.arange(*idx.indices(len(self)))
        idx = np.asarray(idx)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        which = np.searchsorted(self.starts, idx, side="right") - 1  # (shard, offset) per index
        out = np.empty(idx.shape, dtype=self.dtype)
        for k in np.unique(which):
            mask = which == k
            out[mask] = self.shards[k][idx[mask] - self.starts[k]]
        return out
