"""`lowband report`: a static, offline HTML report of one or more run directories.

    lowband report runs/a runs/b -o report.html        (or write_report([...], "report.html"))

The page itself is built in lowband.dashboard.export (Dashboard.export_html writes the same
one); this module is its command line, the report every `lowband train` writes into its run
directory (run_report), and the names a script imports from lowband.report.
"""

from __future__ import annotations

from pathlib import Path

from lowband.config import ArgParser, ConfigError
from lowband.dashboard.export import ReportError, load_runs, render_report, write_report
from lowband.dashboard.tables import run_record

__all__ = ["ReportError", "load_runs", "main", "render_report", "run_record", "run_report",
           "write_report"]


def run_report(run_dir) -> str:
    """The line a finished `lowband train` ends with: `report: RUN/report.html`, the report it
    wrote of the run, or one sentence saying why it could not (the ui extra not installed)."""
    try:
        path = write_report(run_dir, Path(run_dir) / "report.html")
    except ConfigError as e:  # the ui extra is not installed: needs_extra's sentence
        return (f"report: not written: {str(e).rstrip('.')}, then `lowband report {run_dir} -o "
                f"{Path(run_dir) / 'report.html'}`.")
    except ReportError as e:
        return f"report: not written: {e}"
    return f"report: {path}"


def main(argv: list[str] | None = None) -> int:
    """`lowband report RUN_DIR [RUN_DIR ...] -o out.html`"""
    parser = ArgParser(
        prog="lowband report",
        description="Write an offline HTML report (figures, summaries, configs) of one or more "
                    "runs; several runs are overlaid for comparison.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run directory")
    parser.add_argument("-o", "--output", default="report.html",
                        help="the HTML file to write (default: report.html)")
    parser.add_argument("--title", help="the report's title (default: the runs' names)")
    parser.add_argument("--window", type=float, default=None, metavar="SECONDS",
                        help="show the last SECONDS of each timeline at first (default: all)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    # bad input (ReportError; ConfigError: a bad flag, the ui extra missing) is a UserError:
    # `lowband`'s handler (cli.py) prints its sentence
    path = write_report(args.run_dirs, args.output, title=args.title, window_s=args.window)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
