"""The dashboard's aggregation (lowband.dashboard.model) and widgets, on synthetic runs."""

import asyncio
import json
import math
import random
import re
import time

import numpy as np
import pytest

from lowband.dashboard.model import RunModel, SpikeDetector, bin_transfers, detect_spikes
from lowband.dashboard.commits import commit_text
from lowband.dashboard.restarts import restart_text
from lowband.testing.synthetic import SyntheticRun, make_run
from lowband.telemetry import EventWriter, RunDir, read_events, write_json_atomic


def small_run(root, **kw):
    kw.setdefault("steps", 120)
    return make_run(root, **kw)


# -- aggregation --------------------------------------------------------------------------------

def test_bin_transfers_spreads_bytes_evenly():
    edges = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    assert bin_transfers([0.0], [1.0], [100.0], edges) == pytest.approx([25, 25, 25, 25])
    assert bin_transfers([0.1], [0.6], [50.0], edges) == pytest.approx([15, 25, 10, 0])
    # a zero-length transfer lands whole in the bin holding its start
    assert bin_transfers([0.3], [0.3], [7.0], edges) == pytest.approx([0, 7, 0, 0])


def test_bin_transfers_conserves_bytes():
    rng = random.Random(1)
    starts = [rng.uniform(0, 50) for _ in range(500)]
    ends = [s + (0 if i % 7 == 0 else rng.expovariate(1.0)) for i, s in enumerate(starts)]
    nbytes = [rng.uniform(1, 1e6) for _ in starts]
    for width in (0.01, 0.3, 7.0):
        edges = np.arange(0, max(ends) + width, width)
        binned = bin_transfers(starts, ends, nbytes, edges)
        assert binned.sum() == pytest.approx(sum(nbytes), rel=1e-9)
        assert (binned >= -1e-6).all()


def test_bandwidth_from_events_conserves_bytes_and_knows_capacity(tmp_path):
    rd = small_run(tmp_path / "run", link_bandwidth=1e7)
    m = RunModel(rd.root).load()
    bw = m.bandwidth(max_bins=100)
    assert set(bw["series"]) == {"rank 0", "rank 1", "rank 2", "rank 3"}   # a link per rank
    total = sum((rate * np.diff(bw["edges"])).sum() for rate in bw["series"].values())
    outer = sum(e["wire_bytes"] for e in read_events(rd, ("comm",)) if e["group"] == "outer")
    assert total == pytest.approx(outer, rel=1e-9)
    assert m.outer_wire_bytes == pytest.approx(outer)
    assert len(bw["edges"]) <= 102
    assert bw["capacity"] == pytest.approx(1e7 / 8)
    assert 0 < bw["mean"] < bw["peak"]


def test_queued_transfers_on_an_emulated_link_do_not_overlap(tmp_path):
    rd = RunDir(tmp_path / "run").create()
    write_json_atomic(rd.config, {"algo": "streaming", "replicas": 2, "shards": 1,
                                  "link_bandwidth": "8Mbit", "link_latency": "10ms"})
    w = EventWriter(rd, 0, 0)
    # 1 MB each at 1 MB/s, both requested at 100.0: the second waits for the first
    w.emit("comm", t=101.01, op="all_reduce", group="outer", tag="frag0", payload_bytes=1e6,
           wire_bytes=1e6, codec="fp32", start=100.0, end=101.01)
    w.emit("comm", t=102.01, op="all_reduce", group="outer", tag="frag1", payload_bytes=1e6,
           wire_bytes=1e6, codec="fp32", start=100.0, end=102.01)
    w.emit("step", t=103.0, step=1, loss=1.0, tokens=1, step_s=3.0, compute_s=1.0)
    m = RunModel(rd.root).load()
    begin, end = m.transmission_windows()
    assert begin.tolist() == pytest.approx([100.0, 101.0])
    assert end.tolist() == pytest.approx([101.0, 102.0])
    bw = m.bandwidth(max_bins=30)
    assert bw["capacity"] == 1e6
    assert bw["peak"] == pytest.approx(1e6)
    assert (bw["series"]["rank 0"] * np.diff(bw["edges"])).sum() == pytest.approx(2e6)


def _noisy_curve(n, seed, sd=0.02):
    rng = random.Random(seed)
    return [1.6 + 3.0 * math.exp(-i / 60) + rng.gauss(0, sd) for i in range(n)]


def test_spike_detector_flags_a_jump_and_not_steady_noise():
    for seed in range(5):
        losses = _noisy_curve(400, seed)
        assert detect_spikes(losses) == [], f"steady noise flagged (seed {seed})"
        losses[250] += 1.0
        assert detect_spikes(losses) == [250]
    det = SpikeDetector(z=4, warmup=5)
    zs = [det.update(x) for x in [2.0, 2.01, 1.99, 2.0, 2.02, 1.98, 2.0, 2.01, 5.0]]
    assert zs[-1][1] and zs[-1][0] > 4 and not any(flag for _, flag in zs[:-1])


def test_spikes_from_step_events_and_spike_events(tmp_path):
    rd = small_run(tmp_path / "run",
                   spike={"replica": 1, "step": 90, "size": 1.5, "event": True})
    m = RunModel(rd.root).load()
    assert [(s.replica, s.step) for s in m.detected_spikes()] == [(1, 90)]
    assert [(s.replica, s.step) for s in m.spike_events] == [(0, 90)]
    quiet = RunModel(small_run(tmp_path / "quiet").root).load()
    assert quiet.detected_spikes() == []


def test_loss_per_replica_is_the_mean_over_its_ranks(tmp_path):
    rd = small_run(tmp_path / "run", replicas=2, shards=3)
    m = RunModel(rd.root).load()
    by = {}
    for e in read_events(rd, ("step",)):
        by.setdefault((e["replica"], e["step"]), []).append(e["loss"])
    assert sorted(m.replicas) == [0, 1]
    for q, rs in m.replicas.items():
        assert rs.steps == list(range(120))
        for step, loss in zip(rs.steps, rs.loss):
            assert len(by[(q, step)]) == 3
            assert loss == pytest.approx(sum(by[(q, step)]) / 3)
        # tokens: the replica's ranks' tokens summed; the run's: times the replicas
        assert rs.tokens[-1] == 3 * 120 * 4096
    assert m.run_tokens(m.replicas[0].tokens[-1]) == 6 * 120 * 4096


def test_a_lagging_rank_holds_back_its_replicas_point(tmp_path):
    rd = RunDir(tmp_path / "run").create()
    write_json_atomic(rd.config, {"algo": "diloco", "replicas": 1, "shards": 2, "steps": 10})
    w0, w1 = EventWriter(rd, 0, 0), EventWriter(rd, 1, 0)
    for s in range(5):
        w0.emit("step", step=s, loss=2.0, tokens=s, step_s=0.1, compute_s=0.1)
    for s in range(3):
        w1.emit("step", step=s, loss=4.0, tokens=s, step_s=0.1, compute_s=0.1)
    m = RunModel(rd.root)
    m.poll()
    assert m.replicas[0].steps == [0, 1, 2] and m.replicas[0].loss == [3.0, 3.0, 3.0]
    for s in range(3, 5):
        w1.emit("step", step=s, loss=4.0, tokens=s, step_s=0.1, compute_s=0.1)
    m.poll()
    assert m.replicas[0].steps == [0, 1, 2, 3, 4]


def test_sync_marks_are_one_per_step_and_fragment(tmp_path):
    rd = small_run(tmp_path / "run", replicas=2, shards=2, fragments=2, sync_every=20,
                   anomaly_at=(1, 40, 0))
    m = RunModel(rd.root).load()
    syncs = read_events(rd, ("sync",))
    keys = {(e["step"], e["fragment"]) for e in syncs}
    marks = m.sync_marks()
    assert len(marks) == len(keys) and {(mk.step, int(mk.label[4:])) for mk in marks} == keys
    assert [(mk.step, mk.label) for mk in marks if mk.anomaly] == [(40, "frag0")]
    assert m.anomalies == 1


def test_sync_marks_fall_back_to_outer_comm(tmp_path):
    rd = RunDir(tmp_path / "run").create()
    write_json_atomic(rd.config, {"algo": "diloco", "replicas": 2, "shards": 1, "steps": 4})
    ws = [EventWriter(rd, r, r) for r in range(2)]
    t0 = 1000.0
    for s in range(4):
        for r, w in enumerate(ws):
            w.emit("step", t=t0 + s + 0.5, step=s, loss=3.0, tokens=s, step_s=0.5, compute_s=0.4)
            if s in (1, 3):   # both replicas exchange at once: one sync
                w.emit("comm", t=t0 + s + 0.8, op="all_reduce", group="outer", tag="frag0",
                       payload_bytes=100, wire_bytes=100, codec="fp32",
                       start=t0 + s + 0.5 + 0.01 * r, end=t0 + s + 0.8)
    m = RunModel(rd.root).load()
    assert [(mk.step, mk.label) for mk in m.sync_marks()] == [(1, "frag0"), (3, "frag0")]


# -- reading incrementally ----------------------------------------------------------------------

def test_poll_reads_only_what_was_appended(tmp_path):
    run = SyntheticRun(tmp_path / "run", steps=60)
    run.emit_steps(0, 30)
    m = RunModel(run.rd.root)
    first = m.poll()
    files = sorted(run.rd.events.glob("rank*.jsonl"))
    sizes = {p: p.stat().st_size for p in files}
    assert m.offsets == sizes
    lines = sum(len(p.read_text().splitlines()) for p in files)
    assert first == lines - 1             # the synthetic run's "mystery" kind is skipped
    assert m.poll() == 0
    run.emit_steps(30, 40)
    new = m.poll()
    assert new == sum(len(p.read_text().splitlines()) for p in files) - lines
    assert m.offsets == {p: p.stat().st_size for p in files}
    assert all(rs.steps == list(range(40)) for rs in m.replicas.values())
    run.close()


def test_torn_line_waits_until_completed(tmp_path):
    run = SyntheticRun(tmp_path / "run", steps=20)
    run.emit_steps(0, 20)
    m = RunModel(run.rd.root)
    m.poll()
    before = m.offsets
    rest = run.tear(rank=0)
    assert m.poll() == 0 and m.offsets == before
    assert 20 not in m._val
    with open(run.rd.event_file(0), "ab") as f:
        f.write(rest)
    assert m.poll() == 1
    assert m.val_series()[1][-1] == 9.5
    run.close()


def test_damaged_lines_and_unknown_fields_are_skipped(tmp_path):
    rd = small_run(tmp_path / "run", steps=10)
    with open(rd.event_file(1), "a") as f:
        f.write("not json at all\n")
        f.write(json.dumps({"v": 1, "t": 1.7e9, "rank": 1, "replica": 0, "kind": "step",
                            "step": "eleven", "loss": None}) + "\n")
        f.write(json.dumps({"v": 1, "t": 1.7e9, "rank": 1, "replica": 0, "kind": "comm",
                            "group": "outer", "wire_bytes": "lots"}) + "\n")
    m = RunModel(rd.root).load()
    assert all(len(rs.steps) == 10 for rs in m.replicas.values())
    assert m.stats()["status"] == "finished"


def test_status(tmp_path):
    assert RunModel(tmp_path / "nothing").status() == "waiting"
    run = SyntheticRun(tmp_path / "run", steps=10)
    run.emit_steps(0, 5)
    m = RunModel(run.rd.root)
    m.poll()
    assert m.status() == "running"
    assert m.status(now=time.time() + 3600) == "stalled"
    run.emit_steps(5, 10)
    run.finish()
    m.poll()
    assert m.status() == "finished" and m.finished
    assert m.stats()["tokens"] == 4 * 10 * 4096


# group 1 of three dies after step 40 and is back, healed from a live peer, at step 80
ELASTIC = {"kill": 1, "at": 40, "back": 80, "heal_bytes": 1.2e6, "heal_s": 0.3}


def elastic_run(root, **kw):
    kw.setdefault("steps", 120)
    kw.setdefault("elastic", ELASTIC)
    return make_run(root, replicas=3, shards=2, **kw)


def test_membership_is_one_record_per_group_and_quorum(tmp_path):
    rd = elastic_run(tmp_path / "run")
    events = read_events(rd, ("membership",))
    assert len(events) == 2 * (3 + 2 + 3)             # every rank of a group writes one
    healed = next(e for e in events if e["healed"] and e["rank"] == 2)
    with open(rd.event_file(2), "a") as f:            # a rank's line written twice counts once
        f.write(json.dumps(healed) + "\n")
    m = RunModel(rd.root).load()
    assert [(r.step, r.replica, r.quorum_id, r.size, r.change) for r in m.membership()] == [
        (0, 0, 0, 3, "group 0 joined"), (0, 1, 0, 3, "group 1 joined"),
        (0, 2, 0, 3, "group 2 joined"),
        (40, 0, 1, 2, "group 1 left"), (40, 2, 1, 2, "group 1 left"),
        (80, 0, 2, 3, "group 1 joined"),
        (80, 1, 2, 3, "group 1 rejoined (healed 2.4 MB in 0.3 s)"),
        (80, 2, 2, 3, "group 1 joined")]
    rec = m.membership()[6]
    assert rec.healed and rec.ranks == (2, 3) and rec.members == (0, 1, 2)
    assert rec.heal_bytes == 2 * 1.2e6                # each of the group's ranks gets its own
    assert rec.heal_s == 0.3 and rec.wait_s == pytest.approx(0.01 + 0.003)
    assert m.membership()[3].left == (1,) and m.membership()[3].members == (0, 2)
    # the run's changes: every group's view of a quorum merged
    assert [(mk.step, mk.quorum_id, mk.text, mk.healed) for mk in m.membership_marks()] == [
        (0, 0, "groups 0, 1, 2 joined", False), (40, 1, "group 1 left", False),
        (80, 2, "group 1 rejoined (healed 2.4 MB in 0.3 s)", True)]
    assert 40 not in m.replicas[1].steps and 80 in m.replicas[1].steps
    plain = RunModel(small_run(tmp_path / "plain").root).load()
    assert plain.membership() == [] and plain.membership_marks() == []


def test_loss_figure_and_timeline_mark_membership_changes(tmp_path):
    from lowband.dashboard import figures as F

    m = RunModel(elastic_run(tmp_path / "run").root).load()
    traces = {t["name"]: t for t in F.loss_spec([m])[0]}
    line, label = traces["membership change"], traces["membership label"]
    assert line["x"] == [0, 0, None, 40, 40, None, 80, 80, None]
    assert label["x"] == [0, 40, 80] and not label["showlegend"]
    assert label["text"] == ["groups 0, 1, 2 joined", "group 1 left",
                             "group 1 rejoined (healed 2.4 MB in 0.3 s)"]
    assert "quorum 1 of 2 groups: 0, 2" in label["hovertext"][1]
    tokens = {t["name"]: t for t in F.loss_spec([m], "tokens")[0]}["membership label"]
    assert tokens["x"][1] == m.run_tokens(m.replicas[0].tokens_at(40))
    times = {t["name"]: t for t in F.loss_spec([m], "time")[0]}["membership label"]
    assert times["x"][1] == pytest.approx(4.0, abs=0.01)
    F.make_figure(F.loss_spec([m]))                   # plotly takes every property
    # the timeline: a tick on each lane of the group that saw a change, a star where healed
    (tl,) = [t for t in F.timeline_spec(m, window_s=None)[0] if t["name"] == "membership change"]
    assert len(tl["x"]) == 2 * 8
    stars = sorted((y, x) for x, y, s in zip(tl["x"], tl["y"], tl["marker"]["symbol"])
                   if s == "star")
    assert [y for y, _ in stars] == [2, 3] and stars[0][1] == pytest.approx(8.0, abs=0.01)
    assert any("rank 3, group 1: group 1 rejoined" in text for text in tl["text"])
    assert sum(y in (2, 3) for y in tl["y"]) == 4    # group 1 was away from quorum 1
    F.make_figure(F.timeline_spec(m))
    # a run without membership events draws none of it
    plain = RunModel(small_run(tmp_path / "plain").root).load()
    for spec in (F.loss_spec([plain]), F.timeline_spec(plain)):
        assert not any("membership" in t["name"] for t in spec[0])


# ... and the survivors' commit vote of fragment 1's sync at step 50 fails
VOTE = dict(ELASTIC, uncommitted=50)
FAILED = "commit vote failed in groups 0, 2: outer update of fragment 1 skipped there (step 50)"


def test_failed_commit_votes_are_one_record_per_sync_and_drawn(tmp_path):
    from lowband.dashboard import figures as F

    rd = elastic_run(tmp_path / "run", elastic=VOTE)
    skips = read_events(rd, ("skip",))
    assert {(e["rank"], e["step"], e["fragment"], e["what"]) for e in skips} == {
        (r, 50, 1, "commit") for r in (0, 1, 4, 5)}
    with open(rd.event_file(4), "a") as f:            # a rank's line written twice counts once
        f.write(json.dumps(skips[-1]) + "\n")       # and other skips are not failed commits
        f.write(json.dumps(dict(skips[-1], what="pseudo-gradient", step=70)) + "\n")
    m = RunModel(rd.root).load()
    (c,) = m.failed_commits()
    assert (c.step, c.fragment, c.label, c.replicas) == (50, 1, "frag1", (0, 2))
    assert [r for r, _, _ in c.reports] == [0, 1, 4, 5] and c.t == min(t for *_, t in c.reports)
    assert (50, "frag1") not in {(mk.step, mk.label) for mk in m.sync_marks()}   # not applied
    # the loss figure: a dotted line and a crossed-out diamond beside the membership marks
    traces = {t["name"]: t for t in F.loss_spec([m])[0]}
    line, mark = traces["failed commit"], traces["failed commit mark"]
    assert line["x"] == [50, 50, None] and mark["x"] == [50] and not mark["showlegend"]
    assert mark["text"] == [FAILED]
    assert mark["marker"]["color"] == F.FAILED_COMMIT_COLOR
    times = {t["name"]: t for t in F.loss_spec([m], "time")[0]}["failed commit mark"]
    assert times["x"] == [pytest.approx(c.t - m.t0)]
    F.make_figure(F.loss_spec([m]))
    # the timeline: on each reporting rank's lane, where the outer step's diamond would be
    (tl,) = [t for t in F.timeline_spec(m, window_s=None)[0]
             if t["name"] == "failed commit (not applied)"]
    assert tl["y"] == [pytest.approx(y - 0.22) for y in (0, 1, 4, 5)]
    assert tl["text"][2] == f"{FAILED}<br>rank 4, group 2"
    assert tl["marker"]["symbol"] == "diamond-x-open"
    F.make_figure(F.timeline_spec(m))
    # runs without a failed vote, elastic or not, draw none of it
    for plain in (RunModel(elastic_run(tmp_path / "el").root).load(),
                  RunModel(small_run(tmp_path / "plain").root).load()):
        assert plain.failed_commits() == []
        for spec in (F.loss_spec([plain]), F.timeline_spec(plain)):
            assert not any("commit" in t["name"] for t in spec[0])


def test_a_group_healed_in_a_quorum_it_did_not_join_says_why_it_was_behind(tmp_path):
    """Group 2's commit vote of the sync at step 20 failed (group 0's did not): it skipped that
    update and healed in the next quorum, "behind: its commit vote failed at step 20"; its
    second heal has no failed vote before it (it had trained less)."""
    rd = RunDir(tmp_path / "r").create()
    w = {g: EventWriter(rd, g, g) for g in (0, 2)}
    t = iter(range(100))

    def quorum(g, step, q, healed=False, joined=()):
        w[g].emit("membership", t=next(t), step=step, quorum_id=q, size=2, members=[0, 2],
                  joined=list(joined), left=[], healed=healed, wait_s=0.1)

    for g in (0, 2):
        quorum(g, 0, 0, joined=(0, 2))
    w[2].emit("skip", t=next(t), step=20, what="commit", fragment=0)
    for g, healed in ((0, False), (2, True)):
        quorum(g, 40, 1, healed)
    for g, healed in ((0, False), (2, True)):
        quorum(g, 60, 2, healed)
    m = RunModel(rd.root).load()
    heals = [r for r in m.membership() if r.healed]
    assert [r.behind for r in heals] == ["behind: its commit vote failed at step 20",
                                         "behind: it had trained less than the others"]
    assert heals[0].change == "group 2 healed from a live peer (behind: its commit vote failed " \
                              "at step 20)"
    (c,) = m.failed_commits()
    assert c.replicas == (2,)
    assert commit_text(c) == "commit vote failed in group 2: outer update of fragment 0 " \
                             "skipped there (step 20)"


def test_the_first_quorum_after_a_lighthouse_restart_says_so(tmp_path):
    """Both groups' first quorum of the new Lighthouse's life (membership events with
    lighthouse_restarted): the record of each and the run's one mark say it."""
    rd = RunDir(tmp_path / "r").create()
    w = {g: EventWriter(rd, g, g) for g in (0, 1)}
    for g in (0, 1):
        w[g].emit("membership", t=1.0 + g, step=0, quorum_id=1, size=2, members=[0, 1],
                  joined=[0, 1], left=[], healed=False, wait_s=0.1)
        w[g].emit("membership", t=10.0 + g, step=16, quorum_id=1_000_001, size=2,
                  members=[0, 1], joined=[], left=[], healed=False, wait_s=4.2,
                  lighthouse_restarted=True)
    m = RunModel(rd.root).load()
    assert [r.lighthouse_restarted for r in m.membership()] == [False, False, True, True]
    assert [r.change for r in m.membership()][2:] == ["the Lighthouse was restarted"] * 2
    assert [(mk.step, mk.text) for mk in m.membership_marks()] == [
        (0, "groups 0, 1 joined"), (16, "the Lighthouse was restarted")]


def test_dashboard_draws_membership_changes_as_they_come(tmp_path):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", replicas=3, shards=2, steps=120, elastic=VOTE)
    run.emit_steps(0, 30)
    d = Dashboard(run.rd.root)
    assert list(_trace(d.loss_fig, "membership label").text) == ["groups 0, 1, 2 joined"]
    assert not any("commit" in t.name for t in (*d.loss_fig.data, *d.timeline_fig.data))
    run.emit_steps(30, 90)
    d.refresh()
    assert list(_trace(d.loss_fig, "membership label").x) == [0, 40, 80]
    assert len(_trace(d.timeline_fig, "membership change").x) == 2 * 8
    # the failed vote of step 50, read incrementally like the rest
    assert list(_trace(d.loss_fig, "failed commit mark").x) == [50]
    assert FAILED in _trace(d.loss_fig, "failed commit mark").text[0]
    assert len(_trace(d.timeline_fig, "failed commit (not applied)").x) == 4
    run.finish()
    d.refresh()
    assert d.last_error is None
    quiet = Dashboard(small_run(tmp_path / "plain").root)
    assert not any("membership" in t.name or "commit" in t.name
                   for t in (*quiet.loss_fig.data, *quiet.timeline_fig.data))


# -- restarts -----------------------------------------------------------------------------------

# attempt 0 checkpoints after step 20 and dies at step 27; attempt 1, Slurm's first requeue,
# resumes from the checkpoint
REQUEUE = {"at": 20, "crash": 27, "slurm_restart": 1}
RESUMED = "attempt 1 resumed from step 20 (steps 21–27 of the lost attempt redone; Slurm requeue 1)"


def _series(m: RunModel):
    return ([(q, rs.steps, rs.loss, rs.t, rs.tokens) for q, rs in sorted(m.replicas.items())],
            list(m.steps), m.syncs, m.outer, m.restarts())


def test_a_restarted_run_reads_the_same_in_one_poll_and_incrementally(tmp_path):
    run = SyntheticRun(tmp_path / "run", steps=40)
    live = RunModel(run.rd.root)
    run.emit_steps(0, 21)
    kept = run.checkpoint(20)
    run.emit_steps(21, 28)
    live.poll()
    assert live.replicas[0].steps[-1] == 27 and live.restarts() == []
    lost = {q: set(rs.loss[21:]) for q, rs in live.replicas.items()}
    version = live.version
    run.resume(20, kept, crashed_at=27, slurm_restart=1)
    run.emit_steps(21, 40)
    run.close()
    live.poll()                      # it had folded in steps 21-27 of the lost attempt
    assert live.version > version
    whole = RunModel(run.rd.root).load()
    assert _series(live) == _series(whole)
    (r,) = whole.restarts()
    assert (r.attempt, r.step, r.superseded_to, r.slurm_restart) == (1, 20, 27, 1)
    assert [rank for rank, _ in r.reports] == [0, 1, 2, 3] and r.t == r.reports[0][1]
    assert restart_text(r) == RESUMED
    for q, rs in whole.replicas.items():
        assert rs.steps == list(range(40)) and not lost[q] & set(rs.loss)
    assert [s.n_steps for s in live.ranks.values()] == [40] * 4
    assert live.status() == whole.status() == "running"


def test_a_resume_after_the_end_runs_again(tmp_path):
    run = SyntheticRun(tmp_path / "run", steps=10)
    run.emit_steps(0, 10)
    t_end = run.step_end(3, 9) + 0.05
    for w in run.writers.values():
        w.emit("run", t=t_end, phase="end", world=4)
    m = RunModel(run.rd.root)
    m.poll()
    assert m.status() == "ended" and m.restarts() == []
    run.writers[0].emit("run", t=t_end + 1, phase="resume", world=4, step=9, attempt=1)
    m.poll()
    assert m.status() == "running"     # rank 0 runs again
    assert [restart_text(r) for r in m.restarts()] == ["attempt 1 resumed from step 9"]
    run.writers[0].emit("run", t=t_end + 2, phase="end", world=4)
    m.poll()
    assert m.status() == "ended"


def test_restarts_are_drawn_on_the_loss_figure_and_timeline(tmp_path):
    from lowband.dashboard import figures as F

    m = RunModel(make_run(tmp_path / "run", steps=40, restart=REQUEUE).root).load()
    (r,) = m.restarts()
    traces = {t["name"]: t for t in F.loss_spec([m])[0]}
    line, mark = traces["restart"], traces["restart mark"]
    assert line["x"] == [20, 20, None] and mark["x"] == [20] and not mark["showlegend"]
    assert mark["text"] == [RESUMED] and mark["marker"]["color"] == F.RESTART_COLOR
    times = {t["name"]: t for t in F.loss_spec([m], "time")[0]}["restart mark"]
    # on the run's training clock it sits at the checkpoint's seconds: the lost attempt's and
    # the gap before the resume are not training time
    assert times["x"] == [pytest.approx(21 * 0.1, abs=0.01)] and r.t - m.t0 > 7
    tokens = {t["name"]: t for t in F.loss_spec([m], "tokens")[0]}["restart mark"]
    assert tokens["x"] == [m.run_tokens(m.replicas[0].tokens_at(20))]
    F.make_figure(F.loss_spec([m]))
    # the timeline: on each rank's lane, when it resumed
    (tl,) = [t for t in F.timeline_spec(m, window_s=None)[0] if t["name"] == "restart"]
    assert tl["y"] == [0, 1, 2, 3]
    assert tl["x"] == [pytest.approx(t - m.t0) for _, t in r.reports]
    assert tl["text"][1] == f"{RESUMED}<br>rank 1"
    F.make_figure(F.timeline_spec(m))
    plain = RunModel(small_run(tmp_path / "plain").root).load()
    assert plain.restarts() == []
    for spec in (F.loss_spec([plain]), F.timeline_spec(plain)):
        assert not any("restart" in t["name"] for t in spec[0])


# -- the widget ---------------------------------------------------------------------------------

def _trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def _points(fig, name="replica 0") -> int:
    return next((len(t.x) for t in fig.data if t.name == name), -1)


def test_dashboard_refresh_updates_the_figures(tmp_path):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", steps=100)
    run.emit_steps(0, 40)
    d = Dashboard(run.rd.root)              # no event loop here: loads once, synchronously
    assert not d.live
    assert _points(d.loss_fig) == 40
    assert len(_trace(d.loss_fig, "replica 1").y) == 40
    assert any(t.name == "rank 3" and len(t.y) for t in d.bandwidth_fig.data)
    assert any(t.name.startswith("capacity") for t in d.bandwidth_fig.data)
    bars = {t.name: t for t in d.timeline_fig.data if t.type == "bar"}
    assert {"step (compute)", "inner comm", "outer frag0", "outer frag1"} <= set(bars)
    assert len(bars["step (compute)"].x) == 4 * 40
    assert "running" in d.summary.value
    run.emit_steps(40, 70)
    assert d.refresh() > 0
    assert _points(d.loss_fig) == 70
    assert d.refresh() == 0
    d.xaxis.value = "tokens"
    assert _trace(d.loss_fig, "replica 0").x[-1] == 70 * 4096 * 4
    d.xaxis.value = "time"
    assert _trace(d.loss_fig, "replica 0").x[-1] == pytest.approx(7.0, abs=0.05)
    run.finish()
    d.refresh()
    assert "finished" in d.summary.value
    assert d.last_error is None
    assert "application/vnd.jupyter.widget-view+json" in d._repr_mimebundle_()


def test_dashboard_caps_points_per_trace(tmp_path):
    from lowband.dashboard import Dashboard

    rd = small_run(tmp_path / "run", steps=300)
    d = Dashboard(rd.root, max_points=50, max_spans=100)
    assert len(_trace(d.loss_fig, "replica 0").x) <= 50
    assert _trace(d.loss_fig, "replica 0").x[-1] == 299
    assert all(len(t.x) <= 100 for t in d.timeline_fig.data)


def test_dashboard_overlays_several_runs(tmp_path):
    from lowband.dashboard import Dashboard

    a = small_run(tmp_path / "a", name="alpha")
    b = small_run(tmp_path / "b", name="beta", fragments=1, replicas=1)
    d = Dashboard([a.root, str(b.root)])
    names = {t.name for t in d.loss_fig.data}
    assert {"alpha · replica 0", "alpha · replica 1", "beta · replica 0"} <= names
    bw_names = {t.name for t in d.bandwidth_fig.data}
    assert {"alpha (mean per link)", "beta (mean per link)"} <= bw_names
    assert "alpha" in d.timeline_fig.layout.title.text
    d.timeline_run.value = 1
    assert "beta" in d.timeline_fig.layout.title.text


class Handle:
    """A launch handle as the dashboard sees one (lowband.launch.LaunchHandle's status() says
    pending, running, succeeded, failed, cancelled or unknown; TorchX's AppState names are
    upper case)."""

    def __init__(self, run_dir, state="RUNNING"):
        self.run_dir = run_dir
        self.state = state
        self.calls = []

    def start(self):
        self.calls.append("start")

    def cancel(self):
        self.calls.append("cancel")

    def status(self):
        self.calls.append("status")
        return self.state


def test_dashboard_on_a_launch_handle(tmp_path):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", steps=20)
    run.emit_steps(0, 10)
    h = Handle(run.rd.root, state="pending")
    d = Dashboard(h)
    assert d.start_button is not None and d.stop_button is not None
    assert "(job pending)" in d.summary.value      # the job's status, where it says more
    h.calls.clear()
    d.stop_button.click()
    deadline = time.time() + 5
    while "cancel" not in h.calls and time.time() < deadline:
        time.sleep(0.01)
    assert h.calls == ["cancel"]

    class Bare:
        run_dir = run.rd.root

    bare = Dashboard(Bare())
    assert bare.start_button is None and bare.stop_button is None
    run.close()


def _status_cell(d) -> str:
    """The summary's status cell, tags stripped: "running", "failed (ended without ...)"."""
    row = d.summary.value.split("<tbody>")[1]
    return re.sub(r"<[^>]+>", "", re.findall(r"<td>(.*?)</td>", row)[1])


@pytest.mark.parametrize("state", ["running", "RUNNING"])
def test_dashboard_does_not_repeat_the_status_its_handle_gives(tmp_path, state):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", steps=20)
    run.emit_steps(0, 5)
    d = Dashboard(Handle(run.rd.root, state))
    assert _status_cell(d) == "running"             # not "running (running)"
    run.finish()
    d._handle_checked = -math.inf
    d.handles[0].state = "succeeded"
    d.refresh()
    assert _status_cell(d) == "finished"            # not "finished (job succeeded)"


@pytest.mark.parametrize("state", ["failed", "cancelled", "FAILED"])
def test_dashboard_stops_polling_a_run_whose_job_ended_without_a_summary(tmp_path, monkeypatch,
                                                                          state):
    from lowband.dashboard import Dashboard, widget

    monkeypatch.setattr(widget, "HANDLE_STATUS_EVERY_S", 0.05)
    run = SyntheticRun(tmp_path / "run", steps=100, name="doomed")
    run.emit_steps(0, 10)
    h = Handle(run.rd.root, "running")
    d = Dashboard(h, autostart=False, interval=0.01)
    d.start()
    assert _wait(lambda: _points(d.loss_fig) == 10)
    assert d.live
    # the job dies: its last step reached one rank only, and summary.json never comes
    run.emit_steps(10, 12)
    run.writers[0].emit("step", t=run.step_end(0, 12), step=12, loss=2.0, tokens=13 * 4096,
                        step_s=0.1, compute_s=0.08)
    h.state = state
    assert _wait(lambda: not d.live, timeout=5), f"the dashboard still polls a {state} run"
    assert not d.models[0].finished
    assert _points(d.loss_fig) == 13                # read to its end, the last step closed
    assert _status_cell(d) == f"{state.lower()} (ended without summary.json)"
    assert f"all runs ended: doomed {state.lower()}" in d.title.value
    d.stop()
    run.close()


def test_dashboard_asks_a_handle_its_status_at_most_every_few_seconds(tmp_path):
    from lowband.dashboard import Dashboard, widget

    run = SyntheticRun(tmp_path / "run", steps=100)
    run.emit_steps(0, 10)
    h = Handle(run.rd.root, "running")
    d = Dashboard(h, autostart=False, interval=0.01)
    d.start()
    assert _wait(lambda: d.renders >= 1)
    h.state = "failed"                    # not seen before HANDLE_STATUS_EVERY_S have passed
    time.sleep(0.3)                       # dozens of polls
    assert d.live and h.calls.count("status") == 1
    assert widget.HANDLE_STATUS_EVERY_S >= 1
    d._handle_checked = -math.inf         # as after the Stop button: asked at the next poll
    assert _wait(lambda: not d.live, timeout=5)
    assert h.calls.count("status") == 2
    run.close()


def test_dashboard_of_runs_and_a_failed_job_polls_until_every_run_is_over(tmp_path,
                                                                         monkeypatch):
    from lowband.dashboard import Dashboard, widget

    monkeypatch.setattr(widget, "HANDLE_STATUS_EVERY_S", 0.05)
    ok = SyntheticRun(tmp_path / "ok", steps=20, name="ok")
    ok.emit_steps(0, 5)
    bad = SyntheticRun(tmp_path / "bad", steps=20, name="bad")
    bad.emit_steps(0, 5)
    d = Dashboard([ok.rd.root, Handle(bad.rd.root, "failed")], autostart=False, interval=0.01)
    d.start()
    assert _wait(lambda: d.renders >= 1)
    time.sleep(0.2)
    assert d.live                                   # "ok" has no summary.json yet
    ok.finish()
    assert _wait(lambda: not d.live, timeout=5)
    assert "all runs ended: bad failed" in d.title.value
    bad.close()


def _wait(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_live_polling_in_a_thread_follows_the_run_and_stops_at_the_end(tmp_path):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", steps=60)
    run.emit_steps(0, 20)
    d = Dashboard(run.rd.root, autostart=False, interval=0.02)
    d.start()
    assert d.live
    assert _wait(lambda: _points(d.loss_fig) == 20)
    run.emit_steps(20, 60)
    assert _wait(lambda: _points(d.loss_fig) == 60)
    run.finish()
    assert _wait(lambda: not d.live), "polling did not stop once summary.json appeared"
    assert "finished" in d.summary.value
    d.stop()


def test_live_polling_as_an_asyncio_task(tmp_path):
    from lowband.dashboard import Dashboard

    run = SyntheticRun(tmp_path / "run", steps=40)
    run.emit_steps(0, 10)

    async def main():
        began = time.monotonic()
        d = Dashboard(run.rd.root, interval=0.02)   # a loop runs: polls as a task on it
        assert time.monotonic() - began < 5 and d._task is not None
        for _ in range(500):
            await asyncio.sleep(0.01)
            if d.renders and _points(d.loss_fig) == 10:
                break
        assert _points(d.loss_fig) == 10
        run.emit_steps(10, 15)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if _points(d.loss_fig) == 15:
                break
        assert _points(d.loss_fig) == 15
        d.stop()
        await asyncio.sleep(0)
        assert not d.live

    asyncio.run(main())
    run.close()


def test_export_html_is_offline_and_names_the_run(tmp_path):
    from lowband.dashboard import Dashboard

    rd = small_run(tmp_path / "run", name="my-streaming-run", steps=60)
    d = Dashboard(rd.root)
    out = d.export_html(tmp_path / "report.html")
    text = out.read_text()
    assert "my-streaming-run" in text
    assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", text, re.I)
    assert not re.search(r"<link[^>]*href\s*=\s*[\"']?(https?:)?//", text, re.I)
    assert 'id="lowband-loss"' in text


def test_the_report_names_one_peak_bandwidth_a_run(tmp_path):
    """The summary table's "outer peak bandwidth" and the bandwidth figure's peak marker are one
    figure (the highest bin of one link, on the same bins), with one run and with several."""
    from lowband.dashboard.bandwidth_figure import bandwidth_spec
    from lowband.dashboard.export import render_report
    from lowband.dashboard.style import fmt_rate

    # 200 steps: a run whose peak an earlier report gave as 1.25 MB/s in its table (200 bins),
    # 2.5 MB/s in its figure (300) and 2.43 MB/s beside another run (its mean over its links)
    runs = [small_run(tmp_path / "a", steps=200).root,
            small_run(tmp_path / "b", steps=200, link_bandwidth=5e7, seed=3, step_s=0.05).root]
    models = [RunModel(r).load() for r in runs]
    peaks = [m.stats()["peak_outer_bytes_per_s"] for m in models]
    assert peaks[0] > 0 and fmt_rate(peaks[0]) != fmt_rate(peaks[1])
    for shown in ([models[0]], models):
        marks = [t for t in bandwidth_spec(shown)[0] if t.get("mode") == "markers"]
        assert [t["y"][0] for t in marks] == pytest.approx(peaks[:len(shown)])
        assert all(f"peak {fmt_rate(p)}" in t["name"] for t, p in zip(marks, peaks))
    page = render_report(runs)
    cells = re.findall(r'<td data-key="peak_outer_bytes_per_s">([^<]*)', page)
    assert [c.strip() for c in cells] == [fmt_rate(p) for p in peaks]


def test_the_planned_error_is_formatted_by_the_shared_helper():
    from lowband.dashboard.comparison import cell
    from lowband.dashboard.style import fmt_value

    assert fmt_value("planned_error", -0.239) == "-24%" == cell("planned_error",
                                                                {"planned_error": -0.239}, {})
    assert cell("planned_error", {"planned_error": None}, {}) == "–"


def test_a_sync_runs_config_says_its_loop_decided_what_lowband_train_would_have(tmp_path):
    """A lowband.Sync run's report does not list `lowband train`'s defaults its loop never used:
    the options its own loop decides say so; the ones lowband used keep their value."""
    from lowband.dashboard.tables import YOUR_LOOP, config_table
    from lowband.sync.options import loop_only

    mine, theirs = small_run(tmp_path / "sync"), small_run(tmp_path / "train")
    for run, meta in ((mine, {"loop": "lowband.Sync", "your_loop": sorted(loop_only())}),
                      (theirs, {})):
        write_json_atomic(run.config, {**json.loads(run.config.read_text()), "lr": 0.001,
                                       "meta": {"world": 4, **meta}})
    table = config_table([RunModel(mine.root).load(), RunModel(theirs.root).load()])
    lr_row = re.search(r"<tr[^>]*><th>lr</th>(.*?)</tr>", table).group(1)
    assert lr_row.count(YOUR_LOOP) == 1  # the Sync run's cell only
    sync_row = re.search(r"<tr[^>]*><th>sync_every</th>(.*?)</tr>", table).group(1)
    assert YOUR_LOOP not in sync_row and "your_loop" not in table
