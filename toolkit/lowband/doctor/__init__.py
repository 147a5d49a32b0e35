"""`lowband doctor`: the first run across real machines works, or says exactly why.

    lowband doctor                                          # this machine, and its transport
    lowband doctor --nodes 2 --rdzv 10.0.0.1:29500 --save-link link.json -- --model mini

here.py (this machine), nodes.py (the checks across the nodes: the rendezvous, ports both ways,
names, the secret, clocks), measure.py (the link, measured with gloo), cli.py (the command
line, the order of the checks, and the plan on the measured link). docs/doctor.md.
"""

from lowband.doctor.cli import main

__all__ = ["main"]
