"""Tokenizers and prepared corpora (lowband/data/: prepare.py, tokens.ShardedTokens): `lowband
prepare` of text, JSONL and Parquet into shards, resuming, training on shards and with
--tokenizer, bad input. A small BPE tokenizer is trained once here on 300 kB of the built-in
corpus; nothing reaches a hub."""

import json
import os

import numpy as np
import pytest

from conftest import EOS, lowband
from lowband.config import ConfigError
from lowband.data import Batches, ShardedTokens, load_tokens, prepare, tokenizer, vocab_needed

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
TRAIN = ["--algo", "ddp", "--link-bandwidth", "none", "--model", "nano", "--steps", 3,
         "--replicas", 1, "--seq-len", 32, "--batch-size", 4, "--eval-every", 0,
         "--eval-batches", 1, "--no-progress"]


@pytest.fixture(scope="module")
def src(tok, tmp_path_factory):
    """A source directory with text, JSONL and Parquet files, and its documents in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tok[2]
    root = tmp_path_factory.mktemp("src")
    docs = [text[i * 6000:(i + 1) * 6000] for i in range(3)]  # each under UNIT_BYTES: one piece
    for i, d in enumerate(docs):
        (root / f"a{i}.py").write_text(d)
    lines = [text[60_000 + i * 700:60_000 + (i + 1) * 700] for i in range(60)]
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(lines)))
    rows = [text[120_000 + i * 900:120_000 + (i + 1) * 900] for i in range(40)]
    pq.write_table(pa.table({"text": rows}), root / "c.parquet", row_group_size=10)
    return root, docs + lines + rows


def _prepare(tok, src, out, workers=2, shard_tokens=6000, **kw):
    return prepare.prepare_files(prepare.source_files(src), src, out, tokenizer.load_tokenizer(str(tok)),
                                 shard_tokens=shard_tokens, workers=workers, progress=False, **kw)


def _stream(out):
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"]])


def _shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*.bin"))}


@pytest.fixture(scope="module")
def prepared(tok, src, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "shards"
    prepare.UNIT_BYTES, old = 8192, prepare.UNIT_BYTES  # many units from a small corpus
    try:
        _prepare(tok[0], src[0], out)
    finally:
        prepare.UNIT_BYTES = old
    return out


def test_prepare_text_jsonl_parquet_is_the_tokenizers_encoding_with_eos(tok, src, prepared, tmp_path,
                                                                        monkeypatch):
    t = tok[1]
    eos = t.token_to_id(EOS)
    expected = [i for d in src[1] for i in t.encode(d, add_special_tokens=False).ids + [eos]]
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 512 and meta["eos_id"] == eos
    assert meta["tokens"] == len(expected) and _stream(prepared).tolist() == expected
    assert [s["tokens"] for s in meta["shards"][:-1]] == [6000] * (len(meta["shards"]) - 1)
    assert all((prepared / s["file"]).stat().st_size == 2 * s["tokens"] for s in meta["shards"])
    assert [s["path"] for s in meta["sources"]] == ["a0.py", "a1.py", "a2.py", "b.jsonl", "c.parquet"]
    assert meta["tokenizer_sha256"] == tokenizer.tokenizer_sha256(tok[0])
    assert (prepared / "tokenizer" / "tokenizer.json").read_bytes() == tok[0].read_bytes()
    assert not (prepared / "progress.json").exists()
    monkeypatch.setattr(prepare, "UNIT_BYTES", 8192)
    _prepare(tok[0], src[0], tmp_path / "one", workers=1)
    assert _shard_bytes(tmp_path / "one") == _shard_bytes(prepared)  # any number of workers


def test_a_vocabulary_past_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, EOS: 70_001}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens([EOS])  # an end-of-text token is found among the special tokens
    t.save(str(tmp_path / "big.json"))
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "x.txt").write_text("w1 w69999 w65536 nope w3")
    meta = _prepare(tmp_path / "big.json", tmp_path / "s", tmp_path / "o")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    assert _stream(tmp_path / "o").tolist() == [1, 69_999, 65_536, 70_000, 3, 70_001]
    assert vocab_needed(load_tokens(str(tmp_path / "o"))) == 70_002


def test_an_interrupted_prepare_resumes_without_redoing_shards(tok, src, prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "UNIT_BYTES", 8192)
    save, calls = prepare._save_progress, []

    def stop_after_first(out, state):
        save(out, state)
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "_save_progress", stop_after_first)
    out = tmp_path / "o"
    with pytest.raises(KeyboardInterrupt):
        _prepare(tok[0], src[0], out)
    assert sorted(p.name for p in out.iterdir()) == ["progress.json", "shard-00000.bin",
                                                     "shard-00001.bin", "tokenizer"]
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.bin")}
    monkeypatch.setattr(prepare, "_save_progress", save)
    _prepare(tok[0], src[0], out)
    assert _shard_bytes(out) == _shard_bytes(prepared)
    assert {n: (out / n).stat().st_mtime_ns for n in before} == before  # not written again
    assert _prepare(tok[0], src[0], out) == json.loads((out / "meta.json").read_text())  # done
    with pytest.raises(ConfigError, match="--overwrite"):  # other settings: refused, untouched
        _prepare(tok[0], src[0], out, shard_tokens=5000)
    with pytest.raises(ConfigError, match=r"was prepared from \S+src\S* \(now \S+a0.py\)"):
        _prepare(tok[0], src[0] / "a0.py", out)  # another SRC: named
    assert _shard_bytes(out) == _shard_bytes(prepared)
    assert len(_prepare(tok[0], src[0], out, shard_tokens=5000, overwrite=True)["shards"]) > len(before) + 1


def test_training_batches_are_slices_of_the_shards(prepared):
    tokens = load_tokens(str(prepared))
    flat = _stream(prepared)
    assert isinstance(tokens, ShardedTokens) and len(tokens) == len(flat) and vocab_needed(tokens) == 512
    assert (tokens[np.arange(5990, 6010)] == flat[5990:6010]).all()  # across a shard boundary
    assert (tokens[100:7000] == flat[100:7000]).all()
    kw = dict(rank=1, world=2, seq_len=32, batch_size=8, seed=3, val_fraction=0.05)
    a, b, ref = Batches(tokens, **kw), Batches(ShardedTokens(prepared), **kw), Batches(flat, **kw)
    for step, micro in [(0, 0), (5, 1), (17, 0)]:
        x, y = a.train(step, micro)
        assert (x == b.train(step, micro)[0]).all() and (x == ref.train(step, micro)[0]).all()
        starts = a.train_starts(step, micro)
        assert all(x[i].tolist() == flat[s:s + 32].tolist() and y[i].tolist() == flat[s + 1:s + 33].tolist()
                   for i, s in enumerate(starts))
    assert (a.val(2)[0] == ref.val(2)[0]).all()


def test_cli_prepare_then_train_on_the_shards(tok, src, prepared, tmp_path):
    proc = lowband("prepare", src[0], "-o", tmp_path / "d", "--tokenizer", tok[0], "--shard-tokens",
                   "20k", "--workers", 2, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "shards (uint16, vocabulary 512)" in proc.stdout
    assert (_stream(tmp_path / "d") == _stream(prepared)).all()  # 1 MiB units: the same stream
    proc = lowband("train", "--data", tmp_path / "d", "--vocab-size", 512, "--run-dir", "r", *TRAIN,
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["meta"]["tokenizer"]["sha256"] == tokenizer.tokenizer_sha256(tok[0])
    assert (tmp_path / "r" / "tokenizer" / "tokenizer.json").read_bytes() == tok[0].read_bytes()
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 3
    # the tokenizer's vocabulary (512) exceeds the model's: one sentence, exit 2, no config
    proc = lowband("train", "--data", tmp_path / "d", "--run-dir", "small", *TRAIN, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "vocabulary is 256: pass --vocab-size 512" in proc.stderr
    assert not (tmp_path / "small").exists()  # refused before the run directory is made


def test_train_with_a_tokenizer_directory_on_raw_text(tok, src, tmp_path):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok[1], eos_token=EOS).save_pretrained(tmp_path / "tk")
    (tmp_path / "text").mkdir()
    for name in ("a0.py", "a1.py", "a2.py"):
        (tmp_path / "text" / name).write_bytes((src[0] / name).read_bytes())
    env = {"LOWBAND_CACHE": str(tmp_path / "cache")}
    proc = lowband("train", "--data", "text", "--tokenizer", "tk", "--vocab-size", 512, "--run-dir",
                   "r", *TRAIN, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "r" / "tokenizer").iterdir()) == sorted(
        p.name for p in (tmp_path / "tk").iterdir())
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["tokenizer"] == "tk"
    assert config["meta"]["tokenizer"]["sha256"] == tokenizer.tokenizer_sha256(tmp_path / "tk")
    [cached] = (tmp_path / "cache").glob("tokens-*")
    eos = tok[1].token_to_id(EOS)
    expected = [i for n in ("a0.py", "a1.py", "a2.py")
                for i in tok[1].encode((src[0] / n).read_text(), add_special_tokens=False).ids + [eos]]
    assert _stream(cached).tolist() == expected


@pytest.mark.parametrize("bad", ["size", "checksum"])
def test_a_corrupt_shard_is_named_and_left_alone(prepared, tmp_path, bad):
    import shutil

    shutil.copytree(prepared, tmp_path / "d")
    shard = tmp_path / "d" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    if bad == "size":
        data = data[:-2]
    else:
        data[5] ^= 1
    shard.write_bytes(bytes(data))
    if bad == "size":
        with pytest.raises(ConfigError, match="shard-00001.bin has 11998 bytes where meta.json says 12000"):
            load_tokens(str(tmp_path / "d"))
        return
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "d").iterdir()}
    proc = lowband("train", "--data", "d", "--vocab-size", 512, "--run-dir", "r", *TRAIN, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "shard-00001.bin does not match its sampled sha256" in proc.stderr
    assert not (tmp_path / "r" / "config.json").exists()
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "d").iterdir()} == before


def test_bad_sources_and_tokenizers_give_one_sentence(tok, src, prepared, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "x.txt").write_text("hello")
    (tmp_path / "s" / "y.bin").write_bytes(b"\0\1")
    proc = lowband("prepare", "s", "-o", "o", "--tokenizer", tok[0], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "y.bin' is of an unknown type (.bin)" in proc.stderr and not (tmp_path / "o").exists()

    (tmp_path / "noise.json").write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match="tokenizer '.*noise.json' does not load"):
        tokenizer.load_tokenizer(str(tmp_path / "noise.json"))
    (tmp_path / "d").mkdir()
    for p in prepared.glob("shard-*.bin"):
        (tmp_path / "d" / p.name).write_bytes(p.read_bytes())
    with pytest.raises(ConfigError, match="holds token shards but no meta.json"):
        load_tokens(str(tmp_path / "d"))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="no text field 'text': pass --text-field"):
        _prepare(tok[0], tmp_path / "j", tmp_path / "jo")
    assert not (tmp_path / "jo").exists()
    with pytest.raises(ConfigError, match="holds other files"):
        _prepare(tok[0], tmp_path / "s" / "x.txt", tmp_path / "j")
