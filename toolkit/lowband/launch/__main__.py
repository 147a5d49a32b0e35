"""`python -m lowband.launch ARGS`: the `lowband launch` command; `python -m lowband.launch
torchrun ARGS` is the node agent each node of a job runs (component.py)."""

import sys

from lowband.config import ConfigError
from lowband.launch.cli import main

try:
    sys.exit(main(sys.argv[1:]))
except ConfigError as e:
    print(f"lowband: error: {e}", file=sys.stderr)
    sys.exit(2)
