"""The planner calibrated on this machine: tokens factors measured by `lowband compare` in place
of the published figures (plan/loss.py), for the settings it compared.

A finished comparison directory (compare.json with its table, `lowband compare`'s) whose
reference is a ddp run that reached the target gives, for each other run that reached it too, a
measured tokens_factor: its tokens to the target over the reference's. A planned row takes it
when its setting is the compared run's: the same algorithm, R (--replicas), model size (its
parameter count: config.json's meta.n_params against the Run's params) and, of H
(--sync-every), aedit's --sync-seconds, P (--fragments), tau (--overlap) and the codec, those
the algorithm reads (`SETTING`). A compared run that did not reach the target gives no factor;
rows it would have matched keep the published figure, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowband.algorithms import ALGORITHMS as REGISTRY
from lowband.plan.inputs import PlanError
from lowband.plan.loss import DATA_EXPONENT, Penalty
from lowband.telemetry import RunDir

# the options of a setting, where its algorithm reads them (with R and the parameter count)
SETTING = ("sync_every", "sync_seconds", "fragments", "overlap", "codec")


def reads(algo: str) -> set[str]:
    """The option names an algorithm's option groups declare (what it reads)."""
    return {f for group in REGISTRY[algo].options for f in group.names()} if algo in REGISTRY \
        else set()


def setting(algo: str, options, params: float) -> tuple:
    """The match key of a run: its algorithm, R, parameter count and the SETTING options its
    algorithm reads. options: a Config, or a mapping of its options (a run's config.json)."""
    get = options.get if isinstance(options, dict) else (lambda k: getattr(options, k, None))
    read = reads(algo)
    return (algo, get("replicas"), round(float(params)),
            *((k, get(k)) for k in SETTING if k in read))


@dataclass(frozen=True)
class Compared:
    """One run of the comparison: its name, its setting, its measured tokens factor (None: it
    did not reach the target)."""
    name: str
    key: tuple
    factor: float | None


@dataclass(frozen=True)
class Calibration:
    dir: str
    reference: str
    runs: tuple[Compared, ...]

    def penalty(self, algo: str, options, params: float) -> tuple[Penalty | None, str | None]:
        """(the measured penalty, the compared run it comes from) of a planned row's setting;
        (None, NAME) where the matching run NAME did not reach the target; (None, None) where no
        compared run has its setting."""
        key = setting(algo, options, params)
        matches = [r for r in self.runs if r.key == key]
        for r in matches:
            if r.factor is not None:
                return Penalty(r.factor ** DATA_EXPONENT - 1, r.factor,
                               f"measured by lowband compare, {self.dir}, run {r.name}"), r.name
        return None, matches[0].name if matches else None


def _fail(directory, why: str) -> PlanError:
    return PlanError(f"--calibrate {directory} {why}")


def read(directory) -> Calibration:
    """The calibration of a finished `lowband compare` directory; PlanError (one sentence) where
    it is not one, or its reference is not a ddp run that reached the target."""
    root = Path(directory)
    result = RunDir(root).read_json(root / "compare.json") if root.is_dir() else None
    if not isinstance(result, dict):
        raise _fail(directory, "is not a lowband compare directory (no compare.json): give the "
                    "--dir of a finished comparison.")
    rows = {r.get("name"): r for r in result.get("runs") or [] if isinstance(r, dict)}
    ref = rows.get(result.get("reference"))
    if ref is None:
        raise _fail(directory, "holds no table (the comparison did not finish): call lowband "
                    f"compare again with --dir {directory} to finish it.")
    configs = {name: _config(root, row, directory) for name, row in rows.items()}
    if configs[ref["name"]].get("algo") != "ddp":
        raise _fail(directory, f"was measured against {ref['name']} "
                    f"({configs[ref['name']].get('algo')}), not ddp: calibrate on a comparison "
                    "whose reference is a ddp run (lowband compare --algos ddp,...).")
    ref_target = ref.get("target") or {}
    if not ref_target.get("reached") or not ref_target.get("tokens"):
        raise _fail(directory, f"has a target ({result.get('target_loss')}) its ddp reference "
                    "did not reach: compare again with a --target-loss ddp reaches.")
    runs = []
    for name, row in rows.items():
        if name == ref["name"]:  # its factor is 1 by definition
            continue
        cfg, t = configs[name], row.get("target") or {}
        factor = t["tokens"] / ref_target["tokens"] if t.get("reached") and t.get("tokens") \
            else None
        runs.append(Compared(name, setting(cfg.get("algo"), cfg, cfg["meta"]["n_params"]),
                             factor))
    return Calibration(str(directory), ref["name"], tuple(runs))


def _config(root: Path, row: dict, directory) -> dict:
    """A compared run's config.json (with meta.n_params): in the comparison's directory, under
    the run's name (where runner.py puts it), else at the row's run_dir."""
    for where in (root / str(row.get("name")), Path(str(row.get("run_dir")))):
        run = RunDir(where)
        cfg = run.read_json(run.config) if where.is_dir() else None
        if isinstance(cfg, dict) and "n_params" in (cfg.get("meta") or {}):
            return cfg
    raise _fail(directory, f"has no config.json for its run {row.get('name')}: give a "
                "comparison directory as lowband compare left it.")
