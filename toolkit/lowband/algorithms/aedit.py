"""aedit (A-EDiT): edit (edit.py) with syncs triggered by wall-clock time instead of a step count.

Windows. After the warm-up every replica trains as fast as it can. A window starts when a sync
was agreed and lasts --sync-seconds (less where --time-budget ends sooner). Before each step the
replica's rank with shard index 0 decides whether the replica enters the next sync now, and
tells its inner group (a broadcast of two numbers over the fast link, so the S ranks agree on
the same step). It enters when the window ends nearer this step boundary than the next one
(elapsed + half its usual step time >= window, an EWMA of its step times), or when it has done
its quota of the step budget (below). A replica that entered waits in the prepare all-gather
for the others, so a fast replica waits at most until a slow one's step boundary nearest its
window's end, never for it to reach a step number. No clocks need to agree: each replica
measures its own window from the moment the last sync was agreed.

The step budget (R x --steps inner steps over all replicas). The all-gather carries every
replica's steps since the last sync and its elapsed time, so every rank computes the same: the
penalty (edit_plan.py; lowband's on per-step norms), the total of inner steps done, whether the run is
over, and each replica's quota: what is left of the budget split in proportion to the
replicas' steps in the last window (`split`; evenly for the first window). A replica that has
done its quota enters the next sync at once. So the replicas' steps never add up to more than
the budget, and the sync at which they reach it (every quota done) is the last: it is applied
at once and the trainer's loop stops (`should_stop`). A window that ends by time first is an
ordinary sync, after which what is left is split again. With --time-budget the run also ends at
the first sync at which that much training time has passed on some replica (the trainer's clock,
clock.py: evaluations not counted; the replicas share no step boundary, so aedit, not the
trainer, keeps the budget, at its syncs).

--aedit-min-new-steps N (atorch's min_total_global_steps; 0, off, by default): a sync at which
the replicas together did fewer than N steps since the last applied one is called off after
the all-gather (nothing decided, exchanged or applied), unless it would end the run. Each
replica's window restarts; its steps since the last sync and its quota stay, so the budget
holds: a replica that entered by time trains on, one whose quota is done enters the next try at
once (without a step) and waits there. The next applied sync's events say how many were called
off (`skipped`). With --edit-penalty reference the all-gather also carries each replica's steps
since the start, for atorch's step shares.

The learning rate follows the schedule at the run's global progress: (total at the last sync)/R
plus this replica's steps since, scaled by its share of the last window's steps; with
--time-budget also at the budget's elapsed fraction on this replica (its shard 0's clock), so a
time-bound run decays in time (schedule.lr_at).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lowband.algorithms.edit import EDiT, EditOptions
from lowband.algorithms.edit_units import sync_schedule
from lowband.algorithms.exchange import ExchangeOptions
from lowband.algorithms.guard import GuardOptions
from lowband.algorithms.outer import OuterOptions
from lowband.options import (ConfigError, Options, flag, non_negative, option, positive, require,
                             unit_interval)
from lowband.schedule import lr_at


@dataclass
class AEditOptions(Options):
    title = "aedit timing"
    sync_seconds: float = option(5.0, "seconds of training between two syncs")
    edit_step_weights: bool = option(True, "also weigh replicas by their share of the steps "
                                     "since the last sync")
    edit_step_weight_ratio: float = option(0.5, "--edit-penalty reference: a weight is (1 - r) w "
                                           "+ r x the replica's share of all steps since the "
                                           "start (atorch's step_weight_ratio)")
    aedit_min_new_steps: int = option(0, "call a sync off, and restart its window, when all "
                                      "replicas together did fewer steps since the last one; "
                                      "never the run's last (0: off; atorch's "
                                      "min_total_global_steps, 100)")

    @classmethod
    def check(cls, cfg) -> None:
        require(cfg, ("sync_seconds",), positive, "positive")
        require(cfg, ("aedit_min_new_steps",), non_negative, "zero or positive")
        require(cfg, ("edit_step_weight_ratio",), unit_interval, "between 0 and 1")
        if cfg.edit_step_weight_ratio != 0.5 and cfg.edit_penalty != "reference":
            raise ConfigError("--edit-step-weight-ratio mixes atorch's step weights, which only "
                              "--edit-penalty reference has: add it or remove the ratio.")
        if getattr(cfg, "elastic", False) and cfg.aedit_min_new_steps:
            raise ConfigError("--aedit-min-new-steps calls syncs off, which --elastic's quorums "
                              "do not follow: remove one of them.")
        for name in ("checkpoint_every", "stop_after"):
            if getattr(cfg, name, 0):
                raise ConfigError(f"aedit replicas run different numbers of steps, so there is no "
                                  f"common step for {flag(name)}: remove it.")


def split(total: int, weights: list[int]) -> list[int]:
    """`total` steps split in proportion to positive whole `weights`: whole numbers adding up to
    `total`, what rounding down leaves going one each to the largest remainders (ties: the
    lower replica). Integer arithmetic, so every rank gets the same."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


class AEDiT(EDiT):
    name = "aedit"
    own_loop_why = ("it shards the model as edit does, and its replicas sync by wall-clock time and "
                    "decide the run's end among themselves, which your loop's length cannot follow")
    options = (OuterOptions, ExchangeOptions, EditOptions, AEditOptions, GuardOptions)
    summary = "A-EDiT: edit with syncs every --sync-seconds of wall-clock time"
    timed = True

    @classmethod
    def outer_link(cls, run):
        """edit's sync every --sync-seconds: every round(sync_seconds / step time) steps (a
        window ends at the step boundary nearest its end; the stall inside a window is left
        out), its prepare carrying two more numbers (steps and elapsed time)."""
        every = max(1, round(run.sync_seconds / run.step_time))
        return sync_schedule(run, every, extras=2)

    def setup(self, model, blocks, make_optimizer, topology, comm, config):
        optimizer = super().setup(model, blocks, make_optimizer, topology, comm, config)
        self.t0 = None             # this replica's clock starts at its first step
        self.window_start = None   # when the current window began (this replica's clock)
        self.window_len = config.sync_seconds
        self.window_steps = 0      # this replica's steps since the last sync
        self.quota = 0             # this replica's share of the budget left at the last sync
        self.step_s = 0.0          # this replica's step time (EWMA), for the nearest boundary
        self.last_boundary = None
        self.elapsed = 0.0         # the replica's training seconds, as its shard 0 saw them
        self.fraction = None       # --time-budget: the part of it spent, as before_forward read it
        self.total = 0             # inner steps of all replicas, as of the last sync
        self.share = 1 / topology.replicas  # this replica's share of the last window's steps
        self.position = 0.0        # the learning-rate schedule's step of the current step
        self.stopped = False
        self.skipped = 0           # syncs called off (--aedit-min-new-steps) since the last one
        self.rejoining = False     # --elastic: healed into the others' sync in the first quorum
        return optimizer

    def should_stop(self, step: int) -> bool:
        """Consulted by the trainer before each step: agrees on syncs by time or quota and ends
        the run after the sync at which the step or time budget ran out."""
        c, R = self.config, self.topo.replicas
        if self.stopped:
            return True
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        if self.last_boundary is not None:
            gap = now - self.last_boundary
            self.step_s = gap if self.step_s == 0 else 0.7 * self.step_s + 0.3 * gap
        self.last_boundary = now
        self.elapsed = self._elapsed(now)
        if step < c.warmup_sync_steps:
            return False
        if self.window_start is None:  # the warm-up is over: the first window starts
            self._anchor(step)
            if not self.rejoining:  # (a group that healed has the run's total from its peer)
                self.total = c.warmup_sync_steps * R
            self._open_window([1] * R, self._elapsed(now), now, self.topo.replica)
        # the step boundary nearest the window's end: a slow replica may enter up to half a step
        # early, so a fast one waits about half as long for it
        due = (now - self.window_start + 0.5 * self.step_s >= self.window_len
               or self.window_steps >= self.quota or self.rejoining)
        if self.topo.shards > 1:  # the replica's shard 0 decides for its inner group
            flag = torch.tensor([float(due), self.elapsed], dtype=torch.float64, device=self.device)
            flag = self.comm.broadcast(flag, src=0, group="inner", tag="clock").wait().tolist()
            due, self.elapsed = bool(flag[0]), flag[1]
        if not due:
            return False
        if not self.rejoining:
            self._quorum_at = step
            self.membership.begin(step)  # the groups' rendezvous; a group behind heals here
        self.rejoining = False
        self._reshard()
        while True:
            extra = [float(self.window_steps), self._elapsed(now)]
            if self.penalty.mode == "reference":
                extra.append(float(step))  # steps since the start: atorch's step shares
            extras = self._prepare(step, extra, skip=self._too_few_new_steps)
            if extras is not None:
                break
            self.skipped += 1  # called off: the window restarts, the steps go on counting
            now = time.monotonic()
            self._restart_window(self._elapsed(now), now)
            if self.window_steps < self.quota:
                return False  # (a replica whose quota is done waits in the next sync at once)
        steps = [int(e[0]) for e in extras]
        total = self.total + sum(steps)
        elapsed = max(e[1] for e in extras)
        self.sync_info.update(window=self.syncs, replica_steps=steps, total_steps=total)
        if c.aedit_min_new_steps:
            self.sync_info["skipped"], self.skipped = self.skipped, 0
        if sum(steps) > 0 and self.me is not None:
            self.share = steps[self.me] / sum(steps)
        self.total = total
        if self._ends(total, elapsed):
            self._drain()  # the last sync lands at once, and the loop ends
            self.stopped = True
            return True
        # over the quorum's groups (every replica in a plain run); a healed one gets the mean
        weights = [max(s, 1) for s in steps]
        mean = max(sum(weights) // len(weights), 1)
        members = iter(weights)
        weights = [mean if h else next(members) for h in self.healed_in_quorum]
        self._open_window(weights, elapsed, time.monotonic(), self.membership.position())
        return False

    def _ends(self, total: int, elapsed: float) -> bool:
        """Whether a sync with `total` steps done and `elapsed` seconds passed is the run's last."""
        c = self.config
        return total >= c.steps * self.topo.replicas or bool(c.time_budget and elapsed >= c.time_budget)

    def _too_few_new_steps(self, extras: list[list[float]]) -> bool:
        """atorch's min_total_global_steps: all replicas together did fewer than
        --aedit-min-new-steps steps since the last sync, and this one would not end the run."""
        new = sum(int(e[0]) for e in extras)
        return (new < self.config.aedit_min_new_steps
                and not self._ends(self.total + new, max(e[1] for e in extras)))

    def _open_window(self, weights: list[int], elapsed: float, now: float, me: int) -> None:
        """A window (`_restart_window`), and this replica's quota: its part (`me` in `weights`)
        of the steps left, split by `weights`."""
        self._restart_window(elapsed, now)
        self.quota = split(self.config.steps * self.topo.replicas - self.total, weights)[me]
        self.window_steps = 0

    def _restart_window(self, elapsed: float, now: float) -> None:
        """The window's clock from `now`: --sync-seconds, or what is left of --time-budget."""
        c = self.config
        length = c.sync_seconds
        if c.time_budget:
            length = min(length, c.time_budget - elapsed)
        self.window_len, self.window_start = max(length, 0.0), now

    # --elastic: a joining group takes the run's progress too (state_dict's), and enters the
    # sync at once
    def join(self, step):
        super().join(step)
        self.rejoining = self.healed_step is not None

    def quorum_progress(self, step):
        return self.total  # the run's steps at the last sync (a group's own step counts differ)

    def _progress(self, step: int) -> float:
        """The run's global progress in steps of --steps, `step` steps of this replica's done:
        the step number during the warm-up syncs, then all replicas' steps (this one's window
        scaled by its share)."""
        c = self.config
        if step < c.warmup_sync_steps:
            return step
        R = self.topo.replicas
        return self.total / R + self.window_steps / (R * self.share if self.share > 0 else 1)

    def _elapsed(self, now: float) -> float:
        """This rank's training seconds: the trainer's clock (clock.py), or outside the trainer
        the seconds since the replica's first step."""
        return self.clock.seconds() if self.clock is not None else now - self.t0

    def lr(self, step: int) -> float:
        """The schedule at the run's global progress and the budget's elapsed fraction, as
        before_forward read them."""
        return lr_at(self.config, self.position, self.fraction)

    def lr_step(self, step: int) -> float:
        return self.position  # as before_forward read it (the window's count moves after)

    def progress_steps(self, step: int) -> float:
        return self._progress(step + 1)

    def before_forward(self, step):
        super().before_forward(step)
        c = self.config
        self.position = self._progress(step)  # the step number during the warm-up syncs
        # --time-budget: the part spent, as the replica's shard 0 told its inner group (after the
        # warm-up syncs; during them the schedule follows the step, as on every rank alike)
        timed = c.time_budget and step >= c.warmup_sync_steps
        self.fraction = self.elapsed / c.time_budget if timed else None
        for g in self.optimizer.param_groups:  # the schedule at the run's global progress
            g["lr"] = self.lr(step)

    def after_step(self, step):
        super().after_step(step)
        self.window_steps += 1

    def finish(self):
        if self.plan is not None:
            self._drain()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "aedit": {
            "window_steps": self.window_steps, "quota": self.quota, "total": self.total,
            "share": self.share, "stopped": self.stopped, "window_len": self.window_len,
            "step_s": self.step_s, "skipped": self.skipped,
            "window_elapsed": None if self.window_start is None else time.monotonic() - self.window_start,
            "elapsed": None if self.t0 is None else time.monotonic() - self.t0}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        a, now = state["aedit"], time.monotonic()
        self.window_steps, self.quota = a["window_steps"], a["quota"]
        self.total, self.share = a["total"], a["share"]
        self.stopped, self.window_len = a["stopped"], a["window_len"]
        self.skipped = a.get("skipped", 0)
        self.window_start = None if a["window_elapsed"] is None else now - a["window_elapsed"]
        self.t0 = None if a["elapsed"] is None else now - a["elapsed"]
        self.elapsed, self.step_s, self.last_boundary = a["elapsed"] or 0.0, a["step_s"], None
