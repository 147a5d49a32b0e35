"""The one address every listener of this process binds: $LOWBAND_BIND_HOST, set by the launchers, else loopback."""

import os

BIND_ENV = "LOWBAND_BIND_HOST"
LOOPBACK = "127.0.0.1"


def bind_host() -> str:
    return os.environ.get(BIND_ENV) or LOOPBACK
