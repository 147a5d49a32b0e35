"""How options are declared: the bottom of the package (it imports nothing of lowband).

An option group is a dataclass of `option(...)` fields with a `check(cfg)` classmethod. Each
group lives beside the code that reads it (the run's own options in config.py, each
algorithm's in its file under algorithms/, the fault injectors' in faults.py); `Config`
inherits every group, so a run is still one flat object (`cfg.fragments`), and the registry of
algorithms says which groups each algorithm reads. That registry drives validation ("--x
applies only to --algo y") and the grouped `lowband train --help`.

Every command's refusals start here too: UserError (the base of every error a user can cause or
must be told of in one sentence, which `lowband`'s one handler in cli.py prints), ConfigError,
ArgParser, and needs_extra (a feature whose optional extra is not installed).

The job's environment variables are here as well, in one table (ENV): the options and facts that
reach a job's processes through their environment. Every module that reads or sets one imports
its constant from here, so each name is spelled once (tests/test_options.py checks the package).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import os
from dataclasses import field
from typing import ClassVar


ENV: dict[str, str] = {}
"""Every environment variable lowband reads or sets: its name -> what it says (one line). torchrun's
own (RANK, WORLD_SIZE, MASTER_ADDR, ...) and the schedulers' are not lowband's and not here."""


def _variable(name: str, meaning: str) -> str:
    """`name`, entered in ENV with its meaning."""
    ENV[name] = meaning
    return name


# a job's layout (launch/env.py reads it back for a launched script; launch/component.py sets it)
REPLICAS_ENV = _variable("LOWBAND_REPLICAS", "R, replica groups (joined by the slow outer link)")
SHARDS_ENV = _variable("LOWBAND_SHARDS", "S, ranks inside each replica group")
RUN_DIR_ENV = _variable("LOWBAND_RUN_DIR", "the run directory, on a filesystem every node shares")
PROGRESS_ENV = _variable("LOWBAND_PROGRESS", "1 or 0: whether rank 0 shows a progress bar")
# an elastic job's options, lowband train's (ElasticOptions, comm/membership/elastic.py)
ELASTIC_ENV = _variable("LOWBAND_ELASTIC", "1: each replica group a job of its own (--elastic)")
MIN_REPLICAS_ENV = _variable("LOWBAND_MIN_REPLICAS", "--min-replicas of an elastic job")
MAX_RESTARTS_ENV = _variable("LOWBAND_MAX_RESTARTS", "--max-restarts of an elastic job")
QUORUM_TIMEOUT_ENV = _variable("LOWBAND_QUORUM_TIMEOUT", "--quorum-timeout (seconds)")
ELASTIC_TIMEOUT_ENV = _variable("LOWBAND_ELASTIC_TIMEOUT", "--elastic-timeout (seconds)")
HEARTBEAT_TIMEOUT_ENV = _variable("LOWBAND_HEARTBEAT_TIMEOUT", "--heartbeat-timeout (seconds)")
# membership and trust (comm/membership/)
REPLICA_ENV = _variable("LOWBAND_REPLICA", "an elastic job's process: the replica group it is in")
LIGHTHOUSE_ENV = _variable("TORCHFT_LIGHTHOUSE", "torchft's: the address of the job's Lighthouse")
LIGHTHOUSE_HOST_ENV = _variable("LOWBAND_LIGHTHOUSE_HOST", "a Slurm group job: the Lighthouse's "
                                "host (launch/slurm.py)")
LIFE_ENV = _variable("LOWBAND_LIGHTHOUSE_LIFE", "a file: how often the Lighthouse was restarted")
SECRET_ENV = _variable("LOWBAND_SECRET_FILE", "the path of the run's secret, RUN_DIR/secret")
BIND_ENV = _variable("LOWBAND_BIND_HOST", "the address or interface every listener binds")
RANK0_ENV = _variable("LOWBAND_RANK0_ENV", "the name of the scheduler's variable naming the "
                      "first node")
# the processes of a job
NODE_ENV = _variable("LOWBAND_NODE", "a node's name: its log is RUN_DIR/logs/<name>.log")
NODE_LOG_ENV = _variable("LOWBAND_NODE_LOG", "set for a node agent's own process, under its tee")
WORKER_ENV = _variable("LOWBAND_WORKER", "1: a worker `lowband train` started itself "
                       "(launch/local.py)")
REQUEUE_ENV = _variable("LOWBAND_REQUEUE", "1: a Slurm job that requeues itself when SIGUSR1 "
                        "stops it (lowband launch --requeue; checkpoint/preempt.py)")
# the user's
ALGORITHMS_ENV = _variable("LOWBAND_ALGORITHMS", "algorithm modules or .py files to import, "
                           "separated by os.pathsep")
CACHE_ENV = _variable("LOWBAND_CACHE", "the cache directory (default ~/.cache/lowband)")


PREEMPTED = 5  # the exit status of a run SIGTERM or SIGUSR1 stopped after a checkpoint (docs/faults.md)
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")  # what stops a run that way (checkpoint/preempt.py)


class UserError(Exception):
    """What a user can fix, or must know, in one sentence: its message. Every command stops on it
    the same way (cli.py: `lowband: error: SENTENCE`, exit status 2), no traceback. A subclass
    sets `code` (the exit status) and `label` (what precedes the sentence) where it is not bad
    input but a stop a user is told of (ElasticStopped: exit 3, no `error:`)."""
    code: int = 2
    label: str = "error: "


class ConfigError(UserError, ValueError):
    """Input a user can fix; its message is one sentence naming the fix."""


class FilesystemError(UserError):
    """A filesystem fault (a full disk, a read-only filesystem, a directory removed, a file
    where a directory should be) told in one sentence naming the path and the fix
    (filesystem_error). code: 2 before a run starts, 3 for a run it stopped mid-way."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


_FULL = (errno.ENOSPC, errno.EDQUOT)
_FS_FAULTS = (*_FULL, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EEXIST,
              errno.ENOTDIR, errno.EISDIR)


def filesystem_error(e: BaseException, where=None, code: int = 2) -> FilesystemError | None:
    """The one sentence for a filesystem fault in `e` or in an error it was raised from (torch.save
    raises a RuntimeError from a full disk's OSError); None for any other error. where: the
    directory being written (a run directory), named with the file the error names, or alone
    where it names none. code: 2 for a command refused before it started, 3 for a run stopped
    mid-way (whose result files are whole or absent, and whose last checkpoint is intact)."""
    seen = set()
    while e is not None and id(e) not in seen and not (
            isinstance(e, OSError) and e.errno in _FS_FAULTS):
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if e is None or id(e) in seen:
        return None
    path = os.fspath(e.filename) if e.filename else None
    subject = path or (os.fspath(where) if where else "the output")
    inside = where and (not path or os.path.abspath(path).startswith(
        os.path.abspath(where) + os.sep))  # a file of the run directory
    if path and inside:
        subject = f"{os.fspath(where)} (writing {os.path.relpath(path, where)})"
    if e.errno in _FULL:
        what = "no space left" if e.errno == errno.ENOSPC else "the disk quota is used up"
        kept = ("; results are written whole or not at all, and the run's last checkpoint, if "
                "any, is intact" if code == 3 else "")
        other = "give --run-dir on another disk" if code == 3 else "write on another disk"
        text = f"{what} on the device of {subject}: free space, or {other}{kept}"
    elif e.errno == errno.EROFS:
        text = (f"{subject} is on a read-only filesystem: give a path on a writable one "
                "(--run-dir, --dir, -o), or run from a writable directory")
    elif e.errno in (errno.EACCES, errno.EPERM):
        text = (f"permission denied on {subject}: give a path you may write to, or change its "
                "permissions")
    elif e.errno == errno.ENOENT and code == 3 and inside:
        text = (f"cannot write {subject}: its directory was removed while the run was writing to "
                "it, so the run stopped; start it again in a directory that stays")
    elif e.errno == errno.ENOENT:
        text = f"{subject} does not exist: give another path, or create it"
    elif e.errno == errno.EISDIR:
        text = f"{path or subject} is a directory where a file should be: give a file name"
    else:  # EEXIST, ENOTDIR: the file in the way (the deepest part of the path that exists)
        parts = [p for p in [path, *_parents(path)] if p and os.path.lexists(p)]
        if parts and not os.path.isdir(parts[0]):
            text = (f"{parts[0]} is a file where a directory should be: give another path, or "
                    "move the file away")
        else:
            text = f"cannot write {subject} ({e.strerror}): give another path"
    return FilesystemError(text + ".", code)


def _parents(path: str | None) -> list[str]:
    """path's parents, nearest first."""
    out = []
    while path and os.path.dirname(path) not in ("", path):
        path = os.path.dirname(path)
        out.append(path)
    return out


def missing_extra(extra: str, what: str, module: str) -> ConfigError:
    """The one sentence for `what`, which needs lowband's optional extra `extra` (pyproject.toml),
    whose `module` is not installed."""
    return ConfigError(f"{what} needs the {extra} extra ({module} is not installed): "
                       f"pip install 'lowband[{extra}]'.")


def needs_extra(extra: str, what: str, *modules: str) -> None:
    """Refuse `what` (missing_extra's sentence) unless each of `modules` (top-level names) is
    installed; they are looked up without importing them, so each command asks first, before it
    writes anything."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install, or sys.modules[module] set to None
            found = False
        if not found:
            raise missing_extra(extra, what, module)


class ArgParser(argparse.ArgumentParser):
    """argparse for lowband's commands: a bad flag raises ConfigError with one sentence, no usage
    block; each command prints it and exits with status 2. Abbreviations are refused (`--step`
    is not taken for --steps: a flag means what it names), with the options it may have meant."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        meant = self.meant(message)
        hint = f": did you mean {' or '.join(meant)}?" if meant else ""
        raise ConfigError(f"{message}{hint} (see `{self.prog} --help`).")

    def meant(self, message: str) -> list[str]:
        """The options an unrecognized flag in `message` may stand for: those it begins (an
        abbreviation), else the closest spelling."""
        if not message.startswith("unrecognized arguments:"):
            return []
        known = [s for s in self._option_string_actions if s.startswith("--")]
        for token in message.split(":", 1)[1].split():
            given = token.split("=", 1)[0]
            if not given.startswith("--") or given in known:
                continue
            started = sorted((s for s in known if s.startswith(given)), key=len)[:3]
            return started or [m for m in [close_match(given, known)] if m]
        return []


def close_match(given: str, known, cutoff: float = 0.75) -> str | None:
    """The one of `known` that `given` most likely misspells (difflib's closest, None when none
    is close): the did-you-mean of a flag, an option of lowband.Sync, a config key, a recipe."""
    import difflib

    found = difflib.get_close_matches(given, list(known), n=1, cutoff=cutoff)
    return found[0] if found else None


def option(default, help: str, choices=None, kind=None, shown=None):
    """A field; `kind` is its type where the default is None (resolved per algorithm, or by its
    group's `resolve`); `shown`: what --help says its default is, where None says too little."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "type": kind or type(default), "shown": shown})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class Options:
    """A group of options. Subclasses are dataclasses; `title` heads the group in --help.
    `shared_knob`: set for an algorithm that does not read the group, its options are ignored
    with a note (a sweep passes --sync-every to every algorithm) rather than refused."""
    title: ClassVar[str] = ""
    shared_knob: ClassVar[bool] = False

    @classmethod
    def names(cls) -> list[str]:
        """The fields this group declares itself (not those of groups it inherits)."""
        own = cls.__dict__.get("__annotations__", {})
        return [f.name for f in dataclasses.fields(cls) if f.name in own]

    @classmethod
    def resolve(cls, cfg, algorithm) -> None:
        """Fill a field still None whose default depends on other options (OuterOptions:
        --outer-lr by --replicas and --sync-every), or put one in the form the run records
        (ModelOptions: a model's local path made absolute); `algorithm` is the run's algorithm
        class. Called by Config.validate after the algorithm's `defaults` and the checks of the groups
        before this one, just before this group's check, so the value a run used is the one
        its config.json records."""

    @classmethod
    def check(cls, cfg) -> None:
        """Raise ConfigError for a bad value; `cfg` is the whole Config."""


def require(cfg, names, test, what: str) -> None:
    """ConfigError naming the first of `names` whose value fails `test` ("must be `what`")."""
    for name in names:
        value = getattr(cfg, name)
        if not test(value):
            raise ConfigError(f"{flag(name)} must be {what}, got {value}.")


def positive(x) -> bool:
    return x > 0


def non_negative(x) -> bool:
    return x >= 0


def unit_interval(x) -> bool:
    return 0 <= x <= 1
