"""The membership of a plain run: every replica group, always, in one world.

A run always has a membership (Comm.membership), so that an algorithm calls it without asking
whether the run is elastic: this one, or with --elastic torchft's (elastic.py's Membership),
which offers the same methods. Here nobody joins, leaves or heals: a quorum is everyone, every
vote commits, an average is Comm's own exchange over the outer group, and the events and the
state gain no membership fields, so a plain run computes and writes what it did before there
was a membership to ask.
"""

from __future__ import annotations

import torch


class FixedMembership:
    """The replica groups of a plain run: all R of them, each a part of one world."""

    elastic = False  # torchft's Membership says True
    healed_now = False  # nobody heals: no quorum hands a group a peer's state

    def __init__(self, topo):
        self.topo = topo
        self.members: tuple[int, ...] = tuple(range(topo.replicas))

    def register(self, algo) -> None:
        """Nothing to hand over: no group joins from another's state."""

    def hand_over(self, name: str, load, save) -> None:
        """Nothing to hand over (elastic: more state a heal carries, under `name`)."""

    def join(self, step: int) -> bool:
        """The first quorum: every group is in it from the start, none healed into a sync."""
        return False

    def begin(self, step: int) -> bool:
        """A sync's quorum: the same groups as ever, none behind."""
        return False

    def commit(self) -> bool:
        """The commit vote: every exchange of a fixed world lands, so every update commits."""
        return True

    def failed(self) -> bool:
        return False

    def position(self) -> int:
        """This group's index among the groups: its replica, its rank in the outer group."""
        return self.topo.replica

    def sync_fields(self, outer: torch.Tensor) -> dict:
        """A `sync` event adds nothing: there are no quorums to tell apart."""
        return {}

    def heal_fields(self, fields: dict) -> dict:
        """An algorithm's state keeps nothing for heals (elastic: `fields`)."""
        return {}

    def over_groups(self, combine, value):
        """What an algorithm does across replica groups that are worlds of their own (elastic:
        combine(value)): here the world holds every group, so `value` stands as it is."""
        return value

    def average(self, comm, x: torch.Tensor, codec: str, block: int, tag: str,
                healed_counts: bool = False, exchange: str = "auto",
                weight: float | None = None):
        """The mean of x over the outer group: Comm's own exchange (collectives.py)."""
        return comm.group_average(x, "outer", codec, block, tag, exchange, weight)

    def all_reduce(self, comm, t: torch.Tensor, tag: str):
        """The sum of t over the outer group (in place)."""
        return comm.all_reduce(t, "outer", tag=tag)

    def all_gather(self, comm, t: torch.Tensor, tag: str, codec: str = "fp32"):
        """Every group's t, in replica order (`position`)."""
        return comm.all_gather(t, "outer", tag=tag, codec=codec)
