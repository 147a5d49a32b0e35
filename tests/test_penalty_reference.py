"""--edit-penalty reference: the penalty as atorch computes it (penalty_reference.py, dispatched by
edit_plan.py), against a float64 transcription of atorch's code written here (OnlineDynamicEWMA,
LinearReducer with a softmax temperature, the step-weight mix, the clip, A-EDiT's minimum of new
steps). Pure Python: no process is started."""

import collections
import io
import math
import statistics
from types import SimpleNamespace

import pytest
import torch
from lowband.algorithms import edit_plan, penalty_reference as pr
from lowband.algorithms.aedit import AEDiT
from lowband.algorithms.penalty import EWMA, PenaltyConfig
from lowband.config import Config


# ---------------------------------------------------------------------------------------------
# atorch, written again in float64
# ---------------------------------------------------------------------------------------------

class AtorchEWMA:
    """atorch's OnlineDynamicEWMA (anomaly_detection.py); a non-finite value is flagged and not
    folded in (lowband's deviation)."""

    def __init__(self, alpha, warmup, base):
        self.alpha, self.warmup, self.base = alpha, warmup, base
        self.mean, self.M2, self.count = 0.0, 0.0, 0
        self.window = collections.deque(maxlen=warmup)

    def std(self):
        return math.sqrt(self.M2) if self.count >= 2 else 0.0

    def z(self, x):
        if self.std() == 0 or self.count < self.warmup:
            return 0.0
        return (x - self.mean) / self.std()

    def update(self, x):
        self.count += 1
        delta = x - self.mean
        self.mean += self.alpha * delta
        delta2 = x - self.mean
        self.M2 = (1 - self.alpha) * (self.M2 + self.alpha * delta * delta2)
        self.window.append(self.z(x))

    def is_outlier(self, x):
        if not math.isfinite(x):
            return True
        if self.count < self.warmup:
            return False
        recent = statistics.stdev(self.window) if len(self.window) >= 2 else math.nan
        factor = recent if math.isnan(recent) else max(1.0, recent)  # torch.max keeps a NaN
        return self.z(x) > self.base * factor


class AtorchPenalty:
    """Per unit: one detector per replica, then LinearReducer's weights and the clip factor."""

    def __init__(self, rate=0.02, z=3.0, warmup=10, weighted=True, temperature=1.0, clip=0.0,
                 anomaly=True, step_ratio=0.5):
        self.rate, self.z, self.warmup, self.anomaly = rate, z, warmup, anomaly
        self.weighted, self.temperature, self.clip, self.step_ratio = weighted, temperature, clip, step_ratio
        self.detectors = {}

    def decide(self, unit, norms, steps=None):
        """z, flags, weights; `steps`: each replica's global_step (aedit's step weights)."""
        R = len(norms)
        dets = self.detectors.setdefault(unit, [AtorchEWMA(self.rate, self.warmup, self.z)
                                                for _ in range(R)])
        z = [d.z(x) for d, x in zip(dets, norms)]
        flags = [d.is_outlier(x) if self.anomaly else not math.isfinite(x) for d, x in zip(dets, norms)]
        if self.anomaly:
            for d, x in zip(dets, norms):
                if math.isfinite(x):
                    d.update(x)  # with the raw norm, flagged or not
        if all(flags):
            return z, flags, [0.0] * R
        ratio = self.step_ratio if steps is not None else 0.0
        share = [s / sum(steps) for s in steps] if steps is not None else [0.0] * R
        if self.weighted:  # softmax over the all-gathered -(norm + 1e6 flagged) / T
            T = self.temperature or 1.0
            logits = [-(x + (1e6 if f else 0.0)) / T for x, f in zip(norms, flags)]
            top = max(v for v in logits if math.isfinite(v))
            e = [math.exp(v - top) if math.isfinite(v) else 0.0 for v in logits]
            w = [(1 - ratio) * v / sum(e) + ratio * s for v, s in zip(e, share)]
        else:  # LinearReducer's normalize: weight 1 (mixed), divided by the sum over replicas
            base = [(1 - ratio) * 1.0 + ratio * s for s in share]
            w = [b / sum(base) for b in base]
        return z, flags, [0.0 if f else v for v, f in zip(w, flags)]

    def clip_scale(self, norm):
        return min(1.0, self.clip / (norm + 1e-6)) if self.clip > 0 else 1.0


def config(**kw):
    kw.setdefault("rate", 0.02)
    kw.setdefault("warmup", 10)
    kw.setdefault("temperature", 1.0)
    return PenaltyConfig(mode="reference", **kw)


def run_both(sequence, cfg, ref, steps=None):
    """Feed one unit's norms, sync after sync, to the mode and to the transcription; check they
    agree and yield each sync's decision."""
    stats = edit_plan.new_stats(cfg, len(sequence[0]))
    for sync, norms in enumerate(sequence):
        counts = steps[sync] if steps else None
        shares = [s / sum(counts) for s in counts] if counts else None
        d = pr.decide(norms, stats, cfg, shares)
        z, flags, w = ref.decide("u", norms, counts)
        assert d.flags == flags, sync
        assert d.z == pytest.approx(z, rel=1e-12, abs=1e-12, nan_ok=True), sync
        assert d.weights == pytest.approx(w, rel=1e-12, abs=1e-15), sync
        for mine, theirs in zip(d.ewma.replicas, ref.detectors["u"]):
            assert (mine.mean, mine.m2, mine.count) == pytest.approx(
                (theirs.mean, theirs.M2, theirs.count), rel=1e-12, abs=1e-15)
            assert mine.window == pytest.approx(list(theirs.window), rel=1e-9, abs=1e-12)
        stats = d.ewma
        yield sync, d


def noisy(base, syncs, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = 1 + 0.05 * (2 * torch.rand(syncs, len(base), generator=g, dtype=torch.float64) - 1)
    return [[b * float(n) for b, n in zip(base, row)] for row in noise]


# ---------------------------------------------------------------------------------------------
# (a) spikes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [True, False])
def test_a_spike_after_the_warmup_is_flagged_and_the_others_keep_their_weights(weighted):
    seq = noisy([1.0, 1.1, 0.9], 40)
    seq[5][2] *= 10   # inside the warm-up (10 updates): not flagged
    seq[25][2] *= 10  # after it: flagged
    seq[32][0] = math.nan  # always flagged, never folded in
    cfg, ref = config(weighted=weighted), AtorchPenalty(weighted=weighted)
    flagged = {}
    for sync, d in run_both(seq, cfg, ref):
        flagged[sync] = [i for i, f in enumerate(d.flags) if f]
        if sync == 25:
            assert d.z[2] > 3 and d.z[0] < 3 and d.z[1] < 3
            assert d.weights[2] == 0.0 and not d.all_flagged
            if weighted:  # softmax over all three: the flagged one's term is exp(-1e6) = 0
                e = [math.exp(-x) for x in seq[25][:2]]
                assert d.weights[:2] == pytest.approx([v / sum(e) for v in e], rel=1e-12)
            else:  # 1/R each, not renormalized: the weights sum to 2/3
                assert d.weights == pytest.approx([1 / 3, 1 / 3, 0.0])
        if sync < 10:
            assert d.z == [0.0, 0.0, 0.0]  # atorch's z is 0 until the warm-up is done
    assert {s: f for s, f in flagged.items() if f} == {25: [2], 32: [0]}
    dets = ref.detectors["u"]
    assert dets[2].count == 40 and dets[0].count == 39  # the NaN was not folded in
    assert math.isfinite(dets[0].mean)


def test_short_window_never_flags_and_all_flagged_weighs_nothing():
    # warm-up 1: the window holds one z-score, its std is NaN, and z > NaN is false
    cfg, ref = config(warmup=1), AtorchPenalty(warmup=1)
    seq = [[1.0, 1.0], [1.0, 1.2], [50.0, 1.1], [1.0, 1.0]]
    assert all(not any(d.flags) for _, d in run_both(seq, cfg, ref))
    # every replica flagged: all weights 0, the outer step is skipped (all_flagged)
    d = pr.decide([float("inf"), float("nan")], pr.Detectors.fresh(2), config())
    assert d.flags == [True, True] and d.all_flagged and d.weights == [0.0, 0.0]
    assert d.ewma == pr.Detectors.fresh(2)  # nothing folded in
    off = pr.decide([1.0, float("nan")], pr.Detectors.fresh(2), config(anomaly=False))
    assert off.flags == [False, True] and off.ewma == pr.Detectors.fresh(2)


# ---------------------------------------------------------------------------------------------
# (b) a replica steadily 1.5x the others
# ---------------------------------------------------------------------------------------------

def test_b_a_steadily_larger_replica_is_not_anomalous_to_its_own_detector():
    seq = noisy([1.0, 1.0, 1.5], 200, seed=1)
    cfg, ref = config(), AtorchPenalty()
    for sync, d in run_both(seq, cfg, ref):
        assert not any(d.flags), sync
        e = [math.exp(-x) for x in seq[sync]]  # T = 1 on the raw norms
        assert d.weights == pytest.approx([v / sum(e) for v in e], rel=1e-12)
    # each detector follows its own replica's scale (the mean starts at 0, rate 0.02)
    means = [det.mean for det in d.ewma.replicas]
    assert means[2] / means[0] == pytest.approx(1.5, rel=0.05)


# ---------------------------------------------------------------------------------------------
# (c) cumulative step shares mixed into the weights (A-EDiT)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [True, False])
def test_c_unequal_cumulative_steps_mixed_in(weighted):
    seq = noisy([1.0, 1.2], 30, seed=2)
    seq[20][1] *= 20  # flagged: weight 0, the other's not renormalized
    steps = [[10 + 12 * (s + 1), 10 + 4 * (s + 1)] for s in range(30)]  # warm-up 10, 3:1 since
    cfg = config(weighted=weighted, step_weights=True, step_ratio=0.25)
    ref = AtorchPenalty(weighted=weighted, step_ratio=0.25)
    for sync, d in run_both(seq, cfg, ref, steps):
        share = [s / sum(steps[sync]) for s in steps[sync]]
        if sync == 20:
            assert d.flags == [False, True]
            if weighted:
                assert d.weights[0] == pytest.approx(0.75 * 1.0 + 0.25 * share[0], rel=1e-12)
            else:
                b = [0.75 + 0.25 * s for s in share]
                assert d.weights == pytest.approx([b[0] / sum(b), 0.0], rel=1e-12)
            assert sum(d.weights) < 1
        else:
            assert sum(d.weights) == pytest.approx(1.0)
    # through edit_plan: aedit's rows (S = 2 shards) carry [window steps, elapsed, steps since
    # the start]; the reference mode scores raw norms and shares the cumulative steps
    rows = [[0.5, 0.5, 4.0, 1.0, 30.0], [0.5, 0.0, 4.0, 1.0, 30.0],
            [2.0, 1.0, 1.0, 1.0, 10.0], [2.0, 0.0, 1.0, 1.0, 10.0]]
    cfg = config(step_weights=True)
    plan = edit_plan.decide_sync(rows, [edit_plan.new_stats(cfg, 2)] * 2, 2, 2, cfg, per_step=True)
    assert plan.raw_norms == [[1.0, 2.0], [math.sqrt(0.5), 1.0]]
    assert [d.norms for d in plan.decisions] == plan.raw_norms  # not divided by the steps
    _, _, w = AtorchPenalty().decide("u", [1.0, 2.0], [30, 10])
    assert plan.decisions[0].weights == pytest.approx(w, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# (d) A-EDiT's minimum of new steps
# ---------------------------------------------------------------------------------------------

def atorch_skips(new, minimum, total, budget, elapsed, time_budget):
    """min_total_global_steps: fewer new steps than the minimum call the sync off; lowband never
    calls off the sync that ends the run (the budget or --time-budget reached)."""
    last = total + new >= budget or (time_budget is not None and elapsed >= time_budget)
    return new < minimum and not last


@pytest.mark.parametrize("minimum", [0, 20, 100])
@pytest.mark.parametrize("time_budget", [None, 60.0])
def test_d_min_new_steps_decision(minimum, time_budget):
    cfg = Config(algo="aedit", replicas=2, steps=120, aedit_min_new_steps=minimum,
                 time_budget=time_budget, edit_penalty="reference").validate()
    algo = AEDiT.__new__(AEDiT)  # the decision alone: no model, no processes
    algo.config, algo.topo = cfg, SimpleNamespace(replicas=2)
    for total in (20, 150, 230):
        algo.total = total
        for a, b in ((0, 0), (3, 4), (10, 9), (45, 55), (60, 40), (5, 5)):
            for elapsed in (1.0, 61.0):
                extras = [[float(a), elapsed - 0.5, 0.0], [float(b), elapsed, 0.0]]
                want = atorch_skips(a + b, minimum, total, 240, elapsed, time_budget)
                assert algo._too_few_new_steps(extras) == want, (total, a, b, elapsed)
    algo.total = 230
    assert not algo._too_few_new_steps([[5.0, 1.0], [5.0, 1.0]])  # reaches the budget: the last
    assert algo._too_few_new_steps([[4.0, 1.0], [5.0, 1.0]]) == (minimum > 9)


# ---------------------------------------------------------------------------------------------
# (e) the issue's temperature-1 examples, the clip, the statistics' state
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norms,want", [([20.0, 22.0], [0.8808, 0.1192]),
                                         ([0.1, 0.2], [0.5250, 0.4750])])
@pytest.mark.parametrize("temperature", [1.0, 0.0])  # 0: atorch's default of 1
def test_e_temperature_one_examples(norms, want, temperature):
    d = pr.decide(norms, pr.Detectors.fresh(2), config(temperature=temperature))
    assert d.weights == pytest.approx(want, abs=1e-4)  # softmax(-norm): raw norms, no scale
    assert d.weights == pytest.approx(AtorchPenalty().decide("u", norms)[2], rel=1e-12)


def test_clip_and_dispatch():
    ref = AtorchPenalty(clip=0.5)
    for norm in (0.0, 0.4, 0.5, 0.5000005, 2.0, 1e9):
        assert edit_plan.clip_scale(config(clip=0.5), norm) == pytest.approx(ref.clip_scale(norm),
                                                                             rel=1e-15)
    assert edit_plan.clip_scale(config(clip=0.0), 5.0) == 1.0
    assert edit_plan.clip_scale(PenaltyConfig(clip=0.5), 2.0) == 0.25  # lowband: no 1e-6
    assert isinstance(edit_plan.new_stats(PenaltyConfig(), 3), EWMA)


def test_detectors_state_round_trip():
    stats = pr.Detectors.fresh(2)
    for sync, d in run_both(noisy([1.0, 2.0], 15), config(warmup=4), AtorchPenalty(warmup=4)):
        stats = d.ewma
    assert [len(det.window) for det in stats.replicas] == [4, 4]  # the window's maxlen
    f = io.BytesIO()
    torch.save({"ewma": stats.state()}, f)  # as a checkpoint holds it
    f.seek(0)
    back = pr.Detectors.from_state(torch.load(f, weights_only=True)["ewma"])
    assert back == stats
