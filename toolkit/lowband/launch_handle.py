"""Old path of lowband.launch.handle (LaunchHandle, attach(), the TorchX runner). It goes away
after one release: import from lowband.launch.handle, or from lowband.launch."""

from lowband.launch.handle import (LOCAL_SCHEDULERS, ROLE, TERMINAL, LaunchHandle,  # noqa: F401
                                   _get_runner, _keep_signals, attach)

__all__ = ["LOCAL_SCHEDULERS", "ROLE", "TERMINAL", "LaunchHandle", "attach"]
