"""A user's own loop with lowband.Sync, run elastic by `lowband launch --elastic --script` on
local_cwd (launch/component.py: a Lighthouse role, a role a replica group whose torchrun restarts
the script when it dies). Streaming, R=2, nano: group 1's process is SIGKILLed from outside in
the middle of the run; its torchrun starts the script again, which continues from the group's
checkpoint and heals from the live peer (the model, the optimizer, the outer state and the
user's own scheduler), and both groups end with bitwise equal outer parameters. Also: the job's
elastic options reach the script's Sync from its environment, and what is refused."""

import json
import os
import signal
import textwrap
import time

import pytest

pytest.importorskip("torchft")
pytest.importorskip("torchx")

import lowband  # noqa: E402
from lowband.config import Config, ConfigError  # noqa: E402
from lowband.launch import components  # noqa: E402
from lowband.telemetry import read_events  # noqa: E402

pytestmark = pytest.mark.slow  # measured (--durations): README, Run the tests

STEPS, HOLD = 16, 6
# the user's script: nothing in it knows it is elastic; group 1 (first life only) holds before
# step HOLD until the test kills it, so the kill lands between steps, not in an exchange
SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch
    from lowband import Config, Sync
    from lowband.data import Batches, load_corpus, vocab_needed
    from lowband.models import build, for_training, lm_loss

    algo, steps, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = Config(model="nano", seq_len=32, batch_size=4).validate()
    tokens = load_corpus(cfg.data, cfg.tokenizer)
    torch.manual_seed(cfg.seed)
    model = for_training(build(cfg, vocab_needed(tokens)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s / 100))
    sync = Sync(model, optimizer, algo, steps=steps, sync_every=4, fragments=2, seq_len=32,
                batch_size=4, link_bandwidth="", checkpoint_every=4, state={"schedule": schedule})
    run, me = sync.run.root, sync.topo.replica
    (run / f"pid-replica{me}").write_text(str(os.getpid()))
    held = me == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    batches = Batches(tokens, rank=sync.topo.rank, world=sync.topo.world, seq_len=32,
                      batch_size=4, seed=cfg.seed, val_fraction=cfg.val_fraction,
                      device=torch.device("cpu"))
    for step in sync.range():
        while held and step == hold:
            time.sleep(0.05)
        x, y = batches.train(step, 0)
        loss = lm_loss(model, x, y, "fp32")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        sync.step(loss=loss, tokens=x.numel())
    sync.finish()
    (run / f"schedule-replica{me}").write_text(str(schedule.last_epoch))
''')


def _wait_for(h, what, timeout=60):
    """what() once it is true, while the job runs."""
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert h.status() == "running" and time.monotonic() < deadline, h.logs()
        time.sleep(0.2)
    return found


def test_a_killed_group_of_a_users_loop_restarts_and_heals_from_the_live_peer(tmp_path):
    (tmp_path / "loop.py").write_text(SCRIPT)
    run = tmp_path / "run"
    # min_replicas=2: no group trains alone (a late first life would otherwise sync alone)
    h = lowband.launch(script=str(tmp_path / "loop.py"), script_args=["streaming", STEPS, HOLD],
                       replicas=2, run_dir=str(run), elastic=True, min_replicas=2,
                       quorum_timeout=30, max_restarts=1)
    try:
        def steps(g):
            return [e["step"] for e in read_events(run, ("step",)) if e["replica"] == g]

        _wait_for(h, lambda: HOLD in steps(1))  # group 1 holds after step HOLD
        os.kill(int((run / "pid-replica1").read_text()), signal.SIGKILL)
        assert h.wait(timeout=90) == "succeeded", h.logs()
    finally:
        h.cancel()
    config = json.loads((run / "config.json").read_text())  # the job's options, in the Sync
    assert (config["elastic"], config["min_replicas"], config["quorum_timeout"],
            config["max_restarts"]) == (True, 2, 30.0, 1)
    # its torchrun restarted it: the group's checkpoint of step 4, then a heal from group 0
    (restart,) = [e for e in read_events(run, ("run",)) if e.get("restart")]
    assert (restart["replica"], restart["phase"], restart["step"]) == (1, "resume", 4)
    (heal,) = [e for e in read_events(run, ("membership",)) if e["healed"]]
    assert (heal["replica"], heal["heal_from"], heal["step_before"]) == (1, 0, 4), heal
    assert heal["step"] > HOLD and heal["heal_bytes"] > 0
    assert steps(1)[-(STEPS - heal["step"]):] == list(range(heal["step"] + 1, STEPS + 1))
    assert steps(0) == list(range(1, STEPS + 1))  # the live group never went back
    records = [json.loads((run / "groups" / f"replica{g}.json").read_text()) for g in (0, 1)]
    assert records[0]["outer_sha256"] == records[1]["outer_sha256"]  # bitwise equal
    # the user's scheduler came with the heal: every group's stepped STEPS times
    assert [(run / f"schedule-replica{g}").read_text() for g in (0, 1)] == [str(STEPS)] * 2
    elastic = json.loads((run / "summary.json").read_text())["elastic"]  # the Lighthouse role's
    assert (elastic["groups_finished"], elastic["restarts"], elastic["heals"]) == \
        ([0, 1], {"1": 1}, {"1": 1})


def test_the_jobs_elastic_options_are_the_launchers(tmp_path, monkeypatch):
    """A script job's elastic options go to its groups' environment, not its arguments; one
    given without elastic=True is refused; a Sync that contradicts the job is refused."""
    script = tmp_path / "mine.py"
    script.write_text("")
    h = lowband.launch(script=str(script), script_args=["--lr", "3e-4"], replicas=2,
                       run_dir=str(tmp_path / "r"), elastic=True, min_replicas=2,
                       elastic_timeout=40, heartbeat_timeout=12, start=False)
    params = h.dryrun_info.request.role_params
    assert sorted(params) == ["group0", "group1", "lighthouse"]
    (group,) = params["group1"]
    assert group.args[-1].endswith(f"{script} --lr 3e-4"), group.args
    assert "--max_restarts 3" in group.args[-1] and "TORCHFT_LIGHTHOUSE=" in group.args[-1]
    assert {k: group.env[k] for k in group.env if k.startswith("LOWBAND_")} == {
        "LOWBAND_ELASTIC": "1", "LOWBAND_MIN_REPLICAS": "2", "LOWBAND_MAX_RESTARTS": "3",
        "LOWBAND_QUORUM_TIMEOUT": "600", "LOWBAND_ELASTIC_TIMEOUT": "40",
        "LOWBAND_HEARTBEAT_TIMEOUT": "12",
        "LOWBAND_REPLICA": "1", "LOWBAND_REPLICAS": "2", "LOWBAND_SHARDS": "1",
        "LOWBAND_RUN_DIR": str(tmp_path / "r"), "LOWBAND_PROGRESS": "0", "LOWBAND_NODE": "group1",
        "LOWBAND_SECRET_FILE": str(tmp_path / "r" / "secret"),  # (the file, not the secret)
        "LOWBAND_BIND_HOST": "127.0.0.1"}  # local_cwd: one machine, every listener on loopback
    (lighthouse,) = params["lighthouse"]  # the Lighthouse holds a quorum that long
    assert " ".join(lighthouse.args).endswith("--heartbeat-timeout 12"), lighthouse.args
    defaults = components().train.__kwdefaults__  # the component's are lowband train's
    assert [defaults[k] for k in ("quorum_timeout", "elastic_timeout", "heartbeat_timeout")] == \
        [Config().quorum_timeout, Config().elastic_timeout, Config().heartbeat_timeout]
    with pytest.raises(ConfigError, match=r"^min_replicas= is an option of an elastic job"):
        lowband.launch(script=str(script), min_replicas=2, start=False)
    with pytest.raises(ConfigError, match=r"--min-replicas 3 must lie in 1\.\.2"):
        lowband.launch(script=str(script), elastic=True, min_replicas=3, start=False)

    import torch

    monkeypatch.setenv("LOWBAND_ELASTIC", "1")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^elastic=False contradicts the launched job's "
                       r"elastic=True: leave elastic to lowband.launch\.$"):
        lowband.Sync(model, torch.optim.SGD(model.parameters(), lr=0.1), "diloco",
                     blocks=torch.nn.ModuleList([model]), elastic=False)
    assert getattr(model, "_lowband_sync", None) is None


def test_a_job_whose_groups_never_reach_the_lighthouse_ends_with_a_sentence(tmp_path):
    """A script that does not train through lowband.Sync (or fails before it) never reaches the
    Lighthouse: the Lighthouse role ends the job after the job's quorum timeout instead of
    waiting for the groups' records for ever."""
    script = tmp_path / "plain.py"
    script.write_text("import sys\nsys.exit(0)\n")  # trains nothing, joins nothing
    run = tmp_path / "run"
    h = lowband.launch(script=str(script), replicas=2, run_dir=str(run), elastic=True,
                       quorum_timeout=4, max_restarts=0)
    try:
        assert h.wait(timeout=60) == "failed"
    finally:
        h.cancel()
    (log,) = run.glob("logs/torchx/*/*/lighthouse/0/stderr.log")  # the Lighthouse role's
    assert "lowband: no replica group has reached the Lighthouse for 4 s (each failed past its " \
           "restarts, or its script does not train through lowband.Sync), so the job ends" \
           in log.read_text()
    assert not (run / "summary.json").exists()


def test_sync_range_follows_a_heal_and_refuses_a_step_left_out():
    """sync.range() yields the step the Sync is at: after a heal inside sync.step() (a group
    behind the others goes on at a live peer's step) the next one is the peer's, where
    range(sync.start_step, sync.steps) would go on counting. Its Sync stood in for: the step
    it is at (done.step) and whether its run is over (_over: adaptive local steps end a slow
    replica's run at the last sync) are all range() reads."""
    from types import SimpleNamespace as Stand

    sync = Stand(done=Stand(step=2), config=Stand(steps=8), finished=False, _over=False)
    seen = []
    for step in lowband.Sync.range(sync):
        seen.append(step)
        sync.done.step = 6 if step == 3 else step + 1  # sync.step(): step 4 healed to 6
    assert seen == [2, 3, 6, 7]
    forgot = Stand(done=Stand(step=0), config=Stand(steps=8), finished=False, _over=False)
    with pytest.raises(ConfigError, match=r"^sync.range\(\) went past step 1 without "
                       r"sync.step\(\): call it once a step, after the optimizer's step\.$"):
        for step in lowband.Sync.range(forgot):
            pass
