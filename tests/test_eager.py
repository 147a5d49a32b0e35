"""--outer-update eager (algorithms/eager.py): by hand on two replicas, against a float64
reference of the paper's outer gradient, bitwise resume, delayed unchanged, refusals."""

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import outer_lr_of, reference_replicas, train_in_one_job
from lowband.algorithms.eager import Eager
from lowband.algorithms.fragments import Fragment, Fragmented
from lowband.algorithms.outer import Staging
from lowband.algorithms.streaming import Streaming
from lowband.checkpoint import latest
from lowband.telemetry import RunDir
from test_guard import NANO
from test_streaming import BATCH, FLAGS, LR, MU, SEED, SEQ, fragment_of, inner_step

CPU = torch.device("cpu")


class Replica(Eager, Fragmented):
    """One replica's eager outer step on one 2-value fragment, driven with fake exchanges."""
    outer_step = Streaming.outer_step

    def __init__(self, lr: float, mu: float, alpha: float):
        self.config = SimpleNamespace(outer_update="eager", alpha=alpha, outer_lr=lr,
                                      outer_momentum=mu, outer_rule="nesterov", outer_warmup=0)
        self.topo = SimpleNamespace(device=CPU, shards=1)
        self.comm = SimpleNamespace(membership=SimpleNamespace(members=(0, 1)))
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.fragments = [Fragment(0, [self.param], 0, 1, CPU)]
        self.staging = Staging(CPU, CPU)

    def start(self, local: list) -> torch.Tensor:
        """The replica's weights trained to `local`; its sync starts: (its pseudo-gradient)."""
        f = self.fragments[0]
        with torch.no_grad():
            self.param.copy_(torch.tensor(local))
        delta = f.outer - f.local_slice()
        self.eager_start(f, SimpleNamespace(sent=delta))  # fp32: sent is the delta itself
        return delta


def test_two_replicas_by_hand():
    """Two replicas, three syncs, numbers exact in fp32 (lr = mu = alpha = 1/2): the k-th outer
    step takes Delta_own^k / 2 + Delta_other^(k-1) / 2 (the paper's eager outer gradient), the
    last (at the end) Delta_other / 2; worked out here in plain floats, outside the algorithm."""
    lr = mu = alpha = 0.5
    reps = [Replica(lr, mu, alpha) for _ in range(2)]
    ref = [{"outer": [0.0, 0.0], "m": [0.0, 0.0], "local": [0.0, 0.0]} for _ in range(2)]
    moves = [[[-1.0, 2.0], [-3.0, 0.5]], [[-1.0, 0.25], [-1.0, -0.5]], [[0.5, 1.0], [-2.0, 4.0]]]
    prev = None

    def step(r, g):
        m = [mu * a + b for a, b in zip(r["m"], g)]
        r["outer"] = [o - lr * (b + mu * a) for o, a, b in zip(r["outer"], m, g)]
        r["m"] = m
        r["local"] = [alpha * x + (1 - alpha) * o for x, o in zip(r["local"], r["outer"])]

    for k, move in enumerate(moves):
        deltas = []
        for i, (rep, r) in enumerate(zip(reps, ref)):
            r["local"] = [x + d for x, d in zip(r["local"], move[i])]
            deltas.append(rep.start(r["local"]))
        for i, r in enumerate(ref):
            own = [(o - x) / 2 for o, x in zip(r["outer"], r["local"])]
            assert deltas[i].tolist() == [2 * v for v in own]
            other = [0.0, 0.0] if prev is None else [v / 2 for v in prev[1 - i]]
            step(r, [a + b for a, b in zip(own, other)])
        if k == 0:  # by hand: replica 0's delta (1, -2), g = its half (0.5, -1), no momentum
            assert ref[0]["outer"] == [-0.375, 0.75]  # yet: outer = -lr (g + mu g) = -0.75 g
        prev = [d.tolist() for d in deltas]
        avg = (deltas[0] + deltas[1]) / 2  # the exchange lands, tau steps later
        for rep in reps:
            rep.eager_landed(rep.fragments[0], avg.clone(), restart=False)
        for rep, r in zip(reps, ref):
            assert rep.fragments[0].outer.tolist() == r["outer"]
            assert rep.fragments[0].momentum.tolist() == r["m"]
            assert rep.param.tolist() == r["local"]
    for i, (rep, r) in enumerate(zip(reps, ref)):  # the end: the others' share of the last sync
        rep.eager_finish()
        step(r, [v / 2 for v in prev[1 - i]])
        assert rep.fragments[0].outer.tolist() == r["outer"] and rep.param.tolist() == r["local"]
        assert rep.fragments[0].rest is None
    assert ref[0]["outer"] != ref[1]["outer"]  # each replica's own share went first


def test_a_share_that_is_not_finite_waits_for_the_verdict():
    """A value of the own share that is not finite is not applied; the rest holds 0 there, so
    the landed average (or a skip) decides it."""
    rep = Replica(0.5, 0.5, 0.5)
    f = rep.fragments[0]
    rep.eager_start(f, SimpleNamespace(sent=torch.tensor([float("nan"), 2.0])))
    assert f.outer.tolist() == [0.0, -0.75] and f.rest.tolist() == [0.0, -1.0]  # g = 2 / 2


def test_a_share_left_out_is_taken_back_at_once():
    """Left out (or a skipped sync): the outer step's part from the own share is undone and
    the weights move with the outer parameters, as if the merge had used them unchanged."""
    rep = Replica(0.5, 0.5, 0.5)
    f = rep.fragments[0]
    rep.start([-1.0, 2.0])  # delta (1, -2): g = (0.5, -1), outer -0.75 g, weights merged
    assert f.outer.tolist() == [-0.375, 0.75] and rep.param.tolist() == [-0.6875, 1.375]
    rep.eager_undo(f)
    assert f.outer.tolist() == [0.0, 0.0] and f.momentum.tolist() == [0.0, 0.0]
    assert rep.param.tolist() == [-0.5, 1.0] and f.rest.tolist() == [0.0, 0.0]  # alpha x local
    rep.eager_landed(f, torch.tensor([3.0, 1.0]), restart=False)  # the others' average
    assert f.rest.tolist() == [3.0, 1.0]


def reference(R, steps, H, P, tau, alpha, n_layer, outer_lr):
    """Streaming with eager outer updates in float64, written from the paper's formula: the
    k-th outer step of replica r on fragment p takes Delta_r^k / R + sum_{j != r} Delta_j^(k-1) / R,
    at the sync's start (the others' deltas of sync k-1 landed tau steps after it); at the end
    one more with the others' share of the last sync. Returns replica 0's outer and local."""
    init, models, data, opts = reference_replicas(R, 1, n_layer, SEQ, BATCH, LR, SEED)
    names = [n for n, _ in init.named_parameters()]
    frag = {n: fragment_of(n, n_layer, P, "strided") for n in names}
    outer = [{n: p.detach().clone() for n, p in init.named_parameters()} for _ in range(R)]
    mom = [{n: torch.zeros_like(p) for n, p in outer[0].items()} for _ in range(R)]
    last = {}  # fragment -> every replica's deltas of its last sync

    def step(r, p, g):
        local = dict(models[r].named_parameters())
        for n in (n for n in names if frag[n] == p):
            mom[r][n] = MU * mom[r][n] + g[n]
            outer[r][n] = outer[r][n] - outer_lr * (g[n] + MU * mom[r][n])
            with torch.no_grad():
                local[n].copy_(alpha * local[n] + (1 - alpha) * outer[r][n])

    def others(p, r, n):
        return sum(d[n] for j, d in enumerate(last[p]) if j != r) / R if p in last else 0.0

    for step_ in range(steps):
        inner_step(models, opts, data, 1, step_, steps)
        s = step_ + 1
        if s % (H // P) == 0:
            p = (s // (H // P) - 1) % P
            deltas = [{n: outer[r][n] - dict(models[r].named_parameters())[n].detach()
                       for n in names if frag[n] == p} for r in range(R)]
            for r in range(R):
                step(r, p, {n: deltas[r][n] / R + others(p, r, n) for n in deltas[r]})
            last[p] = deltas
    for p in last:
        for r in range(R):
            step(r, p, {n: others(p, r, n) for n in last[p][r]})
    return outer[0], models[0].state_dict()


# the guard's runs (tests/test_guard.py's, with eager): fragment 0 syncs after steps 10, 30, 50
GUARDED = {"clean": [], "scale": ["--corrupt", "1:30:scale:-10"], "nan": ["--corrupt", "1:30:nan"]}
CASES = {"tau1": (12, 4, 2, 1, 0.5), "tau2-alpha0": (16, 8, 2, 2, 0.0)}  # steps, H, P, tau, alpha


def _run(root, name, steps, H, P, tau, alpha, *extra):
    return ["--algo", "streaming", *FLAGS, "--n-layer", 2, "--replicas", 2, "--steps", steps,
            "--sync-every", H, "--fragments", P, "--overlap", tau, "--alpha", alpha,
            "--codec", "fp32", "--no-progress", "--run-dir", root / name, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The float64 cases with eager; streaming's defaults with and without --outer-update
    delayed; eager with --overlap 1 and 3; GUARDED; an eager run whole and stopped at step 6 (frag0's exchange in
    flight, resumed in a second job from its checkpoint alone). Returns the root."""
    root = tmp_path_factory.mktemp("eager")
    resume = ["--outer-update", "eager", "--checkpoint-every", 3]
    train_in_one_job(*[_run(root, c, *CASES[c], "--outer-update", "eager") for c in CASES],
                     ["--algo", "streaming", *FLAGS, "--steps", 8, "--sync-every", 4,
                      "--no-progress", "--run-dir", root / "default"],
                     ["--algo", "streaming", *FLAGS, "--steps", 8, "--sync-every", 4,
                      "--outer-update", "delayed", "--no-progress", "--run-dir", root / "delayed"],
                     *[["--no-progress", "--run-dir", root / name, *NANO, "--outer-update", "eager",
                        *flags] for name, flags in GUARDED.items()],
                     _run(root, "whole", 10, 4, 2, 1, 0.5, *resume),
                     *[_run(root, f"over{tau}", 12, 8, 2, tau, 0.5, "--outer-update", "eager")
                       for tau in (1, 3)],
                     _run(root, "part", 10, 4, 2, 1, 0.5, *resume, "--stop-after", 6))
    assert latest(RunDir(root / "part")).name == "step-00000006"
    train_in_one_job(["--resume", root / "part", "--no-progress"])
    return root


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_matches_float64_reference(runs, case):
    run = RunDir(runs / case)
    want_outer, want_local = reference(2, *CASES[case], 2, outer_lr_of(run))
    got_outer = torch.load(run.root / "outer.pt", weights_only=True)
    got_local = torch.load(run.root / "model.pt", weights_only=True)
    for name, w in want_outer.items():  # (tolerance: tests/test_streaming.py's)
        rel = (got_outer[name].double() - w).norm() / w.norm()
        assert rel <= 5e-5, f"outer {name}: relative error {rel:.2e}"
        rel = (got_local[name].double() - want_local[name]).norm() / want_local[name].norm()
        assert rel <= 5e-5, f"local {name}: relative error {rel:.2e}"


def _load(run, name):
    return torch.load(run / name, weights_only=True)


@pytest.mark.slow
def test_delayed_is_the_default_bitwise(runs):
    for name in ("model.pt", "outer.pt"):
        a, b = _load(runs / "default", name), _load(runs / "delayed", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_eager_is_the_same_for_every_overlap(runs):
    """The average only has to land before the fragment's next sync, where it is first used:
    tau 1 and 3 (below H/P = 4) train bitwise alike."""
    for name in ("model.pt", "outer.pt"):
        a, b = _load(runs / "over1", name), _load(runs / "over3", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
@pytest.mark.parametrize("kind,why", [("scale", "norm"), ("nan", "non-finite")])
def test_the_guard_leaves_out_a_corrupted_replica(runs, kind, why):
    """Its own share went in at the sync's start; the verdict at the landing leaves it out of
    the average, and the rest takes the share back at the fragment's next sync."""
    summary, clean = (json.loads(RunDir(runs / k).summary.read_text()) for k in (kind, "clean"))
    assert [(r["left_out"], r["step"], r["why"]) for r in summary["left_out"]] == [(1, 30, why)]
    assert clean["left_out_updates"] == 0 and not clean["outer_states_agree"]  # (module doc)
    assert "diverged" not in summary and summary["final_val_loss"] < 1.1 * clean["final_val_loss"]


@pytest.mark.slow
def test_resume_with_eager_is_bitwise(runs):
    for name in ("model.pt", "outer.pt"):
        a, b = _load(runs / "whole", name), _load(runs / "part", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


BAD = [(["--overlap", 0], "needs --overlap 1 or more"),
       (["--algo", "diloco"], "which diloco does not have"),
       (["--merge-weights", "tokens"], "use --merge-weights uniform"),
       (["--local-steps", "adaptive", "--grace", "2s"], "do not go together"),
       (["--elastic"], "which --elastic's heals and quorums cannot")]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_values_one_sentence(tmp_path, lowband_here, args, message):
    code, stderr = lowband_here("train", "--algo", "streaming", "--outer-update", "eager",
                                *args, cwd=tmp_path)
    assert code == 2 and stderr.count("\n") == 1 and message in stderr, stderr
