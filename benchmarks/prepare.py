"""`lowband prepare` throughput against the tokenizer's own encode_batch, per core used.

The same documents (the first --mb MB of the Python standard library's *.py files, in the
built-in corpus's order, each file one document) are tokenized by
  encode_batch   the tokenizer's own Tokenizer.encode_batch in this one process, on texts already
                 in memory: one thread (TOKENIZERS_PARALLELISM=false), and all threads last (the
                 Rust pool, for reference); and encode_batch_fast (the same ids without character
                 offsets), which prepare's workers call, on one thread;
  prepare        lowband.data.prepare.prepare_files, what `lowband prepare` runs: reading the files,
                 --workers processes, the shards and meta.json written, pool start-up included;
                 with 1 worker and with one a core.
The tokenizer is a byte-level BPE trained here (--vocab, on 2 MB of the same corpus); nothing is
downloaded. Prints tokens/s, cores, tokens/s per core and the ratio per core to single-threaded
encode_batch for each row, then PASS/MISS for the goal (prepare with one worker a core >= 0.9x
per core). Each row is the fastest of --repeat runs (a shared machine's noise only slows).

    python benchmarks/prepare.py [--mb 16] [--vocab 8192] [--repeat 2] [--smoke] [--json out.json]

On a shared machine the other cores may be busy: the last line, prepare against encode_batch's own
thread pool on the same cores, tells the machine's load apart from prepare's overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from machine import describe  # benchmarks/machine.py

from lowband.data import stdlib_files
from lowband.data.prepare import prepare_files
from lowband.data.tokenizer import load_tokenizer


def train_tokenizer(path: Path, vocab: int, files: list[Path]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = b"".join(f.read_bytes() for f in files)[:2_000_000].decode("utf-8", "replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)],
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.save(str(path))


def encode_batch(tok_path: Path, docs: list[str], threads: str, fn="encode_batch") -> tuple[int, float]:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = threads
    encode = getattr(Tokenizer.from_file(str(tok_path)), fn)
    t0 = time.perf_counter()
    n = sum(len(e.ids) + bool(e.ids) for e in encode(docs, add_special_tokens=False))  # + eos
    return n, time.perf_counter() - t0


def prepare(tok_path: Path, files: list[Path], root: Path, workers: int, out: Path) -> tuple[int, float]:
    tok = load_tokenizer(str(tok_path))
    t0 = time.perf_counter()
    meta = prepare_files(files, root, out, tok, workers=workers, progress=False)
    return meta["tokens"], time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=16, help="MB of text to tokenize (default 16)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    p.add_argument("--repeat", type=int, default=2, help="runs per row; the fastest is kept")
    p.add_argument("--smoke", action="store_true", help="2 MB, vocabulary 1024, one run: a check")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    if a.smoke:
        a.mb, a.vocab, a.repeat = 2, 1024, 1
    cores = len(os.sched_getaffinity(0))
    all_files = stdlib_files()
    root = Path(os.path.commonpath(all_files))
    files, total = [], 0
    for f in all_files:
        if total >= a.mb * 1e6:
            break
        files.append(f)
        total += f.stat().st_size
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {describe(load=True)}")
    print(f"data: {len(files)} files, {total / 1e6:.1f} MB of the standard library; BPE vocabulary "
          f"{a.vocab}; fastest of {a.repeat}")
    work = Path(tempfile.mkdtemp(prefix="lowband-prepare-bench-"))
    tok_path = work / "tokenizer.json"
    train_tokenizer(tok_path, a.vocab, files)
    docs = [f.read_bytes().decode("utf-8", "replace") for f in files]

    rows = []  # (name, cores used, tokens, seconds)

    def best(name, used, run):
        results = [run(i) for i in range(a.repeat)]
        n, s = min(results, key=lambda r: r[1])
        rows.append({"name": name, "cores": used, "tokens": n, "seconds": s})

    best("encode_batch, 1 thread", 1, lambda i: encode_batch(tok_path, docs, "false"))
    best("encode_batch_fast, 1 thread", 1,
         lambda i: encode_batch(tok_path, docs, "false", "encode_batch_fast"))
    best("prepare --workers 1", 1, lambda i: prepare(tok_path, files, root, 1, work / f"w1-{i}"))
    best(f"prepare --workers {cores}", cores,
         lambda i: prepare(tok_path, files, root, cores, work / f"wN-{i}"))
    best(f"encode_batch, {cores} threads", cores, lambda i: encode_batch(tok_path, docs, "true"))
    same = len({r["tokens"] for r in rows}) == 1
    base, fast = (r["tokens"] / r["seconds"] for r in rows[:2])
    print(f"\n{'':30s} {'tokens/s':>12s} {'cores':>6s} {'tokens/s/core':>14s} "
          f"{'per core vs encode_batch':>25s} {'vs _fast':>9s}")
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        r["per_core_ratio"] = r["tokens_per_s"] / r["cores"] / base
        r["per_core_ratio_fast"] = r["tokens_per_s"] / r["cores"] / fast
        print(f"{r['name']:30s} {r['tokens_per_s']:12,.0f} {r['cores']:6d} "
              f"{r['tokens_per_s'] / r['cores']:14,.0f} {r['per_core_ratio']:24.2f}x "
              f"{r['per_core_ratio_fast']:8.2f}x")
    goal = rows[3]["per_core_ratio"]
    print(f"\ntokens agree across rows: {same} ({rows[0]['tokens']:,})")
    print(f"prepare --workers {cores} against encode_batch with {cores} threads (same cores): "
          f"{rows[3]['tokens_per_s'] / rows[4]['tokens_per_s']:.2f}x; load average now "
          f"{os.getloadavg()[0]:.1f}")
    print(f"goal: prepare with {cores} workers >= 0.9x encode_batch per core: {goal:.2f}x "
          f"{'PASS' if goal >= 0.9 else 'MISS'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": describe(load=True), "rows": rows}, indent=1))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
