"""The chaos harness (issue 32): an elastic run under sustained faults, and the invariants its
own records must keep. benchmarks/chaos.py soaks ten minutes; tests/test_chaos.py one.

`lowband train --elastic` runs R replica groups (S=1) of a tiny model on loopback; from outside,
at seeded random times (about one every `kill_every` seconds once the first step is recorded),
every process of a random group is SIGKILLed (its workers: the supervisor's children whose
environment names the group, LOWBAND_REPLICA), and once the Lighthouse (its child
`torchft_lighthouse`), which the supervisor starts again on its port. Then check() reads the
run's events and summary.json:

  1 heal source   every heal came from a group that had trained to the step it handed over,
                  at least as far as the healed one (a fresh group never donates), and every
                  restarted group began at its newest checkpoint (or further: one written in
                  the instant it died), never older
  2 equal state   the groups of one sync (same quorum, step and fragment) hold bitwise equal
                  outer parameters after it (the sync events' outer_digest)
  3 tokens once   each group's step numbers only grow, each step adds its tokens once, and
                  summary.json's tokens are the sum of what the groups' steps recorded
  4 bounded wait  no quorum answered later than --quorum-timeout (membership quorum_s; a group's
                  first quorum of a restarted Lighthouse's life: later by that Lighthouse's
                  time away, summary.json's lighthouse_down_s, and torchft's reconnection
                  backoff, RECONNECT_S), and no quorum wait (wait_s) longer than that and what
                  may follow the answer in the same wait: the process group's reconfiguration
                  and the heal, each bounded by --elastic-timeout, and the Lighthouse's status
                  page (STATUS_S)
  5 loss          the final validation loss within `tolerance` of a run without failures at
                  equal tokens (compare(), with that run's evaluations)
  6 no false alarm  the guard on the outer step (algorithms/guard.py) left no update out: kills,
                  heals and restarts are no bad replica (summary.json's left_out_updates)

It also measures participation: per sync, the groups that took part against the groups alive
then (membership `alive` where recorded, else the groups started and not yet killed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lowband.comm.membership.lives import LIFE, STATUS_TIMEOUT_S
from lowband.options import REPLICA_ENV
from lowband.telemetry import RunDir, parse_event, read_events

RECONNECT_S = 10.0  # torchft reconnects to a Lighthouse with a backoff of at most 10 s a try
STATUS_S = 2 * STATUS_TIMEOUT_S  # the status page a first rank reads in each quorum (connect, read)
TINY = ["--model", "nano", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "2",
        "--no-progress", "--link-bandwidth", "none"]


def train_argv(run_dir, steps: int, replicas: int = 8, elastic: bool = True,
               quorum_timeout: float = 30.0, eval_every: int = 0, extra=()) -> list[str]:
    """`lowband train` for a chaos run (elastic) or its reference (elastic, no faults)."""
    argv = ["train", "--run-dir", str(run_dir), *TINY, "--algo", "streaming", "--replicas",
            str(replicas), "--steps", str(steps), "--sync-every", "8", "--fragments", "2",
            "--eval-every", str(eval_every), "--checkpoint-every", "16", *map(str, extra)]
    if elastic:
        argv += ["--elastic", "--max-restarts", "1000", "--quorum-timeout", str(quorum_timeout),
                 "--elastic-timeout", "15"]
    return argv


@dataclass
class Fault:
    t: float          # seconds since the first recorded step
    what: str         # "group" or "lighthouse"
    group: int | None
    pids: list[int]


@dataclass
class Soak:
    """One chaos run: `lowband train ARGV`, faults from outside until it ends."""
    argv: list[str]
    seed: int = 0
    kill_every: float = 15.0
    lighthouse_at: float = 30.0   # seconds after the first step: the Lighthouse's one kill
    first_kill: float | None = None  # seconds after the first step (None: like the others)
    timeout: float = 900.0
    faults: list[Fault] = field(default_factory=list)
    returncode: int | None = None
    output: str = ""
    wall_s: float = 0.0

    def run(self, log=None) -> "Soak":
        rng = random.Random(self.seed)
        run_dir = Path(self.argv[self.argv.index("--run-dir") + 1])
        out = open(run_dir.parent / f"{run_dir.name}.out", "w+")
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "lowband.cli", *self.argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started, next_kill, lighthouse_done = None, None, False
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 > self.timeout:
                    proc.kill()
                    break
                if started is None:
                    if _any_step(run_dir):
                        started = now
                        next_kill = started + (self.kill_every * rng.uniform(0.5, 1.5)
                                               if self.first_kill is None else self.first_kill)
                elif not lighthouse_done and now - started >= self.lighthouse_at:
                    lighthouse_done = True
                    self._kill(proc.pid, now - started, None, log)
                elif now >= next_kill:
                    self._kill(proc.pid, now - started, rng, log)
                    next_kill = now + self.kill_every * rng.uniform(0.5, 1.5)
                time.sleep(0.2)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.wall_s = time.monotonic() - t0
        self.returncode = proc.returncode
        out.seek(0)
        self.output = out.read()
        out.close()
        return self

    def _kill(self, root: int, t: float, rng, log) -> None:
        """SIGKILL a random group's processes (rng) or the Lighthouse (rng None)."""
        children = _children(root)
        if rng is None:
            pids = [p for p in children if "torchft_lighthouse" in _cmdline(p)]
            group = None
        else:
            groups: dict[int, list[int]] = {}
            for p in children:
                g = _env(p).get(REPLICA_ENV)
                if g is not None:
                    groups.setdefault(int(g), []).append(p)
            if not groups:
                return
            group = rng.choice(sorted(groups))
            pids = groups[group]
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if pids:
            self.faults.append(Fault(round(t, 2), "lighthouse" if group is None else "group",
                                     group, pids))
            if log:
                who = "the Lighthouse" if group is None else f"group {group}"
                log(f"chaos: t={t:6.1f}s SIGKILL {who} (pids {pids})")


def _any_step(run_dir: Path) -> bool:
    events = run_dir / "events"
    if not events.is_dir():
        return False
    for path in events.glob("rank*.jsonl"):
        try:
            if b'"kind":"step"' in path.read_bytes():
                return True
        except OSError:
            pass
    return False


def _children(root: int) -> list[int]:
    """The processes whose parent is `root`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == root:
            out.append(int(entry))
    return out


def _env(pid: int) -> dict:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


@dataclass
class Report:
    """What check() found: failures (one named message each), checks passed per invariant,
    and the figures."""
    failures: list[str] = field(default_factory=list)
    passed: dict[str, int] = field(default_factory=dict)
    figures: dict = field(default_factory=dict)

    def expect(self, invariant: str, ok: bool, message: str) -> None:
        if ok:
            self.passed[invariant] = self.passed.get(invariant, 0) + 1
        else:
            self.failures.append(f"{invariant}: {message}")


def check(run_dir, faults: list[Fault] = ()) -> Report:
    """Invariants 1-4 and 6 from a finished chaos run's records (its timeouts from config.json), and
    its figures."""
    run_dir = Path(run_dir)
    rep = Report()
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = json.loads((run_dir / "config.json").read_text())
    events = [e for e in read_events(run_dir) if e.get("replica") is not None]
    first = [e for e in events if e["rank"] % cfg["shards"] == 0]  # each group's first rank
    steps = [e for e in first if e["kind"] == "step"]
    every_step = _every_step(run_dir, cfg["shards"])
    _heal_sources(rep, first, every_step)
    _equal_state(rep, [e for e in events if e["kind"] == "sync"], cfg["shards"])
    records = {g: json.loads(p.read_text()) for g, p in RunDir(run_dir).group_records().items()}
    finals = {r["outer_sha256"] for r in records.values()}
    rep.expect("2 equal state", len(finals) == 1,
               f"the groups end with {len(finals)} different outer parameters")
    _tokens_once(rep, cfg, summary, steps, len(every_step), set(records))
    _bounded_waits(rep, [e for e in first if e["kind"] == "membership"], cfg,
                   summary.get("elastic", {}).get("lighthouse_down_s", []))
    rep.figures.update(_participation(first, faults, cfg["replicas"]))
    left = summary.get("left_out_updates", 0)
    rep.expect("6 no false alarm", not left,
               f"the guard left {left} updates out of a run whose replicas were all sound: "
               + "; ".join(r["text"] for r in summary.get("left_out", [])[:3]))
    el = summary.get("elastic", {})
    rep.figures.update({
        "kills": sum(f.what == "group" for f in faults),
        "lighthouse_kills": sum(f.what == "lighthouse" for f in faults),
        "restarts": sum(el.get("restarts", {}).values()),
        "lighthouse_restarts": el.get("lighthouse_restarts", 0),
        "heals": sum(el.get("heals", {}).values()),
        "steps_redone": sum(life["redone"][1] - life["redone"][0] + 1
                            for life in el.get("lost_work", []) if life.get("redone")),
        "tokens": summary["tokens"], "final_val_loss": summary["final_val_loss"],
        "wall_s": summary["wall_s"]})
    return rep


def _bounded_waits(rep: Report, memberships: list[dict], cfg: dict, down_s: list[float]) -> None:
    """Invariant 4: the Lighthouse answered each quorum within --quorum-timeout (the first of a
    group's in a restarted Lighthouse's life: also within that Lighthouse's time away and the
    reconnection), and the whole wait (the answer, then the reconfiguration and the heal)
    stayed within its bounds."""
    each, lives = cfg["elastic_timeout"], {}
    for e in sorted(memberships, key=lambda e: e["t"]):
        life = e["quorum_id"] // LIFE
        away = (down_s[life - 1] + RECONNECT_S if life > lives.get(e["replica"], 0)
                and life <= len(down_s) else 0.0)
        lives[e["replica"]] = life
        answer = cfg["quorum_timeout"] + away
        whole = answer + 2 * each + STATUS_S
        where = f"group {e['replica']}, the quorum of step {e['step']}"
        rep.expect("4 bounded wait", e["quorum_s"] <= answer,
                   f"{where}: the Lighthouse answered after {e['quorum_s']:.1f} s (bound "
                   f"{answer:g} s: --quorum-timeout {cfg['quorum_timeout']:g}, and the "
                   f"Lighthouse's restart {away:g})")
        rep.expect("4 bounded wait", e["wait_s"] <= whole,
                   f"{where}: waited {e['wait_s']:.1f} s in all, {e['quorum_s']:.1f} s of them "
                   f"for the answer (bound {whole:g} s: the answer's {answer:g}, twice "
                   f"--elastic-timeout {each:g}, the status page {STATUS_S:g})")


def _every_step(run_dir: Path, shards: int) -> list[dict]:
    """Every step event of each group's first rank, those of lives lost after their
    checkpoints included (read_events leaves them out: superseded)."""
    out = []
    for path in (run_dir / "events").glob("rank*.jsonl"):
        for line in path.read_bytes().splitlines():
            e = parse_event(line)
            if e and e["kind"] == "step" and e["rank"] % shards == 0:
                out.append(e)
    return out


def _heal_sources(rep: Report, first: list[dict], steps: list[dict]) -> None:
    """1: a heal's source had trained to the step it handed over (its step event of that step,
    in any of its lives, a lost one's too; or it had healed to it itself), at least as far as
    the healed group; a restarted group began at or past its newest checkpoint."""
    reached = {(s["replica"], s["step"]) for s in steps}  # (a step's event follows its sync)
    reached |= {(e["replica"], e["step"]) for e in first if e["kind"] == "membership"
                and e.get("healed")}  # (a source healed to its step from one that trained)
    for e in first:
        if e["kind"] == "membership" and e.get("healed"):
            src, g = e.get("heal_from"), e["replica"]
            trained = e["step"] > 0 and (src, e["step"]) in reached
            rep.expect("1 heal source", src is not None and src != g and trained
                       and e["step"] >= e.get("step_before", 0),
                       f"group {g} healed to step {e['step']} from group {src}, which had not "
                       f"trained to it (the healed group had trained to {e.get('step_before')})")
    ckpts = [e for e in first if e["kind"] == "checkpoint"]
    for r in (e for e in first if e["kind"] == "run" and e.get("restart")):
        g = r["replica"]
        newest = max((c["step"] for c in ckpts if c["replica"] == g and c["t"] < r["t"]),
                     default=0)
        rep.expect("1 heal source", r["step"] >= newest,
                   f"group {g} restarted from step {r['step']} though its checkpoint of step "
                   f"{newest} was on disk")


def _equal_state(rep: Report, syncs: list[dict], shards: int) -> None:
    """2: one digest per (quorum, step, fragment, shard)."""
    seen: dict[tuple, dict[str, list[int]]] = {}
    for e in syncs:
        if "outer_digest" not in e:
            continue
        key = (e["quorum_id"], e["step"], e["fragment"], e["rank"] % shards)
        seen.setdefault(key, {}).setdefault(e["outer_digest"], []).append(e["replica"])
    for (quorum, step, fragment, _), digests in sorted(seen.items()):
        rep.expect("2 equal state", len(digests) == 1,
                   f"after the sync of step {step} (fragment {fragment}, quorum {quorum}) the "
                   f"groups' outer parameters differ: {sorted(digests.values())}")
    rep.figures["syncs_compared"] = len(seen)


def _tokens_once(rep: Report, cfg: dict, summary: dict, steps: list[dict], every: int,
                 finished: set[int]) -> None:
    """3: per group, the steps kept (a lost life's after its checkpoint superseded) only grow
    and each adds its tokens once; summary.json's tokens are every life's recorded steps (`every`
    step events), and those not kept (all of a group that did not finish: left out at the end)
    are its elastic.tokens_lost."""
    per_step = cfg["batch_size"] * cfg["seq_len"] * cfg.get("grad_accum", 1)
    kept = 0
    for g in sorted({e["replica"] for e in steps}):
        mine = [e for e in steps if e["replica"] == g]
        numbers = [e["step"] for e in mine]
        rep.expect("3 tokens once", all(a < b for a, b in zip(numbers, numbers[1:])),
                   f"group {g}'s recorded steps do not only grow: {numbers}")
        counted = [e["tokens"] for e in mine]
        rep.expect("3 tokens once", counted == [per_step * (i + 1) for i in range(len(mine))],
                   f"group {g}'s tokens do not grow by {per_step} a recorded step")
        kept += counted[-1] if counted and g in finished else 0
    tokens, lost = summary["tokens"], summary.get("elastic", {}).get("tokens_lost", 0)
    rep.expect("3 tokens once", tokens == every * per_step * cfg["shards"],
               f"summary.json counts {tokens} tokens, the groups' recorded steps (every life) "
               f"{every * per_step * cfg['shards']}")
    rep.expect("3 tokens once", tokens - lost == kept * cfg["shards"],
               f"summary.json keeps {tokens - lost} tokens ({lost} lost), the groups' kept "
               f"steps {kept * cfg['shards']}")


def _participation(first: list[dict], faults, replicas: int) -> dict:
    """Per sync (one quorum, step and fragment): the groups in it against those alive."""
    deaths = sorted((f.t, f.group) for f in faults if f.what == "group")
    runs = [e for e in first if e["kind"] == "run" and e.get("phase") in ("start", "resume")]
    t0 = min((e["t"] for e in first if e["kind"] == "step"), default=0.0)
    alive_in = {(m["quorum_id"], m["step"]): m["alive"] for m in first  # (where recorded)
                if m["kind"] in ("quorum", "membership") and m.get("alive") is not None}
    syncs: dict[tuple, list[dict]] = {}
    for e in first:
        if e["kind"] == "sync" and "quorum_id" in e:
            syncs.setdefault((e["quorum_id"], e["step"], e["fragment"]), []).append(e)
    sizes, full = [], 0
    for (quorum, step, _), group in syncs.items():
        t = min(e["t"] for e in group)
        size = round(1 / group[0]["weight"])
        if (quorum, step) in alive_in:
            alive = len(alive_in[(quorum, step)])
        else:  # started (a run event) and not killed since
            alive = sum(_alive(g, t, t0, runs, deaths) for g in range(replicas))
        sizes.append(size)
        full += size >= alive
    return {"syncs": len(sizes), "mean_participants": sum(sizes) / len(sizes) if sizes else 0.0,
            "syncs_with_every_live_group": full}


def _alive(g: int, t: float, t0: float, runs: list[dict], deaths) -> bool:
    started = max((e["t"] for e in runs if e["replica"] == g and e["t"] <= t), default=None)
    if started is None:
        return False
    return not any(group == g and started < t0 + dt <= t for dt, group in deaths)


def compare(run_dir, reference_dir, tolerance: float = 0.03) -> tuple[bool, str, dict]:
    """5: the chaos run's final validation loss against the reference run's (same flags, no
    faults) at equal tokens: the reference's evaluations (mean over groups), interpolated at
    the tokens of the chaos run's steps in its model (those trained and lost left out).
    (ok, message, figures)"""
    chaos = json.loads((Path(run_dir) / "summary.json").read_text())
    cfg = json.loads((Path(reference_dir) / "config.json").read_text())
    per_step = (cfg["batch_size"] * cfg["seq_len"] * cfg.get("grad_accum", 1) * cfg["replicas"]
                * cfg["shards"])  # the reference's tokens a step, every group training
    by_step: dict[int, list[float]] = {}
    for e in read_events(reference_dir, ("eval",)):
        if e["rank"] % cfg["shards"] == 0:
            by_step.setdefault(e["step"], []).append(e["val_loss"])
    curve = sorted((s * per_step, sum(v) / len(v)) for s, v in by_step.items())
    tokens = chaos["tokens"] - chaos.get("elastic", {}).get("tokens_lost", 0)  # in the model
    ref = _interpolate(curve, tokens)
    loss = chaos["final_val_loss"]
    gap = loss / ref - 1
    figures = {"reference_val_loss_at_equal_tokens": ref, "chaos_val_loss": loss,
               "loss_gap": gap, "tokens_in_model": tokens,
               "reference_tokens": curve[-1][0] if curve else 0}
    ok = gap <= tolerance
    return ok, ("" if ok else f"5 loss: the final validation loss {loss:.4f} is {100 * gap:.1f}% "
                f"above the run without failures at equal tokens ({ref:.4f}; allowed "
                f"{100 * tolerance:.0f}%)"), figures


def _interpolate(curve: list[tuple[float, float]], x: float) -> float:
    if not curve:
        raise ValueError("the reference run has no evaluations: give it --eval-every")
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]
