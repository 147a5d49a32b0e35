"""Healing with weights only, between members of a run (comm/membership/heal.py, comm/membership/secret.py).

A heal source that serves a pickle that would run code is refused with one sentence, nothing
runs and the healing group keeps its state; so is an answer in the right format without the
run's secret's MAC. A process without the secret cannot fetch a group's state (403, no body),
and a quorum that holds it is refused before any connection: the members skip that sync with
one sentence naming it, and it meets nobody. In-process: torchft's Lighthouse and Managers,
gloo on loopback."""

import io
import secrets
import stat
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import pytest
import torch

from lowband.comm.membership import secret
from lowband.config import ConfigError

pytest.importorskip("torchft")

from lowband.comm.membership.heal import (GROUP_HEADER, MAC_HEADER, HealTransport, MembersGloo,  # noqa: E402
                               Refused)

T = timedelta(seconds=10)


class RunsCode:
    """Unpickled, it writes a file: what a heal source must never get to do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def ids(key, *groups):
    return [f"{secret.replica_id(key, g)}:uuid-{g}" for g in groups]


@pytest.fixture
def key():
    return secrets.token_bytes(secret.SIZE)


def test_the_secret_is_a_private_file_a_resume_keeps_and_bad_ones_are_one_sentence(
        tmp_path, monkeypatch):
    path = secret.make(tmp_path / "secret")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32
    first = path.read_bytes()
    assert secret.make(path).read_bytes() == first  # a resumed run keeps its own
    monkeypatch.setenv(secret.SECRET_ENV, str(path))
    assert secret.required("--elastic") == first
    assert secret.signed_group(first, secret.replica_id(first, 3) + ":x") == 3
    assert secret.signed_group(secrets.token_bytes(32), secret.replica_id(first, 3)) is None
    (tmp_path / "short").write_bytes(b"x" * 31)
    monkeypatch.setenv(secret.SECRET_ENV, str(tmp_path / "short"))
    with pytest.raises(ConfigError, match=r"^the run's secret .* holds 31 bytes, not 32: [^\n]*\.$"):
        secret.required("--elastic")
    monkeypatch.delenv(secret.SECRET_ENV)
    with pytest.raises(ConfigError, match=r"^--elastic needs the run's secret: [^\n]*\.$"):
        secret.required("--elastic", wait_s=0)


def test_a_launched_jobs_spec_names_the_secrets_file_and_holds_no_secret(tmp_path):
    pytest.importorskip("torchx")
    import lowband
    from lowband.launch.handle import write_secret

    script = tmp_path / "mine.py"
    script.write_text("")
    h = lowband.launch(script=str(script), replicas=2, run_dir=str(tmp_path / "r"), elastic=True,
                       start=False)
    shown = str(h.dryrun_info)  # what `lowband launch --dryrun` prints
    assert shown.count(f"{secret.SECRET_ENV}': '{tmp_path / 'r' / 'secret'}'") == 3  # each role
    assert not (tmp_path / "r" / "secret").exists()  # a dry run writes nothing
    write_secret(h.run_dir)  # what start() does before it submits
    key = (tmp_path / "r" / "secret").read_bytes()
    write_secret(h.run_dir)  # a resumed launch: the run keeps its secret
    assert (tmp_path / "r" / "secret").read_bytes() == key and len(key) == 32


def test_a_member_heals_and_a_process_without_the_secret_gets_no_byte(key):
    members = ids(key, 0, 1)
    sender = HealTransport(key, 0, T, lambda: (7, members))
    receiver = HealTransport(key, 1, T, lambda: (7, members))
    stranger = secrets.token_bytes(32)
    outsider = HealTransport(stranger, 1, T, lambda: (7, [ids(stranger, 0)[0], members[1]]))
    try:
        state = {"user": {"w": torch.arange(6.0)}, "torchft": {"step": 5}}
        sender.send_checkpoint([1], 5, state, T)
        state["user"]["w"].add_(1)  # the sender trains on after its quorum: the heal is as it was
        got = receiver.recv_checkpoint(0, sender.metadata(), 5, T)
        assert torch.equal(got["user"]["w"], torch.arange(6.0)) and got["torchft"] == {"step": 5}
        for headers in ({}, {MAC_HEADER: secret.mac(stranger, "heal-request", "/heal/7/5/n").hex()}):
            with pytest.raises(HTTPError) as e:
                urlopen(Request(sender.metadata() + "/heal/7/5/n", headers=headers), timeout=10)
            assert e.value.code == 403 and e.value.read() == b""  # no tensor bytes
        # a process of another run (its own secret) asks as a member would: refused
        with pytest.raises(Refused, match=r"^replica group 0 at .* refused this group's heal "
                                          r"request \(403\), so it loaded nothing\.$"):
            outsider.recv_checkpoint(0, sender.metadata(), 5, T)
        # a heal source the quorum names but that is no member is not even asked
        with pytest.raises(Refused, match=r"^replica group 1 refused to heal from 'replica0'"):
            receiver._quorum = lambda: (7, ["replica0:uuid", members[1]])
            receiver.recv_checkpoint(0, sender.metadata(), 5, T)
    finally:
        for t in (sender, receiver, outsider):
            t.shutdown()


def _fake_peer(body: bytes, sign_with: bytes | None):
    """A heal source at some address: `body` after a 200, with a MAC under sign_with (None: a
    MAC of nothing)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header(GROUP_HEADER, "0")
            self.end_headers()
            mac = secret.hasher(sign_with or b"", "heal-response", self.path, "0")
            mac.update(body)
            self.wfile.write(body + (mac.digest() if sign_with else b"\0" * 32))

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _saved(obj) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def test_a_source_serving_code_or_an_unsigned_state_is_refused(key, tmp_path):
    marker = tmp_path / "ran"
    receiver = HealTransport(key, 1, T, lambda: (7, ids(key, 0, 1)))
    code = _saved({"user": {"lowband": RunsCode(marker)}, "torchft": {"step": 5}})
    cases = [  # (body, signed with, the sentence)
        (code, key, r"^the heal state from replica group 0 holds more than tensors and plain "
                    r"data, so replica group 1 loaded nothing of it\.$"),
        (_saved({"user": {}, "torchft": {"step": 5}}), None,
         r"^the heal state from .* does not carry replica group 0's signature under this "
         r"run's secret, so replica group 1 loaded nothing of it\.$"),
        (_saved({"user": {}, "torchft": {"step": 5}}), secrets.token_bytes(32), r"signature")]
    try:
        for body, signer, sentence in cases:
            server, address = _fake_peer(body, signer)
            try:
                with pytest.raises(Refused, match=sentence):
                    receiver.recv_checkpoint(0, address, 5, T)
            finally:
                server.shutdown()
                server.server_close()
    finally:
        receiver.shutdown()
    assert not marker.exists()
    torch.load(io.BytesIO(code), weights_only=False)  # (what the payload does when loaded)
    assert marker.exists()


# -- a group's Membership among torchft peers ---------------------------------------------------

class Events:
    def __init__(self):
        self.seen = []

    def emit(self, kind, **fields):
        self.seen.append((kind, fields))


@pytest.fixture
def site(tmp_path, monkeypatch, key):
    """A Lighthouse, the run's secret, and a store for each of two groups."""
    from torch.distributed import TCPStore

    from lowband.comm.membership.elastic import LIGHTHOUSE_ENV
    from lowband.launch.supervise import lighthouse

    path = tmp_path / "secret"
    path.write_bytes(key)
    server = lighthouse(2, 5.0)
    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(2)]
    monkeypatch.setenv(secret.SECRET_ENV, str(path))
    monkeypatch.setenv(LIGHTHOUSE_ENV, server.address())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(stores[0].port))
    yield SimpleNamespace(address=server.address(), port=stores[1].port)
    server.shutdown()


def _group0(algo):
    """Replica group 0's Membership (one rank), its algorithm registered."""
    from lowband.comm.membership.elastic import Membership

    topo = SimpleNamespace(replica=0, shard=0, shards=1)
    cfg = SimpleNamespace(elastic_timeout=10.0, quorum_timeout=30.0, min_replicas=2)
    m = Membership(topo, cfg, SimpleNamespace(events=Events(), wait_s=0.0))
    m.register(algo)
    return m


def _trained():
    from lowband.algorithms.base import Algorithm

    torch.manual_seed(0)
    algo = Algorithm()
    algo.model = torch.nn.Linear(4, 2)
    algo.optimizer = torch.optim.SGD(algo.model.parameters(), lr=0.1, momentum=0.9)
    algo.model(torch.ones(3, 4)).sum().backward()
    algo.optimizer.step()
    return algo


def _state(algo):
    return [t.clone() for t in algo.model.state_dict().values()] + \
        [s["momentum_buffer"].clone() for s in algo.optimizer.state.values()]


def _peer(site, replica_id, pg, transport=None, step=1 << 40):
    """Replica group 1: a torchft Manager of its own, further on than group 0 (the heal
    source), its quorum started in a thread."""
    from torchft.manager import Manager

    from lowband.comm.membership.lives import LighthouseLives

    manager = Manager(pg=pg, load_state_dict=lambda s: None, state_dict=lambda: {},
                      min_replica_size=2, use_async_quorum=False, timeout=T,
                      quorum_timeout=timedelta(seconds=30), connect_timeout=T, rank=0,
                      world_size=1, store_addr="127.0.0.1", store_port=site.port,
                      lighthouse_addr=site.address, replica_id=replica_id, init_sync=False,
                      checkpoint_transport=transport)
    manager._client = LighthouseLives(manager._client, None)
    manager.load_state_dict({"step": step, "batches_committed": 0})
    thread = threading.Thread(target=manager.start_quorum, daemon=True)
    thread.start()
    return manager, thread


def test_a_group_keeps_its_state_when_its_heal_source_serves_code(site, key, tmp_path, capsys):
    marker = tmp_path / "ran"

    class Compromised(HealTransport):  # a member (it holds the secret) that serves code
        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            super().send_checkpoint(dst_ranks, step, {"user": {"lowband": RunsCode(marker)},
                                                      "torchft": {"step": step}}, timeout)

    algo = _trained()
    before = _state(algo)
    group = _group0(algo)
    last = lambda: (peer._client.last.quorum_id, list(peer._client.last.replica_ids))  # noqa: E731
    peer, thread = _peer(site, secret.replica_id(key, 1), MembersGloo(key, last, T),
                         Compromised(key, 1, T, last))
    try:
        assert group.begin(0) is False  # not healed
        thread.join(30)
        assert capsys.readouterr().err.strip() == (
            "lowband: the heal state from replica group 1 holds more than tensors and plain "
            "data, so replica group 0 loaded nothing of it.")
        assert not marker.exists() and algo.healed_step is None
        assert all(torch.equal(a, b) for a, b in zip(before, _state(algo)))
        # behind and not healed, it takes no part in the sync's exchange: it fails at once
        # (not after the process group's timeout, waiting for peers in another step's sync)
        began = time.monotonic()
        group.barrier()
        assert time.monotonic() - began < T.total_seconds() / 5 and group.failed()
        assert group.commit() is False  # its vote fails: the sync is not applied
    finally:
        group.shutdown()
        peer.shutdown(wait=False)


def test_a_process_without_the_secret_never_meets_the_members(site, key, capsys):
    from torchft.process_group import ProcessGroupGloo

    algo = _trained()
    before = _state(algo)
    group = _group0(algo)
    # torchft's own Manager with its own process group and transport: no secret
    peer, thread = _peer(site, "replica1", ProcessGroupGloo(timeout=timedelta(seconds=3)), step=0)
    try:
        assert group.begin(1) is False and group.members == (0,)  # the intruder took no part
        group.barrier()  # the sync's exchange: refused at once, not with the intruder
        assert group.commit() is False
        assert capsys.readouterr().err.strip() == (
            "lowband: the quorum holds 'replica1', which is not one of this run's replica "
            "groups (its id is not signed with the run's secret), so the members skip this "
            "sync rather than exchange with it.")
        thread.join(30)
        assert peer.errored() is not None  # it met nobody in its process group
        assert all(torch.equal(a, b) for a, b in zip(before, _state(algo)))
    finally:
        group.shutdown()
        peer.shutdown(wait=False)
