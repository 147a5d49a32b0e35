"""Elastic replica groups on torchft: membership, quorum, the commit vote and healing.

With --elastic each replica group is a world of its own (its S ranks; its own local job,
torchrun or TorchX role) and the groups meet only through torchft: a Lighthouse (the quorum
service, started by the launcher) and, on every rank, a torchft `Manager` whose process group
joins the ranks of the same shard index in the groups of the current quorum, reconfigured at
each quorum. lowband writes no quorum, heartbeat or rendezvous protocol of its own.

One outer sync (diloco, streaming):
  begin(step)      Manager.start_quorum, synchronous: who takes part. A group behind the others
                   (restarted, or dropped from a quorum: it has trained less, _set_quorum_step)
                   receives the algorithm's state from a live peer here (weights only, from a
                   member: comm/membership/heal.py; `register`) and loads it: model, inner optimizer, the
                   algorithm's state_dict() (outer parameters and momentum...), the step. Its
                   time is a wait of the step, not compute.
  average(x, ...)  the mean over the groups that take part (by tokens, or 1 each); a group
                   healed in this quorum holds its source's state: weight 0
  commit()         Manager.should_commit: the vote, this group's own (torchft's vote joins a
                   group's ranks, not the groups). False (a peer died mid-exchange, too few
                   groups) leaves this group's outer state as it was: it skipped the update
                   that groups whose vote passed applied, so its next quorum step ranks below
                   theirs and it heals from one of them there (_set_quorum_step).
Every quorum change is a `membership` event (quorum id and size, who joined and left, heal
bytes and seconds, the heal's source) and every quorum a `quorum` event of the group's first
rank (the members and, from the Lighthouse's heartbeats, the groups alive: participation beside
liveness). A Lighthouse that dies is started again by the launcher: torchft asks it again every
RETRY_S within --quorum-timeout, and LighthouseLives keeps the new one's quorum ids apart from the
old one's. A group's quorum step carries a tiebreak (_set_quorum_step) so that groups as far on
with different outer states (quorums of their own while a restarted Lighthouse had not seen
the others) heal one from the other, and a group whose commit vote failed heals from one whose
vote passed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from lowband.comm.membership.bind import bind_gloo, bind_host, bound_manager_server, url_host
from lowband.comm.membership.fixed import FixedMembership
from lowband.comm.membership.lives import LIFE, LighthouseLives, alive_groups
from lowband.options import (LIFE_ENV, LIGHTHOUSE_ENV, REPLICA_ENV, ConfigError, Options,
                             UserError, needs_extra, option)

RETRY_S = 0.5  # while the Lighthouse is unreachable, torchft asks it again this often
TIEBREAK = 1 << 20  # a group's quorum step: its progress's number (below) x TIEBREAK + tiebreak
TORCHFT = ("elastic", "--elastic", "torchft")  # needs_extra's (extra, what, module)


def quiet_rust() -> None:
    """torchft's Rust side logs every quorum at info: warnings only, unless RUST_LOG says."""
    os.environ.setdefault("RUST_LOG", "warn")


@dataclass
class ElasticOptions(Options):
    title = "elastic replica groups (torchft)"
    # its help ends with the algorithms whose class says `elastic` (lowband.config adds them)
    elastic: bool = option(False, "each replica group a world of its own, joined through a "
                           "torchft Lighthouse: a lost group does not stop the others, and a "
                           "restarted one heals from a live peer")
    min_replicas: int = option(1, "smallest quorum of replica groups an outer update commits with")
    quorum_timeout: float = option(600.0, "seconds a group waits for a quorum (longer than the "
                                   "time between syncs)")
    elastic_timeout: float = option(120.0, "seconds an outer exchange or a heal may take before "
                                    "the peer is counted as lost; a quorum waits half as long "
                                    "(at most half the quorum timeout) for a late group")
    max_restarts: int = option(3, "times the launcher restarts a replica group that died")
    heartbeat_timeout: float = option(5.0, "seconds without a group's heartbeats before the "
                                      "Lighthouse leaves it out: how long the others hold a "
                                      "quorum for a killed group to come back (torchft's 5 s)")

    @classmethod
    def check(cls, cfg) -> None:
        if not cfg.elastic:
            return
        if not 1 <= cfg.min_replicas <= cfg.replicas:
            raise ConfigError(f"--min-replicas {cfg.min_replicas} must lie in 1..{cfg.replicas} "
                              f"(the replica groups of the run).")
        for name in ("quorum_timeout", "elastic_timeout", "heartbeat_timeout"):
            if not getattr(cfg, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive seconds.")
        if cfg.max_restarts < 0:
            raise ConfigError("--max-restarts must be zero or positive.")


def join_timeout_s(cfg) -> float:
    """How long the Lighthouse holds a quorum for a group that heartbeats but has not asked yet
    (a slow group, a restarted one still loading): half the shorter of --quorum-timeout and
    --elastic-timeout (60 s by default; torchft's usual 10 s left such a group out). torchft
    forms a quorum at once when every member of the last one asks (its fast quorum), so a group
    once left out met the others only to heal from them, or formed quorums of its own: out of
    phase for good (docs/elastic.md, participation). A dead group drops out when its heartbeats
    stop (the Lighthouse's heartbeat timeout: --heartbeat-timeout, 5 s); a live one stuck in an
    exchange with a lost peer (up to --elastic-timeout) costs the others at most half of that,
    once, and the others go on before their own quorum timeout."""
    return min(cfg.quorum_timeout, cfg.elastic_timeout) / 2


class ElasticStopped(UserError, RuntimeError):
    """An elastic group cannot go on (no Lighthouse, no quorum); the message is one sentence."""
    code, label = 3, ""


def replica_of_env() -> int | None:
    value = os.environ.get(REPLICA_ENV)
    return None if value is None else int(value)


def membership(topo, cfg, comm):
    """The run's membership (Comm.membership): torchft's with --elastic, else the fixed one of
    a plain run (fixed.py). Both offer an algorithm the same methods."""
    if cfg.elastic:
        return Membership(topo, cfg, comm)
    return FixedMembership(topo)


class Membership:
    """This rank's torchft Manager and the process group it reconfigures (see module doc); the
    methods are those of fixed.py's FixedMembership, which a plain run has instead."""

    elastic = True

    def __init__(self, topo, cfg, comm):
        quiet_rust()
        logging.getLogger("torchft").setLevel(logging.ERROR)  # and its Python side warns of NCCL
        needs_extra(*TORCHFT)
        from torchft.manager import Manager

        from lowband.comm.membership import secret
        from lowband.comm.membership.heal import HealTransport, MembersGloo, quiet_refusals

        bind_gloo()  # torchft's gloo group binds bind_host()'s interface, as the world's does

        lighthouse = os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ConfigError(f"--elastic needs a Lighthouse: run it through `lowband train "
                              f"--elastic` or `lowband launch --elastic`, or set {LIGHTHOUSE_ENV}.")
        key = secret.required("--elastic")
        self.topo, self.comm, self.events = topo, comm, comm.events
        timeout = timedelta(seconds=cfg.elastic_timeout)
        quiet_refusals()
        self.pg = MembersGloo(key, self._quorum, timeout)
        self._heal = None  # (bytes, seconds, step, sender) of the state received in the last quorum
        host = bind_host()
        with bound_manager_server(host):
            self.manager = Manager(
                pg=self.pg, load_state_dict=None, state_dict=None, hostname=url_host(host),
                min_replica_size=cfg.min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout), connect_timeout=timeout,
                quorum_retries=max(1, int(cfg.quorum_timeout / RETRY_S)), rank=topo.shard,
                world_size=topo.shards, store_addr=os.environ["MASTER_ADDR"],
                store_port=int(os.environ["MASTER_PORT"]), lighthouse_addr=lighthouse,
                replica_id=secret.replica_id(key, topo.replica), init_sync=False,
                checkpoint_transport=HealTransport(key, topo.replica, timeout, self._quorum))
        self.manager._client = LighthouseLives(self.manager._client, os.environ.get(LIFE_ENV))
        self.life = 0  # the Lighthouse's life of this group's last quorum
        self.members: tuple[int, ...] = ()
        self.quorum_id = -1
        self.at = 0  # the inner step of the quorum this group is in (begin's)
        self.healed_now = self.peer_in_sync = self._joining = False
        self._progress, self._tiebreak = (lambda step: step), (lambda: 0)  # the algorithm's
        self._skipped = False  # this group's last commit vote failed (commit; the next quorum reads it)

    def register(self, algo) -> None:
        """What a live group hands a joining one (the trainer registers its algorithm once):
        the algorithm's heal_state() (algorithms/base.py), the step of the quorum, which the
        joining group's trainer goes on from (healed_step), and whether the sender was in a
        sync (in_sync) or in its first quorum (join)."""

        def load(state):
            t0 = time.perf_counter()
            algo.load_heal_state(state["algorithm"])
            algo.healed_step, self.peer_in_sync = state["step"], state["in_sync"]
            self._heal = (_nbytes(state), time.perf_counter() - t0, state["step"], state["replica"])

        self._progress = algo.quorum_progress
        if self.topo.shards == 1:  # (a rank's record covers its slice: its group's would differ)
            self._tiebreak = algo.quorum_tiebreak
        self.manager.register_state_dict_fn("lowband", load, lambda: {
            "algorithm": algo.heal_state(), "step": self.at, "in_sync": not self._joining,
            "replica": self.topo.replica})

    def hand_over(self, name: str, load, save) -> None:
        """More state a heal carries (a lowband.Sync user's objects): save() on the live group,
        load(what it saved) on the joining one."""
        self.manager.register_state_dict_fn(name, load, save)

    def join(self, step: int) -> bool:
        """The first quorum, before the first step (`step` done: 0, or a checkpoint's). True
        when this group healed into a sync the others are in: it must take part in that sync.
        Otherwise every group is in its first quorum (a fresh start or a resume): they meet in
        a barrier, so a group behind has its state before the senders vote, and commit."""
        self._joining = True
        healed = self.begin(step)
        self._joining = False
        if healed and self.peer_in_sync:
            return True
        self.barrier()
        self.commit()
        return False

    def begin(self, step: int) -> bool:
        """A quorum for the sync after inner step `step`. True when this group was healed in it
        (its state is now a live peer's, the step included)."""
        from lowband.comm.membership import heal

        t0 = time.perf_counter()
        self._heal, self.at = None, step
        self._set_quorum_step(step)
        try:
            self.manager.start_quorum()
        except Exception as e:  # the Lighthouse is gone, or no quorum within --quorum-timeout
            why = re.search(r'message: "([^"]*)"', str(e)) or re.match(r"(.*)", str(e).strip())
            why = why.group(1)[:200] or type(e).__name__
            raise ElasticStopped(f"replica group {self.topo.replica} got no quorum at step {step} "
                                 f"({why}): the Lighthouse at {os.environ.get(LIGHTHOUSE_ENV)} is "
                                 "gone or too few groups are alive, so this group stops; start "
                                 "the run again.") from None
        self.healed_now = self._heal is not None
        refused = heal.refusal(self.manager)  # (said on stderr; the state stays as it was)
        if refused:  # behind the others, not healed: its sync would meet theirs with another
            # step's bytes (a peer's gloo ends its process on the size mismatch), so it takes
            # no part, and their exchange fails at once (every vote with it: a skipped sync)
            self.pg.abort(errored=False)
        self._skipped = False  # read by this quorum: healed, or no group was further on
        members, quorum = self._members(), getattr(self.manager, "_quorum_id", -1)
        # the groups alive beside those that took part: the group's first rank asks (every
        # quorum); its time is part of the quorum's wait
        alive = {"alive": alive_groups(members)} if self.topo.shard == 0 else {}
        waited = time.perf_counter() - t0
        answered = self.manager._client.quorum_s  # the Lighthouse's answer, part of wait_s
        if not self._joining:  # inside a step: a wait, not compute (the trainer subtracts it)
            self.comm.wait_s += waited
        at = self._heal[2] if self.healed_now else step  # a healed group: its state's step
        if alive:
            self.events.emit("quorum", step=at, quorum_id=quorum, members=list(members),
                             healed=self.healed_now, wait_s=waited, quorum_s=answered, **alive,
                             **refused)
        if quorum != self.quorum_id:  # a new quorum: somebody left, joined or was replaced
            joined = sorted(set(members) - set(self.members)) if self.members else list(members)
            extra = {}
            if self.healed_now:  # this group: restarted or behind, now a live peer's copy
                extra = {"heal_bytes": self._heal[0], "heal_s": self._heal[1],
                         "heal_from": self._heal[3], "step_before": step}
            life = quorum // LIFE
            if self.members and life != self.life:  # it rode out the Lighthouse's restart
                extra["lighthouse_restarted"] = True
            self.events.emit("membership", step=at, quorum_id=quorum, size=len(members),
                             members=list(members), joined=joined,
                             left=sorted(set(self.members) - set(members)),
                             healed=self.healed_now, wait_s=waited, quorum_s=answered, **alive,
                             **extra)
            self.members, self.quorum_id, self.life = members, quorum, life
        return self.healed_now

    def sync_fields(self, outer: torch.Tensor) -> dict:
        """What an elastic run's `sync` event adds: the quorum it committed in and a digest of
        this rank's new outer parameters (the first 16 hex digits of their bytes' sha256), so
        that the members' states can be compared after every sync."""
        data = outer.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        return {"quorum_id": self.quorum_id, "outer_digest": hashlib.sha256(data).hexdigest()[:16]}

    def heal_fields(self, fields: dict) -> dict:
        """What an algorithm's state keeps for heals and quorum tiebreaks: `fields` (streaming's
        lineage of outer digests)."""
        return fields

    def over_groups(self, combine, value):
        """What an algorithm does across the replica groups, each a world of its own here
        (ddp's mean gradient, edit's sync rows): combine(value), through this membership."""
        return combine(value)

    def _set_quorum_step(self, step: int) -> None:
        """The step this group brings to the quorum, from which torchft heals: every group whose
        step is below the quorum's highest receives the state of a group at the highest. It is
        what the group has trained (quorum_progress: the inner step, adaptive steps' run step;
        restored from a checkpoint by a restarted group), twice, plus one in a sync: a group in
        its first quorum (fresh, or restored) at the same progress as groups in a sync heals
        from them; a fresh group never hands its state to one that trained. torchft's count of
        commits would not do: a restored group's equals that of the groups that trained on
        since its checkpoint and have not synced yet. Then, at the same
        progress, a group whose last commit vote failed ranks below one whose vote passed: it
        skipped an update the other applied, so it heals from it (every algorithm, any S; when
        every group's vote failed they stay equal). Below that, the algorithm's quorum_tiebreak
        (S=1): groups as far on whose synced states differ otherwise (two quorums of their own
        while a restarted Lighthouse had not seen the others) heal the one from the other."""
        progress = int(self._progress(step))
        order = 2 * (2 * progress + (0 if self._joining else 1)) + (0 if self._skipped else 1)
        mine = order * TIEBREAK + self._tiebreak() % TIEBREAK
        self.manager.load_state_dict({"step": mine,
                                      "batches_committed": self.manager.batches_committed()})

    def _quorum(self) -> tuple[int, list[str]]:
        """The id and the replica ids of this group's last quorum (comm/membership/heal.py checks them)."""
        last = self.manager._client.last
        return last.quorum_id, list(last.replica_ids)

    def _size(self) -> int:
        """The quorum's groups; 1 where its process group was not formed (a refused quorum)."""
        return self.pg._pg.size() if self.pg._pg is not None else 1

    def _members(self) -> tuple[int, ...]:
        """The replica groups of the current quorum (torchft numbers a group's rank k in it as
        replica x S + k: the trailing digits of our replica ids)."""
        ranks = getattr(self.pg, "_global_ranks", None)
        if not ranks:
            return tuple(range(self.manager.num_participants()))
        return tuple(sorted({r // self.topo.shards for r in ranks}))

    def average(self, comm, x: torch.Tensor, codec: str, block: int, tag: str,
                healed_counts: bool = False, exchange: str = "auto",
                weight: float | None = None):
        """A Weighted (comm/exchanges.py) averaging the flat fp32 tensor x over the groups of
        this quorum, each with its weight (--merge-weights tokens: its tokens, else 1), 0 for a
        group healed in this quorum (its x is a copy of its source's) unless `healed_counts`
        (ddp: it healed before computing x); wait() gives the mean. A failed exchange's error goes to the Manager,
        never up: commit() says False. `exchange` does not apply here."""
        from lowband.comm.exchanges import Weighted, encoded

        w = 0.0 if self.healed_now and not healed_counts else \
            (1.0 if weight is None else float(weight))
        share = None if weight is None else w  # (tokens: its share goes in the sync events)
        if codec == "fp32":
            t = torch.cat([x * w, x.new_tensor([w])])
            return Weighted(self.all_reduce(comm, t, tag), x, weight=share)
        payload, sent = encoded(x, codec, block)
        size, tail = (1, payload.new_tensor([int(w)])) if weight is None else \
            (4, torch.tensor([w], dtype=torch.float32).view(torch.uint8))  # 0/1, or tokens
        payload = torch.cat([payload, tail.to(payload.device)])
        return Weighted(self.all_gather(comm, payload, tag, codec), sent, weight=share,
                        decoding=(x.numel(), codec, block, size))

    def all_reduce(self, comm, t: torch.Tensor, tag: str):
        """The sum of t over the groups of the quorum (in place), through lowband's Comm."""
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return comm.run("all_reduce", "outer", self._size(), t.numel() * t.element_size(),
                        lambda: self._reported(lambda: self.pg.allreduce([t], opts)),
                        t, tag, "fp32", t)

    def all_gather(self, comm, t: torch.Tensor, tag: str, codec: str = "fp32"):
        """Every group's t, in the order of their ranks in the quorum (`position`)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        n = self._size()
        outs = [torch.empty_like(t) for _ in range(n)] if n > 1 else [t]
        return comm.run("all_gather", "outer", n, t.numel() * t.element_size(),
                        lambda: self._reported(lambda: self.pg.allgather([outs], [t],
                                                                         AllgatherOptions())),
                        outs, tag, codec, t)

    def position(self) -> int:
        """This group's index among the groups of the quorum (their order in all_gather): the
        rank torchft configured the wrapped group with (the wrapper's own rank() is the one it
        was built with)."""
        return self.pg._pg.rank() if self.pg._pg is not None else 0

    def failed(self) -> bool:
        """Whether an exchange of this quorum failed (the commit vote will say False)."""
        return self.manager.errored() is not None

    def barrier(self) -> None:
        """A one-value collective over the quorum. torchft serves a healing group the state
        only until the sender's commit vote, so groups that exchange nothing in a quorum
        (the first) meet here first: the healing one arrives once it has loaded the state."""
        from torch.distributed.distributed_c10d import AllreduceOptions

        self._reported(lambda: self.pg.allreduce([torch.zeros(1)], AllreduceOptions())).wait()

    def _reported(self, launch) -> "Reported":
        try:
            return Reported(launch(), self.manager)
        except Exception as e:  # the group is already broken: the vote will fail
            self.manager.report_error(e)
            return Reported(None, self.manager)

    def commit(self) -> bool:
        ok = self.manager.should_commit()
        self._skipped = not ok  # behind any group whose vote passed: it heals from one (_set_quorum_step)
        if not ok and self.failed():
            # a peer died mid-exchange: drop this quorum's process group now, so a live group
            # still waiting in the exchange on this one gets its error at once, not after
            # --elastic-timeout (the next quorum's reconfiguration would drop it only then,
            # and that quorum waits for the stuck group: join_timeout_s)
            self.pg.abort(errored=False)
        return ok

    def step(self) -> int:
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _nbytes(state) -> int:
    """Bytes of the tensors in a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def lineage_tiebreak(digests: list[str]) -> int:
    """A quorum tiebreak (algorithms/base.py) from the digests of a state's parts."""
    return int(hashlib.sha256("|".join(digests).encode()).hexdigest()[:5], 16)


class Reported:
    """A torchft collective whose failure goes to the Manager (the commit vote then fails)
    instead of up the training thread."""

    def __init__(self, work, manager):
        self.work, self.manager = work, manager

    def get_future(self):
        out = torch.futures.Future()
        if self.work is None:
            out.set_result(None)
            return out

        def landed(fut):
            try:
                fut.value()
            except Exception as e:
                self.manager.report_error(e)
            out.set_result(None)

        self.work.get_future().add_done_callback(landed)
        return out

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except Exception as e:
            self.manager.report_error(e)
