"""Speed-aware local steps (--local-steps adaptive or declared speeds; algorithms/pace.py): a
slower replica runs fewer inner steps between syncs, every replica meets at each sync, and the
pseudo-gradients merge by the tokens each trained."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import train_in_one_job
from lowband.algorithms.pace import Pace
from lowband.config import Config, ConfigError
from lowband.telemetry import read_events

COMMON = ["--model", "nano", "--link-bandwidth", "none", "--seq-len", "32", "--batch-size", "4",
          "--warmup-steps", "2", "--no-progress", "--algo", "streaming", "--sync-every", "8",
          "--fragments", "2", "--overlap", "1"]  # period H/P = 4


class _Times:
    def __init__(self, values):
        self.values = values

    def wait(self):
        return [torch.tensor([v], dtype=torch.float64) for v in self.values]


def _pace(local_steps="adaptive", replicas=2, replica=0, period=10, fragments=1, tau=0):
    cfg = SimpleNamespace(local_steps=local_steps, sync_every=period * fragments,
                          fragments=fragments, overlap=tau, steps=period * 10, replicas=replicas)
    comm = SimpleNamespace(topo=SimpleNamespace(replicas=replicas, replica=replica),
                           all_gather=lambda *args, **kwargs: "sent")
    return Pace(cfg, comm, lambda: (0.0, 0))


def test_the_steps_follow_the_speeds_and_noise_leaves_them():
    pace = _pace(replicas=3, tau=1)
    assert pace.steps_for([1.0, 2.0, 4.0]) == [10, 5, 3]  # half, a quarter (2.5: rounded up)
    assert pace.steps_for([1.0, 1.1, 0.95]) == [10, 10, 10]  # a loaded machine's noise
    assert pace.steps_for([1.0, 1.0, 10.0]) == [10, 10, 2]  # never below tau + 1
    # a replica at 5 steps stays there until its ideal is 15% of a period away
    assert pace.steps_for([1.0, 2.2, 1.0], [10, 5, 10]) == [10, 5, 10]
    assert pace.steps_for([1.0, 1.0, 1.0], [10, 5, 10]) == [10, 10, 10]


def test_every_rank_decides_the_same_steps_from_the_slowest_rank_of_each_replica():
    """Ranks are replica x shards + shard: a replica's time is its slowest rank's."""
    for replica in (0, 1):
        pace = _pace(replica=replica)
        pace.decide(_Times([0.1, 0.12, 0.2, 0.25]), 0)  # replica 0: 0.12 s, replica 1: 0.25 s
        assert pace.steps_of == [10, 5] and pace.n == (10, 5)[replica]


def test_the_run_steps_of_a_slow_replica_cover_the_period_once():
    """A replica of 5 steps a period of 10: its steps are 2 run steps each, its syncs at the
    run steps of everyone's, and an apply that changes its count spreads the rest evenly."""
    pace = _pace("1,0.5", replica=1, tau=1)
    assert pace.n == 5 and [pace.position(i) for i in range(5)] == [0, 2, 4, 6, 8]
    assert [pace.due(s) for s in range(1, 6)] == [None] * 4 + [0]
    assert pace.start(5) is None and pace.run_step(5) == 10 and pace.run_step(6) is None
    assert pace.position(5) == 10 and pace.sync_step(5) == 10
    measured = _pace(replica=1, tau=1)
    assert measured.start(10) == "sent"  # the time went out (its answer's stand-in below)
    measured.decide(_Times([0.1, 0.4]), 11)  # 4x slower: 3 steps in all, 1 taken already
    assert measured.steps_of == [10, 3] and measured.position(11) == 11
    assert measured.position(12) == pytest.approx(15.5) and measured.due(13) == 0


def test_a_fractional_rate_alternates_its_counts():
    """A replica at 2.5 steps a period of 10 (4x slower) runs 3, 2, 3, 2, ...: never more than
    half a step early or late (error diffusion), where rounding alone would give 3 every
    period; equal replicas stay at the period whatever the noise (the dead band)."""
    pace = _pace(replica=1, tau=1)
    counts = []
    for _ in range(6):
        pace.decide(_Times([0.1, 0.4]), None)
        counts.append(pace.steps_of[1])
    assert counts == [3, 2, 3, 2, 3, 2] and pace.steps_of[0] == 10
    for noisy in ([0.1, 0.35], [0.1, 0.45]):  # within 15% of its rate: the rate stays
        pace.decide(_Times(noisy), None)
    assert pace.rate[1] == 2.5
    pace.decide(_Times([0.1, 0.2]), None)  # now 2x slower: the rate moves at once
    assert pace.rate[1] == 5.0 and pace.steps_of[1] in (5, 6)
    equal = _pace(replica=0)
    for noisy in ([0.1, 0.11], [0.105, 0.1], [0.1, 0.095]):
        equal.decide(_Times(noisy), None)
        assert equal.steps_of == [10, 10]


@pytest.mark.parametrize("options, says", [
    ({"algo": "ddp", "local_steps": "adaptive"}, "--local-steps applies only to --algo diloco"),
    ({"local_steps": "adaptive", "merge_weights": "uniform"}, "drop --merge-weights uniform"),
    ({"local_steps": "1,0"}, "give one positive speed for each of the 2 replicas"),
    ({"local_steps": "1,1,1"}, "give one positive speed for each of the 2 replicas"),
    ({"local_steps": "fast"}, "is not fixed, adaptive or one speed a replica"),
    ({"local_steps": "adaptive", "steps": 33}, "--steps 33 is not a multiple of H/P = 5"),
    ({"local_steps": "adaptive", "eval_every": 7}, "--eval-every 7 is not a multiple"),
    ({"local_steps": "adaptive", "elastic": True, "shards": 2}, "use --shards 1"),
    ({"straggler": "2:2"}, "each replica must be in 0..1 and each factor at least 1"),
    ({"replica_accum": "2"}, "give one positive whole number of micro-batches for each of the 2"),
    ({"replica_accum": "2,0"}, "give one positive whole number of micro-batches"),
    ({"replica_accum": "2,1", "merge_weights": "uniform"}, "drop --merge-weights uniform"),
    ({"straggler": "1:0"}, "each replica must be in 0..1 and each factor at least 1"),
    ({"straggler": "1:2,1:3"}, "names replica 1 twice"),
])
def test_bad_input_gets_one_sentence(options, says):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"algo": "streaming", **options}).validate()
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_several_stragglers_at_once():
    from lowband.faults import parse_straggler
    assert parse_straggler("0:1,1:2,2:4", 3) == {0: 1.0, 1: 2.0, 2: 4.0}
    assert parse_straggler("", 3) == {}


def _final(run_dir):
    return {name: torch.load(run_dir / name, weights_only=True) for name in ("model.pt", "outer.pt")}


def _equal(a, b) -> bool:
    return all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n])
               for n in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """root/NAME for: declared speeds 1,0.5 with replica 1 2x slower (whole, and stopped at run
    step 8 then resumed); declared equal speeds against fixed steps merged by tokens; measured
    speeds with a 2x straggler."""
    root = tmp_path_factory.mktemp("pace")
    common = [*COMMON, "--steps", "16", "--eval-every", "8", "--checkpoint-every", "8"]
    declared = ["--local-steps", "1,0.5", "--straggler", "1:2"]
    train_in_one_job([*common, *declared, "--run-dir", root / "whole"],
                     [*common, *declared, "--stop-after", "8", "--run-dir", root / "part"],
                     [*common, "--local-steps", "1,1", "--run-dir", root / "equal"],
                     [*common, "--merge-weights", "tokens", "--run-dir", root / "fixed"],
                     [*common, "--replica-accum", "2,1", "--run-dir", root / "accum"],
                     [*COMMON, "--steps", "48", "--eval-every", "0", "--local-steps", "adaptive",
                      "--straggler", "1:2", "--run-dir", root / "measured"],
                     [*COMMON, "--steps", "4000", "--eval-every", "0", "--time-budget", "3",
                      *declared, "--run-dir", root / "budget"])
    train_in_one_job(["--resume", root / "part", "--no-progress"])
    return root


def test_a_slower_replica_runs_fewer_steps_and_meets_the_others_at_every_sync(runs):
    """Declared 1,0.5: replica 1 runs 2 steps a period of 4, both sync at run steps 4, 8, ...
    with weights by tokens (2:1), evaluate and checkpoint at run step 8, and end together."""
    whole = runs / "whole"
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["steps_run_per_replica"] == [16, 8]
    syncs = read_events(whole, ("sync",))
    by_replica = {r: [(e["step"], e["inner_step"], round(e["weight"], 6)) for e in syncs
                      if e["replica"] == r] for r in (0, 1)}
    assert by_replica[0] == [(s, s, round(2 / 3, 6)) for s in (4, 8, 12, 16)]
    assert by_replica[1] == [(s, s // 2, round(1 / 3, 6)) for s in (4, 8, 12, 16)]
    evals = [(e["replica"], e["step"]) for e in read_events(whole, ("eval",))]
    assert sorted(evals) == [(0, 8), (0, 16), (1, 8), (1, 16)]
    checkpoints = {(e["replica"], e["step"]) for e in read_events(whole, ("checkpoint",))}
    assert checkpoints == {(0, 8), (0, 16), (1, 8), (1, 16)}
    # the learning rate's place: replica 1's step i of a period stands at run step 2i of it
    lrs = {(e["replica"], e["step"]): e["lr"] for e in read_events(whole, ("step",))}
    assert lrs[(1, 3)] == lrs[(0, 5)] and lrs[(1, 8)] == lrs[(0, 15)]


def test_a_resume_mid_run_is_bitwise(runs):
    assert _equal(_final(runs / "whole"), _final(runs / "part"))
    steps = [e["step"] for e in read_events(runs / "part", ("step",)) if e["replica"] == 1]
    assert steps == list(range(1, 9))  # each of the slow replica's steps once


def test_equal_speeds_equal_fixed_steps_merged_by_tokens(runs):
    """The documented difference: adaptive steps of equal replicas are fixed steps merged by
    tokens (--merge-weights tokens), bitwise; against the uniform mean they agree to rounding."""
    assert _equal(_final(runs / "equal"), _final(runs / "fixed"))


def test_measured_speeds_give_a_straggler_fewer_steps(runs):
    """Measured, with replica 1 computing 2x slower: after the first period it runs fewer steps
    (about half; the machine's load moves it), its tokens weigh less, and both replicas take
    part in every sync."""
    measured = runs / "measured"
    summary = json.loads((measured / "summary.json").read_text())
    fast, slow = summary["steps_run_per_replica"]
    assert fast == 48 and fast * 0.2 <= slow <= fast * 0.8, (fast, slow)
    syncs = read_events(measured, ("sync",))
    assert [e["step"] for e in syncs if e["replica"] == 0] == \
        [e["step"] for e in syncs if e["replica"] == 1] == list(range(4, 49, 4))
    late = [e["weight"] for e in syncs if e["replica"] == 1 and e["step"] > 12]
    assert late and max(late) < 0.5


def test_a_time_budget_ends_every_replica_at_the_same_sync(runs):
    """--time-budget with adaptive steps: rank 0 decides at syncs (the boundaries every replica
    reaches), so both end after the same sync, near the budget, each with its own steps."""
    budget = runs / "budget"
    summary = json.loads((budget / "summary.json").read_text())
    fast, slow = summary["steps_run_per_replica"]
    assert fast < 4000 and slow * 2 == fast and fast % 4 == 0, (fast, slow)
    assert 1.0 < summary["wall_s"] < 9.0  # (3 s: 3x room for a loaded machine)
    last = {e["replica"]: e["step"] for e in read_events(budget, ("sync",))}
    assert last[0] == last[1] == fast


LOOP = '''
import sys, torch
from lowband import Config, Sync
from lowband.data import Batches, load_corpus, vocab_needed
from lowband.models import build, for_training, lm_loss
from lowband.schedule import lr_at
from lowband.train import make_optimizer_factory

cfg = Config(algo="streaming", model="nano", steps=16, seq_len=32, batch_size=4,
             warmup_steps=2, sync_every=8, fragments=2, overlap=1).validate()
tokens = load_corpus(cfg.data, cfg.tokenizer)
torch.manual_seed(cfg.seed)
model = for_training(build(cfg, vocab_needed(tokens)))
optimizer = make_optimizer_factory(cfg, torch.device("cpu"))(model.parameters())
sync = Sync(model, optimizer, "streaming", steps=16, seq_len=32, batch_size=4, sync_every=8,
            fragments=2, overlap=1, local_steps="1,0.5", run_dir=sys.argv[1], link_bandwidth="")
batches = Batches(tokens, rank=sync.topo.rank, world=sync.topo.world, seq_len=32, batch_size=4,
                  seed=cfg.seed, val_fraction=cfg.val_fraction, device=torch.device("cpu"))
for step in sync.range():
    for g in optimizer.param_groups:
        g["lr"] = lr_at(cfg, sync.schedule_step)
    x, y = batches.train(step, 0)
    loss = lm_loss(model, x, y, "fp32")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync.step(loss=loss, tokens=x.numel())
sync.finish()
'''


@pytest.mark.slow
def test_your_loop_runs_declared_speeds_as_lowband_train_does(runs, tmp_path):
    """lowband.Sync with local_steps="1,0.5": sync.range() ends the slow replica's steps at the
    run's last sync, and read at sync.schedule_step the loop's learning rate is lowband
    train's: the same weights, bitwise."""
    import subprocess
    import sys

    from lowband.launch.local import free_port
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
           str(tmp_path / "mine")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train_in_one_job([*COMMON, "--steps", "16", "--eval-every", "0", "--local-steps", "1,0.5",
                      "--run-dir", tmp_path / "theirs"])
    assert _equal(_final(tmp_path / "mine"), _final(tmp_path / "theirs"))
    summary = json.loads((tmp_path / "mine" / "summary.json").read_text())
    assert summary["steps_run_per_replica"] == [16, 8]


def test_a_larger_replica_trains_a_larger_batch_and_weighs_by_its_tokens(runs):
    """--replica-accum 2,1 (fixed steps): replica 0 accumulates two micro-batches a step,
    replica 1 one, so it trains twice the tokens and its pseudo-gradient weighs 2/3."""
    accum = runs / "accum"
    steps = read_events(accum, ("step",))
    tokens = {r: max(e["tokens"] for e in steps if e["replica"] == r) for r in (0, 1)}
    assert tokens == {0: 2 * 16 * 4 * 32, 1: 16 * 4 * 32}
    weights = {round(e["weight"], 6) for e in read_events(accum, ("sync",)) if e["replica"] == 0}
    assert weights == {round(2 / 3, 6)}
    summary = json.loads((accum / "summary.json").read_text())
    assert summary["tokens"] == sum(tokens.values())

