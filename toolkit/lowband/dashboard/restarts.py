"""Restarts of a run: the attempts that continued it after a crash or a Slurm requeue (a resume
from a checkpoint, or a start over in place). Each rank of such an attempt writes a `run` event
with phase resume (or start, with events_kept); the reader (telemetry.EventTail) drops the
events of the lost attempt and gives that run event superseded_to, the last step the lost
attempt reached on that rank. One Restart per attempt (and step resumed at) merges its ranks'.

Restarts is a part of RunModel (it folds in run events and reads the model's _cached); the
records are drawn on the loss figure and the sync timeline and listed in the report.
"""

from __future__ import annotations

from .records import Restart, _int


def lost_steps(rec: Restart) -> str:
    """The steps of the lost attempt that this one redoes: "21–27", "21", or "" (none known,
    or none: an elastic group that healed from a live peer further on redoes none)."""
    if rec.healed_to is not None:
        return ""
    return _span(rec)


def _span(rec: Restart) -> str:
    """The steps of the lost attempt after the step this one resumed from."""
    if rec.step is None or rec.superseded_to is None or rec.superseded_to <= rec.step:
        return ""
    first, last = rec.step + 1, rec.superseded_to
    return f"{first}" if first == last else f"{first}–{last}"


def restart_text(rec: Restart) -> str:
    """What every view says of a restart: "attempt 2 resumed from step 20 (steps 21–27 of the
    lost attempt redone; Slurm requeue 1)"; an elastic group's: "group 1: attempt 1 resumed from
    step 20 (healed to step 30 from a live peer: steps 21–26 of the lost attempt lost)"."""
    who = "a restart" if rec.attempt is None else f"attempt {rec.attempt}"
    if rec.group is not None:
        who = f"group {rec.group}: {who}"
    how = ("started over" if rec.step == 0 else
           f"resumed from step {'?' if rec.step is None else rec.step}")
    lost, span = lost_steps(rec), _span(rec)
    notes = [f"step{'s' if '–' in lost else ''} {lost} of the lost attempt redone"] if lost else []
    if rec.healed_to is not None:
        notes.append(f"healed to step {rec.healed_to} from a live peer"
                     + (f": step{'s' if '–' in span else ''} {span} of the lost attempt lost"
                        if span else ""))
    if rec.slurm_restart is not None:
        notes.append(f"Slurm requeue {rec.slurm_restart}")
    return f"{who} {how}" + (f" ({'; '.join(notes)})" if notes else "")


class Restarts:
    """RunModel's restarts (a mixin: keeps _restarts, calls _cached and membership)."""

    def _fold_run(self, e: dict, t: float, rank: int, replica: int) -> None:
        phase = e.get("phase")
        if phase != "resume" and "events_kept" not in e:
            return   # a run's first start, or its end
        step = _int(e.get("step"), 0 if phase == "start" else None)
        group = replica if e.get("restart") else None  # --elastic: one group restarted alone
        ranks = self._restarts.setdefault((_int(e.get("attempt")), step, group), {})
        ranks[rank] = (t, replica, _int(e.get("superseded_to")), _int(e.get("slurm_restart")))

    def restarts(self) -> list[Restart]:
        """One record per attempt that continued the run, in time order (empty for a run that
        never restarted)."""
        if not self._restarts:
            return []
        return self._cached("restarts", self._merged_restarts)

    def _merged_restarts(self) -> list[Restart]:
        out = []
        for (attempt, step, group), ranks in self._restarts.items():
            t, replica, _, _ = min(ranks.values())
            lost = [v[2] for v in ranks.values() if v[2] is not None]
            slurm = [v[3] for v in ranks.values() if v[3] is not None]
            out.append(Restart(t, step, attempt, max(lost) if lost else None,
                               max(slurm) if slurm else None, replica,
                               tuple(sorted((r, v[0]) for r, v in ranks.items())), group,
                               None if group is None else self._healed_to(group, t, step)))
        return sorted(out, key=lambda r: r.t)

    def _healed_to(self, group: int, t: float, step: int | None) -> int | None:
        """The step a restarted group's first quorum after `t` healed it to, when a live peer
        had trained past its checkpoint's `step`; else None."""
        first = next((m for m in self.membership() if m.replica == group and m.t >= t), None)
        if first is None or not first.healed or first.step is None or first.step <= (step or 0):
            return None
        return first.step
