"""Healing with weights only, between members of the run (comm/membership/elastic.py's Membership uses it).

torchft's Manager hands a group behind the others a live peer's state through a checkpoint
transport; torchft's own (HTTP) loads whatever the answering address sends with
torch.load(weights_only=False), asks nobody who they are, and listens on every interface. This
one, HealTransport:
  - serves the state on bind_host() (comm/membership/bind.py: loopback unless the job names its site link)
    with torch.save, streamed into the socket, to a request that carries a MAC of its path
    (quorum id, step and a fresh nonce) under the run's secret (comm/membership/secret.py); any other gets
    403 and no body;
  - answers with the sender's replica group and, after the body, a MAC of the request's path,
    that group and the body: the receiver checks it before it loads a byte, so a peer without
    the secret cannot feed a healing group anything (nor replay an old answer: the nonce);
  - serves a copy of the state taken inside the quorum (the sender trains on meanwhile);
  - loads with torch.load(weights_only=True): tensors and plain data only, even from a member;
  - heals only from the source torchft's quorum names when that source is a member: its
    replica id in the quorum signed with the secret (secret.replica_id), its group the one the
    answer's MAC names.
MembersGloo is the quorum's process group: its store prefix is derived from the secret, so a
process without it never meets the members there (it cannot send or receive a byte of an
exchange), and a quorum that holds a replica id not signed with the secret is refused before
any connection: the members skip that sync with one sentence naming the intruder.
Either refusal is a Refused (one sentence), which torchft records as the quorum's error: the
group's state stays as it was and its commit vote fails.
"""

from __future__ import annotations

import hmac
import io
import logging
import secrets
import socket
import sys
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport
from torchft.process_group import ProcessGroupGloo

from lowband.comm.membership.bind import bind_host
from lowband.comm.membership.secret import hasher, mac, signed_group, tag

MAC_HEADER, GROUP_HEADER = "X-Lowband-Mac", "X-Lowband-Group"
MAC_BYTES = 32  # HMAC-SHA256, after the answer's body
CHUNK = 8 << 20

Quorum = Callable[[], tuple[int, list[str]]]  # this group's quorum now: (id, its replica ids)


class Refused(RuntimeError):
    """A heal or a quorum this group refused; the message is one sentence."""


def quiet_refusals() -> None:
    """torchft logs the error of a quorum with its traceback; lowband says a refusal itself."""
    logging.getLogger("torchft.manager").addFilter(
        lambda r: not (r.exc_info and isinstance(r.exc_info[1], Refused)))


def refusal(manager) -> dict:
    """A heal or a quorum this group refused (the quorum's error a Refused): its sentence, said
    on stderr, for the quorum event; {} otherwise."""
    why = getattr(manager.errored(), "original_exception", None)
    if not isinstance(why, Refused):
        return {}
    print(f"lowband: {why}", file=sys.stderr, flush=True)
    return {"refused": str(why)}


def intruder(key: bytes, ids: list[str]) -> str | None:
    """The sentence for a quorum that holds someone other than the run's groups (None: all
    members): a replica id not signed with the secret, or two claiming one group."""
    seen = set()
    for rid in ids:
        group = signed_group(key, rid)
        if group is None:
            return (f"the quorum holds {rid.split(':')[0]!r}, which is not one of this run's "
                    "replica groups (its id is not signed with the run's secret), so the "
                    "members skip this sync rather than exchange with it.")
        if group in seen:
            return (f"two processes in the quorum claim replica group {group}, so the members "
                    "skip this sync rather than exchange with the one that is not.")
        seen.add(group)
    return None


class MembersGloo(ProcessGroupGloo):
    """torchft's gloo process group, met under a store prefix derived from the run's secret,
    and only when every replica id in the quorum is a member's."""

    def __init__(self, key: bytes, quorum: Quorum, timeout: timedelta):
        super().__init__(timeout=timeout)
        self._key, self._quorum = key, quorum

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id=None, group_rank=None, group_world_size=None,
                  global_ranks=None) -> None:
        why = intruder(self._key, self._quorum()[1])
        if why is not None:
            self.abort(errored=False)  # no exchange over the last quorum's group either
            self._global_ranks = [global_ranks[rank]] if global_ranks else None  # (itself)
            raise Refused(why)
        super().configure(f"{store_addr}/{tag(self._key, 'torchft-store')}", replica_id, rank,
                          world_size, quorum_id, group_rank, group_world_size, global_ranks)


class HealTransport(CheckpointTransport):
    """torchft's checkpoint transport, weights only and members only (module doc)."""

    def __init__(self, key: bytes, group: int, timeout: timedelta, quorum: Quorum):
        self._key, self._group, self._timeout, self._quorum = key, group, timeout, quorum
        self._cond = threading.Condition()
        self._state = None  # what send_checkpoint serves, until disallow_checkpoint
        self._serving: tuple[int, int] | None = None  # its (quorum id, step)
        self._readers = 0
        host = bind_host()
        server = type("Server", (ThreadingHTTPServer,), {
            "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET,
            "daemon_threads": True})
        self._server = server((host, 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="lowband-heal")
        self._thread.start()

    def metadata(self) -> str:
        host, port = bind_host(), self._server.server_address[1]
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        """Serve a copy of the state as it is now, inside the quorum (torchft calls this while
        the group waits for its quorum): the group trains on while the heal is served (an
        overlapped sync lands steps later), and torch.save streams tensors' memory as it is,
        so a state served by reference reached the joining group torn (and its MAC, taken
        over the bytes before they went out, then failed: a refused heal)."""
        state = tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                         else v, state_dict)
        with self._cond:
            self._state, self._serving = state, (self._quorum()[0], step)
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """No more answers; returns once those under way are sent (the state may change then)."""
        with self._cond:
            self._cond.wait_for(lambda: self._readers == 0, self._timeout.total_seconds())
            self._state = self._serving = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        quorum_id, ids = self._quorum()
        rid = ids[src_rank] if 0 <= src_rank < len(ids) else f"rank {src_rank}"
        source = signed_group(self._key, rid)
        if source is None or source == self._group:
            raise Refused(f"replica group {self._group} refused to heal from {rid.split(':')[0]!r}"
                          ", which torchft's quorum names but is not a member of this run (its "
                          "id is not signed with the run's secret), and loaded nothing.")
        path = f"/heal/{quorum_id}/{step}/{secrets.token_hex(16)}"
        request = Request(metadata.rstrip("/") + path,
                          headers={MAC_HEADER: mac(self._key, "heal-request", path).hex()})
        try:
            with urlopen(request, timeout=timeout.total_seconds()) as answer:
                sender = answer.headers.get(GROUP_HEADER, "")
                check = hasher(self._key, "heal-response", path, sender)
                body, got = _read_signed(answer, check)
        except HTTPError as e:
            raise Refused(f"replica group {source} at {metadata} refused this group's heal "
                          f"request ({e.code}), so it loaded nothing.") from None
        if sender != str(source) or not hmac.compare_digest(got, check.digest()):
            raise Refused(f"the heal state from {metadata} does not carry replica group "
                          f"{source}'s signature under this run's secret, so replica group "
                          f"{self._group} loaded nothing of it.")
        try:
            return torch.load(body, map_location="cpu", weights_only=True)
        except Exception:  # (pickle's refusal of a global, or no torch.save format at all)
            raise Refused(f"the heal state from replica group {source} holds more than tensors "
                          f"and plain data, so replica group {self._group} loaded nothing of "
                          "it.") from None

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = handler.path
        if not hmac.compare_digest(handler.headers.get(MAC_HEADER, ""),
                                   mac(self._key, "heal-request", path).hex()):
            return _refuse(handler, 403)
        try:
            _, heal, quorum_id, step, _nonce = path.split("/")
            wanted = (int(quorum_id), int(step))
        except ValueError:
            return _refuse(handler, 400)
        with self._cond:
            if heal != "heal" or not self._cond.wait_for(
                    lambda: self._serving == wanted, self._timeout.total_seconds()):
                return _refuse(handler, 409)
            state, self._readers = self._state, self._readers + 1
        try:
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header(GROUP_HEADER, str(self._group))
            handler.end_headers()
            out = _Signing(handler.wfile, hasher(self._key, "heal-response", path,
                                                 str(self._group)))
            torch.save(state, out)
            handler.wfile.write(out.mac.digest())
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()


def _handler(transport: HealTransport) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = transport._timeout.total_seconds()

        def do_GET(self):
            transport._answer(self)

        def log_message(self, *args) -> None:  # no access lines (heals are membership events)
            pass

    return Handler


def _refuse(handler: BaseHTTPRequestHandler, code: int) -> None:
    """An answer with no body."""
    handler.send_response(code)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


class _Signing:
    """A write-only stream that MACs what it passes on (torch.save streams into it)."""

    def __init__(self, out, mac):
        self.out, self.mac = out, mac

    def write(self, data) -> int:
        self.mac.update(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def _read_signed(answer, check) -> tuple[io.BytesIO, bytes]:
    """The answer's body with `check` updated over it, and the MAC after it. (Read in large
    pieces: a body of unknown length read at once goes 8 KiB at a time, a quarter slower.)"""
    data = b"".join(iter(lambda: answer.read(CHUNK), b""))
    body = memoryview(data)[:-MAC_BYTES]
    check.update(body)
    return io.BytesIO(body), data[-MAC_BYTES:]
