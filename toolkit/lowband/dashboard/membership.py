"""Membership changes of an --elastic run (docs/elastic.md): its `membership` events, one record
per replica group and quorum (the group's ranks write the same event), and one mark per quorum
change with every group's view merged; and its participation: per sync, the groups alive and the
groups that took part (its `quorum` events).

MembershipChanges is a part of RunModel (it folds in membership events and calls the model's
_cached); the records are drawn on the sync timeline and listed in the report, the marks are
drawn on the loss figure.
"""

from __future__ import annotations

from lowband.summary import participation, sync_participation

from .records import Membership, MembershipMark, _int, _ints, _num
from .style import fmt_bytes


class _Seen:
    """What the ranks of one group said about one quorum, folded in as their events arrive."""

    __slots__ = ("t", "step", "replica", "quorum_id", "size", "members", "joined", "left",
                 "healed", "heal", "wait_s", "ranks", "lighthouse")

    def __init__(self, t, step, replica, quorum_id):
        self.t, self.step, self.replica, self.quorum_id = t, step, replica, quorum_id
        self.size = None
        self.members = self.joined = self.left = ()
        self.healed = False
        self.heal: dict[int, tuple] = {}        # rank -> (bytes, seconds), once per rank
        self.wait_s = None
        self.ranks: set[int] = set()
        self.lighthouse = False                 # the first quorum after a Lighthouse restart


def groups_text(groups) -> str:
    """"group 1" or "groups 0, 2"."""
    groups = list(groups)
    return (f"group {groups[0]}" if len(groups) == 1
            else "groups " + ", ".join(str(g) for g in groups))


def heal_text(nbytes, seconds) -> str:
    """"2.4 MB in 0.3 s", or what of it is known."""
    parts = [fmt_bytes(nbytes)] if nbytes is not None else []
    if seconds is not None:
        parts.append(f"in {seconds:.2g} s" if seconds < 10 else f"in {seconds:,.0f} s")
    return " ".join(parts)


def participation_words(p) -> str:
    """summary.json's elastic `participation` in words: "3.8 of 4.0 alive groups took part on
    average (95%); all alive took part in 11 of 12 syncs"; "" without one."""
    if not isinstance(p, dict) or not p.get("syncs"):
        return ""
    share = "" if p.get("participation") is None else f" ({100 * p['participation']:.0f}%)"
    return (f"{p['mean_participants']:.1f} of {p['mean_alive']:.1f} alive groups took part on "
            f"average{share}; all alive took part in {p['syncs_all_alive_took_part']} of "
            f"{p['syncs']} syncs")


def _facts(rec: Membership, first: bool) -> dict:
    """What one group's record says happened, keyed (group, "join"|"leave"|"heal"), and
    (-1, "lighthouse") in its first quorum after a Lighthouse restart: None for a plain join or
    leave (merged into "groups 0, 2 joined"), else the words. first: the group's first record in
    this run (its start, not a restart)."""
    q = rec.replica
    heal = heal_text(rec.heal_bytes, rec.heal_s) if rec.healed else ""
    facts: dict = {(-1, "lighthouse"): "the Lighthouse was restarted"} \
        if rec.lighthouse_restarted else {}
    if q in rec.joined:
        # this group's own (re)start: its joined is the whole quorum, which says nothing of the
        # others, so only its own arrival counts
        verb = "joined" if first else "rejoined"
        if rec.healed:
            facts[(q, "join")] = f"group {q} {verb} (healed {heal})" if heal else \
                f"group {q} {verb} (healed)"
        else:
            facts[(q, "join")] = None if first else f"group {q} rejoined"
        return facts
    for g in rec.left:
        facts[(g, "leave")] = None
    for g in rec.joined:
        facts[(g, "join")] = None
    if rec.healed:
        why = "; ".join(x for x in (heal, rec.behind) if x)
        facts[(q, "heal")] = f"group {q} healed from a live peer" + (f" ({why})" if why else "")
    return facts


def _words(facts: dict) -> str:
    leave = [g for (g, kind), text in sorted(facts.items()) if kind == "leave" and text is None]
    join = [g for (g, kind), text in sorted(facts.items()) if kind == "join" and text is None]
    parts = [f"{groups_text(leave)} left"] if leave else []
    if join:
        parts.append(f"{groups_text(join)} joined")
    parts += [text for _, text in sorted(facts.items()) if text is not None]
    return "; ".join(parts) or "new quorum, same groups"


class MembershipChanges:
    """RunModel's membership changes (a mixin: keeps _members, calls _cached)."""

    def _fold_membership(self, e: dict, t: float, rank: int, replica: int) -> None:
        step, quorum = _int(e.get("step")), _int(e.get("quorum_id"))
        # one record per group and quorum; without a quorum id, per group and step
        key = (replica, quorum) if quorum is not None else (replica, None, step)
        s = self._members.get(key)
        if s is None:
            s = self._members[key] = _Seen(t, step, replica, quorum)
        s.t = min(s.t, t)
        if step is not None and (s.step is None or step < s.step):
            s.step = step
        s.size = _int(e.get("size"), s.size)
        for name in ("members", "joined", "left"):
            if name in e:
                setattr(s, name, _ints(e.get(name)))
        if e.get("lighthouse_restarted") is True:
            s.lighthouse = True
        if e.get("healed") is True:
            s.healed = True
            s.heal[rank] = (_num(e.get("heal_bytes")), _num(e.get("heal_s")))
        wait = _num(e.get("wait_s"))
        if wait is not None:
            s.wait_s = wait if s.wait_s is None else max(s.wait_s, wait)
        s.ranks.add(rank)

    def membership(self) -> list[Membership]:
        """One record per replica group and quorum, in time order (empty without --elastic)."""
        if not self._members:
            return []
        return self._cached("membership", self._membership)

    def _membership(self) -> list[Membership]:
        out, seen, since = [], set(), {}
        for s in sorted(self._members.values(), key=lambda s: (s.t, s.replica)):
            heal_b = [b for b, _ in s.heal.values() if b is not None]
            heal_s = [x for _, x in s.heal.values() if x is not None]
            rec = Membership(s.t, s.step, s.replica, s.quorum_id,
                             s.size if s.size is not None else (len(s.members) or None),
                             s.members, s.joined, s.left, s.healed,
                             sum(heal_b) if heal_b else None, max(heal_s) if heal_s else None,
                             s.wait_s, tuple(sorted(s.ranks)), "", "", s.lighthouse)
            if rec.healed and s.replica not in rec.joined:
                rec = rec._replace(behind=self._behind(rec, since.get(s.replica)))
            out.append(rec._replace(change=_words(_facts(rec, s.replica not in seen))))
            seen.add(s.replica)
            since[s.replica] = s.t
        return out

    def _behind(self, rec: Membership, since: float | None) -> str:
        """Why a group that did not just (re)start healed: its commit vote had failed in a sync
        since its previous quorum (it skipped an update the others applied), or it had trained
        less than the others (dropped from a quorum, or slow)."""
        failed = [c for c in self.failed_commits() if rec.replica in c.replicas
                  and (since is None or c.t > since) and c.t <= rec.t]
        if failed:
            return f"behind: its commit vote failed at step {failed[-1].step}"
        return "behind: it had trained less than the others"

    def participation(self) -> list[tuple]:
        """Each quorum of the run (a sync's): (step, groups alive, groups that took part, those
        healed in it), from the groups' `quorum` events (lowband.summary.sync_participation);
        empty without."""
        if not self._quorums:
            return []
        return self._cached("participation", lambda: sync_participation(self._quorums))

    def participation_text(self) -> str:
        """participation_words of the run's quorum records ("" without)."""
        return participation_words(participation(self.participation()))

    def membership_marks(self) -> list[MembershipMark]:
        """One mark per quorum change of the run, every group's view of it merged: "group 1
        left", "group 1 rejoined (healed 2.4 MB in 0.3 s)"."""
        if not self._members:
            return []
        return self._cached("membership_marks", self._membership_marks)

    def _membership_marks(self) -> list[MembershipMark]:
        groups: dict = {}
        seen: set = set()
        for rec in self.membership():
            key = rec.quorum_id if rec.quorum_id is not None else ("step", rec.step)
            groups.setdefault(key, []).append((rec, rec.replica not in seen))
            seen.add(rec.replica)
        marks = []
        for group in groups.values():
            facts: dict = {}
            for rec, first in group:
                # the others' plain "group 1 joined" and its own "group 1 rejoined (healed ...)"
                # are one fact: the words win
                for k, text in _facts(rec, first).items():
                    if text is not None or k not in facts:
                        facts[k] = text
            head = group[0][0]
            steps = [r.step for r, _ in group if r.step is not None]
            marks.append(MembershipMark(
                min(r.t for r, _ in group), min(steps) if steps else None, head.replica,
                head.quorum_id, head.size, head.members, _words(facts),
                any(r.healed for r, _ in group)))
        return sorted(marks, key=lambda m: m.t)
