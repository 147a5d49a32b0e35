"""Launch `lowband train` through TorchX: locally (local_cwd), on Slurm or on Kubernetes.

    h = lowband.launch(model="nano", steps=200)          # Python: returns a LaunchHandle at once
    h.status(); h.logs(); h.wait(600); h.cancel(); h.run_dir
    lowband launch -s slurm --gpu 8 --shards 8 --replicas 4 -- --algo streaming   # the CLI

Both build the job from the `train` component in launchers/lowband_components.py (also registered
as `lowband.train` for `torchx run`) and hand it to TorchX's runner. A local_cwd job's processes
belong to this Python process: they keep running after the call (and the notebook cell) returns,
and are stopped by `cancel()` or when this process exits.

`python -m lowband.launch torchrun ARGS` is the agent each node runs: torchrun, after checking
that the rendezvous can be reached, with one clear sentence instead of a traceback when a node
cannot reach it or not every node joins within the timeout.

The code, by part: launch_job.py (launch(), the `train` component), launch_handle.py
(LaunchHandle, attach(), the process-wide TorchX runner), launch_cli.py (`lowband launch`) and
launch_agent.py (the node agent). Every public name imports from here.
"""

from __future__ import annotations

import sys
import types

from lowband.config import ConfigError
from lowband.launch_agent import agent
from lowband.launch_cli import launch_parser, main
from lowband.launch_handle import LOCAL_SCHEDULERS, ROLE, TERMINAL, LaunchHandle, attach
from lowband.launch_job import components, launch

__all__ = ["LOCAL_SCHEDULERS", "ROLE", "TERMINAL", "LaunchHandle", "agent", "attach",
           "components", "launch", "launch_parser", "main"]


class _CallableModule(types.ModuleType):
    """`lowband.launch` is this module and the function both: `import lowband.launch` would
    otherwise replace the function `lowband.launch` with the module."""

    def __call__(self, *args, **kwargs) -> LaunchHandle:
        return launch(*args, **kwargs)


_CallableModule.__call__.__doc__ = launch.__doc__
sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"lowband: error: {e}", file=sys.stderr)
        sys.exit(2)
