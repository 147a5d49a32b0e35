"""A bounded wait at the syncs of diloco and streaming (--grace SECONDS, with --local-steps
adaptive): no replica holds the others at a sync beyond the grace window.

Each rank has a stand-in, a thread that takes part in every sync's exchange for it, in sync
order, on a process group of its own (Comm.side_group "outer:grace"). The training thread hands
its pseudo-gradient in when it reaches a sync; the stand-in sends it. A replica is *late* at
sync k when its training thread has not reached it SECONDS after the last replica that did: its
stand-in then takes part with weight 0 (the merge is by tokens), so the sync merges the others'
work, on time. Once late, the stand-in takes part with weight 0 in each later sync as soon as
the first replica reaches it (no second window), until its replica rejoins:

- the late replica's own work stays in its local weights. Every outer step it missed is applied
  to its copy of the outer state as every replica applies it (outer parameters and momentum
  stay the same everywhere), and its local fragment moves with the outer parameters (rebased:
  local += new outer - old outer), so its pseudo-gradient is the same vector; it merges at the
  fragment's next sync the replica reaches, weighed by all the tokens it trained since.
- when its training thread reaches its next sync (wherever it was stalled), it rejoins at the
  first sync it can still reach with the others, from the syncs' measured cadence (the times
  the first replica reached the last two), running as many steps as its speed allows until
  then: no heal, nothing trained is lost.

Who reached a sync when: a stand-in that decides (its replica's work, or weight 0) sends each
other stand-in one value (1 present, 0 absent) point to point, before the exchange; the others
learn the arrivals from them. The exchange carries each replica's measured step time and
whether it was present (the step-time gather of algorithms/pace.py), so every replica records
who was absent (`absent` in its sync events); the late one records a `late` event when its
stand-in gave up waiting and a `rejoin` event when it rejoins (the syncs it missed, its delay).
Checkpoints and evaluations happen where every replica met (the apply of a sync with nobody
absent): a late replica never reaches the run steps of the syncs it missed.
"""

from __future__ import annotations

import math
import threading
import time

import torch
import torch.distributed as dist

from lowband.algorithms.exchange import exchange_block
from lowband.params import flatten, write_flat
from lowband.units import parse_duration

GROUP = "outer:grace"
STOP = "stop"  # the run stopped before this sync (--stop-after): nobody takes part in it


class Met:
    """One sync's exchange through the stand-in: wait() gives the merged pseudo-gradient (a
    Weighted's); `sent`, `share` as Weighted's; `times` the gathered step times (an absent
    replica's -1), for Pace.decide; `absent` the replicas that sent nothing."""

    def __init__(self, k: int, grace: "Grace"):
        self.k, self.grace = k, grace
        self.avg = self.gathered = None
        self._ready = threading.Event()

    def _started(self) -> None:
        """Wait for the stand-in to start this exchange (its error, if it stopped instead)."""
        while not self._ready.wait(0.2):
            if self.grace.error is not None:
                raise RuntimeError(f"the --grace stand-in stopped before sync {self.k}: "
                                   f"{self.grace.error!r}") from self.grace.error

    def started(self, avg, gathered) -> None:
        self.avg, self.gathered = avg, gathered
        self._ready.set()

    def done(self) -> bool:
        return self._ready.is_set() and self.avg.done() and self.gathered.done()

    def wait(self) -> torch.Tensor:
        self._started()
        return self.avg.wait()

    @property
    def sent(self) -> torch.Tensor:
        self._started()
        return self.avg.sent

    @property
    def share(self) -> float | None:
        return None if self.avg is None else self.avg.share

    @property
    def absent(self) -> list[int]:
        return [r for r, t in enumerate(self.gathered.wait()) if not t[1]]

    @property
    def times(self) -> "Times":
        return Times(self)


class Times:
    """A sync's gathered step times as Pace.decide reads them: wait() gives each rank's as a
    one-value tensor, an absent replica's -1 (it keeps its count)."""

    def __init__(self, met: Met):
        self.met = met

    def wait(self) -> list[torch.Tensor]:
        return [t[:1] if t[1] else t.new_tensor([-1.0]) for t in self.met.gathered.wait()]


class Grace:
    """This rank's stand-in (module doc). The training thread calls reserve(k) at its sync k,
    then hand_in(k, ...); when reserve says no (the stand-in has decided k without it), it
    rejoins (rejoin) and applies the syncs it missed as they land (landed)."""

    def __init__(self, comm, seconds: float, total: int, period: int, sizes: list[int],
                 codec: str, block, exchange: str):
        """total: the run's syncs, `period` run steps apart; sizes: each fragment's values
        (sync k syncs fragment (k-1) mod P)."""
        self.comm, self.seconds, self.total, self.sizes = comm, seconds, total, sizes
        self.period = period
        self.codec, self.block, self.exchange = codec, block, exchange
        self.pg = comm.side_group("outer", "grace")  # at set-up: every rank alike
        self.me, self.n = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        self.cond = threading.Condition()
        self.decided = 0       # the last sync the stand-in took part in
        self.reserved = 0      # the training thread's sync being handed in: wait for it
        self.handed = {}       # k -> (pseudo-gradient, weight, step time, its Met)
        self.skip_until = 0    # syncs below it: weight 0 (a late replica until it rejoins)
        self.late_since = None  # (sync, time) the stand-in first gave up waiting
        self.first = {}        # k -> when the first replica reached sync k (the cadence)
        self.missed: list[Met] = []  # taken part in with weight 0, not yet applied
        self.finished = False
        self.last = total      # the last sync to take part in (close: where the run stopped)
        self.thread = None
        self.error = None      # why the stand-in stopped, for the training thread

    def start(self, after: int) -> None:
        """The stand-in starts with sync after + 1 (a resumed run's next)."""
        self.decided = self.reserved = after
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    # -- the training thread -------------------------------------------------------------------

    def reserve(self, k: int) -> bool:
        """Whether sync k is still this replica's to hand in (then the stand-in waits for it)."""
        with self.cond:
            if k <= self.decided:
                return False
            self.reserved = k
            return True

    def hand_in(self, k: int, x: torch.Tensor, weight: float, took: float) -> Met:
        met = Met(k, self)
        with self.cond:
            self.handed[k] = (x, weight, took, met)
            self.cond.notify_all()
        return met

    def rejoin(self, step_s: float, tau: int, period: int) -> tuple[int, int, float]:
        """Where a late replica rejoins: (the sync, its steps until then, seconds late). The
        first sync the stand-in has not decided, if the others' cadence leaves it at least
        tau + 1 steps of this replica's (step_s each) to reach it, else the one after."""
        with self.cond:
            target = self.decided + 1
            known = sorted(self.first)[-2:]
            steps = period
            if len(known) == 2 and step_s > 0:
                cadence = (self.first[known[1]] - self.first[known[0]]) / (known[1] - known[0])
                due = self.first[known[1]] + (target - known[1]) * cadence
                steps = math.floor((due - time.time()) / step_s + 0.5)
                while steps < tau + 1 and target <= self.total:
                    target, steps = target + 1, steps + max(round(cadence / step_s), 1)
            target = min(target, self.total + 1)  # past the last: this replica's run is over
            late = 0.0 if self.late_since is None else time.time() - self.late_since[1]
            self.skip_until, self.late_since = target, None
            self.cond.notify_all()
            return target, min(max(steps, tau + 1), period), late

    def landed(self, block: bool = False, before: int | None = None) -> list[Met]:
        """The syncs missed (before sync `before`) whose merges have landed (all of them,
        waiting, when `block`), in sync order, taken off the list."""
        out = []
        while True:
            with self.cond:
                if not self.missed or not (block or self.missed[0].done()) or \
                        before is not None and self.missed[0].k >= before:
                    return out
                met = self.missed.pop(0)
            met.wait()
            out.append(met)

    def close(self, last: int) -> list[Met]:
        """The run's end on this rank, at sync `last` (the run's last, or where --stop-after
        stopped every replica): the stand-in takes part in the syncs left up to it (weight 0)
        and stops; the merges it missed, landed."""
        with self.cond:
            self.finished, self.last = True, min(self.last, last)
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        return self.landed(block=True)

    # -- the stand-in --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # the training thread raises it where it waits (Met)
            self.error = e
            raise

    def _serve(self) -> None:
        k = self.decided + 1
        while k <= self.total:
            arrivals = self._listen(k)
            mine = self._decide(k, arrivals)
            self._tell(k, -1.0 if mine is STOP else float(mine is not None))
            if mine is STOP:  # (every stand-in stops at the same sync: its arrivals match)
                return
            self._exchange(k, mine)
            with self.cond:  # (the cadence reads the last two)
                self.first = {j: t for j, t in self.first.items() if j > k - 2}
            k += 1

    def _listen(self, k: int) -> dict:
        """Receive sync k's arrival from each other stand-in: src -> (when, present)."""
        arrivals = {}
        for src in range(self.n):
            if src != self.me:
                buf = torch.zeros(1)
                work = dist.irecv(buf, group_src=src, group=self.pg, tag=k)
                threading.Thread(target=self._arrived, args=(k, work, buf, src, arrivals),
                                 daemon=True).start()
        return arrivals

    def _arrived(self, k, work, buf, src, arrivals) -> None:
        work.wait()
        with self.cond:
            arrivals[src] = (time.time(), bool(buf[0] > 0))
            if buf[0] > 0:
                self.first.setdefault(k, arrivals[src][0])
            self.cond.notify_all()

    def _decide(self, k: int, arrivals: dict):
        """(x, weight, took, Met) handed in for sync k, or None: this replica is absent."""
        with self.cond:
            while True:
                if k > self.last:
                    return STOP
                if k in self.handed:
                    self.first[k] = min(self.first.get(k, math.inf), time.time())
                    self.decided = k
                    return self.handed.pop(k)
                present = [t for t, p in arrivals.values() if p]
                everyone = len(arrivals) == self.n - 1
                now = time.time()
                gone = self.finished and (present or everyone)
                behind = k < self.skip_until or self.late_since is not None
                if self.reserved != k and (gone or behind and (present or everyone)):
                    break
                if self.reserved != k and present and now >= max(present) + self.seconds:
                    self.late_since = (k, max(present))
                    self._late(k, now - max(present))
                    break
                self.cond.wait(0.005 if present else 0.05)
            self.decided = k
            return None

    def _late(self, k: int, waited: float) -> None:
        if self.comm.events is not None:
            self.comm.events.emit("late", step=k * self.period, sync=k, waited_s=waited,
                                  grace_s=self.seconds)

    def _tell(self, k: int, present: float) -> None:
        """Sync k's arrival to each other stand-in: 1 present, 0 absent, -1 stopped."""
        value = torch.tensor([present])
        for dst in range(self.n):
            if dst != self.me:
                self.comm.run("send", "outer", 2, 4,
                              lambda d=dst: dist.isend(value, group_dst=d, group=self.pg, tag=k),
                              value, "arrival", "fp32", value)

    def _exchange(self, k: int, mine) -> None:
        """Start sync k's exchange on the stand-in's group: this replica's pseudo-gradient and
        tokens (or zeros and 0), and [step time, present]."""
        fragment = (k - 1) % len(self.sizes)
        if mine is None:
            x = torch.zeros(self.sizes[fragment], device=self.comm.topo.device)
            weight, took, met = 0.0, 0.0, Met(k, self)
            with self.cond:
                self.missed.append(met)
        else:
            x, weight, took, met = mine
        tag = f"frag{fragment}"
        avg = self.comm.group_average(x, GROUP, self.codec, self.block, tag, self.exchange,
                                      weight)
        gathered = self.comm.all_gather(torch.tensor([took, float(mine is not None)],
                                                     dtype=torch.float64, device=x.device),
                                        GROUP, tag="pace")
        met.started(avg, gathered)


class Graced:
    """diloco's and streaming's side of the stand-in (`self.grace`; None without --grace),
    mixed in before Paced: the syncs a late replica missed, applied as they land, and where it
    rejoins."""
    grace: Grace | None = None

    def set_up_grace(self) -> None:
        c = self.config
        if getattr(c, "grace", ""):  # (a stand-in config of a test may not name it)
            self.grace = Grace(self.comm, parse_duration(c.grace), self.pace.total,
                               self.pace.period, [f.numel for f in self.fragments], c.codec,
                               exchange_block(c),
                               "all-gather" if c.exchange == "auto" else c.exchange)

    def catch_up(self, before: int | None = None, block: bool = False) -> None:
        """Apply the syncs this replica missed that have landed (before sync `before`, all of
        them when `block`), in sync order."""
        for met in self.grace.landed(block, before):
            self._rebase(met)

    @torch.no_grad()
    def _rebase(self, met: Met) -> None:
        """A sync this replica missed: the outer step every replica takes, and the local
        fragment moved with the outer parameters (module doc)."""
        f = self.fragments[(met.k - 1) % len(self.fragments)]
        delta = met.wait().to(self.topo.device)
        self.pace.decide(met.times, None)
        at = met.k * self.pace.period
        norm = self._norm(delta)
        if not math.isfinite(norm):  # as every replica does: the outer state stays
            self.staging.drop(f.outer, f.momentum)
            if self.comm.events is not None:
                self.comm.events.emit("skip", step=at, what="pseudo-gradient", fragment=f.index)
            return
        old = self.staging.get(f.outer).clone()
        new = self.outer_step(f, delta)
        write_flat(f.params, flatten(f.params) + (new - old))
        if self.comm.events is not None:
            self.comm.events.emit("sync", step=at, fragment=f.index, applied_step=at,
                                  pseudo_grad_norm=norm, weight=0.0, anomaly=False,
                                  outer_lr=self.config.outer_lr, absent=met.absent, missed=True)

    def rejoin(self, s: int) -> None:
        """This replica reached sync pace.started + 1 after its stand-in took part without it:
        it goes on towards the first sync it can reach with the others (Grace.rejoin)."""
        missed = self.pace.started + 1
        self.catch_up()
        target, steps, late = self.grace.rejoin(self.pace.took, self.config.overlap,
                                                self.pace.period)
        self.pace.rejoin(s, target, steps)
        if self.comm.events is not None:
            self.comm.events.emit("rejoin", step=min(target - 1, self.pace.total) *
                                  self.pace.period,
                                  missed=list(range(missed, target)), late_s=late, at_sync=target,
                                  steps=steps, carried_tokens=max(f.tokens for f in self.fragments))

    def met(self, avg: Met, applied: int, at: int) -> dict:
        """A sync applied after inner step `applied`, every replica's at run step `at`: the
        absent replicas for its event, and the run's meeting point when there were none."""
        absent = getattr(avg, "absent", [])  # (a Landed one, restored: every replica's)
        if not absent:
            self.pace.met_at = (applied, at)
        return {"absent": absent}
