"""`python -m lowband.doctor ARGS`: `lowband doctor ARGS` (what `lowband launch --doctor` runs
on each node)."""

import sys

from lowband.cli import main

sys.exit(main(["doctor", *sys.argv[1:]]))
