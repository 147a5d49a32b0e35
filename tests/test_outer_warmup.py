"""--outer-warmup (algorithms/outer.py): the outer Nesterov momentum ramped from 0 over each
fragment's first N outer steps, against a float64 hand computation; off is today's step bitwise;
--sync-every-warmup (algorithms/pace.py): diloco's first syncs after H0, 2 H0, ...; a resume
with both on is bitwise; bad values in one sentence. And the default outer lr's one place per
outer rule and codec kind (OUTER_LR_FACTOR)."""

from types import SimpleNamespace

import pytest
import torch

from conftest import train_in_one_job
from lowband.algorithms import outer
from lowband.algorithms.fragments import Fragment
from lowband.algorithms.outer import Staging, default_outer_lr, nesterov_step, outer_lr_for
from lowband.algorithms.pace import Pace, warm_syncs
from lowband.algorithms.streaming import Streaming
from lowband.config import Config
from lowband.options import ConfigError
from lowband.telemetry import RunDir, read_events

LR, MU = 0.7, 0.9


def _stepper(warmup: int, rule: str = "nesterov"):
    """A diloco/streaming outer step as Streaming.outer_step takes it, on one fragment of 7
    values, without a run around it."""
    torch.manual_seed(0)
    alg = Streaming.__new__(Streaming)
    alg.config = SimpleNamespace(outer_rule=rule, outer_lr=LR, outer_momentum=MU,
                                 outer_warmup=warmup)
    cpu = torch.device("cpu")
    alg.staging = Staging(cpu, cpu)
    f = Fragment(0, [torch.nn.Parameter(torch.randn(7))], 0, 1, cpu)
    return alg, f


def _deltas(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(7, generator=g) for _ in range(n)]


@pytest.mark.parametrize("warmup", [1, 3, 4])
def test_momentum_ramp_matches_float64_hand_computation(warmup):
    alg, f = _stepper(warmup)
    o, m = f.outer.double().clone(), torch.zeros(7, dtype=torch.float64)
    for k, d in enumerate(_deltas(6)):
        mu = MU * min(1.0, k / warmup)  # k-th outer step, k from 0: plain SGD first
        m = mu * m + d.double()
        o = o - LR * (d.double() + mu * m)
        alg.outer_step(f, d.clone())
        torch.testing.assert_close(f.outer.double(), o, rtol=0, atol=1e-5)
        torch.testing.assert_close(f.momentum.double(), m, rtol=0, atol=1e-5)
    assert f.outer_steps == 6
    # the first step is plain SGD on the pseudo-gradient, without the (1 + mu) of Nesterov's
    alg, f = _stepper(warmup)
    before, d = f.outer.clone(), _deltas(1)[0]
    alg.outer_step(f, d.clone())
    assert torch.equal(f.outer, before - LR * d)


def test_off_is_todays_step_bitwise():
    alg, f = _stepper(0)
    o, m = f.outer.clone(), f.momentum.clone()
    for d in _deltas(5):
        alg.outer_step(f, d.clone())
        nesterov_step(o, m, d.clone(), LR, MU)  # the step before --outer-warmup existed
        assert torch.equal(f.outer, o) and torch.equal(f.momentum, m)


def test_sync_every_warmup_doubles_up_to_h():
    assert warm_syncs(5, 20) == [5, 15] and warm_syncs(3, 20) == [3, 9, 21]
    assert warm_syncs(0, 20) == [] and warm_syncs(19, 20) == [19]

    def syncs(h0: int, H: int, steps: int) -> list[int]:
        cfg = SimpleNamespace(local_steps="fixed", sync_every=H, fragments=1, overlap=0,
                              sync_every_warmup=h0, replicas=2, grace="", elastic=False)
        pace = Pace(cfg, None, None)
        return [s for s in range(1, steps + 1) if pace.due(s) == 0]

    assert syncs(3, 20, 70) == [3, 9, 21, 41, 61]  # gaps 3, 6, 12, then H
    assert syncs(0, 20, 70) == [20, 40, 60]  # off: every H, as before


def _config(**kw):
    return Config(**{"algo": "diloco", "replicas": 2, "sync_every": 20, **kw}).validate()


def test_bad_values_in_one_sentence():
    for value in (-1, 2.5):
        with pytest.raises(ConfigError, match=r"^--outer-warmup must be 0 \(off\) or a positive "
                           r"number of outer steps, got .*\.$"):
            _config(outer_warmup=value)
    with pytest.raises(ConfigError, match=r"^--outer-warmup ramps the Nesterov outer momentum.*"
                       r"drop one of them\.$"):
        _config(algo="streaming", codec="topk-2bit", outer_rule="sparseloco", outer_warmup=2)
    assert _config(outer_warmup=5).outer_warmup == 5 and _config().outer_warmup == 0
    for value in (-2, 20, 30):
        with pytest.raises(ConfigError, match=r"^--sync-every-warmup must be 0 \(off\) or a "
                           r"number of steps below --sync-every 20, got .*\.$"):
            _config(sync_every_warmup=value)
    with pytest.raises(ConfigError, match=r"^--sync-every-warmup works with --algo diloco only"):
        _config(algo="streaming", sync_every_warmup=5)
    with pytest.raises(ConfigError, match=r"^--sync-every-warmup needs --local-steps fixed"):
        _config(sync_every_warmup=5, local_steps="adaptive", steps=200)
    assert _config(sync_every_warmup=5).sync_every_warmup == 5


def test_default_outer_lr_per_rule_and_codec(monkeypatch):
    # every set-up takes the scaling-law fit unchanged but SparseLoCo's rule on a sparse codec,
    # whose sweep put its best 2.6x higher (benchmarks/outer_lr_sweep.py)
    for rule in ("nesterov", "sparseloco"):
        for codec in ("fp32", "fp4-e3m0", "topk-2bit", "topk-fp4"):
            factor = 2.6 if (rule, codec[:4]) == ("sparseloco", "topk") else 1
            assert outer_lr_for(4, 20, rule, codec) == round(factor * default_outer_lr(4, 20), 3)
    assert _config(algo="streaming", codec="topk-2bit", outer_rule="sparseloco").outer_lr == 1.485
    assert _config(algo="streaming", codec="topk-2bit").outer_lr == default_outer_lr(2, 20)
    # a sweep's factor, set in the one place, reaches a run's resolved default and no other
    monkeypatch.setitem(outer.OUTER_LR_FACTOR, ("nesterov", "sparse"), 1.5)
    assert _config(algo="streaming", codec="topk-2bit").outer_lr == round(1.5 * 0.571, 3)
    assert _config(algo="streaming", codec="fp4-e3m0").outer_lr == 0.571
    assert _config(algo="streaming", codec="topk-2bit", outer_lr=0.3).outer_lr == 0.3


# with the warm-ups: diloco's syncs after 1 and 3 (--sync-every-warmup 1: gaps 1, 2), then 6,
# 9; edit's after 3, 6, 9; --outer-warmup 3: their momentum 0, 0.3, 0.6, then 0.9
WARM = {"diloco": ["--sync-every-warmup", "1", "--outer-warmup", "3"],
        "edit": ["--outer-warmup", "3"]}
COMMON = ["--model", "nano", "--replicas", "2", "--link-bandwidth", "none", "--steps", "10",
          "--sync-every", "3", "--seq-len", "32", "--batch-size", "4", "--warmup-steps", "2",
          "--eval-every", "0", "--checkpoint-every", "3", "--no-progress"]


def _tensors(run, name: str) -> dict:
    return torch.load(run / name, weights_only=True)


def test_resume_with_warmup_on_is_bitwise(tmp_path):
    """With the warm-ups on, a run stopped after 5 and resumed ends bitwise as the run that
    was not stopped: the syncs after the stop take the checkpoint's outer step counts. The
    same run without them differs (they acted)."""
    runs = [["--algo", a, *COMMON, *extra, "--run-dir", tmp_path / a / name]
            for a in WARM for name, extra in (("whole", WARM[a]),
                                              ("part", [*WARM[a], "--stop-after", "5"]),
                                              ("off", []))]
    train_in_one_job(*runs)
    train_in_one_job(*[["--resume", tmp_path / a / "part", "--no-progress"] for a in WARM])
    for a, at in (("diloco", [1, 3, 6, 9]), ("edit", [3, 6, 9])):
        whole, part, off = (tmp_path / a / n for n in ("whole", "part", "off"))
        syncs = {e["step"] for e in read_events(RunDir(whole), ("sync",)) if e["rank"] == 0}
        assert sorted(syncs) == at, (a, syncs)
        for name in ("outer.pt", "model.pt"):
            w, p = _tensors(whole, name), _tensors(part, name)
            assert w.keys() == p.keys() and all(torch.equal(w[k], p[k]) for k in w), (a, name)
        w, o = _tensors(whole, "outer.pt"), _tensors(off, "outer.pt")
        assert not all(torch.equal(w[k], o[k]) for k in w), a
