"""Comm.average's exchanges (all-gather and two-phase) on real gloo processes at R = 2, 3, 4, 8:
the bytes each rank sends equal exchange_wire_bytes, every rank gets the same average, within
the documented error of the float64 mean (fp32: exact), and a NaN on one rank reaches all."""

import ast
import os
import queue
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lowband
from lowband.comm import collectives, topology
from lowband.comm import Comm
from lowband.comm.codecs import TWO_PHASE, payload_bytes
from lowband.comm.membership.elastic import Membership, membership
from lowband.comm.membership.fixed import FixedMembership
from lowband.comm.wire import exchange_plan, exchange_wire_bytes
from lowband.launch.local import free_port

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

SIZES, NUMEL, BLOCK = (2, 3, 4, 8), 1000, 64  # NUMEL: not a multiple of any chunk
MODES = ("auto", "all-gather", "two-phase")
CODECS = ("fp32",) + TWO_PHASE  # the sparse codecs keep the all-gather


def inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    scale = torch.logspace(-3, 1, NUMEL, dtype=torch.float64)  # blocks of unlike magnitudes
    return torch.randn(NUMEL, generator=g, dtype=torch.float64) * scale


def _worker(rank, R, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(R), OMP_NUM_THREADS="1")
    comm = Comm(topology.init(R, 1, "cpu", timeout_s=60), None)
    x = inputs(rank).float()
    for codec in CODECS:
        for mode in MODES:
            before = comm.totals.wire_bytes["outer"]
            avg = comm.average(x, "outer", codec, BLOCK, exchange=mode)
            mean = avg.wait()
            out.put((R, rank, codec, mode, mean.double().numpy(), avg.sent.double().numpy(),
                     comm.totals.wire_bytes["outer"] - before))
    for codec in ("fp32", "int8"):  # --merge-weights: unequal weights (rank + 1)
        avg = comm.average(x, "outer", codec, BLOCK, weight=rank + 1)
        out.put((R, rank, codec, "weighted", avg.wait().double().numpy(),
                 avg.sent.double().numpy(), 0))
    bad = x.clone()
    if rank == R - 1:
        bad[NUMEL // 2] = float("nan")
    for mode in ("all-gather", "two-phase"):
        out.put((R, rank, "int8", "nan-" + mode,
                 comm.average(bad, "outer", "int8", BLOCK, exchange=mode).wait().numpy(), None, 0))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """Every (R, rank, codec, mode): (the average, `sent`, outer wire bytes), from one world of
    R processes for each R, all started at once."""
    q = mp.get_context("spawn").Queue()
    ports = []
    while len(ports) < len(SIZES):
        ports += {free_port()} - set(ports)
    worlds = [mp.spawn(_worker, args=(R, port, q), nprocs=R, join=False)
              for R, port in zip(SIZES, ports)]
    expected = sum(R * (len(CODECS) * len(MODES) + 4) for R in SIZES)
    got = {}
    while len(got) < expected:
        try:
            R, rank, codec, mode, mean, sent, wire = q.get(timeout=1)
        except queue.Empty:  # join raises if a rank failed
            assert not all(w.join(timeout=0) for w in worlds), "ranks ended before sending all"
            continue
        got[R, rank, codec, mode] = (torch.from_numpy(mean), sent if sent is None else
                                     torch.from_numpy(sent), wire)
    for w in worlds:
        while not w.join():
            pass
    return got


TOP = {"int8": 127.0, "fp4-e2m1": 6.0, "fp4-e3m0": 1.0}


def error_bound(v: torch.Tensor, codec: str) -> torch.Tensor:
    """The codec's worst-case error on each value of v (codecs.py's table, float64), with the
    bf16 rounding of the scale on top."""
    if codec == "bf16":
        return v.abs() * 2.0 ** -8
    pad = (-v.numel()) % BLOCK
    absmax = torch.cat([v.abs(), v.new_zeros(pad)]).view(-1, BLOCK).amax(1)
    s = (absmax / TOP[codec]).repeat_interleave(BLOCK)[: v.numel()]
    e = {"int8": s / 2, "fp4-e2m1": s, "fp4-e3m0": v.abs() / 3 + s * 2.0 ** -6}[codec]
    return e * (1 + 2.0 ** -7) + v.abs() * 2.0 ** -7


@pytest.mark.parametrize("R", SIZES)
def test_bytes_identity_and_error(results, R):
    xs = [inputs(r) for r in range(R)]
    exact = torch.stack(xs).mean(0)
    for codec in CODECS:
        for mode in MODES:
            means = [results[R, r, codec, mode][0] for r in range(R)]
            how, _ = exchange_plan(codec, NUMEL, R, BLOCK, mode)
            wire = exchange_wire_bytes(codec, payload_bytes(codec, NUMEL, BLOCK), R, mode, BLOCK)
            assert how == {"fp32": "all-reduce"}.get(codec, "all-gather" if mode == "all-gather"
                                                     or mode == "auto" and R == 2 else "two-phase")
            for r in range(R):
                assert results[R, r, codec, mode][2] == wire, (codec, mode, r)
                assert torch.equal(means[r], means[0]), (codec, mode, r)  # bitwise alike
            if codec == "fp32":
                assert torch.allclose(means[0], exact, rtol=1e-6, atol=1e-7)
                continue
            first = torch.stack([error_bound(x, codec) for x in xs]).mean(0)
            for r in range(R):  # `sent`: x as the others decode it, within the first error
                assert ((results[R, r, codec, mode][1] - xs[r]).abs() <= error_bound(xs[r], codec)).all()
            bound = first if how == "all-gather" else first + error_bound(exact.abs() + first, codec)
            err = (means[0] - exact).abs()
            assert (err <= bound + 1e-6 * exact.abs()).all(), (codec, mode, (err - bound).max())


@pytest.mark.parametrize("R", SIZES)
def test_nan_on_one_rank_reaches_every_rank(results, R):
    for mode in ("nan-all-gather", "nan-two-phase"):
        for r in range(R):
            assert not torch.isfinite(results[R, r, "int8", mode][0]).all(), (mode, r)


def test_wire_formulas():
    P = payload_bytes("int8", 100_000, 64)
    assert exchange_wire_bytes("fp32", 400_000, 4) == 600_000  # a ring all-reduce
    assert exchange_wire_bytes("int8", P, 2) == P  # R=2: the all-gather, one quantization
    assert exchange_wire_bytes("int8", P, 4, "all-gather") == 3 * P
    chunk = payload_bytes("int8", 25_024, 64)  # 100000/4 rounded up to whole blocks
    assert exchange_wire_bytes("int8", P, 4) == 2 * 3 * chunk <= 1.51 * P
    assert exchange_wire_bytes("int8", payload_bytes("int8", 100, 64), 8) == 7 * 104  # tiny
    with pytest.raises(ValueError, match="exchange"):
        exchange_wire_bytes("int8", P, 4, "ring")


@pytest.mark.parametrize("R", SIZES)
def test_weighted_average_matches_a_float64_reference(results, R):
    """--merge-weights tokens: sum_i w_i x_i / sum_i w_i with unequal w_i; fp32 to rounding,
    int8 within its error (each rank's w_i x_i quantized), the same on every rank."""
    w = torch.arange(1, R + 1, dtype=torch.float64)
    ref = sum(w[i] * inputs(i).float().double() for i in range(R)) / w.sum()
    for codec, tol in (("fp32", 1e-6), ("int8", 2e-2)):
        means = [results[R, rank, codec, "weighted"][0] for rank in range(R)]
        assert all(torch.equal(m, means[0]) for m in means)
        err = (means[0] - ref).abs().max().item() / ref.abs().max().item()
        assert err < tol, (codec, err)
        uniform = sum(inputs(i).float().double() for i in range(R)) / R
        assert (means[0] - uniform).abs().max() > 10 * tol * ref.abs().max()  # the weights count


def test_every_dense_codec_takes_two_phase_unless_it_says_why_not():
    """The codec records own the fact (codecs.Codec.two_phase); TWO_PHASE is read from them."""
    from lowband.comm.codecs import CODEC_RECORDS, Codec

    for name, c in CODEC_RECORDS.items():
        assert c.two_phase or c.no_two_phase, f"{name}: dense, not two-phase, and no reason"
        assert not (c.two_phase and c.sparse), name  # a sum of topk payloads is not sparse
    assert TWO_PHASE == tuple(n for n, c in CODEC_RECORDS.items() if c.two_phase)
    assert set(TWO_PHASE) == {n for n, c in CODEC_RECORDS.items() if not c.sparse} - {"fp32"}
    assert Codec("fp8", 1.0, True, "a new dense codec").two_phase  # takes it without a list
    with pytest.raises(ValueError, match="say why"):
        Codec("fp8", 1.0, True, "a new dense codec", two_phase=False)


def test_the_exchange_the_planner_and_the_config_read_the_record(monkeypatch):
    """One fact: flipping a record's two_phase changes what Comm.average takes (exchange_plan),
    what the planner counts and what --exchange two-phase accepts, alike."""
    import dataclasses

    from lowband.comm.codecs import CODEC_RECORDS
    from lowband.config import Config, ConfigError
    from lowband.plan import exchange_phases, make_run

    def facts(codec):
        how = exchange_plan(codec, 10**6, 4, BLOCK)[0]
        run = make_run(params=1e6, layers=2, step_time=0.1, replicas=4, codec=codec,
                       block_size=BLOCK)
        try:
            Config(algo="streaming", model="nano", codec=codec, exchange="two-phase",
                   replicas=4, fragments=1).validate()
            accepted = True
        except ConfigError:
            accepted = False
        return how, len(exchange_phases(run, 10**6)), accepted

    for codec, c in CODEC_RECORDS.items():
        expect = ("two-phase", 2, True) if c.two_phase else (
            ("all-reduce", 1, True) if codec == "fp32" else ("all-gather", 1, False))
        assert facts(codec) == expect, codec
    monkeypatch.setitem(CODEC_RECORDS, "int8", dataclasses.replace(
        CODEC_RECORDS["int8"], two_phase=False, no_two_phase="a test says so"))
    assert facts("int8") == ("all-gather", 1, False)


ALGORITHMS_DIR = Path(lowband.__file__).parent / "algorithms"


def _membership_reads(tree: ast.AST):
    """The attribute nodes `X.elastic` and `X.membership` (and bare names of those) in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("elastic", "membership"):
            yield node
        elif isinstance(node, ast.Name) and node.id in ("elastic", "membership"):
            yield node


def test_no_algorithm_asks_whether_the_run_is_elastic():
    """Every run has a membership (comm.membership): algorithms/ and Comm call it, and never
    compare it (or the old comm.elastic) with None, nor read comm.elastic."""
    files = sorted(ALGORITHMS_DIR.glob("*.py")) + [Path(collectives.__file__)]
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        reads = {id(n) for n in _membership_reads(tree)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot))
                                                     for op in node.ops):
                sides = [node.left, *node.comparators]
                if any(id(s) in reads for s in sides):
                    found.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "elastic" \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "comm":
                found.append(f"{path.name}:{node.lineno} comm.elastic")
    assert not found, f"elastic/None branches came back: {found}"


def test_the_fixed_membership_answers_as_a_plain_run_needs():
    topo = SimpleNamespace(replicas=3, rank=4, shards=2, replica=2)
    comm = Comm(topo, None)
    assert isinstance(comm.membership, FixedMembership)  # never None, even before set_up
    m = membership(topo, SimpleNamespace(elastic=False), comm)
    assert isinstance(m, FixedMembership) and not m.elastic and Membership.elastic
    assert m.join(0) is False and m.begin(8) is False and m.commit() is True
    assert not m.healed_now and not m.failed()
    assert m.members == (0, 1, 2) and m.position() == 2
    assert m.sync_fields(torch.ones(3)) == {} and m.heal_fields({"lineage": ["a"]}) == {}
    assert m.over_groups(lambda v: v + 1, 5) == 5  # one world holds every group
    m.register(object())
    m.hand_over("user", None, None)


def test_every_membership_method_an_algorithm_calls_is_on_both():
    """What algorithms/ call on a membership exists on the fixed one and torchft's alike."""
    called = set()
    for path in sorted(ALGORITHMS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "membership":
                called.add(node.attr)
    assert {"join", "begin", "commit", "average", "healed_now"} <= called
    for name in called:
        assert hasattr(FixedMembership, name) or name in FixedMembership(
            SimpleNamespace(replicas=1, replica=0)).__dict__, name
        assert hasattr(Membership, name) or name in ("healed_now", "members"), name
