"""The registry of algorithms, open to algorithms from outside the package.

lowband's own algorithms are listed in algorithms/__init__.py. A researcher adds one without
forking lowband, in three ways that all end in `register(cls)`:

- `lowband.register(MyAlgo)` in their own module (or a notebook, for runs in that process);
- an entry point of the group `lowband.algorithms` in their package's metadata
  (`[project.entry-points."lowband.algorithms"]  my-algo = "my_pkg.algos:MyAlgo"`), loaded the
  first time anything reads the registry;
- the environment variable LOWBAND_ALGORITHMS: module names or .py files, separated by ':' as
  in PYTHONPATH, imported the first time anything reads the registry
  (`LOWBAND_ALGORITHMS=my_algo.py lowband train --algo my-algo`; the workers of `lowband train`
  and of torchrun inherit it; `lowband launch --env LOWBAND_ALGORITHMS=...` passes it to a
  TorchX job's).

A worker process that `lowband train` spawns reads the registry afresh, so a registration
reaches it by the entry point or the variable; `register` adds the module of a class it
registers to the variable of its own process, so that workers started from there import it too
(a class defined in a notebook or a script's __main__ cannot reach them: put it in a module).

The readers (config validation, `lowband train --help`, recipes, the trainer, the planner, the
dashboard and the report) read ALGORITHMS, which loads the entry points and the variable on its
first read; `HOOKS` lets the config refuse a class whose new options clash and add its options.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from lowband.algorithms.base import EVERY_STEP, PERIODIC, Algorithm
from lowband.options import ALGORITHMS_ENV, ConfigError, Options

GROUP = "lowband.algorithms"  # the entry-point group
# called with a class about to be registered (after its own checks): may refuse it (ConfigError)
# and makes its new option groups part of the Config (lowband.config adds one)
HOOKS: list[Callable[[type], None]] = []
BROKEN: dict[str, str] = {}   # an entry point or module that failed to load -> the sentence said


class Registry(dict):
    """name -> Algorithm class. Reading it (a name, the names, the classes) first loads the
    entry points and LOWBAND_ALGORITHMS; `builtin` holds lowband's own, read without loading."""

    def __init__(self):
        super().__init__()
        self.builtin: dict[str, type[Algorithm]] = {}
        self.loaded = False
        self.loading = False  # while loading: the sources are in the variable or entry points

    def add_builtin(self, *algorithms: type[Algorithm]) -> None:
        """lowband's own algorithms (algorithms/__init__.py), taken as they are."""
        for a in algorithms:
            dict.__setitem__(self, a.name, a)
            self.builtin[a.name] = a

    def load(self) -> "Registry":
        if not self.loaded:
            self.loaded = self.loading = True  # a plugin reading the registry makes no loop
            for source in sources():
                _load(f"{ALGORITHMS_ENV} entry '{source}'", lambda: _import(source))
            for ep in entry_points(group=GROUP):
                _load(f"entry point '{ep.name} = {ep.value}' of group {GROUP}",
                      lambda: _register_loaded(ep.load()))
            self.loading = False
        return self

    def __getitem__(self, name):
        return super(Registry, self.load()).__getitem__(name)

    def __contains__(self, name):
        return super(Registry, self.load()).__contains__(name)

    def __iter__(self):
        return super(Registry, self.load()).__iter__()

    def __len__(self):
        return super(Registry, self.load()).__len__()

    def get(self, name, default=None):
        return super(Registry, self.load()).get(name, default)

    def keys(self):
        return super(Registry, self.load()).keys()

    def values(self):
        return super(Registry, self.load()).values()

    def items(self):
        return super(Registry, self.load()).items()


ALGORITHMS = Registry()  # lowband's own are added by algorithms/__init__.py


def sources() -> list[str]:
    """The modules and files LOWBAND_ALGORITHMS names."""
    return [s.strip() for s in os.environ.get(ALGORITHMS_ENV, "").split(os.pathsep) if s.strip()]


def _load(what: str, action: Callable[[], None]) -> None:
    """Run one loading action; a failure is said in one sentence and the others go on."""
    try:
        action()
    except Exception as e:  # noqa: BLE001 (anything a third-party import raises)
        reason = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        BROKEN[what] = f"lowband: skipped {what} ({reason.rstrip('.')}): fix it or remove it."
        print(BROKEN[what], file=sys.stderr)


def _import(source: str) -> None:
    """Import a module by name, or a .py file (registered under its stem)."""
    if not source.endswith(".py"):
        importlib.import_module(source)
        return
    path = Path(source).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no file {source}")
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path:
            return  # imported already (this process registered from it)
    if path.stem in sys.modules:
        raise ImportError(f"the module name '{path.stem}' is another module's: rename the file")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(path.stem, None)
        raise


def _register_loaded(obj) -> None:
    """An entry point names an Algorithm class (registered here) or a module that registers."""
    if isinstance(obj, type):
        register(obj)
    elif not hasattr(obj, "__file__"):
        raise ConfigError(f"it names {obj!r}, neither an Algorithm class nor a module")


NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def register(cls: type) -> type:
    """Add an algorithm class to the registry: its flags, validation, the trainer, telemetry,
    the dashboard, the report and (for a subclass of an algorithm it models) the planner see it.
    Checks the class and raises ConfigError with one sentence on a bad one. Returns the class,
    so it also serves as a decorator. The class defined again (a notebook cell run again, a
    module reloaded) replaces its first definition, option groups included."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ConfigError(f"register() takes a subclass of lowband.algorithms.Algorithm, got "
                          f"{cls!r}: subclass Algorithm (or one of lowband's algorithms).")
    what = f"algorithm class {cls.__qualname__}"
    name = cls.__dict__.get("name")
    registry = ALGORITHMS
    taken = dict.get(registry, cls.name)
    if taken is not None and name not in registry.builtin and same_definition(taken, cls):
        taken = None  # defined again: it replaces the first definition
    elif taken is cls or (taken is not None and _same_file(taken, cls)):
        return taken  # registered already (its file imported again under another name)
    if not isinstance(name, str):
        raise ConfigError(f"{what} declares no `name` of its own (it would be "
                          f"'{cls.name}'): set `name = \"...\"` on the class.")
    if not NAME.fullmatch(name):
        raise ConfigError(f"{what}'s name '{name}' is not a valid --algo value: use lowercase "
                          "letters, digits, '-' and '_'.")
    if taken is not None:
        by = ("lowband's built-in" if name in registry.builtin
              else f"{taken.__module__}.{taken.__qualname__}, also")
        raise ConfigError(f"{what}'s name '{name}' is taken by {by} --algo {name}: give the "
                          "class another `name`.")
    if cls.kind not in (EVERY_STEP, PERIODIC):
        raise ConfigError(f"{what}'s kind must be EVERY_STEP or PERIODIC (lowband.algorithms."
                          f"base), got {cls.kind!r}.")
    if not isinstance(cls.elastic, bool):
        raise ConfigError(f"{what}'s elastic (whether it runs --elastic) must be True or False, "
                          f"got {cls.elastic!r}.")
    if not (isinstance(cls.summary, str) and cls.summary.strip()):
        raise ConfigError(f"{what} has no `summary`: set one line, shown by --help and "
                          "`lowband recipes`.")
    if not isinstance(cls.options, tuple) or not all(
            isinstance(g, type) and issubclass(g, Options) and dataclasses.is_dataclass(g)
            for g in cls.options):
        raise ConfigError(f"{what}'s `options` must be a tuple of option groups (dataclasses "
                          f"subclassing lowband.options.Options), got {cls.options!r}.")
    fields = {f.name for g in cls.options for f in dataclasses.fields(g)}
    for key in cls.defaults:
        if key not in fields:
            raise ConfigError(f"{what}'s defaults name '{key}', which none of its option groups "
                              "declares: add the group that declares it to `options`.")
    for hook in HOOKS:
        hook(cls)
    dict.__setitem__(registry, name, cls)
    _export(cls)
    return cls


def same_definition(a: type, b: type) -> bool:
    """Whether b is a's class (or option group) defined again: the same module and name."""
    return a is not b and (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _same_file(a: type, b: type) -> bool:
    """The same class from the same source imported twice (a file under two module names)."""
    try:
        import inspect
        return a.__qualname__ == b.__qualname__ and inspect.getfile(a) == inspect.getfile(b)
    except (TypeError, OSError):
        return False


def _export(cls: type) -> None:
    """Name the module of a registered class in LOWBAND_ALGORITHMS, so that worker processes
    started from this one register it too: a package's module by name, a lone file by path."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if ALGORITHMS.loading or cls.__module__ == "__main__" or not file:
        return
    source = cls.__module__ if "." in cls.__module__ else str(Path(file).resolve())
    present = sources()
    if not any(s == source or (s.endswith(".py") and Path(s).resolve() == Path(file).resolve())
               for s in present):
        os.environ[ALGORITHMS_ENV] = os.pathsep.join(present + [source])
