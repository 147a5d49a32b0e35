"""Synthetic run directories: events as a streaming-DiLoCo trainer would write them, without
training anything. For tests, docs and trying the dashboard or a report in seconds:

    from lowband.testing.synthetic import make_run
    make_run("runs/demo", steps=300)             # a finished run
    make_run("runs/elastic", elastic={"kill": 1, "at": 60, "back": 100})   # group 1 lost, back
    make_run("runs/vote", elastic={"kill": 1, "at": 60, "back": 100, "uncommitted": 60})
    make_run("runs/requeued", restart={"at": 100, "crash": 130, "slurm_restart": 1})
    make_run("runs/target", target_loss=2.0)    # summary.json's `target`, as --target-loss
    make_run("runs/straggler", straggler={1: 2})  # replica 1 computes 2x slower, 0 waits
    run = SyntheticRun("runs/live"); run.emit_steps(0, 50)   # ... later: run.emit_steps(50, 80)
"""

from __future__ import annotations

import math
import random

from lowband.summary import save, target
from lowband.telemetry import EventWriter, RunDir, write_json_atomic


class SyntheticRun:
    """Writes a fake run step by step. Times are synthetic (from t_start, step_s apart), so the
    same arguments always give the same files."""

    def __init__(self, root, *, replicas: int = 2, shards: int = 2, steps: int = 200,
                 fragments: int = 2, sync_every: int = 20, step_s: float = 0.1,
                 link_bandwidth: float = 2e7, model_bytes: float = 8e6, eval_every: int = 50,
                 spike: dict | None = None, anomaly_at: tuple | None = None,
                 name: str | None = None, algo: str = "streaming", t_start: float = 1.7e9,
                 noise: float = 0.02, seed: int = 0, elastic: dict | None = None,
                 target_loss: float = 0.0, straggler: dict | None = None):
        """elastic: an --elastic run (membership events) whose group `kill` dies after step
        `at` and is back, healed from a live peer, at step `back` (both moved on to the next
        sync); heal_bytes, heal_s as the healed group reports them; uncommitted: a step whose
        sync (the next one from there) fails its commit vote: the live ranks write a `skip`
        event (what=commit) instead of its `sync` event. target_loss: as --target-loss. straggler:
        as --straggler, {replica: factor}: the slowest replica computes 80% of each step, a
        replica `factor` times faster than it that much less, and waits for the link the rest."""
        self.rd = RunDir(root).create()
        self.R, self.S, self.steps, self.P, self.H = replicas, shards, steps, fragments, sync_every
        self.step_s, self.bw, self.model_bytes = step_s, link_bandwidth, model_bytes
        self.eval_every, self.spike, self.anomaly_at = eval_every, spike, anomaly_at
        self.t_start, self.noise = t_start, noise
        self.t_shift = 0.0            # the time lost to restarts so far
        self.attempt = 0
        self.rng = random.Random(seed)
        self.config = {"name": name or self.rd.root.name, "algo": algo, "replicas": replicas,
                       "shards": shards, "steps": steps, "fragments": fragments,
                       "sync_every": sync_every, "link_bandwidth": f"{link_bandwidth / 1e6:g}Mbit",
                       "codec": "fp4", "target_loss": target_loss,
                       "straggler": ",".join(f"{q}:{f:g}" for q, f in (straggler or {}).items())}
        slowest = max((straggler or {}).values(), default=1.0)
        self.compute_share = [0.8 * (straggler or {}).get(q, 1.0) / slowest
                              for q in range(replicas)]
        self.world = replicas * shards
        self.elastic = None
        if elastic is not None:
            kill = int(elastic.get("kill", 1))
            at = self._next_sync(int(elastic.get("at", steps // 3)))
            back = self._next_sync(max(int(elastic.get("back", 2 * steps // 3)), at + 1))
            self.elastic = dict(elastic, kill=kill, at=at, back=back)
            if elastic.get("uncommitted") is not None:
                self.elastic["uncommitted"] = self._next_sync(int(elastic["uncommitted"]))
            self.config["elastic"] = True
        write_json_atomic(self.rd.config, self.config)
        self.writers = {r: EventWriter(self.rd, r, r // shards) for r in range(self.world)}
        self.tokens_per_step = 4096
        self.outer_wire = self.inner_wire = 0.0
        self.compute = 0.0
        self.peak_payload = 0.0
        self.last_loss: list[float] = []
        self.last_val = None
        self.evals: list[list] = []   # [step, val_loss, elapsed_s, tokens, outer_bytes]
        self.saved: dict = {}         # the totals at each checkpoint, for resume()
        for w in self.writers.values():
            w.emit_run("start", self.world, "synthetic", t=t_start, step=0, attempt=0)
        self.writers[0].emit("mystery", t=t_start, note="an unknown kind readers must skip")

    def base_loss(self, step: int) -> float:
        return 1.6 + 3.0 * math.exp(-step / 60)

    def step_end(self, rank: int, step: int) -> float:
        return self.t_start + self.t_shift + (step + 1) * self.step_s + 0.002 * rank

    def _next_sync(self, step: int) -> int:
        """The first step from `step` on at which a fragment syncs."""
        offset = self.H // self.P
        while step < self.steps and not any(
                step and (step - p * offset) % self.H == 0 for p in range(self.P)):
            step += 1
        return step

    def down(self, replica: int, step: int) -> bool:
        """Whether replica group `replica` is dead at step `step` (elastic runs)."""
        el = self.elastic
        return el is not None and replica == el["kill"] and el["at"] <= step < el["back"]

    def _membership(self, step: int) -> None:
        el = self.elastic
        if el is None or step not in (0, el["at"], el["back"]):
            return
        groups = list(range(self.R))
        quorum = {0: 0, el["at"]: 1, el["back"]: 2}[step]
        members = [g for g in groups if step != el["at"] or g != el["kill"]]
        for r, w in self.writers.items():
            q = r // self.S
            if q not in members:
                continue
            fields = dict(step=step, quorum_id=quorum, size=len(members), members=members,
                          joined=[], left=[], healed=False, wait_s=0.01 + 0.001 * r)
            if step == 0 or (step == el["back"] and q == el["kill"]):
                fields["joined"] = members          # a group's first quorum in its life
            elif step == el["at"]:
                fields["left"] = [el["kill"]]
            else:
                fields["joined"] = [el["kill"]]
            if step == el["back"] and q == el["kill"]:
                fields.update(healed=True, heal_bytes=el.get("heal_bytes", self.model_bytes / 2),
                              heal_s=el.get("heal_s", 0.3))
            w.emit("membership", t=self.step_end(r, step - 1) + 0.001, **fields)

    def emit_steps(self, start: int, stop: int) -> None:
        """Write the events of steps [start, stop) on every rank."""
        for s in range(start, stop):
            losses = []
            self._membership(s)
            for r, w in self.writers.items():
                q = r // self.S
                if self.down(q, s):
                    continue
                t = self.step_end(r, s)
                loss = self.base_loss(s) + 0.03 * q + self.rng.gauss(0, self.noise)
                if self.spike and self.spike.get("step") == s and self.spike.get("replica", q) == q:
                    loss += self.spike.get("size", 1.5)
                losses.append(loss)
                compute = self.compute_share[q] * self.step_s
                self.compute += compute
                w.emit_step(s, loss, 3e-4, (s + 1) * self.tokens_per_step, self.step_s, compute,
                            self.clock(r, s), t=t, future_field="ignored")
                inner = self.model_bytes / 8
                self.inner_wire += inner
                w.emit("comm", t=t, op="reduce_scatter", group="inner", tag="bucket0",
                       payload_bytes=inner, wire_bytes=inner, codec="fp32",
                       start=t - 0.3 * self.step_s, end=t - 0.15 * self.step_s)
                for p in range(self.P):
                    if s == 0 or (s - p * (self.H // self.P)) % self.H:
                        continue
                    payload = self.model_bytes / self.P / self.S
                    wire = payload / 8 * 1.03          # fp4 plus per-block scales
                    self.outer_wire += wire
                    self.peak_payload = max(self.peak_payload, payload)
                    end = t + wire * 8 / self.bw
                    w.emit("comm", t=end, op="all_reduce", group="outer", tag=f"frag{p}",
                           payload_bytes=payload, wire_bytes=wire, codec="fp4", start=t, end=end)
                    if self.elastic and self.elastic.get("uncommitted") == s:
                        w.emit("skip", t=end, step=s, what="commit", fragment=p)
                        continue
                    anomaly = self.anomaly_at == (q, s, p)
                    alive = sum(not self.down(g, s) for g in range(self.R))
                    w.emit("sync", t=end, step=s, fragment=p,
                           pseudo_grad_norm=0.5 + self.rng.random() * (5 if anomaly else 0.1),
                           weight=1 / alive, anomaly=anomaly, outer_lr=0.7)
                if self.spike and self.spike.get("event") and self.spike.get("step") == s \
                        and r == 0:
                    w.emit("spike", t=t, step=s, loss=loss, z=9.0)
            self.last_loss = losses
            if self.eval_every and (s + 1) % self.eval_every == 0:
                self.last_val = self.base_loss(s) + 0.05
                self.evals.append([s, self.last_val, self.clock(self.world - 1, s),
                                   self.run_tokens(s), self.outer_wire])
                self.writers[0].emit_eval(s, self.last_val, t=self.step_end(0, s) + 0.01,
                                          **dict(zip(("elapsed_s", "tokens", "outer_bytes"),
                                                     self.evals[-1][2:])))

    def clock(self, rank: int, step: int) -> float:
        """A rank's training seconds at the end of step `step` (the time lost to restarts
        left out)."""
        return self.step_end(rank, step) - self.t_start - self.t_shift

    def run_tokens(self, step: int) -> int:
        """Tokens of every rank up to step `step` (those of a lost group's steps left out)."""
        gone = sum(self.down(self.elastic["kill"], u) for u in range(step + 1)) if self.elastic else 0
        return (self.world * (step + 1) - self.S * gone) * self.tokens_per_step

    def checkpoint(self, step: int) -> dict[int, int]:
        """A checkpoint after step `step` on every rank: its event, and the size of each rank's
        event file then (what a resume from it keeps, for resume())."""
        kept = {}
        for r, w in self.writers.items():
            w.emit_checkpoint(step, f"step-{step}", t=self.step_end(r, step))
            kept[r] = self.rd.event_file(r).stat().st_size
        self.saved[step] = (self.outer_wire, self.inner_wire, self.compute, list(self.evals))
        return kept

    def resume(self, step: int, kept: dict[int, int], crashed_at: int, gap_s: float = 5.0,
               slurm_restart: int | None = None) -> None:
        """A new attempt after the run died at step `crashed_at`: it resumes gap_s later from
        the checkpoint of step `step` (kept: what checkpoint() returned); emit_steps(step + 1,
        ...) goes on from there."""
        self.t_shift += self.step_end(0, crashed_at) - self.step_end(0, step) + gap_s
        self.attempt += 1
        self.outer_wire, self.inner_wire, self.compute, self.evals = self.saved[step]
        extra = {} if slurm_restart is None else {"slurm_restart": slurm_restart}
        for r, w in self.writers.items():
            w.emit_run("resume", self.world, "synthetic", t=self.step_end(r, step), step=step,
                       attempt=self.attempt, events_kept=kept[r], **extra)

    def tear(self, rank: int = 0) -> bytes:
        """Append half an event line to a rank's file, as a crash mid-write leaves it. Returns
        the rest of the line (append it to complete the event)."""
        line = (b'{"v":1,"t":%f,"rank":%d,"replica":%d,"kind":"eval","step":%d,'
                b'"val_loss":9.5}\n' % (self.step_end(rank, self.steps), rank, rank // self.S,
                                         self.steps))
        cut = len(line) // 2
        with open(self.rd.event_file(rank), "ab") as f:
            f.write(line[:cut])
        return line[cut:]

    def finish(self) -> dict:
        t_end = self.step_end(self.world - 1, self.steps - 1) + 0.05
        for w in self.writers.values():
            w.emit_run("end", self.world, "synthetic", t=t_end)
            w.close()
        tokens = self.run_tokens(self.steps - 1)
        wall = t_end - self.t_start
        summary = {"algorithm": self.config["algo"], "replicas": self.R, "shards": self.S,
                   "steps": self.steps, "tokens": tokens, "wall_s": wall,
                   "tokens_per_s": tokens / wall, "compute_s": self.compute,
                   "compute_utilization": self.compute / (wall * self.world),
                   "outer_wire_bytes": self.outer_wire, "inner_wire_bytes": self.inner_wire,
                   "peak_outer_payload_bytes": self.peak_payload,
                   "final_loss": sum(self.last_loss) / max(len(self.last_loss), 1),
                   "final_val_loss": self.last_val}
        if self.elastic:
            summary["elastic"] = {"groups_finished": list(range(self.R)),
                                  "restarts": {str(self.elastic["kill"]): 1}}
        if self.config["target_loss"]:
            summary["target"] = target(self.evals, self.config["target_loss"])
        save(self.rd, summary)
        return summary

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def make_run(root, *, finished: bool = True, restart: dict | None = None, **kwargs) -> RunDir:
    """A whole synthetic run in `root` (summary.json written when finished). restart: it dies
    after step `crash` and a new attempt resumes from the checkpoint of step `at` (with
    slurm_restart: as Slurm's requeue number `slurm_restart`)."""
    run = SyntheticRun(root, **kwargs)
    done = 0
    if restart is not None:
        at, crash = int(restart["at"]), int(restart["crash"])
        run.emit_steps(0, at + 1)
        kept = run.checkpoint(at)
        run.emit_steps(at + 1, crash + 1)
        run.resume(at, kept, crash, slurm_restart=restart.get("slurm_restart"))
        done = at + 1
    run.emit_steps(done, run.steps)
    if finished:
        run.finish()
    else:
        run.close()
    return run.rd
