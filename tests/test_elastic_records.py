"""The records of elastic runs' faults, written by hand (in-process, no training): each
restart's row, what a lost life redid or lost, and a group left out at the end; summary.json's
`elastic` and its line say the same (launch/supervise.py, summary.py)."""

import json

from lowband.telemetry import RunDir


def test_each_groups_restart_says_what_it_redid_or_lost(tmp_path):
    """The records of the case above, written by hand (in-process): each group's restart is a
    row of its own (both are attempt 1 from step 20); group 0 redoes steps 21-25, group 1 heals
    to step 30 from group 0 and so loses steps 21-26; summary.json's `elastic` and its line
    say the same."""
    from lowband.config import Config
    from lowband.dashboard.model import RunModel
    from lowband.dashboard.restarts import restart_text
    from lowband.dashboard.tables import restarts_table
    from lowband.summary import write_elastic as write_summary
    from lowband.summary import fault_text
    from lowband.telemetry import EventWriter, RunDir
    from lowband.units import fmt_si

    rd = RunDir(tmp_path / "r").create()
    w = {g: EventWriter(rd, g, g) for g in (0, 1)}
    t = iter(range(1000))

    def steps(g, first, last):
        for s in range(first, last + 1):
            w[g].emit("step", t=next(t), step=s, loss=3.0, tokens=s, step_s=0.1, compute_s=0.1)

    def quorum(g, step, healed):
        w[g].emit("membership", t=next(t), step=step, quorum_id=step, size=2, members=[0, 1],
                  joined=[0, 1], left=[], healed=healed, wait_s=0.1)

    for g in (0, 1):
        w[g].emit("run", t=next(t), phase="start", world=1, step=0, attempt=0)
        quorum(g, 0, False)
        steps(g, 1, 20)
    kept = {g: rd.event_file(g).stat().st_size for g in (0, 1)}
    steps(0, 21, 25)
    steps(1, 21, 26)
    w[0].emit("run", t=next(t), phase="resume", world=1, step=20, attempt=1, restart=True,
              events_kept=kept[0])
    quorum(0, 20, False)
    steps(0, 21, 30)
    w[1].emit("run", t=next(t), phase="resume", world=1, step=20, attempt=1, restart=True,
              events_kept=kept[1])
    quorum(1, 30, True)
    steps(1, 31, 32)
    steps(0, 31, 32)
    m = RunModel(rd.root).load()
    assert [restart_text(r) for r in m.restarts()] == [
        "group 0: attempt 1 resumed from step 20 (steps 21–25 of the lost attempt redone)",
        "group 1: attempt 1 resumed from step 20 (healed to step 30 from a live peer: steps "
        "21–26 of the lost attempt lost)"]
    table = restarts_table([m])
    assert "<th>group</th><th>healed to step</th>" in table
    assert "<td>0</td><td>–</td><td>1</td><td>21–25</td>" in table
    assert "<td>1</td><td>30</td><td>1</td><td>–</td>" in table
    rd.groups.mkdir()
    for g in (0, 1):  # the groups' records, as their first ranks write them at the end
        rank = {"tokens": 32, "steps": 32, "wall_s": 1.0, "compute_s": 0.5, "loss": 3.0,
                "val_loss": 3.1, "replica": g, "shard": 0, "outer_wire": 0, "inner_wire": 0,
                "peak_outer": 0}
        (rd.groups / f"replica{g}.json").write_text(json.dumps({"ranks": [rank],
                                                                 "ddp_one_step": 8}))
    # the launcher named the run directory itself (no --run-dir): the workers' config has none
    cfg = Config(algo="diloco", replicas=2, elastic=True, run_dir="")
    group_step = cfg.batch_size * cfg.seq_len
    for g, kept in ((0, 32), (1, 22)):  # group 1 healed past steps 21-30: it never trained them
        path = rd.groups / f"replica{g}.json"
        record = json.loads(path.read_text())
        record["ranks"][0]["tokens"] = kept * group_step
        path.write_text(json.dumps(record))
    summary = write_summary(cfg, rd)
    assert summary["run_dir"] == str(rd.root)
    # each life's step events: group 0 trained 20 + 5 + 12, group 1 20 + 6 + 2 steps; the
    # lost lives' steps after step 20 (5 and 6) were trained and lost
    assert summary["steps_run_per_replica"] == [37, 28]
    assert summary["tokens"] == 65 * group_step
    assert summary["elastic"]["tokens_lost"] == 11 * group_step
    record = summary["elastic"]
    assert record["restarts"] == {"0": 1, "1": 1} and record["heals"] == {"1": 1}
    assert record["lost_work"] == [
        {"group": 0, "died_after": 25, "resumed_from": 20, "redone": [21, 25]},
        {"group": 1, "died_after": 26, "resumed_from": 20, "redone": None}]
    assert fault_text({"elastic": record}) == (
        f"2 group deaths, 2 restarts, 1 heal of group 1, 5 steps redone, "
        f"{fmt_si(11 * group_step)} tokens trained and lost (group 0 died after step "
        "25, restarted from step 20: steps 21–25 redone; group 1 died after step 26, restarted "
        "from step 20: steps 21–26 lost)")


def test_a_group_back_after_another_finished_is_left_out_and_said_so(tmp_path):
    """Records written by hand: group 2 died after step 13 and came back (from its checkpoint
    of step 8) while groups 0 and 1 synced without it and finished. Since its restart it has met
    no finished group, so the launcher stops it (alone it would train on to a state of its own
    and write model.pt over the run's); the summary counts one death and says why it was left
    out."""
    from lowband.config import Config
    from lowband.launch.supervise import leave_out_stragglers
    from lowband.summary import write_elastic as write_summary
    from lowband.summary import fault_text
    from lowband.telemetry import EventWriter, RunDir

    rd = RunDir(tmp_path / "r").create()
    w = {g: EventWriter(rd, g, g) for g in (0, 1, 2)}
    cfg = Config(algo="diloco", replicas=3, elastic=True, steps=16, run_dir=str(rd.root))
    for g in (0, 1, 2):
        w[g].emit("run", t=0, phase="start", world=1, step=0, attempt=0)
        w[g].emit("membership", t=1, step=0, quorum_id=1, size=3, members=[0, 1, 2],
                  joined=[0, 1, 2], left=[], healed=False, wait_s=0.1)
        for s in range(1, 14 if g == 2 else 17):
            w[g].emit("step", t=1 + s, step=s, loss=3.0, tokens=s, step_s=0.1, compute_s=0.1)
    for g in (0, 1):
        w[g].emit("membership", t=20, step=16, quorum_id=2, size=2, members=[0, 1], joined=[],
                  left=[2], healed=False, wait_s=0.1)
        w[g].emit("run", t=21, phase="end", world=1)  # (group 1 is writing its record)
    w[2].emit("run", t=30, phase="resume", world=1, step=8, attempt=1, restart=True)
    assert leave_out_stragglers(cfg, rd, {1: 0.0, 2: 0.0}) == {}  # no group has finished yet
    rd.groups.mkdir()
    rank = {"tokens": 16 * 128, "steps": 16, "wall_s": 1.0, "compute_s": 0.5, "loss": 3.0,
            "val_loss": 3.1, "shard": 0, "outer_wire": 0, "inner_wire": 0, "peak_outer": 0}
    for g in (0, 1):
        (rd.groups / f"replica{g}.json").write_text(json.dumps({"ranks": [{**rank, "replica": g}],
                                                                 "ddp_one_step": 8}))
    why = "since it was restarted it has met no group that finished, so no live peer is left "
    why += "to heal it"
    assert leave_out_stragglers(cfg, rd, {1: 0.0, 2: 0.0}, restarted={2}) == {2: why}
    # one that met a finished group in this life is not left out (it heals at its next quorum)
    assert leave_out_stragglers(cfg, rd, {1: 0.0}) == {}
    summary = write_summary(cfg, rd)
    assert summary["elastic"]["groups_finished"] == [0, 1]
    assert summary["elastic"]["lost_work"] == [
        {"group": 2, "died_after": 13, "resumed_from": 8, "redone": None},
        {"group": 2, "died_after": 13, "resumed_from": None, "redone": None, "left_out": why}]
    text = fault_text(summary)
    assert text.startswith("1 group death, 1 restart, 0 heals, 0 steps redone"), text
    assert text.endswith(f"group 2 stopped after step 13: {why})"), text


def test_a_resumed_launch_does_not_take_its_earlier_records_for_results(tmp_path, capsys,
                                                                         monkeypatch):
    """The records of a run's earlier launch (before --resume) are not this launch's: the
    Lighthouse role waits for its groups instead of ending the job on the old records (it
    wrote summary.json and left the groups without a Lighthouse), and left-out.json stays."""
    from lowband.launch.lighthouse import main
    from lowband.launch.local import free_port

    monkeypatch.setenv("LOWBAND_BIND_HOST", "127.0.0.1")  # (the role sets it: undone after)
    run = RunDir(tmp_path / "r").create()
    run.groups.mkdir()
    for g in (0, 1):
        run.group_record(g).write_text(json.dumps({"ranks": [], "outer_sha256": "old"}))
    (run.groups / "left-out.json").write_text(json.dumps({"1": "an earlier launch's"}))
    assert list(run.group_records()) == [0, 1]
    code = main(["--replicas", "2", "--run-dir", str(run.root), "--port", str(free_port()),
                 "--idle-timeout", "1"])
    assert code == 1 and "no replica group has reached the Lighthouse" in capsys.readouterr().err
    assert not run.group_records() and not run.summary.exists()
    assert (run.groups / "left-out.json").exists()
