"""The per-run secret: 32 random bytes a run's members hold and nobody else (docs/elastic.md).

It is made once a run, when the run starts (`lowband train --elastic` in its run directory,
`lowband launch` for a launched job), as RUN_DIR/secret with mode 0600; a resumed run keeps its
directory's. The processes of the run find it through SECRET_ENV, which names the file, not the
bytes: a job's spec (TorchX's dry run, a Slurm batch script, a pod's spec, which other users of
a cluster may read) then carries a path, and the bytes stay in the run directory, on the
filesystem every node shares. lowband checks it where it owns the protocol: heal requests and
answers (comm/membership/heal.py), the replica ids its groups give torchft and the store prefix of every
process group of the run (topology.init, comm/membership/heal.MembersGloo). It is never printed, nor
written to config.json, the events or the summary.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from pathlib import Path

from lowband.options import SECRET_ENV, ConfigError

FILE = "secret"  # its name in the run directory
SIZE = 32
TAG = 8  # bytes of a MAC that name a store prefix or sign a replica id


def make(path) -> Path:
    """The secret's file (RUN_DIR/secret, the directory made if need be): made now (32 random
    bytes, mode 0600), or kept as a resumed run made it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        read(path)  # a resumed run's: it must be one
        return path
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(SIZE))
    return path


def read(path=None) -> bytes | None:
    """The run's secret, from `path` or the file SECRET_ENV names (None: neither is given)."""
    path = path or os.environ.get(SECRET_ENV)
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"the run's secret {path} cannot be read ({e.strerror}): the run "
                          "directory must be on a filesystem every node shares, and `lowband "
                          "train --elastic` or `lowband launch` writes it there.") from None
    if len(data) != SIZE:
        raise ConfigError(f"the run's secret {path} holds {len(data)} bytes, not {SIZE}: let "
                          "lowband write it (delete the file and start the run again).")
    return data


def required(what: str, wait_s: float = 60.0) -> bytes:
    """The run's secret, which `what` needs (one sentence without it). A file not there yet is
    waited for wait_s: a job's Lighthouse role writes it as the groups start (launch/lighthouse.py)."""
    path, deadline = os.environ.get(SECRET_ENV), time.monotonic() + wait_s
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    key = read()
    if key is None:
        raise ConfigError(f"{what} needs the run's secret: run it through `lowband train "
                          f"--elastic` or `lowband launch`, or set {SECRET_ENV} to the path of a "
                          "file of 32 random bytes (mode 0600).")
    return key


def hasher(secret: bytes, *parts):
    """An HMAC-SHA256 under the secret, fed the parts (str, int or bytes), each length-prefixed
    so that none runs into the next; a streamed body may follow (update)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return h


def mac(secret: bytes, *parts) -> bytes:
    """HMAC-SHA256 of the parts (hasher)."""
    return hasher(secret, *parts).digest()


def tag(secret: bytes, *parts) -> str:
    """A short MAC in hex: a store prefix or a replica id's signature."""
    return mac(secret, *parts)[:TAG].hex()


def replica_id(secret: bytes, group: int) -> str:
    """The replica id group `group` gives torchft: `replica<g>-<signature>-<g>` (torchft reads a
    group's number off its trailing digits, and lowband's dashboard off `replica<g>`)."""
    return f"replica{group}-{tag(secret, 'replica', group)}-{group}"


_SIGNED = re.compile(r"replica(\d+)-([0-9a-f]{16})-(\d+)")


def signed_group(secret: bytes, rid: str) -> int | None:
    """The group a replica id in a quorum names (torchft adds `:<uuid>`), when it is signed
    with this run's secret; None for any other."""
    m = _SIGNED.fullmatch(rid.split(":")[0])
    if m is None or m.group(1) != m.group(3):
        return None
    group = int(m.group(1))
    return group if hmac.compare_digest(m.group(2), tag(secret, "replica", group)) else None
