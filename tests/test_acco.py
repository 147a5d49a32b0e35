"""zero1 and acco against float64 references (real processes over gloo), and their state.

The acco reference follows the schedule documented in lowband/algorithms/acco.py, written out
here on its own: per step t, group 1 at the estimate θ̃(t), the estimate θ̃(t+1) = Opt(θ(t),
mean of group 1) with the optimizer state untouched, group 2 at θ(t), and the real step
θ(t+1) = Opt(θ(t), mean over both groups); micro-batch k of rank r is its batch (k // A, k % A).
"""

import math
import os
import statistics

import pytest
import torch
import torch.nn.functional as F
from lowband.config import Config, ConfigError
from lowband.data import Batches, load_tokens
from lowband.model import GPT, gpt_config, num_params
from lowband.telemetry import RunDir, read_events
from test_ddp import ACCUM as DDP_ACCUM
from test_ddp import BATCH as DDP_BATCH
from test_ddp import CLIP as DDP_CLIP
from test_ddp import LR as DDP_LR
from test_ddp import SEQ as DDP_SEQ
from test_ddp import STEPS as DDP_STEPS
from test_ddp import WARMUP as DDP_WARMUP
from test_ddp import reference_params

STEPS, BATCH, SEQ, LR, WARMUP, SEED = 4, 2, 32, 1e-3, 2, 7
B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def reference_lr(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return 0.1 * LR + 0.9 * LR * 0.5 * (1 + math.cos(math.pi * progress))


class Reference:
    """Float64, one process: parameters as a dict, gradients of single micro-batches."""

    def __init__(self, world: int):
        torch.manual_seed(SEED)
        self.model = GPT(gpt_config("nano", seq_len=SEQ)).double()
        tokens = load_tokens("builtin")
        self.data = [Batches(tokens, rank=r, world=world, seq_len=SEQ, batch_size=BATCH,
                             seed=SEED, val_fraction=0.02) for r in range(world)]
        self.names = [n for n, _ in self.model.named_parameters()]

    def params(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def grad(self, theta: dict, rank: int, step: int, micro: int) -> dict:
        """Gradient of one micro-batch's mean token loss at theta."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(theta[n])
        self.model.zero_grad()
        x, y = self.data[rank].train(step, micro)
        logits = self.model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}


def clipped(g: dict, clip: float) -> dict:
    if clip <= 0:
        return g
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in g.values()))
    coef = min(1.0, clip / (norm + 1e-6))
    return {n: v * coef for n, v in g.items()}


def opt_step(theta, state, g, lr, kind, wd):
    """AdamW (decoupled weight decay on matrices and embeddings) or plain SGD; returns the new
    parameters and the new state without touching the old ones."""
    new, m, v, k = {}, {}, {}, state["step"] + 1
    for n, p in theta.items():
        p = p * (1 - lr * (wd if p.dim() >= 2 else 0.0))
        if kind == "sgd":
            new[n] = p - lr * g[n]
            continue
        m[n] = B1 * state["m"][n] + (1 - B1) * g[n]
        v[n] = B2 * state["v"][n] + (1 - B2) * g[n] ** 2
        m_hat, v_hat = m[n] / (1 - B1 ** k), v[n] / (1 - B2 ** k)
        new[n] = p - lr * m_hat / (v_hat.sqrt() + EPS)
    return new, {"step": k, "m": m, "v": v}


def acco_reference(counts, kind, clip, wd, accum=1):
    """The documented two-round schedule with fixed per-rank counts [(N1, N2), ...]."""
    ref = Reference(len(counts))
    theta = ref.params()
    estimate = {n: t.clone() for n, t in theta.items()}  # θ̃(0) = θ(0)
    zeros = {n: torch.zeros_like(t) for n, t in theta.items()}
    state = {"step": 0, "m": dict(zeros), "v": dict(zeros)}
    counter = [0] * len(counts)

    def group(at, sizes):
        total, n = {k: torch.zeros_like(t) for k, t in theta.items()}, 0
        for r, size in enumerate(sizes):
            for _ in range(size):
                k = counter[r]
                counter[r] += 1
                for name, g in ref.grad(at, r, k // accum, k % accum).items():
                    total[name] += g
                n += 1
        return total, n

    for t in range(STEPS):
        lr = reference_lr(t)
        g1, c1 = group(estimate, [c[0] for c in counts])  # at θ̃(t)
        next_estimate, _ = opt_step(theta, state, clipped({n: g / c1 for n, g in g1.items()}, clip),
                                    lr, kind, wd)  # the state returned is thrown away
        g2, c2 = group(theta, [c[1] for c in counts])  # at θ(t)
        mean = {n: (g1[n] + g2[n]) / (c1 + c2) for n in theta}
        theta, state = opt_step(theta, state, clipped(mean, clip), lr, kind, wd)
        estimate = next_estimate
    return theta


def assert_close(run, want: dict, tol: float):
    got = torch.load(run.root / "model.pt", weights_only=True)
    for name, w in want.items():
        rel = float((got[name].double() - w).norm() / w.norm())
        assert rel <= tol, f"{name}: relative error {rel:.2e}"


# Every multi-rank case runs in one pair of real processes over gloo (a harness like
# benchmarks/ddp_overhead.py's): each calls lowband.train.train — the worker side of `lowband
# train` — once per configuration below, then checks the state round trip; the tests read the
# run directories. One start-up for all of them keeps the file fast.
WORLD = 2
COMMON = dict(model="nano", steps=STEPS, batch_size=BATCH, seq_len=SEQ, lr=LR,
              warmup_steps=WARMUP, seed=SEED, eval_every=0, progress=False)
RUNS = {
    # plain SGD, fixed 2:1 (= --grad-accum 3), two replicas over an emulated outer link
    "acco-sgd": dict(COMMON, algo="acco", replicas=2, shards=1, shard_optimizer="sgd",
                     acco_micro="2:1", grad_accum=3, weight_decay=0.0, grad_clip=0.0,
                     link_bandwidth="2Gbit"),
    # AdamW with clipping, unequal counts per rank, two shards of one replica (inner link)
    "acco-adamw": dict(COMMON, algo="acco", replicas=1, shards=2, acco_micro="1:2,3:1",
                       grad_clip=0.5),
    # zero1 with exactly tests/test_ddp.py's flags (R=2), against its reference
    "zero1": dict(algo="zero1", model="nano", replicas=2, shards=1, steps=DDP_STEPS,
                  grad_accum=DDP_ACCUM, batch_size=DDP_BATCH, seq_len=DDP_SEQ, lr=DDP_LR,
                  warmup_steps=DDP_WARMUP, grad_clip=DDP_CLIP, seed=3, eval_every=0,
                  progress=False),
    # adaptive counts with replica 1 four times slower
    "acco-adaptive": dict(algo="acco", model="nano", replicas=2, shards=1, steps=6,
                          batch_size=BATCH, seq_len=SEQ, straggler="1:4", link_bandwidth="40Mbit",
                          eval_every=3, progress=False),
}


def _harness(rank, world, port, root, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from lowband.train import train

    for name, fields in RUNS.items():
        train(Config(**fields, run_dir=os.path.join(root, name)))
    queue.put((rank, _roundtrip(rank, world)))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch.multiprocessing as mp
    from lowband.local import free_port

    root = tmp_path_factory.mktemp("acco")
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_harness, args=(WORLD, free_port(), str(root), queue), nprocs=WORLD,
                       start_method="spawn")
    roundtrip = dict(queue.get(timeout=10) for _ in range(WORLD))
    return {name: RunDir(root / name) for name in RUNS}, roundtrip


def test_acco_sgd_is_theta_minus_lr_times_mean_gradient(runs):
    """Plain SGD: θ(t+1) = θ(t) − η·(mean over both groups), group 1 taken at the estimate."""
    run = runs[0]["acco-sgd"]
    assert_close(run, acco_reference([(2, 1), (2, 1)], "sgd", clip=0, wd=0, accum=3), 1e-6)
    events = read_events(run)
    tokens = {e["tokens"] for e in events if e["kind"] == "step" and e["step"] == STEPS}
    assert tokens == {STEPS * 3 * BATCH * SEQ}  # N1 + N2 = A: exactly ddp's batches
    comm = [e for e in events if e["kind"] == "comm" and e["rank"] == 0]
    tags = [e["tag"] for e in comm]
    for tag in ("est-grad", "est-norm", "est-params", "grad", "norm", "params"):
        assert tags.count(tag) == STEPS, tag  # two rounds a step
    # two replicas: every world-ring transfer crosses the outer link, through the emulated link
    assert all(e["group"] == "outer" and "begin" in e for e in comm)


def test_acco_adamw_heterogeneous_counts_on_the_inner_link(runs):
    """AdamW with clipping, unequal counts per rank (every micro-batch weighs the same), the
    estimate leaving the optimizer state alone; two shards of one replica (the inner link)."""
    run = runs[0]["acco-adamw"]
    # fp32 against float64 through AdamW: ~1e-6, depending on the CPU's kernels (2.1e-6 seen)
    assert_close(run, acco_reference([(1, 2), (3, 1)], "adamw", clip=0.5, wd=WD), 5e-6)
    events = read_events(run)
    tokens = {e["rank"]: e["tokens"] for e in events if e["kind"] == "step" and e["step"] == STEPS}
    assert tokens == {0: STEPS * 3 * BATCH * SEQ, 1: STEPS * 4 * BATCH * SEQ}
    assert {e["group"] for e in events if e["kind"] == "comm"} == {"inner"}


def test_zero1_matches_data_parallel_reference_and_shards_the_state(runs):
    run = runs[0]["zero1"]
    assert_close(run, reference_params(WORLD), 1e-6)

    n = num_params(GPT(gpt_config("nano", seq_len=DDP_SEQ)))
    chunk = math.ceil(n / WORLD)
    shard = [e for e in read_events(run, ("shard",))]
    assert sorted(e["rank"] for e in shard) == list(range(WORLD))
    for e in shard:  # measured from the moments' tensors: 1/N of AdamW's 2 x 4 bytes x n
        assert e["unsharded_state_bytes"] == 2 * 4 * n
        assert e["state_bytes"] == 2 * 4 * chunk
        assert e["state_bytes"] * WORLD == pytest.approx(e["unsharded_state_bytes"], rel=1e-3)
    comm = read_events(run, ("comm",))
    for rank in range(WORLD):
        mine = [e for e in comm if e["rank"] == rank]
        rs = [e for e in mine if e["tag"] == "grad"]
        ag = [e for e in mine if e["tag"] == "params"]
        assert len(rs) == len(ag) == DDP_STEPS
        assert all(e["payload_bytes"] == 4 * WORLD * (chunk + 1) for e in rs)
        assert all(e["payload_bytes"] == 4 * chunk and e["wire_bytes"] == 4 * chunk * (WORLD - 1)
                   for e in ag)
        assert {e["group"] for e in mine} == {"outer"}


def test_adaptive_counts_follow_speed(runs):
    """Adaptive mode with a 4x straggler: the fast rank fills the straggler's idle time."""
    run = runs[0]["acco-adaptive"]
    steps = read_events(run, ("step",))
    tokens = {r: max(e["tokens"] for e in steps if e["rank"] == r) for r in (0, 1)}
    assert tokens[0] > 2 * tokens[1] > 0
    fast = statistics.fmean(e["compute_s"] / e["step_s"] for e in steps if e["rank"] == 0)
    assert fast > 0.8  # the fast rank computes while the rounds are in flight
    assert len(read_events(run, ("eval",))) == 2 * 2


def _roundtrip(rank, world) -> dict:
    """Run 3 steps, take state_dict() (through torch.save / torch.load(weights_only=True)),
    run 3 more; a fresh model and algorithm loaded from that state run the same 3 steps: the
    parameters and the shard's state must come out bitwise equal."""
    import io

    from lowband import topology
    from lowband.algorithms import ALGORITHMS
    from lowband.comm import Comm
    from lowband.train import build_model, lr_at, make_optimizer_factory

    topo = topology.init(world, 1)
    results = {}
    for algo_name, micro in (("zero1", "adaptive"), ("acco", "1:2,2:1")):
        cfg = Config(algo=algo_name, model="nano", replicas=world, batch_size=BATCH, seq_len=SEQ,
                     steps=6, warmup_steps=2, acco_micro=micro).validate()
        batches = Batches(load_tokens("builtin"), rank=rank, world=world, seq_len=SEQ,
                          batch_size=BATCH, seed=SEED, val_fraction=0.02)

        def build(cfg=cfg, algo_name=algo_name):
            torch.manual_seed(SEED)
            model = build_model(cfg, 256)
            algo = ALGORITHMS[algo_name]()
            algo.setup(model, model.blocks, make_optimizer_factory(cfg, topo.device), topo,
                       Comm(topo, None), cfg)
            return model, algo

        model_a, a = build()
        for s in range(3):
            a.train_step(s, batches, lr_at(cfg, s))
        buf = io.BytesIO()  # what a checkpoint would write, read back as a checkpoint would
        torch.save({"algo": a.state_dict(), "model": model_a.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        for s in range(3, 6):
            a.train_step(s, batches, lr_at(cfg, s))
        a.finish()  # nothing of a's in flight when b starts: the rounds share the group

        model_b, b = build()
        model_b.load_state_dict(saved["model"])
        b.load_state_dict(saved["algo"])
        for s in range(3, 6):
            b.train_step(s, batches, lr_at(cfg, s))
        b.finish()
        same = all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters()))
        same &= torch.equal(a.opt.master, b.opt.master) and torch.equal(a.opt.m, b.opt.m)
        same &= torch.equal(a.opt.v, b.opt.v) and a.opt.step == b.opt.step
        results[algo_name] = bool(same)
    return results


def test_state_dict_round_trip_continues_bitwise(runs):
    assert runs[1] == {r: {"zero1": True, "acco": True} for r in range(WORLD)}


@pytest.mark.parametrize("fields,message", [
    ({"algo": "acco", "acco_micro": "2"}, "N1:N2"),
    ({"algo": "acco", "acco_micro": "1:0"}, "N1:N2"),
    ({"algo": "acco", "acco_micro": "1:1,1:1,1:1"}, "3 counts for 2 ranks"),
    ({"algo": "ddp", "acco_micro": "1:1"}, "only to --algo acco"),
    ({"algo": "ddp", "shard_optimizer": "sgd"}, "only to --algo zero1 or acco"),
    ({"algo": "zero1", "shard_optimizer": "lion"}, "is not one of adamw, sgd"),
])
def test_bad_options(fields, message):
    with pytest.raises(ConfigError, match=message):
        Config(**fields).validate()
