"""The outer state's device copies (algorithms/outer.py's Staging) and streaming's use of them.

With --outer-state-device cpu on a GPU every read of the outer parameters or momentum goes
through a staged device copy and every write back through put(). Without a GPU both places are
the CPU and nothing is copied, so these tests force the copies on the CPU (moves=True, no side
stream): streaming must then give bitwise what it gives working in place, through exchanges,
applies, skips, evaluation with the outer parameters, an elastic heal and a checkpoint's round
trip. The side stream's own path (copies on it, writes kept by put() until flush()) needs a GPU:
`drive(device=cuda, home="cpu")` against `home="same"` checks it there, bitwise."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from lowband.algorithms.outer import Staging, nesterov_step, sgd_step
from lowband.algorithms.streaming import Streaming
from lowband.comm.exchanges import encoded
from lowband.comm.membership.fixed import FixedMembership

CPU = torch.device("cpu")


def copying(home=CPU, device=CPU) -> Staging:
    """A staging that copies even where the state already is (as with a CPU home on a GPU)."""
    s = Staging(home, device, overlap=False)
    s.moves = True
    return s


def test_staging_in_place():
    s = Staging(CPU, CPU)
    assert not s.moves and s.side is None
    t = torch.arange(4.0)
    assert s.get(t) is t and s.get(t, keep=False) is t
    s.fetch(t)
    s.put(t, t)
    s.drop(t)
    s.settle()
    assert s.staged == {}


def test_staging_copies():
    s = copying()
    host = torch.arange(4.0)
    dev = s.get(host)
    assert dev is not host and torch.equal(dev, host)
    assert s.get(host) is dev  # staged: read again without another copy
    s.fetch(host)
    assert s.get(host) is dev
    dev.add_(1)
    assert torch.equal(host, torch.arange(4.0))  # the host copy changes at put() only
    s.put(host, dev)
    assert torch.equal(host, torch.arange(4.0) + 1) and s.staged == {}
    other = s.get(host, keep=False)  # a copy for this read alone
    assert torch.equal(other, host) and s.staged == {}
    staged = s.get(host)
    assert s.get(host, keep=False) is staged and id(host) in s.staged  # a staged one stays
    s.drop(host)
    assert s.staged == {}
    a, b = torch.zeros(2), torch.ones(2)
    s.fetch(a)
    s.fetch(b)
    s.drop()
    assert s.staged == {}


@pytest.mark.parametrize("rule", ["nesterov", "sgd"])
def test_steps_alike_wherever_the_state_is(rule):
    """The outer step's arithmetic is the same in place, with copies, and without a staging
    (the signature edit and aedit call)."""
    g = torch.Generator().manual_seed(0)
    outer, momentum = torch.randn(100, generator=g), torch.randn(100, generator=g)
    delta = torch.randn(100, generator=g)
    results = []
    for staging in (None, Staging(CPU, CPU), copying()):
        o, m = outer.clone(), momentum.clone()
        if rule == "nesterov":
            new = nesterov_step(o, m, delta, 0.7, 0.9, staging)
        else:
            new = sgd_step(o, delta, 0.7, staging)
        assert torch.equal(new, o)
        if staging is not None:
            assert staging.staged == {}
        results.append((o, m))
    for o, m in results[1:]:
        assert torch.equal(o, results[0][0]) and torch.equal(m, results[0][1])


class Tiny(nn.Module):
    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, width)


class Landing:
    """An average of a world of one: what this rank sent, as the codec decodes it."""

    def __init__(self, x, codec, block, poison):
        self.sent = x if codec == "fp32" else encoded(x, codec, block)[1]
        self.value = self.sent.clone()
        if poison:
            self.value[0] = float("nan")

    def wait(self):
        return self.value.clone()


class OneRank:
    def __init__(self, poison_at=()):
        self.membership = FixedMembership(SimpleNamespace(replicas=1, replica=0))
        self.events, self.syncs, self.poison_at = None, 0, poison_at

    def average(self, x, group, codec, block, tag="", exchange="auto", weight=None):
        self.syncs += 1
        return Landing(x, codec, block, self.syncs in self.poison_at)


def drive(device=CPU, home="same", force_copies=False, rule="nesterov", P=4, H=8, tau=1,
          codec="fp4-e3m0", steps=40, width=16, blocks=4, resume_at=None, eval_at=(),
          poison_at=(), heal_at=None, busy=None, update="delayed"):
    """Streaming's outer loop on a small model through `steps` inner steps (each a seeded
    random update of every weight; `busy(step)` may queue work on the device first), with a
    checkpoint's round trip into a fresh instance after step `resume_at`, evaluations with the
    outer parameters after the steps in `eval_at`, the syncs numbered in `poison_at`
    averaging to NaN, and at the sync after step `heal_at` (an exchange must have landed by
    then) an elastic heal to a state whose outer parameters and momentum moved. Returns every tensor a run ends with (and those it evaluated)."""
    torch.manual_seed(0)
    model = Tiny(width, blocks).to(device)
    cfg = SimpleNamespace(
        fragments=P, sync_every=H, overlap=tau, alpha=0.5 if tau else 0.0,
        fragment_pattern="strided", outer_rule=rule, outer_lr=0.7, outer_momentum=0.9,
        outer_state_device=home, codec=codec, codec_block=64, exchange="auto",
        merge_weights="uniform", error_feedback=True, grad_accum=1, batch_size=1, seq_len=1,
        local_steps="fixed", outer_update=update)
    topo = SimpleNamespace(device=device, shard=0, shards=1, replicas=1)
    comm = OneRank(poison_at)

    def start():
        algo = Streaming()
        algo.setup(model, model.blocks, lambda ps: torch.optim.SGD(ps, lr=0.1), topo, comm, cfg)
        if force_copies:
            algo.staging = copying(algo.fragments[0].outer.device, device)
        skip = algo._skip

        def counted(f, started):
            seen["skipped"] += 1
            skip(f, started)

        algo._skip = counted
        return algo

    seen = {"skipped": 0}
    algo = start()
    for step in range(steps):
        algo.before_forward(step)
        if busy is not None:
            busy(step)
        algo.before_backward(step, 0, True)
        g = torch.Generator().manual_seed(1000 + step)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g).to(device), alpha=1e-2)
        if step + 1 == heal_at:  # as a quorum at this sync's start would (its fragment staged)
            state = copy.deepcopy(algo.heal_state())
            for f in state["algorithm"]["fragments"]:
                f["outer"].add_(0.25)
                f["momentum"].add_(0.25)
            algo.load_heal_state(state)
        algo.after_step(step)
        if step + 1 in eval_at:
            with algo.eval_weights("outer"):
                seen[f"eval{step + 1}"] = [p.detach().clone() for p in model.parameters()]
        if step + 1 == resume_at:
            state = copy.deepcopy(algo.state_dict())
            weights = copy.deepcopy(model.state_dict())
            algo = start()  # a fresh instance (its state from the model as it is now) ...
            model.load_state_dict(weights)
            algo.load_state_dict(state)  # ... then the checkpoint's
    algo.finish()
    seen["outer"] = algo.outer_params()
    state = algo.state_dict()
    seen["state"] = [(f["outer"].clone(), f["momentum"].clone(), f["residual"])
                     for f in state["fragments"]]
    seen["model"] = [p.detach().clone() for p in model.parameters()]
    seen["skips"] = algo.skips
    return seen


def assert_bitwise(a, b, where="run"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        x, y = a.cpu(), b.cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, where
        assert torch.equal(x.view(torch.int32), y.view(torch.int32)), f"{where} differs"
    else:
        assert a == b, where


CASES = {
    "streaming": {},
    "streaming-tau2-resume-eval-skip": dict(P=2, tau=2, resume_at=13, eval_at=(6, 13, 18),
                                            poison_at=(3,)),
    "streaming-heal": dict(P=2, tau=1, heal_at=12, eval_at=(12, 14)),
    "streaming-eager-resume-eval-skip": dict(P=2, tau=2, update="eager", resume_at=13,
                                             eval_at=(6, 13, 18), poison_at=(3,)),
    "sparseloco": dict(rule="sparseloco", resume_at=9, eval_at=(9,)),
    "diloco": dict(P=1, H=4, tau=0, codec="fp32", resume_at=10, eval_at=(8, 10),
                   poison_at=(2,)),
}


@pytest.mark.parametrize("case", CASES)
def test_streaming_with_copies_is_bitwise_in_place(case):
    kw = CASES[case]
    want = drive(**kw)
    assert want["skipped"] == len(kw.get("poison_at", ()))
    assert_bitwise(want, drive(force_copies=True, **kw))


def test_a_lost_write_back_is_seen(monkeypatch):
    """The comparison above catches a staging that forgets to write the new state back."""
    want = drive(P=2, tau=1, steps=12)
    monkeypatch.setattr(Staging, "put", lambda self, host, dev: self.staged.pop(id(host), None))
    with pytest.raises(AssertionError):
        assert_bitwise(want, drive(P=2, tau=1, steps=12, force_copies=True))


def test_copies_stay_staged_only_within_a_sync():
    """With copies and tau > 0, a fragment's outer parameters are on the device from the last
    backward of the step before its exchange to its apply, its momentum from the last backward
    of the step before its apply; never more than one fragment's."""
    torch.manual_seed(0)
    model = Tiny(8, 4)
    cfg = SimpleNamespace(
        fragments=4, sync_every=12, overlap=2, alpha=0.5, fragment_pattern="strided",
        outer_rule="nesterov", outer_lr=0.7, outer_momentum=0.9, outer_state_device="same",
        codec="fp32", codec_block=64, exchange="auto", merge_weights="uniform",
        error_feedback=True, grad_accum=1, batch_size=1, seq_len=1, local_steps="fixed")
    topo = SimpleNamespace(device=CPU, shard=0, shards=1, replicas=1)
    algo = Streaming()
    algo.setup(model, model.blocks, lambda ps: torch.optim.SGD(ps, lr=0.1), topo, OneRank(), cfg)
    algo.staging = copying()
    period, tau = 3, 2  # fragment due(s) exchanges after step s, applies after step s + 2

    def staged():
        return set(algo.staging.staged)

    def frag(s):
        return algo.fragments[algo.due(s)]

    for step in range(36):
        s = step + 1
        algo.before_forward(step)
        algo.before_backward(step, 0, False)  # not the last micro-batch: nothing yet
        outer = {id(frag(s - s % period).outer)} if s > period and 0 < s % period <= tau else set()
        assert staged() == outer, s  # exchanged, waiting for its apply
        algo.before_backward(step, 0, True)
        if s % period == 0:  # its exchange follows
            assert staged() == {id(frag(s).outer)}, s
        elif s % period == tau and s > period:  # its apply follows
            assert staged() == {id(frag(s - tau).outer), id(frag(s - tau).momentum)}, s
        else:
            assert staged() == outer, s
        algo.after_step(step)
        if s % period == 0 or (s % period == 1 and s > period):
            assert staged() == {id(frag(s - s % period).outer)}, s
        else:  # applied and written back
            assert staged() == set(), s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a GPU session)")
@pytest.mark.parametrize("case", CASES)
def test_outer_state_in_host_memory_is_bitwise_on_the_gpu(case):
    """On a GPU the copies run on a side stream, ordered by events: the state kept in pinned host
    memory gives the bits of the state kept on the device."""
    cuda = torch.device("cuda")
    kw = CASES[case]
    assert_bitwise(drive(device=cuda, home="same", **kw), drive(device=cuda, home="cpu", **kw))
