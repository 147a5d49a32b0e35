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
    """The steps of the lost attempt that this one redoes: "21–27", "21", or "" (none known)."""
    if rec.step is None or rec.superseded_to is None or rec.superseded_to <= rec.step:
        return ""
    first, last = rec.step + 1, rec.superseded_to
    return f"{first}" if first == last else f"{first}–{last}"


def restart_text(rec: Restart) -> str:
    """What every view says of a restart: "attempt 2 resumed from step 20 (steps 21–27 of the
    lost attempt redone; Slurm requeue 1)"."""
    who = "a restart" if rec.attempt is None else f"attempt {rec.attempt}"
    how = ("started over" if rec.step == 0 else
           f"resumed from step {'?' if rec.step is None else rec.step}")
    lost = lost_steps(rec)
    notes = [f"step{'s' if '–' in lost else ''} {lost} of the lost attempt redone"] if lost else []
    if rec.slurm_restart is not None:
        notes.append(f"Slurm requeue {rec.slurm_restart}")
    return f"{who} {how}" + (f" ({'; '.join(notes)})" if notes else "")


class Restarts:
    """RunModel's restarts (a mixin: keeps _restarts, calls _cached)."""

    def _fold_run(self, e: dict, t: float, rank: int, replica: int) -> None:
        phase = e.get("phase")
        if phase != "resume" and "events_kept" not in e:
            return   # a run's first start, or its end
        step = _int(e.get("step"), 0 if phase == "start" else None)
        ranks = self._restarts.setdefault((_int(e.get("attempt")), step), {})
        ranks[rank] = (t, replica, _int(e.get("superseded_to")), _int(e.get("slurm_restart")))

    def restarts(self) -> list[Restart]:
        """One record per attempt that continued the run, in time order (empty for a run that
        never restarted)."""
        if not self._restarts:
            return []
        return self._cached("restarts", self._merged_restarts)

    def _merged_restarts(self) -> list[Restart]:
        out = []
        for (attempt, step), ranks in self._restarts.items():
            t, replica, _, _ = min(ranks.values())
            lost = [v[2] for v in ranks.values() if v[2] is not None]
            slurm = [v[3] for v in ranks.values() if v[3] is not None]
            out.append(Restart(t, step, attempt, max(lost) if lost else None,
                               max(slurm) if slurm else None, replica,
                               tuple(sorted((r, v[0]) for r, v in ranks.items()))))
        return sorted(out, key=lambda r: r.t)
