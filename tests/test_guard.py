"""The guarded outer step (algorithms/guard.py): each corruption kind is left out and recorded at
R = 2 and R = 4, a clean run is bitwise the run without the guard, a resume after a left-out
update is bitwise, an elastic run with a corrupted group stays correct, bad thresholds are refused
with one sentence, and a run that diverged anyway says so and exits 4."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import lowband, train_in_one_job
from lowband.algorithms.guard import BOUND_SLACK, Guard, Guarded, Verdict, judge
from lowband.telemetry import RunDir, read_events

CFG = SimpleNamespace(guard="norm", guard_ratio=2.0, guard_peers=4.0, guard_warmup=1,
                      guard_rate=0.5)


def rows(*norms, weights=None):
    return [(r, n, 1.0 if weights is None else weights[r]) for r, n in enumerate(norms)]


def test_judge_leaves_out_a_non_finite_norm_from_the_first_sync():
    v = judge(rows(1.0, math.nan), {}, CFG)
    assert list(v.left_out) == [1] and v.left_out[1][0] == "non-finite" and not v.everyone
    assert judge(rows(math.inf, math.nan), {}, CFG).everyone


def test_judge_at_r2_needs_a_rise_over_its_usual_and_over_the_other():
    history = {}
    judge(rows(1.0, 1.0), history, CFG)  # the first sync: history only
    assert history[0] == [0.0, 1] and history[1] == [0.0, 1]
    v = judge(rows(1.0, 10.0), history, CFG)  # 10x its usual and 10x the other: out
    assert v.left_out == {1: ("norm", 10.0, 1.0)} and v.bound == 1.0
    assert history[1] == [0.0, 1]  # a left-out norm is not folded into its history
    assert history[0] == [0.0, 2]
    # both rise alike (the run, not a fault): nobody is left out
    assert not judge(rows(10.0, 12.0), {0: [0.0, 3], 1: [0.0, 3]}, CFG).left_out
    # it stands out from the other but its own norms were always that large: not a fault
    assert not judge(rows(1.0, 10.0), {0: [0.0, 3], 1: [math.log(9.0), 3]}, CFG).left_out
    # a weighed replica of weight 0 (a healed elastic group) is not judged
    assert not judge(rows(1.0, 1e9, weights=[1.0, 0.0]), {1: [0.0, 3]}, CFG).left_out


def test_judge_at_r4_compares_with_the_median_from_the_first_sync():
    v = judge(rows(1.0, 1.1, 0.9, 9.0), {}, CFG)
    assert list(v.left_out) == [3] and v.left_out[3][0] == "peers"
    assert not judge(rows(1.0, 1.1, 0.9, 3.0), {}, CFG).left_out


def test_the_usual_norm_follows_a_fall_at_once_and_a_rise_slowly():
    history = {0: [math.log(8.0), 2]}
    judge([(0, 2.0, 1.0)], history, CFG)
    assert history[0][0] == pytest.approx(math.log(2.0))
    judge([(0, 8.0, 1.0)], history, CFG)
    assert history[0][0] == pytest.approx(math.log(4.0))  # half the way in logs


class _Landed:
    def __init__(self, value, sent=None):
        self.value, self.sent, self.share = value, sent if sent is not None else value, None

    def done(self):
        return True

    def wait(self):
        return self.value.clone() if torch.is_tensor(self.value) else self.value


def _guard(replica=0):
    topo = SimpleNamespace(shards=1, replica=replica)
    return Guard(CFG, SimpleNamespace(), topo, norm=lambda v: float(v.double().norm()))


def _norm_rows(*norms):
    return _Landed([torch.tensor([float(r), n * n, 1.0, 1.0], dtype=torch.float64)
                    for r, n in enumerate(norms)])


def test_a_left_out_replica_is_averaged_again_at_weight_zero():
    calls = []

    def again(x, w):
        calls.append((x.clone(), w))
        return _Landed(torch.full((4,), 0.5), torch.zeros(4) if w == 0 else x)

    mine = torch.full((4,), 50.0)
    g = _guard(replica=1)
    g.history[0] = {0: [0.0, 1], 1: [0.0, 1]}
    out = Guarded(g, _Landed(torch.full((4,), 25.0)), _norm_rows(1.0, 100.0), mine, None, 0,
                  again)
    assert torch.equal(out.wait(), torch.full((4,), 0.5))  # (norm 1: within the bound)
    assert out.verdict.again and list(out.verdict.left_out) == [1]
    (x, w), = calls
    assert w == 0.0 and torch.equal(x, torch.zeros(4))  # its update never enters the merge
    assert out.residual is None


def test_a_merge_larger_than_the_claimed_norms_allow_is_scaled_to_the_bound():
    g = _guard()
    value = torch.tensor([30.0, 40.0])  # norm 50, both replicas claimed norm 2
    out = Guarded(g, _Landed(value), _norm_rows(2.0, 2.0), torch.zeros(2), None, 0,
                  lambda x, w: pytest.fail("nobody is left out"))
    got = out.wait()
    assert out.verdict.scaled == pytest.approx(BOUND_SLACK * 2.0 / 50.0)
    assert got.norm().item() == pytest.approx(BOUND_SLACK * 2.0)
    record, = g.record(out.verdict, 10, 0)
    assert record["why"] == "inconsistent" and "scaled by" in record["text"]


def test_a_verdict_kept_in_a_checkpoint_reads_back_as_it_was():
    """A checkpoint keeps an exchange in flight with its verdict; read back, each number is in
    its own field (scaled and mine_lr were once swapped: a resumed run then recorded a merge
    'scaled by' its learning rates' sum that never was)."""
    v = Verdict(left_out={1: ("norm", 3.0, 1.0)}, weighed=[0, 1], norms=[1.0, 3.0], bound=1.0,
                again=True, mine_lr=0.006, scaled=0.5, norm=0.7)
    assert Verdict.from_state(json.loads(json.dumps(v.state()))) == v


@pytest.mark.parametrize("flags,words", [
    (["--guard-ratio", "1"], "--guard-ratio must be above 1"),
    (["--guard-peers", "0.5"], "--guard-peers must be above 1"),
    (["--guard-warmup", "0"], "--guard-warmup must be a positive number"),
    (["--guard-rate", "2"], "--guard-rate must lie in (0, 1]"),
    (["--guard", "norm", "--grace", "5", "--local-steps", "adaptive"], "use --guard off with --grace"),
    (["--corrupt", "1:5:flip", "--algo", "ddp"], "only diloco and streaming send"),
    (["--corrupt", "1:9-5:nan"], "a range's last not before its first"),
    (["--corrupt", "1:5:scale:x"], "cannot read --corrupt"),
])
def test_bad_guard_and_corrupt_flags_are_refused_in_one_sentence(tmp_path, lowband_here, flags,
                                                                 words):
    code, stderr = lowband_here("train", *flags, cwd=tmp_path)
    assert code == 2 and words in stderr and "Traceback" not in stderr, stderr
    assert not any(tmp_path.iterdir())


NANO = ["--algo", "streaming", "--model", "nano", "--steps", 60, "--link-bandwidth", "none",
        "--eval-every", 0, "--eval-batches", 2]
# (streaming on nano: 2 fragments, H 20: fragment 0 syncs after steps 10, 30, 50, fragment 1
# after 20, 40, 60; a replica's own history judges from a fragment's second sync)
R2 = {"clean": [], "off": ["--guard", "off"], "scale": ["--corrupt", "1:30:scale:-10"],
      "nan": ["--corrupt", "1:30:nan"], "noise": ["--corrupt", "1:30:100"],
      "persistent": ["--corrupt", "1:30-50:scale:-10"], "flip": ["--corrupt", "1:30:flip"]}


@pytest.fixture(scope="module")
def r2_runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("guard")
    train_in_one_job(*[["--no-progress", "--run-dir", root / name, *NANO, *flags]
                       for name, flags in R2.items()])
    return {name: RunDir(root / name) for name in R2}


def _left_out(run) -> list[tuple]:
    summary = json.loads(run.summary.read_text())
    return [(r["left_out"], r["step"], r["why"]) for r in summary["left_out"] if "left_out" in r]


def _weights(run):
    return torch.load(run.root / "model.pt", weights_only=True)


@pytest.mark.slow
def test_a_clean_run_is_bitwise_the_run_without_the_guard(r2_runs):
    clean, off = r2_runs["clean"], r2_runs["off"]
    assert _left_out(clean) == [] and json.loads(clean.summary.read_text())["left_out_updates"] == 0
    for name in ("model.pt", "outer.pt"):
        a = torch.load(clean.root / name, weights_only=True)
        b = torch.load(off.root / name, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), name
    syncs = [e for e in read_events(clean, ("sync",))]
    assert all(len(e["guard_norms"]) == 2 and not e["anomaly"] for e in syncs)


@pytest.mark.slow
@pytest.mark.parametrize("kind,expected", [
    ("scale", [(1, 30, "norm")]), ("nan", [(1, 30, "non-finite")]),
    # (noise in its weights: left out at fragment 1's sync; its fragment 0 is off its usual too
    # and restarts at once, so fragment 0's sync of step 50 takes it back)
    ("noise", [(1, 40, "norm")]),
    ("persistent", [(1, 30, "norm"), (1, 40, "norm"), (1, 50, "norm")])])
def test_each_corruption_at_r2_is_left_out_and_recorded(r2_runs, kind, expected):
    run, clean = r2_runs[kind], r2_runs["clean"]
    assert _left_out(run) == expected
    summary = json.loads(run.summary.read_text())
    clean_summary = json.loads(clean.summary.read_text())
    assert summary["left_out_updates"] == len(expected) and "diverged" not in summary
    assert summary["outer_states_agree"]
    # nano, 60 steps, one replica's work left out: within 10% of the clean run (the benchmark
    # measures the goal, micro and longer)
    assert summary["final_val_loss"] < 1.1 * clean_summary["final_val_loss"]
    events = [e for e in read_events(run, ("guard",))]
    assert {e["rank"] for e in events} == {0, 1}  # every rank records the verdict
    assert events[0]["text"].startswith(f"replica 1's update at step {expected[0][1]} was left out")
    marked = {(e["replica"], e["step"]) for e in read_events(run, ("sync",)) if e["anomaly"]}
    assert marked == {(1, step) for _, step, _ in expected}


@pytest.mark.slow
def test_a_sign_flip_is_not_a_size_the_guard_sees(r2_runs):
    """A negated pseudo-gradient has its usual norm: the guard lets it through (its doc says
    so) and the run goes on; the benchmark measures what it costs."""
    assert _left_out(r2_runs["flip"]) == []
    fault, = [e for e in read_events(r2_runs["flip"], ("fault",))]
    assert (fault["replica"], fault["step"], fault["how"]) == (1, 30, "flip")


@pytest.mark.slow
def test_at_r4_diloco_leaves_out_a_scaled_a_non_finite_and_a_noisy_replica(tmp_path):
    base = ["--no-progress", "--algo", "diloco", "--model", "nano", "--replicas", 4, "--steps",
            24, "--sync-every", 6, "--link-bandwidth", "none", "--eval-every", 0,
            "--eval-batches", 1]
    runs = {"scale": ["--corrupt", "2:6:scale:-10"], "nan": ["--corrupt", "3:12-18:nan"],
            "noise": ["--corrupt", "1:6:100"]}
    train_in_one_job(*[[*base, "--run-dir", tmp_path / n, *f] for n, f in runs.items()])
    # the peers' median judges from the first sync
    assert _left_out(RunDir(tmp_path / "scale")) == [(2, 6, "peers")]
    assert _left_out(RunDir(tmp_path / "nan")) == [(3, 12, "non-finite"), (3, 18, "non-finite")]
    # noise in its weights after step 6 (the sync of step 6 had started): out at the next, and
    # restarted from the outer parameters then, so never again
    assert _left_out(RunDir(tmp_path / "noise")) == [(1, 12, "peers")]
    for n in runs:
        summary = json.loads(RunDir(tmp_path / n).summary.read_text())
        assert summary["outer_states_agree"] and "diverged" not in summary
        weights = _weights(RunDir(tmp_path / n))
        assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
def test_resume_after_a_left_out_update_is_bitwise(tmp_path):
    """The checkpoint after step 30 holds fragment 0's exchange of step 30 in flight (applied
    after step 31), judged and averaged again without replica 1 as it was drained."""
    flags = [*NANO, "--steps", 40, "--checkpoint-every", 30, "--corrupt", "1:30:scale:-10",
             "--no-progress"]
    train_in_one_job(["--run-dir", tmp_path / "whole", *flags],
                     ["--run-dir", tmp_path / "part", *flags, "--stop-after", 30])
    train_in_one_job(["--resume", tmp_path / "part", "--no-progress"])
    whole, part = RunDir(tmp_path / "whole"), RunDir(tmp_path / "part")
    assert _left_out(whole) == _left_out(part) == [(1, 30, "norm")]
    for name in ("model.pt", "outer.pt"):
        a = torch.load(whole.root / name, weights_only=True)
        b = torch.load(part.root / name, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.slow
def test_an_elastic_run_with_a_corrupted_group_stays_correct(tmp_path):
    pytest.importorskip("torchft")
    run = tmp_path / "r"
    proc = lowband("train", "--run-dir", run, *NANO, "--steps", 40, "--elastic",
                   "--min-replicas", 2, "--replicas", 2, "--heartbeat-timeout", 12,
                   "--corrupt", "1:30:scale:-10", "--no-progress", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _left_out(RunDir(run)) == [(1, 30, "norm")]
    summary = json.loads(RunDir(run).summary.read_text())
    assert summary["left_out_updates"] == 1 and "diverged" not in summary
    assert "1 update left out (replica 1's update at step 30 was left out" in proc.stdout
    outer = {g: json.loads(p.read_text())["outer_sha256"]
             for g, p in RunDir(run).group_records().items()}
    assert len(set(outer.values())) == 1  # both groups applied the same guarded merge


@pytest.mark.slow
def test_a_run_that_diverged_says_so_and_exits_4(tmp_path):
    proc = lowband("train", "--run-dir", tmp_path / "r", *NANO, "--steps", 40, "--guard", "off",
                   "--corrupt", "1:20:100", "--no-progress", cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "the run diverged: its validation loss ended at" in proc.stderr
    assert "Traceback" not in proc.stderr
    summary = json.loads(RunDir(tmp_path / "r").summary.read_text())
    assert summary["diverged"].startswith("the run diverged")
    report = (tmp_path / "r" / "report.html").read_text()
    assert 'data-key="diverged"' in report


@pytest.mark.slow
def test_a_loss_jump_rolls_back_to_the_exact_outer_state_of_the_last_good_evaluation(tmp_path):
    """diloco (its exchange lands at once) without the guard: replica 1's weights are ruined
    after step 30, the evaluation of step 30 jumps, and the outer state rolls back to step 20's,
    which a run stopped after step 20 wrote as outer.pt."""
    from lowband.params import digest

    flags = ["--no-progress", "--algo", "diloco", "--model", "nano", "--steps", 50,
             "--sync-every", 10, "--eval-every", 10, "--eval-batches", 2, "--link-bandwidth",
             "none", "--guard", "off", "--rollback", 1.5, "--corrupt", "1:30:100"]
    train_in_one_job(["--run-dir", tmp_path / "a", *flags],
                     ["--run-dir", tmp_path / "b", *flags, "--stop-after", 20])
    back = [e for e in read_events(RunDir(tmp_path / "a"), ("rollback",))]
    assert {(e["rank"], e["step"], e["to_step"], e["syncs_undone"]) for e in back} == \
        {(0, 30, 20, 1), (1, 30, 20, 1)}
    at_20 = torch.load(tmp_path / "b" / "outer.pt", weights_only=True)
    assert {e["outer_sha256"] for e in back} == {digest(at_20)}
    summary = json.loads(RunDir(tmp_path / "a").summary.read_text())
    assert summary["rollbacks"] == 1 and "diverged" not in summary
    assert summary["final_val_loss"] < 4


@pytest.mark.parametrize("flags,words", [
    (["--rollback", "1"], "--rollback must be above 1"),
    (["--rollback", "2", "--algo", "edit"], "has none to roll back"),
    (["--guard", "edit"], "--guard edit is EDiT's pseudo-gradient penalty"),
])
def test_bad_rollback_and_guard_modes_are_refused(tmp_path, lowband_here, flags, words):
    code, stderr = lowband_here("train", *flags, cwd=tmp_path)
    assert code == 2 and words in stderr, stderr
