"""The planner with replicas that differ (--straggler, --local-steps adaptive or declared
speeds): closed forms on an unlimited link or a latency alone, and plans of alike replicas
unchanged (plan/replicas.py, docs/plan.md "Replicas that differ")."""

import pytest

from lowband.plan import PlanError, plan_configs, simulate
from lowband.plan.check import measured
from lowband.options import UserError
from lowband.plan.cli import run_plan, table
from lowband.telemetry import EventWriter, RunDir, write_json_atomic

T = 0.1
RUN = dict(params=1e6, layers=4, step_time=T, replicas=2, sync_every=20, bandwidth="inf",
           latency=0)


def test_fixed_steps_wait_for_the_slowest():
    # diloco, replica 1 computes 2x slower, no link: each step lasts the slow one's 2T
    r = simulate("diloco", straggler="1:2", **RUN)
    assert r.per_replica["utilization"] == pytest.approx([0.5, 1.0])
    assert r.cu == pytest.approx(0.75) and r.per_replica["run_step_s"] == pytest.approx(2 * T)
    assert r.per_replica["steps_per_sync"] is None and r.per_replica["step_share"] == 1


def test_adaptive_steps_keep_every_replica_busy():
    # the slow replica runs H/2 steps a period, which take it as long as the fast one's H
    r = simulate("diloco", straggler="1:2", local_steps="adaptive", **RUN)
    assert r.per_replica["steps_per_sync"] == [20, 10]
    assert r.per_replica["utilization"] == pytest.approx([1.0, 1.0]) and r.cu == pytest.approx(1)
    assert r.per_replica["run_step_s"] == pytest.approx(T)
    assert r.per_replica["step_share"] == pytest.approx((20 + 10) / (2 * 20))
    # declared speeds set the same counts; without a straggler the slow-declared one idles
    declared = simulate("diloco", straggler="1:2", local_steps="1,0.5", **RUN)
    assert declared.per_replica["steps_per_sync"] == [20, 10] and declared.cu == pytest.approx(1)
    idle = simulate("diloco", local_steps="1,0.5", **RUN)
    assert idle.per_replica["utilization"] == pytest.approx([1.0, 0.5])


def test_tokens_per_second_of_unequal_replicas():
    base = {"algo": "diloco", "replicas": 2, "sync_every": 20, "steps": 200, "eval_every": 0}
    per_step = None
    out = {}
    for name, extra in (("alike", {}), ("fixed", {"straggler": "1:2"}),
                        ("adaptive", {"straggler": "1:2", "local_steps": "adaptive"})):
        rows = plan_configs(base | extra, [], step_time=T, bandwidth="inf", latency=0)
        out[name] = row = rows["algorithms"]["diloco"]
        per_step = per_step or row["tokens_per_step"]  # every rank's tokens a step
    assert out["alike"]["tokens_per_s"] == pytest.approx(per_step / T)
    assert out["fixed"]["tokens_per_s"] == pytest.approx(per_step / (2 * T))
    # (H + H/2) steps of a replica's tokens a period of H steps of T
    assert out["adaptive"]["tokens_per_s"] == pytest.approx((20 + 10) * per_step / 2 / (20 * T))
    assert out["fixed"]["wall_s"] == pytest.approx(200 * 2 * T)
    assert out["adaptive"]["wall_s"] == pytest.approx(200 * T)
    assert out["adaptive"]["tokens"] == pytest.approx(200 * per_step * 0.75)


def test_ddp_and_diloco_on_a_latency():
    lam = 0.01
    # ddp at infinite bandwidth stalls one latency a step, after the slowest's 2T
    ddp = simulate("ddp", straggler="1:2", **(RUN | {"latency": lam}))
    assert ddp.per_replica["utilization"] == pytest.approx([T / (2 * T + lam),
                                                            2 * T / (2 * T + lam)])
    # adaptive diloco: either replica's period is H·T of compute and one latency
    dl = simulate("diloco", straggler="1:2", local_steps="adaptive", **(RUN | {"latency": lam}))
    cu = 20 * T / (20 * T + lam)
    assert dl.per_replica["utilization"] == pytest.approx([cu, cu])
    # a whole run: the same, its last exchange's wait included once
    whole = simulate("diloco", straggler="1:2", steps=40, **(RUN | {"latency": lam}))
    assert whole.compute_s + whole.stall_s == pytest.approx(40 * 2 * T + 2 * lam)


def test_a_slow_replica_rounds_its_steps_and_the_fast_one_waits():
    # streaming H=20 P=4: a period of 5 steps; the slow replica rounds 2.5 up to 3 steps of 2T
    r = simulate("streaming", straggler="1:2", local_steps="adaptive", fragments=4, overlap=1,
                 **RUN)
    assert r.per_replica["steps_per_sync"] == [5, 3]
    assert r.per_replica["utilization"] == pytest.approx([5 / 6, 1.0])
    assert r.sync_period_steps == 20  # the run's H, on the run step's clock


def test_a_small_slowdown_keeps_its_steps():
    # within pace.DEAD_BAND of a period the count stays: as fixed steps
    r = simulate("diloco", straggler="1:1.1", local_steps="adaptive", **RUN)
    assert r.per_replica["steps_per_sync"] == [20, 20]
    assert r.per_replica["utilization"] == pytest.approx([1 / 1.1, 1.0])


def test_alike_replicas_plan_as_before():
    link = dict(RUN, bandwidth="50mbit", latency=0.01)
    for algo, more in (("streaming", {"fragments": 4, "overlap": 1}), ("ddp", {}),
                       ("edit", {}), ("acco", {})):
        plain = simulate(algo, **link, **more)
        assert plain.per_replica is None and "per_replica" not in plain.to_dict()
        for same in ({"straggler": "0:1,1:1"}, {"local_steps": "adaptive"}):
            assert simulate(algo, **link, **more, **same) == plain
    # one replica, slower: only its step time changes
    one = simulate("diloco", **(link | {"replicas": 1}), straggler="0:2")
    assert one.cu == 1 and one.per_replica["run_step_s"] == pytest.approx(2 * T)


@pytest.mark.parametrize("flags, says", [
    (["--straggler", "1:0.5"], "each factor at least 1"),
    (["--straggler", "3:2"], "each replica must be in 0..1"),
    (["--local-steps", "1,0.5,2"], "one positive speed for each of the 2 replicas"),
])
def test_bad_replicas_are_refused_in_one_sentence(flags, says):
    with pytest.raises(UserError, match=says):
        run_plan(["--recipe", "main", "--step-time", "27ms", *flags])
    with pytest.raises(PlanError, match=says):
        simulate("diloco", **{flags[0][2:].replace("-", "_"): flags[1]}, **RUN)


def test_the_table_says_the_set_up_and_each_replica():
    result, _ = run_plan(["--recipe", "main", "--step-time", "27ms", "--compare", "ddp",
                          "--straggler", "1:2", "--local-steps", "adaptive",
                          "--link-bandwidth", "1gbit"])
    text = table(result)
    assert "slower compute: replica 1 2x (--straggler)" in text
    assert "steps adaptive" in text and "streaming: CU by replica" in text
    assert "inner steps a sync 5, 3" in text and "ddp: CU by replica" in text
    assert result["algorithms"]["ddp"]["per_replica"]["local_steps"] == "fixed"


def test_a_measured_step_time_leaves_out_the_straggler(tmp_path):
    run = RunDir(tmp_path / "run").create()
    write_json_atomic(run.config, {"algo": "ddp", "replicas": 2, "straggler": "1:3",
                                   "meta": {"n_params": 1000}})
    write_json_atomic(run.summary, {"steps_run": 10, "compute_utilization": 0.5})
    for replica, compute in ((0, 0.1), (1, 0.3)):  # the slow one's sleep is its compute
        events = EventWriter(run, replica, replica)
        for step in range(1, 11):
            events.emit_step(step, 1.0, 1e-3, 100, 0.3, compute, 0.3 * step)
        events.close()
    assert measured(run.root, warmup_steps=0)[2]["step_time"] == pytest.approx(0.1)


def test_the_recommended_h_is_one_adaptive_steps_can_run():
    """With --local-steps other than fixed, H/P must divide the run's steps and evaluations
    (lowband train refuses the rest): the recommendation skips the H it would refuse."""
    from types import SimpleNamespace

    from lowband import recipes
    from lowband.config import Config
    from lowband.plan.target import recommend

    def first_h(**given):
        cfg = Config.from_dict({**recipes.get("main").values, **given}).validate()
        run = SimpleNamespace(params=1e6, replicas=cfg.replicas)
        return recommend(cfg, lambda trial: run, lambda run: 1.0, 0.9)["sync_every"]

    fixed, adaptive = first_h(), first_h(local_steps="adaptive")
    cfg = Config.from_dict({**recipes.get("main").values, "local_steps": "adaptive"}).validate()
    period = adaptive // cfg.fragments
    assert fixed == 28 and adaptive > fixed
    assert cfg.steps % period == 0 and cfg.eval_every % period == 0
