"""Running a comparison: the runs one after another, each with the machine to itself and
started as `lowband train` starts it (launch/here.py), in one comparison directory:

    compare/<time>/compare.json    what it runs (its identity), what each run was given, the table
    compare/<time>/<name>/         one run directory per entry
    compare/<time>/report.html     the table, then lowband report's page of every run

At equal time (the default) the reference (the first ddp run, else the first run) runs first
for its --steps and every other run gets its measured training seconds as --time-budget, with
--steps raised so that the time ends it; with --time-budget among the flags every run gets that
budget. At equal tokens every run trains on the reference's tokens (its --steps scaled by the
tokens a step). A run whose directory holds summary.json is done and skipped, so calling again
with the same directory continues where it stopped: an unfinished run resumes from its newest
intact checkpoint, or starts over when it has none.

With test_hosts (root), the runs go over a real shaped link instead of the emulated one: R test
hosts (lowband.launch.hosts: network namespaces on veths, each host's egress shaped by tbf to
the flags' --link-bandwidth, or a measured --link FILE's), replica i's ranks on host i, the
emulated link off. This kernel has no netem, so that link adds no latency: --link-latency is
not applied there (compare.json's `link` says so), and the plan's columns take the hosts'
bandwidth. A measured link (--link FILE) is named as the comparison starts, and compare.json's
`link.measured` and the report keep its record.
"""

from __future__ import annotations

import contextlib

import math
import sys
import time
from pathlib import Path

from lowband.compare import entries as E
from lowband.compare import table as T
from lowband.config import ConfigError
from lowband.dashboard.tables import measured_text
from lowband.flags import parse_train
from lowband.options import UserError, needs_extra
from lowband.summary import one_line
from lowband.telemetry import RunDir, write_json_atomic

STEPS_CAP = 1_000_000  # --steps of a run that its time budget ends
EQUAL = ("time", "tokens")


class CompareStopped(UserError, RuntimeError):
    """A run failed or was interrupted; `code` is its exit status. Calling again with the same
    directory continues the comparison."""
    label = ""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def compare(recipes=(), configs=(), algos=(), *, flags=(), equal: str = "time",
            target_loss: float | None = None, directory=None, report: bool = True,
            out=None, test_hosts: bool = False, **options) -> dict:
    """Run the entries one after another on the same flags and budget, and return the table
    (compare.json's: `runs`, a row per entry, and what they were compared on).

    recipes, configs, algos: names ("ddp,streaming" or a list), or a mapping of names to options
    of their own ({"ddp": {}, "streaming": {"fragments": 2}}); flags: `lowband train` flags for
    every run (["--model", "nano"]), options: the same as keywords (model="nano"); equal: "time"
    or "tokens"; target_loss: the validation loss to reach (default: the reference's final one);
    directory: the comparison directory (default compare/<time>; an unfinished one continues);
    report: write report.html; out: where progress is printed (default stdout); test_hosts: run
    over real test hosts joined by a link shaped to --link-bandwidth (root; see above).
    Raises ConfigError (one sentence) on bad input before anything is written, CompareStopped
    when a run fails or is interrupted."""
    from lowband.launch.job import flag_args

    say = (lambda *a: print(*a, file=out or sys.stdout, flush=True))
    if equal not in EQUAL:
        raise ConfigError(f"--equal must be time or tokens, got '{equal}'.")
    if report:
        needs_extra("ui", "the comparison's report.html (--no-report leaves it out)", "plotly")
    args = E.shared_args([*flags, *flag_args(options)])
    target_loss = args.pop("target_loss", target_loss)
    if target_loss is not None and not (isinstance(target_loss, (int, float))
                                        and math.isfinite(target_loss) and target_loss > 0):
        raise ConfigError(f"--target-loss must be a positive, finite validation loss, got "
                          f"{target_loss}: leave it out to reach the reference's final one.")
    runs = E.resolve(recipes, configs, algos, args)
    ref = E.reference(runs)
    if equal == "tokens":
        for e in runs:
            if e.config.time_budget is not None:
                raise ConfigError(f"{e.given} has a --time-budget, and --equal tokens ends every "
                                  "run by its tokens: remove the budget or compare at equal time.")
    for e in runs:
        for name in e.dropped:
            say(f"lowband compare: note: --{name.replace('_', '-')} is not an option of --algo "
                f"{e.name}: left out of its run.")
    hosts = _test_hosts(runs) if test_hosts else None
    spec = E.identity(runs, equal) | ({"link": hosts.rate} if hosts else {})
    root = _directory(directory, spec)
    state = RunDir(root).read_json(root / "compare.json") or {"identity": spec}
    write_json_atomic(root / "compare.json", state)
    order = [ref] + [e for e in runs if e is not ref]
    given = {}
    if ref.config.measured_link:  # --link FILE
        say(f"lowband compare: {measured_text(ref.config.measured_link)}")
    if hosts is not None:
        say(f"lowband compare: test hosts {', '.join(hosts.names)}, each host's link shaped to "
            f"{hosts.rate} (tbf)")
    with hosts if hosts is not None else contextlib.nullcontext():  # hosts: set up, then removed
        _run_all(order, ref, root, equal, given, say, hosts)
    result = _result(runs, ref, root, equal, given, target_loss, hosts)
    write_json_atomic(root / "compare.json", {**state, **result})
    say(T.text(result))
    if report:
        path = _report(root, runs, result, say)
        if path:
            say(f"report: {path}")
    say(f"table: {root / 'compare.json'}")
    return result


def _run_all(order: list[E.Entry], ref: E.Entry, root: Path, equal: str, given: dict, say,
             hosts) -> None:
    """Run the entries in order (the reference first), skipping those done before."""
    for i, e in enumerate(order, 1):
        given[e.label] = _budget(e, ref, root, equal)
        run = RunDir(root / e.label)
        if run.read_json(run.summary) is not None:
            say(f"lowband compare: [{i}/{len(order)}] {e.label}: done before ({run.root})")
            continue
        say(f"lowband compare: [{i}/{len(order)}] {e.label}: {_given_text(given[e.label], e, ref)}"
            f" -> {run.root}")
        code = _train(e, run, given[e.label], hosts)
        if code:
            again = f"call it again with --dir {root} to continue"
            if code == 130:
                raise CompareStopped(f"interrupted during {e.label}; {again}.", 130)
            raise CompareStopped(f"the run {e.label} failed (exit status {code}); fix what it "
                                 f"says and {again}.", code)
        say(one_line(_summary(root, e)))


def _test_hosts(runs: list[E.Entry]):
    """The test hosts the runs go over (not yet set up): one a replica, each host's egress
    shaped to the runs' --link-bandwidth; ConfigError (one sentence) where they cannot be."""
    from lowband.launch.hosts import TestHosts
    from lowband.units import parse_bandwidth

    links = {e.config.link_bandwidth for e in runs}
    if links == {""} or len(links) != 1:
        raise ConfigError("--test-hosts shapes the hosts' link to the runs' --link-bandwidth: "
                          "give one --link-bandwidth for every run.")
    for e in runs:
        if e.config.elastic:
            raise ConfigError(f"{e.given} is --elastic, whose groups start on this machine: "
                              "compare it without --test-hosts.")
    n = max(2, max(e.config.replicas for e in runs))
    rate = f"{parse_bandwidth(links.pop()) / 1e3:g}kbit"
    hosts = TestHosts("lbc", "10.213.14", rate, "128kb", "100ms", n=n)
    why = hosts.unavailable()
    if why:
        raise ConfigError(f"--test-hosts {why}: run as root, or compare on the emulated link.")
    return hosts


def _directory(directory, spec: dict) -> Path:
    """The comparison's directory, made: refused (one sentence) where it holds anything but this
    comparison."""
    if directory is None:
        base = Path("compare") / time.strftime("%Y%m%d-%H%M%S")
        for n in range(1, 1000):
            root = base if n == 1 else Path(f"{base}-{n}")
            try:
                root.mkdir(parents=True)
                return root
            except FileExistsError:
                continue
        raise ConfigError(f"compare/ has no free name like {base}: give --dir.")
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--dir {root} is a file: give a directory for the comparison.")
    held = RunDir(root).read_json(root / "compare.json")
    if held is not None and held.get("identity") != spec:
        raise ConfigError(f"{root} holds {E.difference(held.get('identity') or {}, spec)}: give "
                          "another --dir, or the same runs and flags to continue it.")
    if held is None and root.is_dir() and any(root.iterdir()):
        raise ConfigError(f"{root} is not empty and holds no comparison (compare.json): give a "
                          "new or empty --dir.")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _budget(e: E.Entry, ref: E.Entry, root: Path, equal: str) -> dict:
    """What the entry's run is given beyond its own config: {"steps": N} and, at equal time,
    {"time_budget": seconds}: the reference's own budget (the flags' --time-budget) for every
    run, else the reference's measured training seconds for the others."""
    cfg, r = e.config, ref.config
    if equal == "tokens":
        mine = cfg.batch_size * cfg.seq_len * cfg.grad_accum * cfg.world
        theirs = r.batch_size * r.seq_len * r.grad_accum * r.world * r.steps
        return {"steps": max(1, round(theirs / mine))}
    if r.time_budget is not None:
        return {"steps": STEPS_CAP, "time_budget": r.time_budget}
    if e is ref:
        return {"steps": cfg.steps}
    return {"steps": STEPS_CAP, "time_budget": _summary(root, ref)["wall_s"]}


def _summary(root: Path, e: E.Entry) -> dict:
    run = RunDir(root / e.label)
    return run.read_json(run.summary) or {}


def _given_text(given: dict, e: E.Entry, ref: E.Entry) -> str:
    if "time_budget" not in given:
        return f"{given['steps']} steps" + (" (the reference)" if e is ref else
                                            f" ({ref.label}'s tokens)")
    return f"a time budget of {given['time_budget']:.3g} s" + (
        f" ({ref.label}'s training time)" if e is not ref and ref.config.time_budget is None
        else "")


def _train(e: E.Entry, run: RunDir, given: dict, hosts=None) -> int:
    """Start the entry's run as `lowband train` starts it (on the test hosts, without the
    emulated link, where there are some), or continue it from its newest intact checkpoint: its
    exit status."""
    from lowband.checkpoint import newest_intact
    from lowband.launch.here import train_here
    from lowband.launch.job import flag_args

    if run.config.exists() and not e.config.elastic and newest_intact(run)[0] is not None:
        argv = ["--resume", str(run.root)] + ([] if e.config.progress else ["--no-progress"])
    else:
        values = {**e.config.to_dict(), **given, "run_dir": str(run.root), "overwrite": True}
        if hosts is not None:  # the hosts' link is the link (a measured one's bandwidth)
            values |= {"link_bandwidth": "", "link_latency": "0ms", "link": ""}
        argv = flag_args(values)
    cfg, resume = parse_train(argv)
    return train_here(cfg, argv, resume, hosts)[0]


def _result(runs: list[E.Entry], ref: E.Entry, root: Path, equal: str, given: dict,
            target_loss: float | None, hosts=None) -> dict:
    """compare.json's table and what it was measured against."""
    reference = _summary(root, ref)
    loss = target_loss if target_loss is not None else reference.get("final_val_loss")
    link = ref.config.link_bandwidth if hosts is None else hosts.rate
    rows, equal_s = T.rows([(e.label, str(root / e.label), given[e.label]) for e in runs], loss,
                           ref.label, None if hosts is None else link)
    return {"dir": str(root), "equal": equal, "reference": ref.label, "target_loss": loss,
            "link": {"test_hosts": hosts is not None, "bandwidth": link or None,
                     "latency": "none added (tbf only)" if hosts else ref.config.link_latency,
                     **({"measured": ref.config.measured_link}
                        if ref.config.measured_link else {})},
            "target_from": "--target-loss" if target_loss is not None else
            f"{ref.label}'s final validation loss",
            "budget_s": (ref.config.time_budget or reference.get("wall_s")) if equal == "time"
            else None, "equal_time_s": equal_s, "runs": rows}


def _report(root: Path, runs: list[E.Entry], result: dict, say) -> Path | None:
    from lowband.report import ReportError, write_report

    try:
        return write_report([root / e.label for e in runs], root / "report.html",
                            title="lowband compare · " + ", ".join(e.label for e in runs),
                            compare=result)
    except ReportError as err:  # (the ui extra was asked for before the runs)
        say(f"lowband compare: note: no report.html: {err}")
    return None
