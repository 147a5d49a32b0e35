"""Launch `lowband train` through TorchX: locally (local_cwd), on Slurm or on Kubernetes.

    h = lowband.launch(model="nano", steps=200)          # Python: returns a LaunchHandle at once
    h.status(); h.logs(); h.wait(600); h.cancel(); h.run_dir
    lowband launch -s slurm --gpu 8 --shards 8 --replicas 4 -- --algo streaming   # the CLI
    h = lowband.launch(script="train_mine.py", script_args=["--lr", "3e-4"], replicas=4)
    lowband launch --script train_mine.py --replicas 4 -- --lr 3e-4                # your script

A launched script reads its layout from the workers' environment (LOWBAND_REPLICAS,
LOWBAND_SHARDS, LOWBAND_RUN_DIR, LOWBAND_PROGRESS): `layout()` gives them as Config keywords and
`launch_config(**options)` the Config itself (env.py).

Both build the job from the `train` component in component.py (registered as `lowband.train`
for `torchx run`; launchers/lowband_components.py re-exports it by path) and hand it to TorchX's runner. A local_cwd job's processes
belong to this Python process: they keep running after the call (and the notebook cell) returns,
and are stopped by `cancel()` or when this process exits.

`python -m lowband.launch torchrun ARGS` (__main__.py) is the agent each node runs: torchrun,
after checking that the rendezvous can be reached, with one clear sentence instead of a
traceback when a node cannot reach it or not every node joins within the timeout.

The package, by part: component.py (the TorchX component), job.py (launch()), handle.py (LaunchHandle,
attach(), the process-wide TorchX runner), cli.py (`lowband launch`), node.py (the node
agent) and env.py (what a launched script reads of its layout); without TorchX, here.py runs a
plain `lowband train` on this machine (for `lowband compare` too): local.py starts its R x S
workers (on this machine, or on hosts.py's test hosts: network namespaces joined by a link shaped
by tc) and supervise.py runs `lowband train --elastic` on one machine (lighthouse.py: a launched
elastic job's Lighthouse role). Every public
name imports from here; the submodules import each other, never this file.
"""

from __future__ import annotations

import sys
import types

from lowband.launch.cli import launch_parser, main
from lowband.launch.env import launch_config, layout
from lowband.launch.handle import LOCAL_SCHEDULERS, ROLE, TERMINAL, LaunchHandle, attach
from lowband.launch.job import components, launch
from lowband.launch.node import agent

__all__ = ["LOCAL_SCHEDULERS", "ROLE", "TERMINAL", "LaunchHandle", "agent", "attach",
           "components", "launch", "launch_config", "launch_parser", "layout", "main"]


class _CallableModule(types.ModuleType):
    """`lowband.launch` is this package and the function both: `import lowband.launch` would
    otherwise replace the function `lowband.launch` with the package."""

    def __call__(self, *args, **kwargs) -> LaunchHandle:
        return launch(*args, **kwargs)


_CallableModule.__call__.__doc__ = launch.__doc__
sys.modules[__name__].__class__ = _CallableModule
