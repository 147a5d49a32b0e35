"""`lowband compare [--recipes ...] [--configs ...] [--algos ...] [OPTIONS] [--] [TRAIN FLAGS]`"""

from __future__ import annotations

import sys

from lowband.config import ArgParser

DESCRIPTION = (
    "Run recipes, configs and algorithms one after another on the same `lowband train` flags "
    "(after --; every `lowband train --help` option but --algo, --run-dir and --resume; a "
    "--recipe or --config there is what the --algos runs start from), each with the machine to "
    "itself, at an equal wall-clock budget (default: "
    "the first ddp run's training time for its --steps, or --time-budget SECONDS for every run) "
    "or at equal tokens. Prints and writes (DIR/compare.json, DIR/report.html) per run the "
    "training time, tokens and outer-link bytes it took to reach the target validation loss "
    "(default: the reference's final one), its validation loss at equal time, its compute "
    "utilization measured and planned, and its tokens/s. Calling again with the same --dir "
    "continues a comparison that stopped.")
USAGE = ("lowband compare [--recipes NAMES] [--configs PATHS] [--algos NAMES] "
         "[--equal {time,tokens}] [--dir DIR] [--no-report] [--test-hosts] [--] "
         "[TRAIN FLAGS: --target-loss L, --time-budget SECONDS, --model ..., --link-bandwidth ...]")
EPILOG = ("example: lowband compare --algos ddp,diloco,streaming -- --model mini "
          "--link-bandwidth 100Mbit --steps 200")


def parser() -> ArgParser:
    p = ArgParser(prog="lowband compare", description=DESCRIPTION, epilog=EPILOG, usage=USAGE)
    p.add_argument("--recipes", metavar="NAME,NAME", help="recipes to run (`lowband recipes`)")
    p.add_argument("--configs", metavar="PATH,PATH", help="TOML files, runs' config.json or run "
                   "directories to run (as `lowband train --config PATH`)")
    p.add_argument("--algos", metavar="NAME,NAME", help="algorithms to run, each on the flags "
                   "alone (options of other algorithms' groups left out); runs go in this "
                   "order: recipes, configs, algorithms; the first ddp run (else the first run) "
                   "is the reference and runs first")
    p.add_argument("--equal", choices=("time", "tokens"), default="time",
                   help="what every run gets the same of (default: time)")
    p.add_argument("--dir", metavar="DIR", help="the comparison directory: one run directory a "
                   "run, compare.json and report.html (default: compare/<time>); the same DIR "
                   "with the same runs and flags continues it")
    p.add_argument("--no-report", action="store_true", help="write no report.html")
    p.add_argument("--test-hosts", action="store_true", help="run over a real shaped link "
                   "instead of the emulated one: one test host (network namespace) a replica, "
                   "each host's link shaped by tc to --link-bandwidth, or to a measured --link "
                   "FILE's (no latency added); needs root, `ip` and `tc`")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    if {"-h", "--help"} & set(argv[:cut]):
        parser().print_help()
        return 0
    from lowband.compare.runner import compare

    # bad input (ConfigError) and a failed run (CompareStopped, its exit status) are UserErrors:
    # `lowband`'s handler (cli.py) prints their sentence
    try:
        args, extra = parser().parse_known_args(argv[:cut])
        compare(args.recipes, args.configs, args.algos, flags=[*extra, *argv[cut + 1:]],
                equal=args.equal, directory=args.dir, report=not args.no_report,
                test_hosts=args.test_hosts)
    except KeyboardInterrupt:
        print("lowband compare: interrupted; call it again with the same --dir to continue.",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
