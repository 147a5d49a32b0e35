"""python -m lowband.plan ... (the same as `lowband plan ...`)."""

import sys

from lowband.cli import main

raise SystemExit(main(["plan", *sys.argv[1:]]))
