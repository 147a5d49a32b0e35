"""Across machines: every node of a job runs `lowband doctor --nodes N --rdzv HOST:PORT` (or
`lowband launch --doctor` runs it as the job's first step), and before any training process
starts they find out together whether the run can work, each failure one sentence.

The nodes meet where the job's rendezvous will be: the node that holds HOST's address serves a
store on PORT (bound to its bind address only, as the run's is; comm/membership/bind.py), the
others connect to it within --timeout. Each node then says who it is (its name, the address and
interface it binds, the port range its system picks from, its secret's MAC over a fresh nonce)
and opens one probe listener on a port its system picks, as gloo, the heal transport and
torchft's manager will (and the Lighthouse's port on the first node with --elastic). Every node
connects to every other node's listeners, each answering with its clock, and resolves every
node's name. The first node reads all that and says what is wrong (`verdict`, a pure function of
the records: the tests feed it records), and every node prints the same lines.

Nothing a peer sends is run or unpickled: the store holds JSON text, and a probe's answer is
8 bytes read as a float.
"""

from __future__ import annotations

import json
import secrets as random
import socket
import struct
import threading
import time
from datetime import timedelta
from pathlib import Path

from lowband.comm.membership import secret as run_secret
from lowband.comm.membership.bind import interface_of, interfaces, listen_socket
from lowband.options import SECRET_ENV, ConfigError

PROBE_S = 3.0  # seconds a probe's connection may take: a firewall that drops shows in this
CLOCK_S = 0.5  # clocks further apart than this are noted
PREFIX = "lowband-doctor/"


def port_range() -> str:
    """The ports this system picks a listener's from (gloo's, the heal transport's)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return f"{low}-{high}"
    except (OSError, ValueError):
        return "the system's ephemeral range"


def secret_state(path: str | None, nonce: str) -> dict:
    """What a node says of its secret: absent (none given), missing or bad (with why), or its
    MAC over the nonce (never the secret)."""
    if not path:
        return {"state": "absent"}
    if not Path(path).exists():
        return {"state": "missing", "path": path}
    try:
        key = run_secret.read(path)
    except (ConfigError, OSError) as e:
        return {"state": "bad", "path": path, "why": str(e)}
    return {"state": "ok", "path": path, "mac": run_secret.tag(key, "doctor", nonce)}


class Listener:
    """A probe listener on `address` (a port the system picks, or `port`): each connection gets
    this machine's clock (8 bytes, seconds since the epoch) and is closed."""

    def __init__(self, address: str, port: int = 0):
        self.socket = listen_socket(address, port)
        self.port = self.socket.getsockname()[1]
        self.socket.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="doctor-probe")
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.socket.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                try:
                    conn.sendall(struct.pack("!d", time.time()))
                except OSError:
                    pass

    def close(self):
        self._stop.set()
        self._thread.join()
        self.socket.close()


def probe(address: str, port: int, timeout: float = PROBE_S, clock=time.time) -> dict:
    """Connect to a probe listener: {"ok": True, "offset": its clock less ours, "rtt": seconds}
    or {"ok": False, "why": ...}."""
    start = clock()
    try:
        with socket.create_connection((address, port), timeout=timeout) as c:
            data = b""
            while len(data) < 8:
                chunk = c.recv(8 - len(data))
                if not chunk:
                    return {"ok": False, "why": "the connection closed without an answer"}
                data += chunk
    except socket.timeout:
        return {"ok": False, "why": f"no answer within {timeout:g} s"}
    except OSError as e:
        return {"ok": False, "why": (e.strerror or str(e)).lower()}
    end = clock()
    return {"ok": True, "offset": struct.unpack("!d", data)[0] - (start + end) / 2,
            "rtt": end - start}


def resolve_first(name: str) -> str | None:
    """The address a connection to `name` tries first here, None where it does not resolve."""
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None


def label(node: dict) -> str:
    return f"{node['name']} ({node['address']})"


def verdict(nodes: list[dict], probes: list[dict], rdzv: str, loopback: bool) -> dict:
    """{"failures": [...], "notes": [...], "passed": [...]}, each a sentence, from every node's
    record (`nodes`, index = node) and what it found probing the others (`probes`, index =
    prober: {"to": [{"node", "port", "what", "ok", "why"|"offset"}], "names": {name: address}})."""
    fail, note, ok = [], [], []
    first = nodes[0]
    # ports, both ways
    blocked = 0
    for i, found in enumerate(probes):
        for p in found["to"]:
            if p["ok"]:
                continue
            blocked += 1
            to = nodes[p["node"]]
            what = ("the Lighthouse's (--elastic)" if p["what"] == "lighthouse" else
                    "a port its system picks for listeners, where gloo, the heal transport and "
                    "torchft's manager listen")
            fix = (f"open TCP {p['port']} on {to['name']}" if p["what"] == "lighthouse" else
                   f"open TCP {to['ports']} on {to['name']} to the other nodes")
            fail.append(f"{label(nodes[i])} cannot open a connection to {label(to)} port "
                        f"{p['port']}, {what} ({p['why']}): {fix} (a firewall?).")
    connections = sum(len(f["to"]) for f in probes)
    if connections and not blocked:
        ok.append(f"ports: every node reached every other's ({connections} connections, both "
                  f"ways), and the rendezvous {rdzv} from every node")
    # names: what each node's name resolves to on every node, against the address it binds
    if loopback:
        ok.append("names: not used (every node on this machine, on loopback)")
    else:
        said = len(fail) + len(note)
        for j, node in enumerate(nodes):
            for i, found in enumerate(probes):
                where = "here" if i == j else f"on {nodes[i]['name']}"
                got = found["names"].get(node["name"])
                fix = (f"make '{node['name']}' name {node['address']} on every node (/etc/hosts "
                       "or DNS)")
                if got is None:  # the first node is reached by name (the rank-0 host)
                    why = ("the job reaches its first node by name" if j == 0 else
                           "nothing can reach it by name")
                    (fail if j == 0 else note).append(
                        f"{label(node)}'s name '{node['name']}' does not resolve {where}, so "
                        f"{why}: {fix}.")
                elif got != node["address"]:
                    held = node["addresses"].get(got) if i == j else None
                    held = f"its interface {held}'s address" if held else "another address"
                    fail.append(f"{label(node)} advertises the name '{node['name']}', which "
                                f"resolves {where} to {got} ({held}), not to the address it "
                                f"binds ({node['address']} on {node['interface']}): {fix}, or "
                                f"bind the interface that holds {got} (--bind) if that is the "
                                "link between the nodes.")
        if len(fail) + len(note) == said:
            ok.append("names: every node's name resolves, on every node, to the address it "
                      "binds")
    # the secret, present and equal
    states = [n["secret"] for n in nodes]
    if all(s["state"] == "absent" for s in states):
        note.append(f"secret: none given (--secret, {SECRET_ENV}), not checked: a launched job's "
                    "is RUN_DIR/secret, which every node must read (`lowband doctor --secret "
                    "RUN_DIR/secret` checks it).")
    else:
        macs = {s.get("mac") for s in states if s["state"] == "ok"}
        for node, s in zip(nodes, states):
            if s["state"] == "absent":
                fail.append(f"{label(node)} was given no secret while others were: give every "
                            f"node the run's secret file (--secret, {SECRET_ENV}).")
            elif s["state"] == "missing":
                fail.append(f"{label(node)} has no secret at {s['path']}: put the run directory "
                            "on a filesystem every node shares, or copy RUN_DIR/secret there "
                            "(mode 0600).")
            elif s["state"] == "bad":
                fail.append(f"{label(node)}: {s['why']}")
        if len(macs) > 1:
            odd = [label(n) for n, s in zip(nodes, states)
                   if s["state"] == "ok" and s["mac"] != first["secret"].get("mac")]
            fail.append(f"the secret of {', '.join(odd)} differs from {label(first)}'s: every "
                        "node must read the same RUN_DIR/secret (one run directory, shared).")
        elif macs and all(s["state"] == "ok" for s in states):
            ok.append(f"secret: present and equal on all {len(nodes)} nodes")
    # clocks
    skew = [(abs(p["offset"]), i, p["node"]) for i, f in enumerate(probes) for p in f["to"]
            if p["ok"] and p["what"] == "probe"]
    if skew:
        worst, i, j = max(skew)
        if worst > CLOCK_S:
            note.append(f"the clocks of {nodes[i]['name']} and {nodes[j]['name']} differ by "
                        f"{worst:.2f} s: events, timelines and reports line the nodes up by "
                        "their clocks; run NTP (chrony, systemd-timesyncd) on every node.")
        else:
            ok.append(f"clocks: within {max(worst, 0.001) * 1e3:.0f} ms of each other")
    return {"failures": fail, "notes": note, "passed": ok}


class Meeting:
    """This node at the rendezvous: its store (served here on the first node, else a client's),
    its index (0 on the first node) and the doctor's keys."""

    def __init__(self, host: str, port: int, nodes: int, first: bool, address: str,
                 timeout: float):
        from lowband.comm.membership.bind import bound_store_type
        from torch.distributed import TCPStore

        self.nodes, self.timeout = nodes, timeout
        wait = timedelta(seconds=timeout)
        if first:
            try:
                self.store = bound_store_type()(address, port, None, True, timeout=wait,
                                                wait_for_workers=False)
            except RuntimeError as e:
                raise Stop(f"this node ({socket.gethostname()}) cannot serve the rendezvous on "
                           f"{address}:{port} ({_short(e)}): another job's rendezvous? give "
                           "another port (--rdzv HOST:PORT).") from None
            self.index = 0
            self.put("nonce", random.token_hex(16))
        else:
            from lowband.launch.node import _wait_reachable

            why = _wait_reachable(host, port, timeout)
            if why is not None:
                raise Stop(f"this node ({socket.gethostname()}) could not reach the rendezvous "
                           f"at {host}:{port} within {timeout:g} s ({why}): check that --rdzv "
                           "names the first node's address on the link between the nodes, "
                           f"that its doctor is running and that port {port} is open to this "
                           "node.")
            self.store = TCPStore(host, port, None, False, timeout=wait)
            self.index = self.store.add(PREFIX + "joined", 1)
            if self.index >= nodes:
                raise Stop(f"more than --nodes {nodes} nodes came to the rendezvous at "
                           f"{host}:{port}: give every node the same --nodes.")
        self.nonce = self.get("nonce")

    def put(self, key: str, value) -> None:
        self.store.set(PREFIX + key, json.dumps(value))

    def get(self, key: str):
        return json.loads(self.store.get(PREFIX + key).decode())

    def gather(self, key: str, what: str, rdzv: str) -> list:
        """Every node's `key/<i>`, waited for until --timeout (one sentence if not all come)."""
        keys = [f"{PREFIX}{key}/{i}" for i in range(self.nodes)]
        deadline = time.monotonic() + self.timeout
        while True:
            have = sum(self.store.check([k]) for k in keys)
            if have == self.nodes:
                return [self.get(f"{key}/{i}") for i in range(self.nodes)]
            if time.monotonic() > deadline:
                raise Stop(f"only {have} of {self.nodes} nodes {what} at {rdzv} within "
                           f"{self.timeout:g} s: start `lowband doctor --nodes {self.nodes} "
                           f"--rdzv {rdzv}` on every node (a node that started says why it "
                           "could not reach the rendezvous).")
            time.sleep(0.05)


class Stop(Exception):
    """A failure that ends this node's doctor: its one sentence."""


def _short(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def check_nodes(meeting: Meeting, me: dict, rdzv: str, loopback: bool,
                lighthouse_port: int | None) -> dict:
    """The checks across nodes, from this node: returns the verdict every node prints."""
    listeners = [Listener(me["address"])]
    me = dict(me, ports=port_range(), probe=listeners[0].port, lighthouse=None)
    try:
        if meeting.index == 0 and lighthouse_port:
            try:
                listeners.append(Listener(me["address"], lighthouse_port))
            except OSError as e:
                raise Stop(f"the Lighthouse's port {lighthouse_port} on {label(me)} is not free "
                           f"({(e.strerror or str(e)).lower()}): give another one "
                           "(--lighthouse-port).") from None
            me["lighthouse"] = lighthouse_port
        meeting.put(f"node/{meeting.index}", me)
        nodes = meeting.gather("node", "reached the rendezvous", rdzv)
        found = {"to": [], "names": {n["name"]: resolve_first(n["name"]) for n in nodes}}
        for j, node in enumerate(nodes):
            targets = [("probe", node["probe"])] if j != meeting.index else []
            if node.get("lighthouse") and j != meeting.index:
                targets.append(("lighthouse", node["lighthouse"]))
            for what, port in targets:
                found["to"].append({"node": j, "port": port, "what": what,
                                    **probe(node["address"], port)})
        meeting.put(f"probe/{meeting.index}", found)
        if meeting.index == 0:
            probes = meeting.gather("probe", "finished their probes", rdzv)
            meeting.put("verdict", {**verdict(nodes, probes, rdzv, loopback), "nodes": nodes})
        return meeting.get("verdict")
    finally:
        for listener in listeners:
            listener.close()


def describe(address: str) -> dict:
    """This node as it tells the others: its name, the address it binds and that interface,
    and every address of its interfaces (to name the one its name resolves to)."""
    held = {a: name for name, addrs in interfaces().items() for a in addrs}
    return {"name": socket.gethostname(), "address": address,
            "interface": interface_of(address) or "a secondary address", "addresses": held}
