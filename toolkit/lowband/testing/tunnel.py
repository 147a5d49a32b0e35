"""An encrypted outer link on the test hosts (issue 35): a userspace WireGuard interface
(`wireguard-go`) in each host's namespace, peered over the hosts' shaped veth link, and a packet
capture on a veth end to show what an eavesdropper on that link reads.

    with TestHosts(...) as hosts:            # lowband.launch.hosts: namespaces, veth, tbf
        with WireGuard(hosts, "10.77.0") as wg:
            ...  # MASTER_ADDR=wg.addrs[0], GLOO_SOCKET_IFNAME=wg.ifaces[r]: gloo goes through it

Every byte the tunnel carries crosses the same shaped veth (as UDP, encrypted), so a run over
`wg.addrs` pays the link's rate plus WireGuard's overhead. Needs root, /dev/net/tun,
`wireguard-go` and `wg` (Debian: wireguard-go, wireguard-tools); `unavailable()` says why not.
Keys are made fresh for each set-up (`wg genkey`) and never written to disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from lowband.launch.hosts import TestHosts, _run

SOCKETS = Path("/var/run/wireguard")  # wireguard-go's control sockets, for every namespace
PORT = 51820


class WireGuard:
    """Interface <prefix>-wg<i> in host i's namespace with address <subnet>.<i+1>/24, peered with
    every other host at its veth address (UDP port 51820), allowed the peer's tunnel address."""

    def __init__(self, hosts: TestHosts, subnet: str, prefix: str):
        self.hosts = hosts
        self.ifaces = [f"{prefix}-wg{i}" for i in range(len(hosts.names))]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(len(hosts.names))]
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why a tunnel cannot be made here (one sentence, after "it"), or None when it can."""
        missing = [f"`{t}`" for t in ("wireguard-go", "wg") if shutil.which(t) is None]
        if missing:
            return f"needs {' and '.join(missing)} (Debian: wireguard-go, wireguard-tools)"
        if not os.path.exists("/dev/net/tun"):
            return "needs /dev/net/tun for wireguard-go's interface"
        return None

    def __enter__(self) -> "WireGuard":
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> "WireGuard":
        self.teardown()
        try:
            keys = [_run("wg", "genkey").stdout.strip() for _ in self.ifaces]
            pubs = [subprocess.run(["wg", "pubkey"], input=k, capture_output=True, text=True,
                                   check=True).stdout.strip() for k in keys]
            for i, iface in enumerate(self.ifaces):
                log = Path(os.environ.get("TMPDIR", "/tmp")) / f"{iface}.log"
                # -f: in the foreground, so the hosts' teardown can stop it like any process
                self.procs.append(self.hosts.popen(i, ["wireguard-go", "-f", iface],
                                                   dict(os.environ), log))
            for i, iface in enumerate(self.ifaces):
                self._wait_socket(iface, self.procs[i])
                ns = ["ip", "netns", "exec", self.hosts.names[i]]
                subprocess.run([*ns, "wg", "set", iface, "private-key", "/dev/stdin",
                                "listen-port", str(PORT)], input=keys[i], text=True,
                               capture_output=True, check=True)
                for j, pub in enumerate(pubs):
                    if j != i:
                        _run(*ns, "wg", "set", iface, "peer", pub, "endpoint",
                             f"{self.hosts.addrs[j]}:{PORT}", "allowed-ips", f"{self.addrs[j]}/32")
                _run("ip", "-n", self.hosts.names[i], "addr", "add", f"{self.addrs[i]}/24",
                     "dev", iface)
                _run("ip", "-n", self.hosts.names[i], "link", "set", iface, "up")
        except Exception:
            self.teardown()
            raise
        return self

    @staticmethod
    def _wait_socket(iface: str, proc: subprocess.Popen, timeout: float = 15.0) -> None:
        deadline = time.time() + timeout
        while not (SOCKETS / f"{iface}.sock").exists():
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"wireguard-go did not bring up {iface} (see its log in "
                                   f"{os.environ.get('TMPDIR', '/tmp')}/{iface}.log)")
            time.sleep(0.05)

    def teardown(self) -> None:
        """Stop our wireguard-go processes (SIGTERM: each removes its interface and socket),
        then remove any socket a killed one left. Safe to call when nothing exists."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self.procs.clear()
        for iface in self.ifaces:
            (SOCKETS / f"{iface}.sock").unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """Control sockets of ours that still exist (the interfaces go with the namespaces)."""
        return [str(SOCKETS / f"{i}.sock") for i in self.ifaces
                if (SOCKETS / f"{i}.sock").exists()]


class Capture:
    """Every frame seen on veth end `hosts.devs[i]`, recorded from inside host i's namespace by
    an AF_PACKET raw socket (no tcpdump needed) into `path`, from start() until stop()."""

    def __init__(self, hosts: TestHosts, i: int, path: Path):
        self.hosts, self.i, self.path = hosts, i, Path(path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Capture":
        self.proc = subprocess.Popen(
            [*self.hosts.exec_prefix(self.i), sys.executable, "-c", _CAPTURE,
             self.hosts.devs[self.i], str(self.path)],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.hosts.procs.append(self.proc)  # the hosts' teardown stops it too
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the packet capture on {self.hosts.devs[self.i]} did not start")
        return self

    def stop(self) -> bytes:
        """Stop recording; the captured frames, each after its length (frames() splits them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        return self.path.read_bytes()


def known_tensor(seed: int = 35, n: int = 1 << 16) -> bytes:
    """The fp32 bytes exchange() sends: a seeded standard normal tensor of n elements."""
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


def exchange(hosts: TestHosts, master: str, ifaces: list[str], port: int, seed: int = 35,
             timeout: float = 120) -> None:
    """Rank 0 on host 0 broadcasts known_tensor(seed) to rank 1 on host 1 over gloo, rendezvous
    at `master` (a veth or a tunnel address), gloo bound to `ifaces[r]`: the same transport as
    lowband's outer link. Raises unless rank 1 received it bitwise."""
    procs = []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": master,
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": ifaces[r]}
        procs.append(subprocess.Popen([*hosts.exec_prefix(r), sys.executable, "-c", _EXCHANGE,
                                       str(seed)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
                q.wait()
            raise RuntimeError(f"the gloo exchange over {master} did not finish in {timeout:g} s")
    if any(p.returncode for p in procs) or "received" not in outs[1]:
        raise RuntimeError(f"the gloo exchange over {master} failed: {outs[0][-400:]} "
                           f"{outs[1][-400:]}")


def windows(data: bytes, n: int = 16, size: int = 64) -> list[bytes]:
    """n windows of `size` bytes spread evenly over `data` (a window can straddle two TCP
    segments in a capture, so a search takes several)."""
    step = (len(data) - size) // max(n - 1, 1)
    return [data[k * step:k * step + size] for k in range(n)]


def found(capture: bytes, wins: list[bytes]) -> int:
    """How many of the windows occur verbatim in the captured bytes."""
    return sum(w in capture for w in wins)


def frames(capture: bytes):
    """The frames of a Capture's recording."""
    at = 0
    while at + 4 <= len(capture):
        n = int.from_bytes(capture[at:at + 4], "big")
        yield capture[at + 4:at + 4 + n]
        at += 4 + n


def ipv4_kinds(capture: bytes) -> dict[str, int]:
    """How many IPv4 frames of a recording are TCP, UDP to or from a port (the lower of the two:
    "udp 51820" is WireGuard's) or another protocol; ARP and IPv6 are left out."""
    kinds: dict[str, int] = {}
    for f in frames(capture):
        if len(f) < 38 or f[12:14] != b"\x08\x00":  # Ethernet type IPv4
            continue
        proto, ihl = f[23], (f[14] & 0x0F) * 4
        ports = (int.from_bytes(f[14 + ihl:16 + ihl], "big"),
                 int.from_bytes(f[16 + ihl:18 + ihl], "big"))
        kind = {6: "tcp", 17: f"udp {min(ports)}"}.get(proto, f"ip proto {proto}")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


_EXCHANGE = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
n = 1 << 16
t = (torch.randn(n, generator=torch.Generator().manual_seed(int(sys.argv[1])))
     if dist.get_rank() == 0 else torch.zeros(n))
dist.broadcast(t, src=0)
ok = torch.equal(t, torch.randn(n, generator=torch.Generator().manual_seed(int(sys.argv[1]))))
dist.barrier()
dist.destroy_process_group()
print("received" if ok else "corrupted", flush=True)
"""

# in the host's namespace: frames to a file (each after its length, 4 bytes) until SIGTERM
_CAPTURE = """
import signal, socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))  # ETH_P_ALL
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root): past rmem_max, drop nothing
s.bind((sys.argv[1], 0))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
s.settimeout(0.2)
print("ready", flush=True)
with open(sys.argv[2], "wb") as out:
    while not stop:
        try:
            frame = s.recv(1 << 16)
            out.write(len(frame).to_bytes(4, "big") + frame)
        except (socket.timeout, InterruptedError):
            pass
"""
