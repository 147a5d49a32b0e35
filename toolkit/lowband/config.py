"""The configuration of a run: one flat dataclass made of option groups, one validate().

The run's own options are declared here (RunOptions); the model's beside the model sources
(models/), each algorithm's beside its code (algorithms/), the emulated link's in comm/link.py,
the fault injectors' in faults.py. Config inherits every group, so `cfg.fragments` reads as
before, and the registry of algorithms (algorithms/__init__.py) says which groups each algorithm
reads: validation refuses an option of another algorithm's group, and `lowband train --help`
lists the options group by group.

Every field is a `lowband train` flag (`--batch-size` for `batch_size`) and a key of a
`--config` file (TOML, or a run's own config.json); flags given on the command line override it.
The defaults are the main job's (streaming over an emulated 100 Mbit/s, 10 ms link: recipes.main
changes nothing), so a flag or key changes only what it names: `--algo ddp` is the baseline over
the same link, `--link-bandwidth none` the same run without the emulated link.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from lowband.algorithms import ALGORITHMS, inner, option_groups, registry, users
from lowband.comm.membership.elastic import ElasticOptions
from lowband.comm.link import LinkOptions, recorded, with_units
from lowband.faults import FaultOptions
from lowband.options import (ArgParser, ConfigError, Options, close_match, flag,  # noqa: F401
                             option)  # (ArgParser, ConfigError re-exported)
from lowband import models
from lowband.models import ModelOptions

_f = option


@dataclass
class RunOptions(Options):
    title = "run"
    # what to run
    # the defaults are the main job's (`lowband train` alone): a flag changes what it names
    algo: str = _f("streaming", "training algorithm")  # its help names them (_name_algorithms)
    replicas: int = _f(2, "R: replica groups, joined by the slow outer link")
    shards: int = _f(1, "S: ranks inside each replica group, joined by the fast inner link")
    # data
    data: str = _f("builtin", "'builtin' (the Python standard library's source), a text file or "
                   "directory of text files, a uint16 token file (.bin), or a directory written "
                   "by `lowband prepare`")
    tokenizer: str = _f("", "a tokenizer.json or a tokenizer directory (save_pretrained): text "
                        "--data is tokenized with it once (cached) and the model's vocabulary "
                        "must cover the tokenizer's; without it, text is bytes (vocabulary 256)")
    val_fraction: float = _f(0.02, "fraction of the corpus held out for validation")
    seq_len: int = _f(128, "tokens per sequence")
    batch_size: int = _f(8, "sequences per micro-batch on each rank")
    grad_accum: int = _f(1, "micro-batches accumulated per step on each rank")
    # inner optimizer
    steps: int = _f(200, "training steps (with --time-budget: the most steps)")
    time_budget: float = _f(None, "seconds of training (evaluations and checkpoints not "
                            "counted) after which the run ends with its final evaluation and "
                            "checkpoint, every rank at the same step, rank 0's clock deciding; "
                            "the learning rate then warms up, holds, and decays over the last "
                            "fifth of the budget (or of --steps, which stays an upper bound: "
                            "raise it to let time decide); a resume keeps the time spent. The "
                            "stop step and the learning rate then follow the clock, so two runs "
                            "differ (without it nothing depends on time). Unset: no limit",
                            kind=float)
    optimizer: str = _f("adamw", "inner optimizer (algorithms/inner.py): adamw, or muon: "
                        "torch's Muon (momentum 0.95, Nesterov) on the 2-D weight matrices "
                        "inside the blocks and AdamW on the rest (embeddings, output head, "
                        "norms, biases); Muon scales --lr per matrix to match AdamW's update "
                        "size (adjust_lr_fn match_rms_adamw), so --lr and --weight-decay "
                        "carry over from AdamW", ("adamw", "muon"))
    lr: float = _f(3e-3, "peak learning rate of the inner optimizer")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = _f(10, "linear learning-rate warm-up steps")
    weight_decay: float = _f(0.1, "decoupled weight decay (AdamW's; Muon's too)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the gradient norm to this value (0 disables)")
    # communication
    bucket_mb: float = _f(4.0, "gradient bucket size in MiB for data-parallel all-reduce")
    # checkpoints and faults
    checkpoint_every: int = _f(0, "write a checkpoint every N steps and at the end (0: never)")
    keep_checkpoints: int = _f(3, "how many of the newest checkpoints to keep")
    auto_resume: bool = _f(False, "if --run-dir already holds this run (the same options), "
                           "continue it from its latest complete checkpoint, or start it over "
                           "in place when it has none, instead of refusing; implied when Slurm "
                           "restarts the job (SLURM_RESTART_COUNT > 0: a requeue or preemption)")
    stop_after: int = _f(0, "stop after this many steps as if interrupted (0: run to --steps); "
                         "the schedule still spans --steps, so --resume continues it")
    max_skips: int = _f(10, "stop after this many updates in a row skipped for NaN or inf")
    # evaluation, output, reproducibility
    eval_every: int = _f(50, "evaluate on the validation split every N steps (0: only at the end)")
    eval_batches: int = _f(4, "validation micro-batches per evaluation")
    target_loss: float = _f(0.0, "a validation loss to reach: summary.json's `target` gives the "
                            "training time, tokens and outer-link bytes at the first evaluation "
                            "at or below it, or the best loss when none is (0: no target)")
    seed: int = _f(0, "seed for initialisation and data order")
    run_dir: str = _f("", "run directory (default: runs/<algo>-<time>)")
    overwrite: bool = _f(False, "start afresh in a --run-dir that already holds a run, removing "
                         "its events, summary, checkpoints and logs")
    device: str = _f("auto", "auto, cpu or cuda", ("auto", "cpu", "cuda"))
    backend: str = _f("auto", "process-group backend: auto (gloo on CPU; on CUDA nccl when every "
                      "rank of a node has its own GPU, else gloo, which lets several ranks "
                      "share one), nccl or gloo", ("auto", "nccl", "gloo"))
    precision: str = _f("fp32", "fp32, or bf16: forward and backward under bf16 autocast; "
                        "weights, gradients, optimizer states and exchanges stay fp32",
                        ("fp32", "bf16"))
    compile: bool = _f(False, "torch.compile each block's forward (hooks and communication stay "
                       "eager)")
    progress: bool = _f(True, "show a progress bar on rank 0 (when its stderr is a terminal)")
    oversubscribe: bool = _f(False, "start the workers even where the ranks far outnumber this "
                             "machine's cores or their memory estimate exceeds its available "
                             "memory (launch/fits.py), which is refused before any worker starts")

    @classmethod
    def check(cls, cfg) -> None:
        for name in ("replicas", "shards", "seq_len", "batch_size", "grad_accum", "steps",
                     "eval_batches", "keep_checkpoints"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"{flag(name)} must be a positive integer, got {getattr(cfg, name)}.")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "max_skips", "stop_after"):
            if getattr(cfg, name) < 0:
                raise ConfigError(f"{flag(name)} must be zero or positive, got {getattr(cfg, name)}.")
        for name in ("lr", "bucket_mb"):
            if not getattr(cfg, name) > 0:
                raise ConfigError(f"{flag(name)} must be positive, got {getattr(cfg, name)}.")
        for name in ("weight_decay", "grad_clip"):
            if not getattr(cfg, name) >= 0:
                raise ConfigError(f"{flag(name)} must be zero or positive, got {getattr(cfg, name)}.")
        for name in ("beta1", "beta2", "min_lr_ratio"):
            if not 0 <= getattr(cfg, name) <= 1:
                raise ConfigError(f"{flag(name)} must lie in [0, 1], got {getattr(cfg, name)}.")
        if not (math.isfinite(cfg.target_loss) and cfg.target_loss >= 0):
            raise ConfigError(f"--target-loss must be a finite validation loss (or 0 for none), "
                              f"got {cfg.target_loss}.")
        if cfg.target_loss and cfg.elastic:
            raise ConfigError("--target-loss is not measured for --elastic runs, whose replica "
                              "groups evaluate apart: remove one of them.")
        if cfg.time_budget is not None and not (math.isfinite(cfg.time_budget) and cfg.time_budget > 0):
            raise ConfigError(f"--time-budget must be a positive, finite number of seconds, got "
                              f"{cfg.time_budget}: leave it out for a run bounded by --steps alone.")
        if cfg.time_budget is not None and cfg.elastic:
            raise ConfigError("--time-budget needs one clock for the whole job, which --elastic's "
                              "replica groups (each its own job) do not share yet: remove one of them.")
        if not 0 < cfg.val_fraction < 1:
            raise ConfigError(f"--val-fraction must lie strictly between 0 and 1, got {cfg.val_fraction}.")
        if cfg.data != "builtin" and not Path(cfg.data).exists():
            raise ConfigError(f"data path '{cfg.data}' does not exist: give an existing text file, "
                              "directory or .bin token file, or 'builtin'.")
        if cfg.tokenizer and not Path(cfg.tokenizer).exists():
            raise ConfigError(f"tokenizer '{cfg.tokenizer}' does not exist: give a tokenizer.json "
                              "file or a directory saved with save_pretrained.")
        inner.check(cfg, ALGORITHMS[cfg.algo])  # --optimizer muon where it cannot run


# the groups every algorithm reads, then each algorithm's own (in registry order)
COMMON_GROUPS = (RunOptions, ModelOptions, LinkOptions, FaultOptions, ElasticOptions)
# a list: an algorithm registered from outside (algorithms/registry.py) adds its new groups
GROUPS = [*COMMON_GROUPS, *option_groups(builtin=True)]

# What a continued run (--resume, --auto-resume, a Slurm restart) may set otherwise than its
# config.json says: how far and how this attempt runs, never what the run is. The run directory
# is the run's own (the one continued). `lowband train --resume` refuses any other option, and a
# relaunch into a directory whose run differs in any other is not continued (flags.py,
# checkpoint/lifecycle.py), both with RESUME_RULE.
RESUME_MAY_CHANGE = ("steps", "stop_after", "crash_checkpoint", "progress", "auto_resume",
                     "overwrite", "oversubscribe", "run_dir")
_MAY = [flag(n) for n in RESUME_MAY_CHANGE if n != "run_dir"]
RESUME_RULE = (f"a continued run keeps its own config: only {', '.join(_MAY[:-1])} and "
               f"{_MAY[-1]} may change")


@dataclass
class Config(*reversed(GROUPS)):
    """A run: every group's fields, flat. The run's own fields come first."""

    def __new__(cls, *args, **kwargs):  # algorithms registered from outside bring their fields
        ALGORITHMS.load()               # first (the __init__ called next is then theirs too)
        return super().__new__(cls)

    @property
    def world(self) -> int:
        return self.replicas * self.shards

    def validate(self) -> "Config":
        if self.algo not in ALGORITHMS:
            broken = [w for w in registry.BROKEN if f"'{self.algo}" in w]
            raise ConfigError(f"unknown algorithm '{self.algo}': use one of {', '.join(ALGORITHMS)}"
                              + (f" ({broken[0]} failed to load)." if broken else "."))
        models.check(self)
        algorithm = ALGORITHMS[self.algo]
        if self.elastic and not algorithm.elastic:
            raise ConfigError(f"--elastic works with --algo {' or '.join(_elastic(ALGORITHMS))} "
                              f"for now: --algo {self.algo} cannot lose a replica group mid-run yet.")
        for name, value in algorithm.defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value(self) if callable(value) else value)
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"{flag(f.name)} '{value}' is not one of {', '.join(choices)}.")
        for group in self._foreign_groups():
            if not group.shared_knob:
                _refuse_foreign(self, group)
        for group in COMMON_GROUPS + algorithm.options:
            group.resolve(self, algorithm)
            group.check(self)
        algorithm.check(self)
        return self

    def _foreign_groups(self) -> list[type[Options]]:
        return [g for g in GROUPS if g not in COMMON_GROUPS and g not in ALGORITHMS[self.algo].options]

    def ignored(self) -> list[str]:
        """One note per option set for another algorithm that this one ignores (a shared knob
        such as --sync-every, passed to every algorithm of a sweep)."""
        return [f"{flag(name)} is read only by --algo {' or '.join(users(g))}: --algo {self.algo} "
                "ignores it." for g in self._foreign_groups() if g.shared_knob
                for name in _set_away_from_default(self, g)]

    # the block count of a model given to train() as a module (set there), else the source's
    # (a plain attribute, not an option: it is neither a flag nor saved)
    model_blocks = None

    def n_blocks(self) -> int:
        if self.model_blocks is not None:
            return self.model_blocks
        return models.spec(self.model).n_blocks(self.n_layer)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "Config":
        ALGORITHMS.load()  # a registered algorithm's options are keys too
        values = _renamed(values)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key.replace("-", "_") not in known:
                meant = close_match(key.replace("-", "_"), known)
                spelled = meant and (meant.replace("_", "-") if "-" in key else meant)
                hint = (f"did you mean {spelled}? (or remove it)" if meant else
                        "remove it or use one of the `lowband train --help` options")
                raise ConfigError(f"unknown key '{key}' in {source}: {hint}.")
        cfg = cls()
        for key, value in values.items():
            name = key.replace("-", "_")
            expected = FIELD_TYPES[name]
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if value is None and getattr(cfg, name) is None:  # left to the algorithm's default
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(f"'{key}' in {source} must be of type {expected.__name__}, "
                                  f"got {value!r}.")
            setattr(cfg, name, value)
        return cfg

    @classmethod
    def from_file(cls, path: str) -> "Config":
        """A config from a TOML file, a run's own config.json, or a run directory (its
        config.json): a finished run can be repeated from its record (in a new run directory)."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
            if not file.exists():
                raise ConfigError(f"'{path}' is a directory without a config.json: give a TOML "
                                  "file, a run's config.json or a run directory.")
        try:
            text = file.read_text()
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' does not exist: check the --config path.") from None
        if file.suffix == ".json":
            try:
                values = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"config file '{file}' is not valid JSON ({e}): fix its syntax.") from None
            if not isinstance(values, dict):
                raise ConfigError(f"config file '{file}' holds no JSON object of options.")
            meta = values.pop("meta", None)  # what the run measured about itself, not options
            values.pop("run_dir", None)  # a repeat gets its own directory
            values.pop("overwrite", None)
            values.pop("oversubscribe", None)  # (this machine's to decide)
            return recorded(cls.from_dict(with_units(values), source=str(file)), meta)
        try:
            values = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid TOML ({e}): fix its syntax.") from None
        return cls.from_dict(values, source=path)


def _renamed(values: dict) -> dict:
    """An older config's keys under their names now: aedit's max_seconds (0: no limit) is the
    run option --time-budget."""
    values = dict(values)
    for old in ("max_seconds", "max-seconds"):
        seconds = values.pop(old, None)
        if seconds:
            values.setdefault("time_budget", seconds)
    return values


def _set_away_from_default(cfg: Config, group: type[Options]) -> list[str]:
    return [f.name for f in dataclasses.fields(group)
            if f.name in group.names() and getattr(cfg, f.name) != f.default]


def _refuse_foreign(cfg: Config, group: type[Options]) -> None:
    """ConfigError when an option of a group cfg's algorithm does not read is set."""
    for name in _set_away_from_default(cfg, group)[:1]:
        who = users(group)
        article = "an" if who[0][0] in "aeiou" else "a"
        raise ConfigError(f"{flag(name)} applies only to --algo {' or '.join(who)} "
                          f"({flag(name)} is {article} {'/'.join(who)} option): remove it "
                          f"for --algo {cfg.algo}.")


def fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(Config))


FIELD_TYPES = {f.name: f.metadata["type"] for f in dataclasses.fields(Config)}


def _admit(cls) -> None:
    """Before an algorithm from outside is registered (algorithms/registry.py): refuse it if an
    option of a group new to lowband has the name of an existing option (of another meaning:
    an existing group shared is fine), then make its new groups part of Config, GROUPS and
    FIELD_TYPES, so flags, config files and validation know them. A group defined again (a
    notebook cell run again) takes the place of its first definition."""
    new = [g for g in dict.fromkeys(cls.options) if g not in GROUPS]
    again = {g: old for g in new for old in GROUPS if registry.same_definition(old, g)}
    owner = {name: g for g in GROUPS if g not in again.values() for name in g.names()}
    for group in new:
        for name in group.names():
            if name in owner:
                raise ConfigError(
                    f"algorithm class {cls.__qualname__}: option {flag(name)} of its group "
                    f"{group.__name__} is already the {owner[name].title} option {flag(name)} "
                    f"({owner[name].__name__}) of another meaning: rename it, or list "
                    f"{owner[name].__name__} in `options` to share it.")
            owner[name] = group
    if new:
        swap = {old: g for g, old in again.items()}
        GROUPS[:] = [swap.get(g, g) for g in GROUPS] + [g for g in new if g not in again]
        Config.__bases__ = (*reversed([g for g in new if g not in again]),  # after the others
                            *(swap.get(g, g) for g in Config.__bases__))
        for name in ("__dataclass_fields__", "__init__", "__repr__", "__eq__", "__hash__",
                     "__match_args__"):
            if name in Config.__dict__:
                delattr(Config, name)
        dataclass(Config)  # again, over the groups it now inherits
        FIELD_TYPES.clear()
        FIELD_TYPES.update((f.name, f.metadata["type"]) for f in dataclasses.fields(Config))
    _name_algorithms({**dict.copy(ALGORITHMS), cls.name: cls})


def _elastic(algorithms: dict) -> list[str]:
    """The algorithms that run --elastic: those whose class says `elastic` (algorithms/base.py)."""
    return [name for name, a in algorithms.items() if a.elastic]


ELASTIC_HELP = ElasticOptions.__dataclass_fields__["elastic"].metadata["help"]


def _name_algorithms(algorithms: dict) -> None:
    """--algo's help names the algorithms, --elastic's those that run elastic: lowband's own,
    and each registered from outside as it is (_admit)."""
    for group, name, text in ((RunOptions, "algo", f"training algorithm: {', '.join(algorithms)}"),
                              (ElasticOptions, "elastic", f"{ELASTIC_HELP} (--algo "
                               f"{', '.join(_elastic(algorithms))})")):
        f = group.__dataclass_fields__[name]
        f.metadata = MappingProxyType({**f.metadata, "help": text})


_name_algorithms(ALGORITHMS.builtin)
registry.HOOKS.append(_admit)
