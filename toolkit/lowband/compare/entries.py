"""What a comparison runs: its entries (recipes, configs, algorithms), each with the shared
`lowband train` flags on top, as validated Configs; and the identity of the whole list, which a
comparison directory keeps so that it is continued only by the same runs.

An entry is `lowband train --recipe NAME FLAGS`, `lowband train --config PATH FLAGS` or
`lowband train --algo NAME FLAGS` (the flags may hold a --recipe or --config for the algorithm
entries to start from: `--algos ddp,streaming -- --recipe main`). An algorithm entry leaves out the shared flags of option
groups that its algorithm does not read (as `lowband plan`'s rows do): `--fragments 4` is
streaming's, not ddp's. A recipe or config entry takes every shared flag, and is refused with
one sentence naming the entry where an option does not apply to it. From Python an entry may
bring options of its own, on top of the shared ones: algos={"ddp": {}, "streaming":
{"fragments": 2}}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lowband.algorithms import ALGORITHMS
from lowband.config import COMMON_GROUPS, GROUPS, Config, ConfigError
from lowband.flags import config_of_args, train_parser

KINDS = {"recipe": "--recipes", "config": "--configs", "algo": "--algos"}
# train flags a comparison sets itself, and what to give instead
OWN = {"algo": "give the algorithms to compare with --algos NAME,NAME",
       "resume": "continue a comparison with --dir DIR and the same runs",
       "run_dir": "each run's directory is DIR/NAME: give the comparison's own with --dir",
       "overwrite": "a comparison continues where it stopped: give a new --dir to start afresh"}
# what does not make two comparisons different runs
NOT_IDENTITY = ("run_dir", "overwrite", "progress", "target_loss")


@dataclass
class Entry:
    kind: str                     # recipe, config or algo
    name: str                     # as given: a recipe, a path, an algorithm
    label: str = ""               # its run's name: its directory in the comparison
    config: Config | None = None  # validated, before the comparison's budget
    dropped: list[str] = field(default_factory=list)  # shared flags its algorithm does not read
    own: dict = field(default_factory=dict)  # its own options (Python: a mapping's values)

    @property
    def given(self) -> str:
        return f"{KINDS[self.kind]} {self.name}"


def named(kind: str, value) -> list[Entry]:
    """The entries of one kind from "a,b", ["a", "b"] or a path (one name), from a mapping of
    names to their own options ({"streaming": {"fragments": 2}}), or from (name, options) pairs
    (one name twice: [("acco", {}), ("acco", {"acco_micro": "1:1"})])."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        value = list(value.items())
    items = [value] if isinstance(value, (str, Path)) else list(value)
    return [Entry(kind, str(v[0]), own=dict(v[1] or {})) if isinstance(v, tuple) else Entry(kind, n.strip())
            for v in items for n in ([v[0]] if isinstance(v, tuple) else str(v).split(","))
            if str(n).strip()]


def shared_args(flags: list[str]) -> dict:
    """The shared `lowband train` flags, parsed by its own parser (only those given)."""
    args = vars(train_parser().parse_args([str(f) for f in flags]))
    for name, instead in OWN.items():
        if name in args:
            raise ConfigError(f"--{name.replace('_', '-')} is not a flag for every compared run: "
                              f"{instead}.")
    return args


def resolve(recipes=(), configs=(), algos=(), args: dict | None = None) -> list[Entry]:
    """Every entry's validated Config (recipes, then configs, then algorithms, each in the order
    given), with a label unique in the comparison. ConfigError, one sentence, on the first that
    cannot run."""
    from lowband.launch.job import flag_args

    entries = named("recipe", recipes) + named("config", configs) + named("algo", algos)
    if not entries:
        raise ConfigError("give the runs to compare: --algos NAME,NAME, --recipes NAME,NAME or "
                          "--configs PATH,PATH (`lowband compare --help`).")
    ALGORITHMS.load()
    taken: set[str] = set()
    for e in entries:
        mine = dict(args or {})
        whole = [k for k in ("recipe", "config") if k in mine]
        if whole and e.kind != "algo":  # a shared --recipe or --config: the --algos runs' base
            raise ConfigError(f"{e.given} is a whole configuration, and --{whole[0]} among the "
                              "shared flags gives one to the --algos runs only: remove one of "
                              "them.")
        if e.kind == "algo":
            if e.name not in ALGORITHMS:
                Config(algo=e.name).validate()  # its one sentence: the algorithms there are
            own = ALGORITHMS[e.name].options
            foreign = {n for g in GROUPS if g not in COMMON_GROUPS and g not in own
                       and not g.shared_knob for n in g.names()}
            e.dropped = sorted(k for k in mine if k in foreign)
            mine = {k: v for k, v in mine.items() if k not in foreign}
        mine.update(shared_args(flag_args(e.own)) if e.own else {})
        mine[e.kind] = e.name
        try:
            e.config, _ = config_of_args(mine)
        except ConfigError as err:
            text = str(err)
            raise ConfigError(text if e.name in text else f"{e.given}: {text}") from None
        e.config.run_dir, e.config.overwrite = "", False
        e.label = _unique(_label(e), taken)
    return entries


def _label(e: Entry) -> str:
    if e.kind == "config":
        path = Path(e.name)
        name = path.parent.name if path.name == "config.json" else path.stem or path.name
    else:
        name = e.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or e.kind


def _unique(label: str, taken: set[str]) -> str:
    out, n = label, 1
    while out in taken or out in ("compare.json", "report.html"):
        n += 1
        out = f"{label}-{n}"
    taken.add(out)
    return out


def reference(entries: list[Entry]) -> Entry:
    """The run the others are measured against: the first ddp run, else the first run."""
    return next((e for e in entries if e.config.algo == "ddp"), entries[0])


def identity(entries: list[Entry], equal: str) -> dict:
    """What a comparison directory keeps to know its runs: the entries, how they are made equal
    and each one's options (a target loss, the progress bar and the directories aside)."""
    configs = {e.label: {k: v for k, v in e.config.to_dict().items() if k not in NOT_IDENTITY}
               for e in entries}
    return json.loads(json.dumps({"entries": [[e.kind, e.name, e.label] for e in entries],
                                  "equal": equal, "configs": configs}))


def difference(held: dict, wanted: dict) -> str:
    """Why a comparison directory holding `held` is not the comparison `wanted`, in words."""
    labels = lambda spec: ", ".join(e[2] for e in spec.get("entries", []))  # noqa: E731
    if held.get("entries") != wanted["entries"]:
        return f"a comparison of {labels(held) or 'nothing'}, not of {labels(wanted)}"
    if held.get("equal") != wanted["equal"]:
        return f"a comparison at equal {held.get('equal')}, not at equal {wanted['equal']}"
    for label, cfg in wanted["configs"].items():
        old = held.get("configs", {}).get(label, {})
        for key in sorted(set(cfg) | set(old)):
            if cfg.get(key) != old.get(key):
                return (f"a comparison whose run {label} had --{key.replace('_', '-')} "
                        f"{old.get(key)!r}, not {cfg.get(key)!r}")
    return "another comparison"
