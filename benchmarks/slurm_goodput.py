"""Goodput on the local Slurm cluster when nodes are lost: elastic group restart against
whole-job requeue.

Streaming (R=3 replica groups, one node each; tau 1) on a local Slurm cluster of five nodes
(lowband.testing.slurm_cluster, SlurmdTimeout 10 s). The same faults hit two jobs: group 1's node
is lost for good (LocalSlurm.lose_node: its slurmd and every process of its job steps SIGKILLed)
when group 0 reaches each of the steps steps x i / (failures + 1); Slurm notices by itself (no
answer for SlurmdTimeout) and fails the job on it.
  elastic   `lowband launch -s slurm --elastic`: a Slurm job a group (launch/slurm.py); the lost
            group's job alone is requeued and started on a free node, heals from a live peer;
            the others train on. No checkpoints (a group heals from its peers).
  requeue   the plain job (TorchX's heterogeneous job, `--requeue`), requeued whole at the
            fault (`scontrol requeue`: Slurm's own requeue on NODE_FAIL leaves a heterogeneous
            job's components stuck in 22.05); it resumes from its newest checkpoint
            (--checkpoint-every) on the nodes left
Slurm holds a requeued job for two minutes (its BeginTime): the hold is lifted at once in both
(lowband's Lighthouse does it for its groups; this script for the requeued job), so neither pays
it. The lost node is started again once the job runs again, ready for the next fault.
Goodput = tokens that end in the model / wall seconds from submission to the job's end: for
requeue, the final summary's tokens (re-done steps count once); for elastic, every life's steps
less what the lost group trained after its last sync in each lost life (benchmarks/elastic.py).

    sudo python benchmarks/slurm_goodput.py [--steps 3000] [--failures 2] [--json F]

Needs root and Slurm's Debian packages; says why and exits 0 without them. Stops a local cluster
of lowband's that runs in another shape, and the one it starts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic import lost_tokens  # benchmarks/elastic.py
from machine import describe  # benchmarks/machine.py

import lowband
from lowband.telemetry import RunDir, read_events
from lowband.testing.slurm_cluster import LocalSlurm, missing_tools


def flags(a) -> list[str]:
    return ["--algo", "streaming", "--model", a.model, "--fragments", "2", "--sync-every",
            str(a.sync_every), "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
            "--link-bandwidth", "none", "--eval-every", "0", "--eval-batches", "1",
            "--steps", str(a.steps)]


def squeue(*args: str) -> list[list[str]]:
    out = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, timeout=60)
    return [line.split() for line in out.stdout.splitlines() if line.strip()]


def last_step(run: Path) -> int:
    """Group 0's newest step, from its event file as written (a requeued job's lines too)."""
    try:
        text = RunDir(run).event_file(0).read_text()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in text.splitlines()
                if '"kind":"step"' in line), default=0)


def node_of(name: str) -> str:
    """The node a running job (name: TorchX's job name) holds now, '' while none."""
    rows = [r for r in squeue("-o", "%j %T %N") if r[0] == name and r[1] == "RUNNING"]
    return rows[0][2] if rows else ""


def run_arm(a, cluster: LocalSlurm, name: str, root: Path) -> dict:
    """One job under the fault schedule, timed from submission to its end."""
    elastic = name == "elastic"
    extra = ["--elastic"] if elastic else ["--checkpoint-every", str(a.checkpoint_every)]
    run = root / name
    t0 = time.monotonic()
    h = lowband.launch([*flags(a), *extra], scheduler="slurm", replicas=3, cpu=2, memMB=2000,
                       run_dir=str(run))
    victim = "group1-0" if elastic else "node-1"  # group 1's job (elastic) or het component
    faults, at = [], [a.steps * (i + 1) // (a.failures + 1) for i in range(a.failures)]
    while not h.done:
        if at and last_step(run) >= at[0] and node_of(victim):
            node = node_of(victim)
            cluster.lose_node(node)
            if not elastic:  # the whole job requeued at once (Slurm's own requeue on its
                # NODE_FAIL leaves a heterogeneous job's components stuck in 22.05)
                subprocess.run(["scontrol", "requeue", h.app_id], capture_output=True)
            faults.append({"step": last_step(run), "t": time.monotonic() - t0, "node": node})
            print(f"  {name}: lost {node} (group 1's) at step {faults[-1]['step']}, "
                  f"{faults[-1]['t']:.1f} s", flush=True)
            at.pop(0)
            # the job (elastic: group 1's) back on a node; lift a requeue's hold (lowband's
            # Lighthouse does it for its groups), then the lost node comes back for the next
            while node_of(victim) in ("", node) and not h.done:
                if not elastic and h.status() == "pending":
                    subprocess.run(["scontrol", "update", f"JobId={h.app_id}", "StartTime=now"],
                                   capture_output=True)
                time.sleep(0.5)
            faults[-1]["back_s"] = time.monotonic() - t0 - faults[-1]["t"]
            print(f"  {name}: group 1 running again on {node_of(victim)} "
                  f"{faults[-1]['back_s']:.1f} s later", flush=True)
            cluster.revive_node(node)
        time.sleep(0.5)
    wall = time.monotonic() - t0
    state = h.wait(60)
    if state != "succeeded":
        raise SystemExit(f"slurm_goodput: {name} {state}; logs: {run / 'logs'}")
    print(f"  {name}: {wall:.1f} s, {len(faults)} faults", flush=True)
    return {"wall": wall, "faults": faults, "job": h.app_handle, "run": str(run)}


def analyze(rows: dict, tokens_per_step: int) -> dict:
    for name, r in rows.items():
        run = Path(r["run"])
        r["summary"] = json.loads((run / "summary.json").read_text())
        if name == "elastic":
            ran = len(read_events(run, ("step",))) * tokens_per_step
            # lost_tokens counts the lives that were followed by another; a last life lost
            # for good (cancelled: back too late to heal) loses its steps since its last sync
            syncs = {e["step"] for e in read_events(run, ("sync",)) if e["rank"] == 1}
            gone = [w["died_after"] for w in r["summary"]["elastic"]["lost_work"]
                    if w["resumed_from"] is None]
            r["lost"] = lost_tokens(run, 1, tokens_per_step) + sum(
                (d - max([x for x in syncs if x <= d] or [0])) * tokens_per_step for d in gone)
            r["useful_tokens"] = ran - r["lost"]
        else:
            r["useful_tokens"] = r["summary"]["tokens"]
        r["goodput"] = r["useful_tokens"] / r["wall"]
    ratio = rows["elastic"]["goodput"] / rows["requeue"]["goodput"]
    print("\ngoodput (tokens in the model / job wall seconds, submission to end):")
    for name, r in rows.items():
        back = ", ".join(f"{f['back_s']:.1f}" for f in r["faults"] if "back_s" in f)
        print(f"  {name:8s} {r['goodput']:8.0f} tokens/s  ({r['useful_tokens']:,} tokens in "
              f"{r['wall']:.1f} s; final loss {r['summary']['final_loss']:.4f}; faults at steps "
              f"{[f['step'] for f in r['faults']]}, group 1 running again after {back} s)")
    print(f"  elastic / requeue = {ratio:.2f}x  (goal >= 1.5x)  "
          f"{'PASS' if ratio >= 1.5 else 'MISS'}")
    return {"rows": rows, "ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--failures", type=int, default=2)
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="the requeued job's checkpoint interval, in steps")
    p.add_argument("--json", default="")
    p.add_argument("--reanalyze", default="", help="a JSON this script wrote: analyze its runs "
                   "again")
    a = p.parse_args(argv)
    if a.reanalyze:
        rows = json.loads(Path(a.reanalyze).read_text())["rows"]
        analyze(rows, a.batch_size * a.seq_len)
        return 0
    a.json = os.path.abspath(a.json) if a.json else ""  # (the jobs run in a scratch directory)
    cluster = LocalSlurm(nodes=5, slurmd_timeout=10)
    why = ("needs root" if os.geteuid() != 0 else
           f"needs Slurm's packages ({', '.join(missing_tools())} missing)" if missing_tools()
           else "")
    if why:
        print(f"slurm_goodput: skipped: it {why}.")
        return 0
    print(describe())
    root = Path(tempfile.mkdtemp(prefix="lowband-slurm-goodput-"))
    os.chdir(root)  # the jobs run (and Slurm writes their slurm-*.out) here
    os.environ.update(cluster.env())
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    rows = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the cluster is stopped below)
    try:
        cluster.up()
        for name in ("elastic", "requeue"):
            rows[name] = run_arm(a, cluster, name, root)
    finally:
        cluster.down()
    result = analyze(rows, a.batch_size * a.seq_len)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), **result}, indent=1))
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
