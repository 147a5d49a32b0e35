"""The prepare pipeline: text into the token shards that `lowband train --data DIR` reads
memory-mapped (tokens.ShardedTokens), run by `lowband prepare` (cli.py) and by `lowband train
--tokenizer` on raw text (batches.load_corpus). docs/data.md has the format.

  tokenizer  a tokenizer.json or a save_pretrained directory, read by tokenizer.py; its hash
             covers its files' bytes
  sources    SRC, a file or a directory (every file under it, sorted by path, dot-files left
             out): text (TEXT_SUFFIXES; a file is one document), JSONL (.jsonl: a document a line,
             its --text-field) or Parquet (.parquet: the --text-field column, read with pyarrow)
  units      the sources cut into units of about UNIT_BYTES (small files grouped; a longer text
             file cut after a line end, JSONL at line starts, Parquet by row group): fixed by the
             sources alone, never by the number of workers
  encoding   worker processes (--workers), each single-threaded, run the tokenizer's
             encode_batch_fast (encode_batch before tokenizers 0.21; no special tokens) on a unit
             and append the end-of-text id after each document; the parent takes the results in unit order, so the shards are the same
             bytes for any number of workers
  shards     that stream cut every --shard-tokens tokens into shard-NNNNN.bin (uint16 when the
             vocabulary fits, else uint32), each written under a temporary name and renamed;
             progress.json then records where the stream stands, and a rerun continues there
  meta.json  written last: its presence means the directory is complete

`--tokenizer` with raw text (batches.load_corpus) prepares it once into a cache directory keyed
on the source files and the tokenizer's hash. tokenizers, transformers and pyarrow load lazily.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from lowband.data.tokenizer import TokenizerRef, tokenizer_files
from lowband.data.tokens import META, sample_sha256
from lowband.options import ConfigError, needs_extra

FORMAT = "lowband-shards-1"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
UNIT_BYTES = 1 << 20
PROGRESS = "progress.json"


# ---------------------------------------------------------------------------------------------
# sources and units
# ---------------------------------------------------------------------------------------------

def kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        needs_extra("parquet", f"'{path}' (Parquet)", "pyarrow")
    if suffix in (".jsonl", ".parquet"):
        return suffix[1:]
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise ConfigError(f"'{path}' is of an unknown type ({suffix or 'no suffix'}): prepare reads "
                      f"text ({', '.join(TEXT_SUFFIXES)}), JSONL (.jsonl) and Parquet (.parquet) files.")


def source_files(src: Path) -> list[Path]:
    if not src.exists():
        raise ConfigError(f"source '{src}' does not exist: give a text, JSONL or Parquet file or "
                          "a directory of them.")
    files = [src] if src.is_file() else sorted(
        p for p in src.rglob("*") if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(src).parts))
    if not files:
        raise ConfigError(f"source directory '{src}' has no files: put text, JSONL or Parquet files in it.")
    for f in files:
        kind_of(f)
    return files


def _line_cuts(path: Path, size: int) -> list[int]:
    """Byte offsets cutting a file into pieces of about UNIT_BYTES, each after a line end."""
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + UNIT_BYTES < size:
            f.seek(cuts[-1] + UNIT_BYTES)
            f.readline()
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return cuts + [size]


def plan_units(files: list[Path], text_field: str) -> tuple[list[list[tuple]], list[int]]:
    """The units (lists of pieces (kind, path, a, b, ends_document)) and their sizes in bytes."""
    pieces = []
    for f in files:
        kind = kind_of(f)
        if kind == "parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(f)
            except Exception as e:
                raise ConfigError(f"'{f}' is not a readable Parquet file ({type(e).__name__}).") from None
            if text_field not in pf.schema_arrow.names:
                raise ConfigError(f"'{f}' has no column '{text_field}': pass --text-field with one "
                                  f"of {', '.join(pf.schema_arrow.names)}.")
            md = pf.metadata
            pieces += [(kind, str(f), i, 0, True, md.row_group(i).total_byte_size)
                       for i in range(md.num_row_groups)]
        else:
            if kind == "jsonl":
                _documents(kind, str(f), 0, _line_cuts(f, f.stat().st_size)[1], text_field)
            size = f.stat().st_size
            cuts = _line_cuts(f, size)
            pieces += [(kind, str(f), a, b, kind == "jsonl" or b == size, b - a)
                       for a, b in zip(cuts, cuts[1:])]
    units, sizes = [], []
    for piece in pieces:
        if not units or sizes[-1] >= UNIT_BYTES:
            units.append([])
            sizes.append(0)
        units[-1].append(piece[:5])
        sizes[-1] += piece[5]
    return units, sizes


# ---------------------------------------------------------------------------------------------
# encoding (in worker processes)
# ---------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int | None, text_field: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: --workers is the cores
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    # encode_batch_fast (tokenizers >= 0.21): the same ids, without computing character offsets
    _worker.update(encode=getattr(tok, "encode_batch_fast", tok.encode_batch), field=text_field,
                   dtype=np.dtype(dtype), eos=None if eos_id is None else np.array([eos_id], dtype))


def _documents(kind: str, path: str, a: int, b: int, field: str) -> list[str]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        column = pq.ParquetFile(path).read_row_group(a, columns=[field]).column(0).to_pylist()
        return [t for t in column if t is not None]
    with open(path, "rb") as f:
        f.seek(a)
        data = f.read(b - a)
    if kind == "text":
        return [data.decode("utf-8", "replace")]
    docs = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise ConfigError(f"'{path}' has a line that is no JSON object after byte {a}: fix "
                              "or remove it.")
        text = record.get(field)
        if field not in record or not isinstance(text, (str, type(None))):
            raise ConfigError(f"a record of '{path}' after byte {a} has no text field '{field}': "
                              "pass --text-field with the field that holds the text.")
        if text is not None:
            docs.append(text)
    return docs


def _encode_unit(unit: list[tuple]) -> np.ndarray:
    """The token ids of a unit: each document's encoding, then the end-of-text id."""
    texts, ends = [], []
    for kind, path, a, b, ends_document in unit:
        docs = _documents(kind, path, a, b, _worker["field"])
        texts += docs
        ends += [ends_document] * len(docs)
    parts, dtype, eos = [], _worker["dtype"], _worker["eos"]
    for enc, end in zip(_worker["encode"](texts, add_special_tokens=False), ends):
        parts.append(np.array(enc.ids, dtype=dtype))
        if end and enc.ids and eos is not None:
            parts.append(eos)
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pool(tok: TokenizerRef, text_field: str, dtype: str, workers: int):
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(
        workers, initializer=_init_worker, initargs=(tok.json, tok.eos_id, text_field, dtype))


# ---------------------------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------------------------

def shard_name(k: int) -> str:
    return f"shard-{k:05d}.bin"


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _save_progress(out: Path, state: dict) -> None:
    _write_json(out / PROGRESS, state)


class _ShardWriter:
    """The token stream into shards of shard_tokens: a shard is written under a temporary name,
    renamed when full, then progress.json says where the stream resumes (unit, tokens to skip)."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, state: dict):
        self.out, self.dtype, self.shard_tokens, self.state = out, dtype, shard_tokens, state
        self.file, self.n = None, 0

    def add(self, ids: np.ndarray, unit: int, offset: int) -> None:
        pos = 0
        while pos < len(ids):
            if self.file is None:
                self.path = self.out / shard_name(len(self.state["shards"]))
                self.file, self.n, self.sha = open(self.path.with_suffix(".tmp"), "wb"), 0, hashlib.sha256()
            chunk = ids[pos:pos + self.shard_tokens - self.n]
            self.file.write(chunk.tobytes())
            self.sha.update(chunk.tobytes())
            self.n, pos = self.n + len(chunk), pos + len(chunk)
            if self.n == self.shard_tokens and pos == len(ids):
                self.commit(unit + 1, 0)
            elif self.n == self.shard_tokens:
                self.commit(unit, offset + pos)

    def commit(self, next_unit: int, skip: int) -> None:
        self.file.close()
        self.file = None
        os.replace(self.path.with_suffix(".tmp"), self.path)
        self.state["shards"].append({
            "file": self.path.name, "tokens": self.n, "bytes": self.path.stat().st_size,
            "sha256": self.sha.hexdigest(), "sample_sha256": sample_sha256(self.path)})
        self.state.update(next_unit=next_unit, skip=skip)
        _save_progress(self.out, self.state)

    def close(self) -> None:  # an unfinished shard is dropped: a rerun writes it again
        if self.file is not None:
            self.file.close()
            self.path.with_suffix(".tmp").unlink(missing_ok=True)
            self.file = None


def _sources(files: list[Path], root: Path) -> list[dict]:
    """Each source file by its path under root, size and contents' sha256: a file merely
    touched (its mtime moved) is the same source."""
    out = []
    for f in files:
        with open(f, "rb") as data:
            digest = hashlib.file_digest(data, "sha256").hexdigest()
        out.append({"path": f.name if f == root else str(f.relative_to(root)),
                    "bytes": f.stat().st_size, "sha256": digest})
    return out


def _identity(files: list[Path], root: Path, tok: TokenizerRef, text_field: str,
              shard_tokens: int) -> dict:
    """What the shards depend on: a rerun with another identity is refused."""
    return {"format": FORMAT, "dtype": "uint16" if tok.vocab_size <= 1 << 16 else "uint32",
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "tokenizer_sha256": tok.sha256,
            "text_field": text_field, "shard_tokens": shard_tokens, "source": str(root.resolve()),
            "sources": _sources(files, root)}


# what differs, in the words of prepare's arguments (the rest follow from the tokenizer)
_SETTINGS = {"source": "from {} (now {})", "text_field": "with --text-field {} (now {})",
             "shard_tokens": "with --shard-tokens {} (now {})"}


def _difference(prior: dict, ident: dict) -> str:
    """How a directory's preparation (`prior`) differs from this one's, the first difference
    named: 'with --shard-tokens 6000 (now 5000)', 'with another tokenizer', 'from other
    sources (a0.py changed)'."""
    for key, words in _SETTINGS.items():
        if prior.get(key) != ident[key]:
            return words.format(prior.get(key), ident[key])
    if any(prior.get(k) != ident[k] for k in ident if k != "sources"):
        return "with another tokenizer"
    before = {s["path"]: s for s in prior.get("sources") or []}
    now = {s["path"]: s for s in ident["sources"]}
    for path in sorted(before.keys() | now.keys()):
        if path not in now or path not in before:
            return f"from other sources ({path} is {'gone' if path in before else 'new'})"
        if "sha256" not in before[path]:
            return "by an older lowband, which did not record its sources' contents"
        if before[path] != now[path]:
            return f"from other sources ({path} changed)"
    return "from other sources"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def prepare_files(files: list[Path], root: Path, out: Path, tok: TokenizerRef, *,
                  text_field: str = "text", shard_tokens: int = 100_000_000,
                  workers: int | None = None, progress: bool = True,
                  overwrite: bool = False) -> dict:
    """Tokenize files (under root) into shards in out; returns the meta.json written (or found:
    an identical, complete preparation is not redone)."""
    ident = _identity(files, root, tok, text_field, shard_tokens)
    units, sizes = plan_units(files, text_field)  # refuses bad sources before out is touched
    meta, state = _read_json(out / META), _read_json(out / PROGRESS)
    prior = meta or (state or {}).get("ident")
    if prior is None:
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"'{out}' holds other files: give a new or empty directory.")
    elif not overwrite and {k: prior.get(k) for k in ident} != ident:
        raise ConfigError(f"'{out}' was prepared {_difference(prior, ident)}: pass --overwrite "
                          "to prepare it again, or give another -o directory.")
    elif not overwrite and meta is not None:
        return meta  # done before, identically
    elif overwrite:  # only what a preparation writes is removed
        for p in [*out.glob("shard-*.bin"), *out.glob("shard-*.tmp"), out / META, out / PROGRESS]:
            p.unlink(missing_ok=True)
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        state = None
    for s in (state or {}).get("shards", []):
        if not (out / s["file"]).exists() or (out / s["file"]).stat().st_size != s["bytes"]:
            raise ConfigError(f"shard {out / s['file']} of an unfinished preparation is corrupt: "
                              "pass --overwrite to start again.")
    out.mkdir(parents=True, exist_ok=True)
    if state is None:  # first, so that a rerun knows the directory as this preparation's
        state = {"ident": ident, "shards": [], "next_unit": 0, "skip": 0}
        _write_json(out / PROGRESS, state)
    (out / "tokenizer").mkdir(exist_ok=True)
    for name, p in tokenizer_files(tok.path):
        shutil.copyfile(p, out / "tokenizer" / name)

    from tqdm import tqdm

    first, skip = state["next_unit"], state["skip"]
    writer = _ShardWriter(out, np.dtype(ident["dtype"]), shard_tokens, state)
    bar = tqdm(total=sum(sizes), initial=sum(sizes[:first]), unit="B", unit_scale=True,
               desc="tokenizing", file=sys.stderr, disable=not (progress and sys.stderr.isatty()),
               mininterval=0.5, dynamic_ncols=True)
    workers = max(1, min(workers or cores(), len(units) - first))
    try:
        with _pool(tok, text_field, ident["dtype"], workers) as pool:
            for unit, ids in enumerate(pool.imap(_encode_unit, units[first:]), start=first):
                offset = skip if unit == first else 0
                writer.add(ids[offset:], unit, offset)
                bar.update(sizes[unit])
        if writer.file is not None:
            writer.commit(len(units), 0)
    finally:
        writer.close()
        bar.close()
    if not state["shards"]:
        raise ConfigError(f"'{root}' holds no text to tokenize: give sources with text in them.")
    meta = {**ident, "tokenizer_path": str(tok.path), "tokens": sum(s["tokens"] for s in state["shards"]),
            "shards": state["shards"]}
    _write_json(out / META, meta)
    (out / PROGRESS).unlink()
    return meta
