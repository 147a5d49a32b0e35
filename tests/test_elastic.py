"""--elastic (comm/membership/elastic.py, launch/supervise.py): replica groups joined through torchft's
Lighthouse.
A group killed mid-run (SIGKILL of all its ranks) does not stop the others; restarted, it heals
from a live peer, not from disk; one that never comes back leaves the others to finish; without
failures an elastic run equals the plain one to fp32 rounding. Real processes, gloo, loopback."""

import json

import pytest
import torch

from conftest import lowband, train_in_one_job
from lowband.telemetry import RunDir, read_events
from lowband.testing.chaos import RECONNECT_S

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

pytest.importorskip("torchft")

SMALL = ["--model", "nano", "--seq-len", 32, "--batch-size", 4, "--eval-every", 0,
         "--eval-batches", 1, "--no-progress", "--link-bandwidth", "none"]
# a killed group's restart takes about 3 s here and more on a loaded machine: the others hold
# their quorum for it this long (torchft's 5 s left it out under load, to heal at a later sync)
HOLD = ["--heartbeat-timeout", 12]


def train(tmp_path, name, *args):
    proc = lowband("train", "--run-dir", tmp_path / name, *SMALL, *args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp_path / name, proc


def groups(run) -> dict[int, dict]:
    return {g: json.loads(p.read_text()) for g, p in RunDir(run).group_records().items()}


EQUAL = [("diloco", 1), ("ddp", 2), ("edit", 1)]  # (algo, shards) compared with the plain run


def _same_run_flags(algo, shards) -> list:
    return ["--algo", algo, "--replicas", 2, "--shards", shards, "--steps", 16, "--sync-every", 4]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory) -> dict:
    """The plain runs the elastic ones are compared with, (algo, shards) -> run directory,
    trained as `lowband train`'s workers train them, in one set of worker processes a world size
    (conftest.train_in_one_job), before the first elastic run."""
    root = tmp_path_factory.mktemp("plain")
    runs = {(algo, shards): root / f"{algo}-{shards}" for algo, shards in EQUAL}
    train_in_one_job(*(["--run-dir", run, *SMALL, *_same_run_flags(*case)]
                       for case, run in runs.items()))
    return runs


@pytest.mark.parametrize("algo,shards", EQUAL)
def test_without_failures_an_elastic_run_equals_the_plain_one(tmp_path, plain_runs, algo, shards):
    """(ddp with two shards a group: the group's mean, then each shard's slice over the groups)"""
    plain = plain_runs[algo, shards]
    # (every group in every quorum: with --min-replicas 1 a group that starts late on a loaded
    # machine misses the first quorum and heals at a later one)
    elastic, _ = train(tmp_path, "elastic", *_same_run_flags(algo, shards), "--elastic",
                       "--min-replicas", 2)
    for name in ("model.pt", "outer.pt")[: 1 if algo == "ddp" else 2]:
        a = torch.load(plain / name, weights_only=True)
        b = torch.load(elastic / name, weights_only=True)
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        assert diff < 1e-6, (name, diff)
    summary = json.loads((elastic / "summary.json").read_text())
    assert summary["steps_run_per_replica"] == [16, 16] and not summary["elastic"]["restarts"]
    assert len({r["model_sha256"] for r in groups(elastic).values()}) == 1  # synced at the end
    quorums = [e for e in read_events(elastic, ("membership",))]
    assert {e["size"] for e in quorums} == {2} and not any(e["healed"] for e in quorums)


def test_a_killed_group_restarts_and_heals_from_a_live_peer(tmp_path):
    """Streaming (fp4, tau 1) with three groups; group 1 is SIGKILLed after step 10 and
    restarted: the others never stop, it heals at their next sync and all three end with the
    same outer parameters bitwise. No checkpoint is written or read."""
    run, proc = train(tmp_path, "r", "--algo", "streaming", "--replicas", 3, "--steps", 24,
                      "--sync-every", 8, "--fragments", 2, "--elastic", "--kill", "1:10", *HOLD)
    assert "replica group 1 was killed by SIGKILL" in proc.stderr
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert [e["replica"] for e in healed] == [1]
    # the others' next sync (step 12), or a later one (syncs every 4 steps) when its restart
    # took longer than their quorum of step 12 waited (a loaded machine)
    h = healed[0]["step"]
    assert h in (12, 16, 20) and healed[0]["heal_bytes"] > 0, h
    records = groups(run)
    assert sorted(records) == [0, 1, 2]
    assert len({r["outer_sha256"] for r in records.values()}) == 1  # bitwise equal
    for g in (0, 2):  # the survivors ran every step once, without a gap
        steps = [e for e in read_events(run, ("step",)) if e["replica"] == g]
        assert [e["step"] for e in steps] == list(range(1, 25)), (g, steps)
        # their quorums inside steps (all but the first) are waits, not compute: the one of
        # step 12 waited for group 1 (its heartbeats to stop, or it to start again)
        waits = sum([e["wait_s"] for e in read_events(run, ("membership",)) if e["rank"] == g][1:])
        assert waits > 0.5 and sum(e["compute_s"] for e in steps) <= \
            sum(e["step_s"] for e in steps) - waits + 1e-3
    restarted = [e["step"] for e in read_events(run, ("step",)) if e["replica"] == 1]
    assert restarted == list(range(1, 10)) + list(range(h + 1, 25))  # killed in step 10; healed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"]["restarts"] == {"1": 1} and summary["elastic"]["heals"] == {"1": 1}
    assert summary["elastic"]["lost_work"] == [{"group": 1, "died_after": 9, "resumed_from": 0,
                                                "redone": None}]
    # every life's steps count: the first life's 9 were trained and lost (its successor began
    # afresh and healed to step h), 4 x 32 tokens a step
    assert summary["steps_run_per_replica"] == [24, 9 + 24 - h, 24]
    assert summary["tokens"] == (24 + 9 + 24 - h + 24) * 128
    assert summary["elastic"]["tokens_lost"] == 9 * 128
    assert "1 group death, 1 restart, 1 heal of group 1, 0 steps redone, 1.15 k tokens trained " \
        "and lost" in proc.stdout
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    logs = "".join(p.read_text() for p in (run / "logs").glob("*.log"))  # the heal server
    assert "GET /heal" not in proc.stdout + proc.stderr + logs   # served the heal quietly
    # the run's secret (comm/membership/secret.py) is its file's alone: in no output, event or record
    key = (run / "secret").read_bytes()
    assert len(key) == 32 and (run / "secret").stat().st_mode & 0o777 == 0o600
    for path in [p for p in run.rglob("*") if p.is_file() and p.name != "secret"]:
        data = path.read_bytes()
        assert key not in data and key.hex().encode() not in data, path
    assert key.hex() not in proc.stdout + proc.stderr


def test_adaptive_local_steps_heal_a_killed_group_on_the_run_steps(tmp_path):
    """--local-steps adaptive with --elastic (three groups, group 2 computing 3x slower): group
    1 is killed after step 10 and heals from a live peer on the run's schedule (a quorum
    compares run steps, not the groups' unequal inner steps), takes its own count again, and
    every group ends with the same outer parameters; the straggler runs fewer steps, and its
    pseudo-gradients weigh by their tokens."""
    run, proc = train(tmp_path, "r", "--algo", "streaming", "--replicas", 3, "--steps", 40,
                      "--sync-every", 8, "--fragments", 2, "--elastic", "--kill", "1:10",
                      "--local-steps", "adaptive", "--straggler", "2:3", *HOLD)
    assert "replica group 1 was killed by SIGKILL" in proc.stderr
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert [e["replica"] for e in healed] == [1]
    records = groups(run)
    assert len({r["outer_sha256"] for r in records.values()}) == 1  # bitwise equal
    syncs = read_events(run, ("sync",))
    # the survivors applied (or, where the kill broke an exchange, skipped alike) every sync
    # of the run's schedule; the healed group every one from its heal on
    skipped = {e["step"] for e in read_events(run, ("skip",)) if e["what"] == "commit"}
    for g in (0, 2):
        assert {e["step"] for e in syncs if e["replica"] == g} | skipped == \
            set(range(4, 41, 4)), g
    mine = [e for e in syncs if e["replica"] == 1]
    heal = min(e["step"] for e in mine if e["weight"] == 0)  # its heal's sync: weight 0
    assert set(range(heal, 41, 4)) <= {e["step"] for e in mine}
    summary = json.loads((run / "summary.json").read_text())
    fast, _, slow = summary["steps_run_per_replica"]  # (group 1's count both its lives)
    assert slow < fast * 0.8, summary["steps_run_per_replica"]
    late = [e for e in syncs if e["step"] >= 24]  # by then the counts follow the speeds (three
    # groups on two cores: the noise moves the others' counts, and may even them out at a sync)
    assert sum(e["steps_of"][2] < max(e["steps_of"]) for e in late) >= len(late) * 2 / 3
    weights = [e["weight"] for e in late if e["replica"] == 2]
    assert sum(weights) / len(weights) < 1 / 3, weights


def test_groups_killed_one_after_the_other_continue_from_their_checkpoints(tmp_path):
    """Group 0 is killed in step 25 and, while it restarts, group 1 in step 26: no live peer
    has trained past their step-20 checkpoints, so each continues from its own (a `run`
    event: resume at step 20, a restart), never from fresh weights, and a group that trained
    never takes a fresh one's state. Each redoes the steps of its lost life after step 20 (or,
    where the other trained on first, heals from it at step 30); both end bitwise equal, and
    summary.json, the terminal line and the report say what was lost and redone."""
    run, proc = train(tmp_path, "r", "--algo", "diloco", "--replicas", 2, "--steps", 60,
                      "--sync-every", 10, "--checkpoint-every", 10, "--elastic",
                      "--kill", "0:25,1:26", *HOLD)
    firsts = [e for e in read_events(run, ("run",)) if e["phase"] != "end"]
    restarts = [(e["replica"], e["phase"], e["step"], e["attempt"]) for e in firsts if e.get("restart")]
    assert sorted(restarts) == [(0, "resume", 20, 1), (1, "resume", 20, 1)], firsts
    heals = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert all(e["step"] == 30 for e in heals), heals  # only ever from a group that trained on
    records = groups(run)
    assert len({r["outer_sha256"] for r in records.values()}) == 1
    assert len({r["model_sha256"] for r in records.values()}) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run_dir"] == str(run)
    assert summary["elastic"]["restarts"] == {"0": 1, "1": 1}
    assert summary["elastic"]["tokens_lost"] == (4 + 5) * 128  # steps 21-24 and 21-25, lost lives'
    lives = sorted(summary["elastic"]["lost_work"], key=lambda x: x["group"])
    redone = 0
    for g, died in ((0, 24), (1, 25)):  # killed in steps 25 and 26: their last records
        life = lives[g]
        assert (life["group"], life["died_after"], life["resumed_from"]) == (g, died, 20), life
        steps = [e["step"] for e in read_events(run, ("step",)) if e["replica"] == g]
        if any(e["replica"] == g for e in heals):  # the other trained on first: it redoes none
            assert life["redone"] is None and steps == list(range(1, 21)) + list(range(31, 61))
        else:
            assert life["redone"] == [21, died] and steps == list(range(1, 61)), (life, steps)
            redone += died - 20
    line = next(x for x in proc.stdout.splitlines() if "group deaths" in x)  # the final line
    assert len(heals) < 2 and f"; 2 group deaths, 2 restarts, {len(heals)} heal" in line, line
    assert f", {redone} steps redone, 1.15 k tokens trained and lost (" in line, line
    assert line.count("restarted from step 20") == 2
    assert "GET /checkpoint" not in proc.stdout + proc.stderr
    report = (run / "report.html").read_text()
    assert "2 group deaths, 2 restarts" in report and "<th>group</th><th>healed to step</th>" in report


def test_elastic_ddp_heals_a_killed_group_before_its_next_step(tmp_path):
    """ddp takes a quorum before every step: group 1, killed after step 5 and restarted,
    receives model, optimizer and step from a live peer and computes the others' step with
    them (its gradient counts); all end with bitwise equal weights."""
    run, proc = train(tmp_path, "r", "--algo", "ddp", "--replicas", 3, "--steps", 12,
                      "--elastic", "--kill", "1:5", *HOLD)
    assert "replica group 1 was killed by SIGKILL" in proc.stderr
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert [(e["replica"], e["step"]) for e in healed] == [(1, 5)] and healed[0]["heal_bytes"] > 0
    steps = {g: [e["step"] for e in read_events(run, ("step",)) if e["replica"] == g] for g in range(3)}
    assert steps[0] == steps[2] == list(range(1, 13))
    assert steps[1] == [1, 2, 3, 4] + list(range(6, 13))  # killed in step 5, healed to 5 done
    assert len({r["model_sha256"] for r in groups(run).values()}) == 1


def test_elastic_edit_heals_an_fsdp_sharded_group_from_a_live_peer(tmp_path):
    """edit, two groups of two FSDP2 shards: group 1 killed after step 6 is restarted; at the
    others' sync of step 8 each of its ranks receives its shards (model, inner optimizer as
    DTensors, outer state, the penalty's statistics), it takes part with weight 0 (a copy of
    its source) and trains on; both end bitwise equal."""
    run, proc = train(tmp_path, "r", "--algo", "edit", "--replicas", 2, "--shards", 2,
                      "--steps", 16, "--sync-every", 4, "--elastic", "--kill", "1:6", *HOLD)
    assert "replica group 1 was killed by SIGKILL" in proc.stderr
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert sorted((e["replica"], e["rank"], e["step"]) for e in healed) == [(1, 2, 8), (1, 3, 8)]
    syncs = [e for e in read_events(run, ("sync",)) if e["replica"] == 1 and e["step"] == 8]
    assert syncs and all(e["weight"] == 0.0 for e in syncs)
    steps = [e["step"] for e in read_events(run, ("step",)) if e["rank"] == 2]
    assert steps == list(range(1, 6)) + list(range(9, 17))
    records = groups(run)
    assert len({r["outer_sha256"] for r in records.values()}) == 1
    assert len({r["model_sha256"] for r in records.values()}) == 1


def test_elastic_aedit_heals_into_the_others_window_and_keeps_the_step_budget(tmp_path):
    """aedit (syncs by time, a budget of R x --steps inner steps): group 1 killed after step 8
    is restarted, heals at the others' sync (their quota of 40 steps done: step 40) with their
    progress, takes part with weight 0, gets a share of the next window, and the run ends when
    the steps of the windows reach the budget; all end bitwise equal."""
    run, proc = train(tmp_path, "r", "--algo", "aedit", "--replicas", 3, "--steps", 40,
                      "--sync-seconds", 30, "--elastic", "--kill", "1:8", *HOLD)
    assert "replica group 1 was killed by SIGKILL" in proc.stderr
    healed = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert [(e["replica"], e["step"]) for e in healed] == [(1, 40)]
    roots = [e for e in read_events(run, ("sync",)) if e["block"] == "root"]
    first = [e for e in roots if e["window"] == 1]
    assert {e["replica_steps"] == [40, 40] for e in first} == {True}  # group 1 has no row
    assert [e["weight"] for e in first if e["replica"] == 1] == [0.0]
    last = [e for e in roots if e["window"] == 2]
    assert len(last) == 3 and {e["total_steps"] for e in last} == {120}
    assert all(len(e["replica_steps"]) == 3 and e["weight"] > 0 for e in last)
    records = groups(run)
    assert len({r["outer_sha256"] for r in records.values()}) == 1


def test_a_group_that_never_comes_back_leaves_the_others_to_finish(tmp_path):
    run, proc = train(tmp_path, "r", "--algo", "diloco", "--replicas", 3, "--steps", 16,
                      "--sync-every", 4, "--elastic", "--kill", "2:6", "--max-restarts", 0)
    assert "is not restarted again" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["elastic"]["groups_finished"] == [0, 1]
    assert summary["steps_run_per_replica"] == [16, 16, 5]  # group 2's 5 steps count, and are lost
    assert summary["elastic"]["tokens_lost"] == 5 * 128
    last = [e for e in read_events(run, ("membership",)) if e["replica"] == 0][-1]
    assert last["members"] == [0, 1] and last["left"] == [2] and last["size"] == 2
    syncs = [e for e in read_events(run, ("sync",)) if e["replica"] == 0 and e["step"] > 8]
    assert syncs and all(e["weight"] == 0.5 for e in syncs)  # averages over the two left


def test_a_lost_lighthouse_is_restarted_and_a_stopped_run_resumes_from_checkpoints(tmp_path):
    """Three groups, streaming (tau 1: checkpoints hold a landed exchange and its vote); group
    2 is lost at step 2 before its first checkpoint; the Lighthouse is killed after step 6: the
    launcher starts a new one on its port and groups 0 and 1 wait for it in their next quorum
    (its ids those of the Lighthouse's second life) and train on, until --stop-after 10.
    --resume: they continue from their checkpoint of step 10, group 2 (none of its own) starts
    afresh and heals from them in the first quorum; all end with the same outer parameters,
    also when the new Lighthouse formed a quorum of one group each for step 8."""
    flags = ["--algo", "streaming", "--replicas", 3, "--steps", 16, "--sync-every", 8,
             "--fragments", 2, "--checkpoint-every", 5, "--elastic", "--kill", "2:2,lighthouse:6",
             "--max-restarts", 0, "--quorum-timeout", 20, "--elastic-timeout", 5, "--stop-after", 10]
    run = tmp_path / "r"
    proc = lowband("train", "--run-dir", run, *SMALL, *flags, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the Lighthouse stopped; a new one serves" in proc.stderr
    after = [e for e in read_events(run, ("membership",)) if e.get("lighthouse_restarted")]
    assert sorted(e["replica"] for e in after) == [0, 1]
    elastic = json.loads((run / "summary.json").read_text())["elastic"]
    assert elastic["lighthouse_restarts"] == 1 and len(elastic["lighthouse_down_s"]) == 1
    # the quorum waited for the new Lighthouse too: its time away, and torchft's reconnection
    assert all(e["quorum_id"] > 1_000_000 and e["quorum_s"] <= e["wait_s"]
               < 20 + elastic["lighthouse_down_s"][0] + RECONNECT_S for e in after)
    assert "lost, 1 Lighthouse restart (group 2 died after step 1" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["replica0", "replica1"]

    proc = lowband("train", "--resume", run, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = groups(run)
    assert sorted(records) == [0, 1, 2] and len({r["outer_sha256"] for r in records.values()}) == 1
    resumed = [e for e in read_events(run, ("run",)) if e["phase"] == "resume"]
    assert sorted((e["replica"], e["step"]) for e in resumed) == [(0, 10), (1, 10)]
    healed = {e["replica"]: e for e in read_events(run, ("membership",)) if e["healed"]}
    assert (healed[2]["step"], healed[2]["step_before"], healed[2]["heal_from"] in (0, 1)) == (10, 0, True)
    for g in set(healed) - {2}:  # 0 and 1 each alone in a quorum of step 8 (the new Lighthouse
        # knew only the first to reach it): as far on, different states, one heals (tiebreak)
        assert (healed[g]["step"], healed[g]["step_before"], healed[g]["heal_from"]) == (10, 10, 1 - g)
    for g in (0, 1):  # every step once, across the Lighthouse's restart and the resume
        steps = [e["step"] for e in read_events(run, ("step",)) if e["replica"] == g]
        assert steps == list(range(1, 17)), (g, steps)
    summary = json.loads((run / "summary.json").read_text())
    # what each group trained in both runs: 0 and 1 steps 1-10, then 11-16; group 2 step 1
    # (killed in step 2), then 11-16 (healed to 10); thrown away: group 2's step 1, 128 tokens
    assert summary["steps_run_per_replica"] == [16, 16, 1 + 6]
    assert summary["elastic"]["tokens_lost"] == 1 * 128


@pytest.mark.parametrize("args,words", [
    (["--algo", "diloco", "--replicas", 3, "--min-replicas", 4], "--min-replicas 4 must lie in 1..3"),
    (["--algo", "acco"], "--algo acco cannot lose a replica group mid-run yet"),
    (["--algo", "zero1"], "--algo zero1 cannot lose a replica group mid-run yet"),
    (["--algo", "edit", "--warmup-sync-steps", 2], "drop one of them"),
    (["--algo", "diloco", "--kill", "lighthouse:0"], "the step in 1.."),
    (["--algo", "diloco", "--heartbeat-timeout", 0], "--heartbeat-timeout must be positive"),
])
def test_bad_elastic_input_gives_one_sentence(tmp_path, lowband_here, args, words):
    code, stderr = lowband_here("train", "--elastic", *args, cwd=tmp_path)
    assert code == 2 and words in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_launch_elastic_runs_a_lighthouse_job_that_submits_a_requeued_job_a_group():
    pytest.importorskip("torchx")
    import lowband

    h = lowband.launch(scheduler="slurm", replicas=2, shards=2, algo="streaming", elastic=True,
                       max_restarts=2, model="micro", run_dir="/shared/runs/e", start=False)
    script = str(h.dryrun_info)
    # no heterogeneous job: the Lighthouse's own (not requeued), which writes a batch script a
    # group and hands them to the Lighthouse; each group's is requeued, its srun not
    # --kill-on-bad-exit (launch/slurm.py)
    assert "hetjob" not in script and script.count("--kill-on-bad-exit") == 1
    assert "#SBATCH --job-name=lighthouse-0 --ntasks-per-node=1" in script
    assert "--no-requeue" in script.split("#SBATCH --job-name=group0-0")[0]
    assert ("python3 -m lowband.launch lighthouse --port 29510 --min-replicas 1 --run-dir "
            "/shared/runs/e --replicas 2 --join-timeout 60 --heartbeat-timeout 5 --slurm-groups "
            "\"$groups\"") in script
    for g in (0, 1):
        assert f"cat > \"$groups\"/group{g}-0.sh <<'LOWBAND_GROUP_SCRIPT'" in script
        assert f"#SBATCH --job-name=group{g}-0 --requeue " in script
        assert f"LOWBAND_REPLICA={g}," in script
    assert script.count("TORCHFT_LIGHTHOUSE=http://${LOWBAND_LIGHTHOUSE_HOST:-"
                        "${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}}:29510 python3 -m "
                        "lowband.launch torchrun") == 2
    assert script.count("torchrun --max_restarts 2 ") == 2
    assert script.count("--nnodes 1 --nproc_per_node 2") == 2
    assert script.count(" --elastic") == 2 and script.count("--model micro") == 2


# The elastic TorchX component run for real by a scheduler (the Lighthouse's job, a job a group,
# a killed group restarted by its torchrun and healed, a node lost for good): tests/test_slurm.py,
# on a real Slurm cluster (its local_cwd twin was dropped to keep CI within its time).


def test_a_resume_is_not_a_restart_and_a_life_its_launcher_counted_is(monkeypatch):
    """A replica group is restarted when its launcher says so (torchrun's
    TORCHELASTIC_RESTART_COUNT, which lowband train's supervisor sets too), whatever attempts
    the run's events hold: an explicit --resume is not a restart, a death during one is."""
    from lowband.checkpoint.lifecycle import RESTART_COUNT, restarted_group

    monkeypatch.delenv(RESTART_COUNT, raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert not restarted_group()
    for lives, restarted in (("0", False), ("", False), ("1", True), ("3", True)):
        monkeypatch.setenv(RESTART_COUNT, lives)
        assert restarted_group() is restarted
    # on Slurm a group is a job of its own (launch/slurm.py): Slurm requeued it when its node
    # was lost, and its torchrun starts counting again
    monkeypatch.setenv(RESTART_COUNT, "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert restarted_group()
