"""`python -m lowband.launch ARGS`: the `lowband launch` command; `python -m lowband.launch
torchrun ARGS` is the node agent each node of a job runs (component.py)."""

import sys

from lowband.cli import main

sys.exit(main(["launch", *sys.argv[1:]]))
