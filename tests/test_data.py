import numpy as np
import pytest

from lowband.config import ConfigError
from lowband.data import Batches, load_tokens, stdlib_files, vocab_needed


def _batches(tokens, rank, world, seed=0, seq=16, batch=4):
    return Batches(tokens, rank=rank, world=world, seq_len=seq, batch_size=batch, seed=seed,
                   val_fraction=0.05)


def test_builtin_corpus_is_the_stdlib_in_a_fixed_order():
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    tokens = load_tokens("builtin")
    assert len(tokens) >= 10_000_000
    assert len(tokens) == sum(f.stat().st_size for f in files)
    assert bytes(tokens[: 200]) == files[0].read_bytes()[:200]
    assert vocab_needed(tokens) == 256


def test_shards_are_disjoint_reproducible_and_never_touch_validation():
    tokens = np.arange(20_000, dtype=np.uint16)  # each token id is its position
    world = 4
    seen = []
    for rank in range(world):
        b = _batches(tokens, rank, world)
        again = _batches(tokens, rank, world)
        positions = set()
        for step in range(30):
            for micro in range(2):
                x, y = b.train(step, micro)
                x2, y2 = again.train(step, micro)
                assert (x == x2).all() and (y == y2).all()
                assert (y[:, :-1] == x[:, 1:]).all() and (y == x + 1).all()
                positions |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        assert min(positions) >= b.lo and max(positions) < b.hi
        assert max(positions) < b.val_start
        seen.append(positions)
    for i in range(world):
        for j in range(i + 1, world):
            assert not seen[i] & seen[j]
    b = _batches(tokens, 0, world)
    x, y = b.val(0)
    assert x.min() >= b.val_start
    assert (b.val(3)[0] == _batches(tokens, 2, world).val(3)[0]).all()  # same on every rank
    # another seed reads other windows of the same shard
    assert not (b.train(0)[0] == _batches(tokens, 0, world, seed=1).train(0)[0]).all()


def test_text_file_directory_and_token_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"world" * 100)
    (tmp_path / "d" / "a.txt").write_bytes(b"hello" * 100)
    tokens = load_tokens(str(tmp_path / "d"))
    assert bytes(tokens[:5]) == b"hello" and bytes(tokens[500:505]) == b"world"
    (tmp_path / "one.txt").write_bytes(b"abc" * 10)
    assert bytes(load_tokens(str(tmp_path / "one.txt"))) == b"abc" * 10
    ids = np.array([5, 50000, 7], dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    t = load_tokens(str(tmp_path / "t.bin"))
    assert t.tolist() == [5, 50000, 7] and vocab_needed(t) == 50001


@pytest.mark.parametrize("make", ["missing", "empty", "odd-bin", "empty-dir"])
def test_bad_data_gives_one_clear_sentence(tmp_path, make):
    path = tmp_path / {"missing": "nope.txt", "empty": "e.txt", "odd-bin": "o.bin",
                       "empty-dir": "dir"}[make]
    if make == "empty":
        path.write_bytes(b"")
    elif make == "odd-bin":
        path.write_bytes(b"abc")
    elif make == "empty-dir":
        path.mkdir()
    with pytest.raises(ConfigError, match=str(path.name)):
        load_tokens(str(path))


def test_corpus_too_small_for_the_world():
    with pytest.raises(ConfigError, match="too small"):
        _batches(np.zeros(100, dtype=np.uint8), 0, 8, seq=16)
