"""`lowband train --elastic` on one machine: a torchft Lighthouse and R replica groups, each a
job of its own (S local workers, launch.local.LocalJob), restarted when it dies.

The Lighthouse is torchft's own program (`torchft_lighthouse`), a process of its own whose
output goes to RUN/logs/lighthouse.log; every worker finds it through TORCHFT_LIGHTHOUSE, and
its group through LOWBAND_REPLICA (comm/membership/elastic.py). A group that dies (a killed node, a crash)
is started again, up to --max-restarts times: it continues from its newest intact checkpoint
(checkpoint/lifecycle.py: restarted_group), or afresh without one, heals from a live peer that
trained further at the others' next sync, and trains on. A group that refuses its input (status
2) or stops on purpose (3: no quorum within --quorum-timeout) stops the whole job: the others
would meet it too. A Lighthouse that dies is started again on its port (restart_lighthouse);
the groups' quorums wait for it. Once a group has finished, a group that has met no finished
group in a quorum since it last started is stopped, and a group that dies is not restarted
(leave_out_stragglers): no live peer is left to heal them. When every group has finished or is
lost for good, the groups' records (RUN/groups/) become summary.json, with what the faults cost
(elastic_record).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
import socket
import subprocess
import sys
import time
from pathlib import Path

from lowband.checkpoint.lifecycle import RESTART_COUNT
from lowband.comm.membership import secret
from lowband.comm.membership.bind import bind_host, url_host
from lowband.comm.membership.elastic import TORCHFT, join_timeout_s, quiet_rust
from lowband.comm.membership.lives import lighthouse_life
from lowband.faults import lighthouse_kill_asked
from lowband.launch.local import LocalJob, describe_exit, free_port, last_line
from lowband.options import (LIFE_ENV, LIGHTHOUSE_ENV, REPLICA_ENV, SECRET_ENV, ConfigError,
                             missing_extra, needs_extra)
from lowband.summary import add_ddp_bytes, participation, summarize, sync_participation
from lowband.telemetry import RunDir, read_events, write_json_atomic



def lighthouse(min_replicas: int, join_s: float, port: int = 0, heartbeat_timeout_s: float = 5.0):
    """torchft's Lighthouse, serving in this process on bind_host() (port 0: a free one);
    join_s: how long a quorum waits for a group that heartbeats but has not asked
    (comm/membership/elastic.join_timeout_s); a group whose heartbeats stop for heartbeat_timeout_s
    (torchft's default: 5 s) is left out of the next quorum."""
    quiet_rust()
    needs_extra(*TORCHFT)
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"{url_host(bind_host())}:{port}", min_replicas=min_replicas,
                            join_timeout_ms=int(join_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def lighthouse_process(cfg, log: Path, ready_s: float = 30.0,
                       port: int = 0) -> tuple[subprocess.Popen, str]:
    """torchft's Lighthouse program for the run of `cfg` (its --min-replicas, join timeout and
    --heartbeat-timeout) on bind_host() and `port` (0: a free local one), and its address once
    it answers."""
    exe = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not Path(exe).exists():
        extra, what, _ = TORCHFT
        raise missing_extra(extra, what, "torchft_lighthouse")
    port, host = port or free_port(), bind_host()
    quiet_rust()
    with open(log, "ab") as out:
        proc = subprocess.Popen([exe, "--min_replicas", str(cfg.min_replicas),
                                 "--bind", f"{url_host(host)}:{port}",
                                 "--join_timeout_ms", str(int(join_timeout_s(cfg) * 1000)),
                                 "--heartbeat_timeout_ms", str(int(cfg.heartbeat_timeout * 1000))],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=os.environ)
    deadline = time.monotonic() + ready_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, f"http://{url_host(host)}:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ConfigError(f"torchft's Lighthouse did not start (see {log}), so the elastic run "
                      "cannot begin.")


def run_elastic(cfg, argv: list[str], run: RunDir) -> int:
    """Run the replica groups to the end; the job's exit status."""
    server, address = lighthouse_process(cfg, run.logs / "lighthouse.log")
    lives = {g: 0 for g in range(cfg.replicas)}
    run.clear_group_records()  # (a resumed run's earlier part: its groups finish again)
    # the run's secret (a resumed run's: its own), its groups' only
    secret_file = secret.make(run.root / secret.FILE)

    began = {}  # each group's current life: when it was started (wall clock, as events are)

    def start(g: int) -> LocalJob:
        began[g] = time.time()
        # the group's lives, as torchrun counts them (checkpoint/lifecycle.py: restarted_group)
        env = {LIGHTHOUSE_ENV: address, REPLICA_ENV: str(g), RESTART_COUNT: str(lives[g]),
               LIFE_ENV: str(life_file(run)), SECRET_ENV: str(secret_file)}
        return LocalJob(argv, cfg.shards, run, env, log_prefix=f"replica{g}-", terminal=g == 0,
                        node=(g * cfg.shards, cfg.world))

    jobs, finished = {g: start(g) for g in range(cfg.replicas)}, set()
    try:
        while jobs:
            if lighthouse_kill_asked(run.root):  # --kill lighthouse:STEP, as if its host were lost
                print("lowband: the Lighthouse was killed (--kill lighthouse).", file=sys.stderr,
                      flush=True)
                server.kill()
            if server.poll() is not None:
                server = restart_lighthouse(cfg, run, address)
                if server is None:
                    for job in jobs.values():
                        job.stop()
                    return 3
            for g, job in list(jobs.items()):
                if g not in jobs:  # stopped in this round (leave_out_stragglers)
                    continue
                result = job.poll()
                if result is None:
                    continue
                code, rank = result
                del jobs[g]
                if code == 0:
                    if not finished:  # the run's result exists: no live peer for a late group
                        lives_now = {j: began[j] for j in jobs}
                        restarted = {j for j in jobs if lives[j]}
                        for late, why in leave_out_stragglers(cfg, run, lives_now,
                                                              restarted).items():
                            jobs.pop(late).stop()
                            print(f"lowband: replica group {late} is stopped: {why}.",
                                  file=sys.stderr, flush=True)
                    finished.add(g)
                elif code in (2, 3, 130):  # bad input (every group would refuse it), a stop
                    # on purpose (no quorum, NaN: a restart would meet it again), or Ctrl-C
                    if code in (2, 3) and (g, rank) != (0, 0):  # its sentence is in its log
                        print(last_line(run.logs / f"replica{g}-rank{rank}.log"), file=sys.stderr)
                    for other in jobs.values():
                        other.stop()
                    return code
                elif finished:  # alone it would train on to a state of its own
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}) and is "
                          "not restarted: a group has finished, so no live peer is left to heal "
                          "it.", file=sys.stderr, flush=True)
                elif lives[g] < cfg.max_restarts:
                    lives[g] += 1
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}); "
                          f"restarting it (life {lives[g] + 1} of {cfg.max_restarts + 1}), the "
                          "others train on.", file=sys.stderr, flush=True)
                    jobs[g] = start(g)
                else:
                    print(f"lowband: replica group {g} {describe_exit(code)} (rank {rank}) and "
                          f"is not restarted again (--max-restarts {cfg.max_restarts}); the "
                          "others train on.", file=sys.stderr, flush=True)
            time.sleep(0.1)
    except KeyboardInterrupt:
        for job in jobs.values():
            job.stop()
        return 130
    finally:
        server.kill()
        server.wait()
    if not finished:
        raise ConfigError("every replica group was lost, so the run has no result: see "
                          f"{run.logs} and start it again.")
    write_summary(cfg, run)
    return 0


LEFT_OUT = "left-out.json"  # in RUN/groups/, beside the records (replica<i>.json)


def life_file(run: RunDir) -> Path:
    """How often the Lighthouse was restarted (comm/membership/elastic.py: LighthouseLives)."""
    return run.logs / "lighthouse-life"


def down_file(run: RunDir) -> Path:
    """Seconds each restart left the groups without a Lighthouse (summary.json: elastic)."""
    return run.logs / "lighthouse-down.json"


def restart_lighthouse(cfg, run: RunDir, address: str) -> subprocess.Popen | None:
    """A new Lighthouse on the dead one's port, its life written first (None: it did not start:
    the job stops). The pause lets every quorum the old one answered reach its group before
    the file says the next life, and lets the old port go. How long it was away (from its
    death seen, within the supervisor's 0.1 s poll, to the new one answering) is recorded."""
    t0 = time.monotonic()
    life = lighthouse_life(life_file(run)) + 1
    time.sleep(1.0)
    write_json_atomic(life_file(run), life)
    try:
        server, _ = lighthouse_process(cfg, run.logs / "lighthouse.log",
                                       port=int(address.rsplit(":", 1)[1]))
    except ConfigError:
        print(f"lowband: the Lighthouse stopped and a new one did not start on {address} (see "
              f"{run.logs / 'lighthouse.log'}), so the groups stop; `lowband train --resume "
              f"{run.root}` continues them from their checkpoints.", file=sys.stderr, flush=True)
        return None
    down = (run.read_json(down_file(run)) or []) + [round(time.monotonic() - t0, 3)]
    write_json_atomic(down_file(run), down)
    print(f"lowband: the Lighthouse stopped; a new one serves {address} (restart {life}, after "
          f"{down[-1]:.1f} s), and the groups' quorums wait for it.", file=sys.stderr, flush=True)
    return server


def leave_out_stragglers(cfg, run: RunDir, unfinished: dict[int, float],
                         restarted: set[int] = frozenset()) -> dict[int, str]:
    """Once a group has finished: the groups of `unfinished` (each with the wall-clock time its
    current life began, or 0: from its last `run` event) that have met no finished group in a
    quorum since then (restarted too late to heal), with why. No live peer is left to heal
    them, and alone they would train on to a state of their own (and write model.pt over the
    run's): the caller stops them, and the summary counts their work as lost (record_left_out).
    restarted: the groups whose current life is a restart (the reason says so: a life stopped
    before its first event leaves no other trace of its restart)."""
    done = set(run.group_records())
    if not done:
        return {}
    events = [e for e in read_events(run, ("run", "membership"))
              if e["rank"] % cfg.shards == 0 and e.get("replica") in unfinished]
    left = {}
    for g in sorted(set(unfinished) - done):
        mine = [e for e in events if e["replica"] == g]
        since = max([unfinished[g]] + [e["t"] for e in mine if e["kind"] == "run"
                                       and e.get("phase") in ("start", "resume")])
        if not any(e["kind"] == "membership" and e["t"] >= since and done & set(e["members"])
                   for e in mine):
            left[g] = (f"since it {'was restarted' if g in restarted else 'started'} it has "
                       "met no group that finished, so no live peer is left to heal it")
    record_left_out(run, left)
    return left


def record_left_out(run: RunDir, groups: dict[int, str]) -> None:
    """RUN/groups/left-out.json: each group left out at the end, and why (elastic_record)."""
    if groups:
        run.groups.mkdir(exist_ok=True)
        before = run.read_json(run.groups / LEFT_OUT) or {}
        write_json_atomic(run.groups / LEFT_OUT, {**before, **{str(g): why
                                                              for g, why in groups.items()}})


def write_summary(cfg, run: RunDir) -> dict:
    """summary.json from the groups that finished, with what faults cost them (`elastic`)."""
    records = [run.read_json(p) for p in run.group_records().values()]
    records = [r for r in records if r]
    ranks = [rank for r in records for rank in r["ranks"]]
    summary = summarize(cfg, ranks)
    summary["run_dir"] = str(run.root)  # (the launcher may have named it: cfg's is empty then)
    summary["elastic"] = elastic_record(cfg, run, sorted({r["replica"] for r in ranks}))
    group_step = cfg.grad_accum * cfg.batch_size * cfg.seq_len * cfg.shards
    count_every_life(summary, cfg, run, ranks, group_step)
    add_ddp_bytes(summary, records[0]["ddp_one_step"], cfg.replicas, cfg.replicas * group_step)
    write_json_atomic(run.summary, summary)
    return summary


def count_every_life(summary: dict, cfg, run: RunDir, ranks: list[dict], group_step: int) -> None:
    """`tokens`, `tokens_per_s`, `steps_run` and `steps_run_per_replica` (one entry a group)
    count what every life of every group trained: the step events of each group's first rank,
    a lost life's included (a group's ranks' totals cover only its last life and the
    checkpoint it went on from; a healed group's skipped steps were never trained). Tokens
    trained but thrown away (by a life that died, after the step its group went on from; all of
    a group lost for good) are `elastic.tokens_lost`. group_step: a group's tokens in one step."""
    steps = [run.count_events(g * cfg.shards, "step") for g in range(cfg.replicas)]
    kept = sum(r["tokens"] for r in ranks)
    summary["tokens"] = sum(steps) * group_step
    summary["tokens_per_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] > 0 else 0.0
    summary["steps_run_per_replica"] = steps
    mean = sum(steps) / len(steps)
    summary["steps_run"] = int(mean) if mean == int(mean) else round(mean, 2)
    summary["elastic"]["tokens_lost"] = summary["tokens"] - kept


def elastic_record(cfg, run: RunDir, finished: list[int]) -> dict:
    """summary.json's `elastic`, from the events of each group's first rank: the groups that
    finished; the times each was restarted (its `run` events marked restart); its heals (its
    membership events, healed: a live peer's state received); and `lost_work`, one entry a
    life lost: the group, the step its life died after, the step its next life began at (its
    newest checkpoint's, 0 without one; None: lost for good) and the steps of the lost life
    it trained again (`redone`, [first, last]; None when a peer's state came first)."""
    events = [e for e in read_events(run, ("run", "membership", "step", "quorum"))
              if e["rank"] % cfg.shards == 0 and "replica" in e]
    restarts = [e for e in events if e["kind"] == "run" and e.get("restart")]
    heals = Counter(e["replica"] for e in events if e["kind"] == "membership" and e.get("healed"))
    steps = [e for e in events if e["kind"] == "step"]
    lost = []
    for r in restarts:
        g, t = r["replica"], r["t"]
        before = [e["step"] for e in steps if e["replica"] == g and e["t"] < t]
        died = r.get("superseded_to", before[-1] if before else 0)
        later = [e["t"] for e in restarts if e["replica"] == g and e["t"] > t]
        again = sorted({e["step"] for e in steps if e["replica"] == g and t < e["t"] < min(
            later, default=float("inf")) and r["step"] < e["step"] <= died})
        lost.append({"group": g, "died_after": died, "resumed_from": r["step"],
                     "redone": [again[0], again[-1]] if again else None})
    left_out = run.read_json(run.groups / LEFT_OUT) or {}
    for g in sorted(set(range(cfg.replicas)) - set(finished)):
        mine = [e["step"] for e in steps if e["replica"] == g]
        why = {"left_out": left_out[str(g)]} if str(g) in left_out else {}
        lost.append({"group": g, "died_after": mine[-1] if mine else 0, "resumed_from": None,
                     "redone": None, **why})
    lost.sort(key=lambda life: life["group"])  # (each group's lives stay in time order)
    return {"groups_finished": finished, "lighthouse_restarts": lighthouse_life(life_file(run)),
            "lighthouse_down_s": run.read_json(down_file(run)) or [],
            "restarts": {str(g): n for g, n in sorted(Counter(e["replica"] for e in restarts).items())},
            "heals": {str(g): n for g, n in sorted(heals.items())}, "lost_work": lost,
            "participation": participation(sync_participation(events))}
