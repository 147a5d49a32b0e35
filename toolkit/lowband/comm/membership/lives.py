"""A Lighthouse started again (launch/supervise.py: restart_lighthouse) and torchft's quorum
ids: the new one counts from 1 again, so lowband numbers the quorums of its life n as
n x LIFE + torchft's id (comm/membership/elastic.py uses LighthouseLives; docs/elastic.md); and the groups
alive in the Lighthouse's eyes (alive_groups: its status page)."""

from __future__ import annotations

import os
import re
import time

from lowband.options import LIGHTHOUSE_ENV

LIFE = 1_000_000  # quorum ids of the Lighthouse's life n: n x LIFE + torchft's quorum id
STATUS_TIMEOUT_S = 2.0  # alive_groups' wait for the Lighthouse's status page (each socket step)


class LighthouseLives:
    """torchft's client of this group's Manager, renumbering the quorums by the Lighthouse's
    life. A restarted Lighthouse (launch/supervise.py) counts its quorum ids from 1 again, and
    torchft names a quorum's process group by its id alone (keys torchft/<id>/ in the store the
    groups meet at, still holding the old life's keys): the old ids would meet stale addresses,
    or be taken for the quorum a group is already in. The launcher writes the life (n, in the
    file LIFE_ENV names) a second after the old Lighthouse died and before the new one listens,
    so a quorum answered by life n reads n when it returns; without the file (`lowband launch`)
    the life is 0 and the ids are torchft's."""

    def __init__(self, client, path: str | None):
        self._client, self._path = client, path
        self.last = None  # the last quorum's result (its members: comm/membership/heal.py checks them)
        self.quorum_s = 0.0  # seconds the last quorum's answer took (torchft's retries included)

    def _quorum(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            result = self._client._quorum(*args, **kwargs)
        finally:
            self.quorum_s = time.perf_counter() - t0
        self.last = Renumbered(result, lighthouse_life(self._path) * LIFE + result.quorum_id)
        return self.last

    def __getattr__(self, name):
        return getattr(self._client, name)


class Renumbered:
    """A torchft quorum result with another quorum id."""

    def __init__(self, result, quorum_id: int):
        self._result, self.quorum_id = result, quorum_id

    def __getattr__(self, name):
        return getattr(self._result, name)


def lighthouse_life(path) -> int:
    """The Lighthouse's life: 0 for the first, n after n restarts (LIFE_ENV's file)."""
    try:
        return int(open(path).read().strip() or 0) if path else 0
    except (OSError, ValueError):
        return 0


def alive_groups(members, timeout_s: float = STATUS_TIMEOUT_S, lighthouse: str | None = None
                 ) -> list[int] | None:
    """The replica groups alive now in the Lighthouse's eyes: those whose heartbeat it saw
    within its heartbeat timeout (its /status page lists every replica id it heard from, old
    ones marked; a restarted group's lives have ids of their own, `replica1:<uuid>`), with the
    quorum's members (healthy when it formed). None when the Lighthouse does not answer.
    lighthouse: its address (default: TORCHFT_LIGHTHOUSE's)."""
    from urllib.request import urlopen

    try:
        address = lighthouse or os.environ[LIGHTHOUSE_ENV]
        with urlopen(address.rstrip("/") + "/status", timeout=timeout_s) as r:
            page = r.read().decode("utf-8", "replace")
    except (OSError, ValueError, KeyError):
        return None
    beating = {int(g) for old, g in _HEARTBEAT.findall(page) if not old}
    return sorted(beating | set(members))


_HEARTBEAT = re.compile(r'class="heartbeat\s*(old)?\s*">\s*replica(\d+)\b')
