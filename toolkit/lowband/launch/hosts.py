"""Test hosts on this machine: Linux network namespaces joined by veth pairs whose ends are
shaped by `tc qdisc ... tbf` to a bandwidth, optionally each with its own hostname. Two hosts are
joined by one veth pair (both ends shaped); three or more each by a veth pair to a bridge in a
namespace of its own (each host's end shaped: every host's egress is the throttled link).

Needs root, `ip` and `tc` (and `unshare` for hostnames); `unavailable()` says why not. Setting up
first removes leftovers of a crashed run; `with TestHosts(...) as hosts:` always removes what it
made: the processes started in the hosts, the namespaces (and with them the bridge and veths)
and /etc/netns/<host>.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ETC_NETNS = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<host>/* over /etc


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:  # no `ip` here: nothing of ours can exist either
        proc = subprocess.CompletedProcess(cmd, 127, "", str(e))
    if check and proc.returncode != 0:
        why = proc.stderr.strip() or proc.stdout.strip()
        raise RuntimeError(f"`{shlex.join(cmd)}` failed: {why}")
    return proc


class TestHosts:
    """Hosts <prefix>-<host>0 .. <host>{n-1} (network namespaces) with addresses <subnet>.1 ..
    .n/24 on veth <prefix>-v0 .. -v{n-1}, each host's end's egress shaped by tbf (rate, burst,
    latency). n = 2: -v0 <-> -v1 directly. n > 2: -v<i> <-> port -p<i> of bridge -br in
    namespace <prefix>-<host>sw (unshaped).

    With `uplink` (an address in the subnet, e.g. "<subnet>.254"), the hosts always meet at the
    bridge, and this machine's own (root) namespace joins it too, by veth <prefix>-up (unshaped)
    with that address: services run here (a Slurm controller) and the hosts reach each other.

    With `hostnames`, a command run on host i (`exec_prefix(i)`, `popen`) also gets its own UTS
    namespace with the host's name as hostname, and an /etc/hosts naming every host, as cluster
    nodes resolve each other (torch's rendezvous and TCPStore need it).
    """

    __test__ = False  # not a pytest test class, whatever module imports it

    def __init__(self, prefix: str, subnet: str, rate: str, burst: str, latency: str, *,
                 host: str = "h", hostnames: bool = False, n: int = 2,
                 uplink: str | None = None):
        if n < 2:
            raise ValueError(f"n={n}: test hosts come two or more")
        self.names = [f"{prefix}-{host}{i}" for i in range(n)]
        self.devs = [f"{prefix}-v{i}" for i in range(n)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(n)]
        # n > 2 (or an uplink): the bridge, its namespace and its port for each host
        bridged = n > 2 or uplink is not None
        self.switch = f"{prefix}-{host}sw" if bridged else None
        self.bridge = f"{prefix}-br" if bridged else None
        self.ports = [f"{prefix}-p{i}" for i in range(n)] if bridged else []
        self.uplink = uplink
        self.uplink_dev = f"{prefix}-up"
        self.rate, self.burst, self.latency = rate, burst, latency
        self.hostnames = hostnames
        self.procs: list[subprocess.Popen] = []

    def unavailable(self) -> str | None:
        """Why the hosts cannot be made here (one sentence, after "it"), or None when they can."""
        if os.name != "posix" or os.geteuid() != 0:
            return "needs root to create network namespaces"
        tools = ("ip", "tc", "unshare") if self.hostnames else ("ip", "tc")
        missing = [f"`{t}`" for t in tools if shutil.which(t) is None]
        if missing:
            listed = ", ".join(missing[:-1]) + " and " + missing[-1] if missing[1:] else missing[0]
            return f"needs {listed}, not found on PATH"
        return None

    # -- life cycle --------------------------------------------------------------------------

    def __enter__(self) -> "TestHosts":
        return self.setup()

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> "TestHosts":
        self.teardown()  # leftovers of a run that crashed
        # IPv4-mapped too: torch's TCPStore names its peers by reverse look-up of those
        etc_hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{ip} {name}\n::ffff:{ip} {name}\n" for ip, name in zip(self.addrs, self.names))
        sw, br = self.switch, self.bridge
        # each veth pair: (namespace, end) <-> (namespace, end)
        pairs = ([((self.names[0], self.devs[0]), (self.names[1], self.devs[1]))] if sw is None
                 else [((ns, dev), (sw, port))
                       for ns, dev, port in zip(self.names, self.devs, self.ports)])
        try:
            for ns in self.namespaces():
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            if sw:
                _run("ip", "-n", sw, "link", "add", br, "type", "bridge")
                _run("ip", "-n", sw, "link", "set", br, "up")
            for (ns_a, a), (ns_b, b) in pairs:
                _run("ip", "link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b,
                     "netns", ns_b)
            for port in self.ports:
                _run("ip", "-n", sw, "link", "set", port, "master", br, "up")
            if self.uplink:
                up, port = self.uplink_dev, self.uplink_dev + "p"
                _run("ip", "link", "add", up, "type", "veth", "peer", "name", port, "netns", sw)
                _run("ip", "-n", sw, "link", "set", port, "master", br, "up")
                _run("ip", "addr", "add", f"{self.uplink}/24", "dev", up)
                _run("ip", "link", "set", up, "up")
            for ns, dev, ip in zip(self.names, self.devs, self.addrs):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                     "burst", self.burst, "latency", self.latency)
                if self.hostnames:
                    (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
                    (ETC_NETNS / ns / "hosts").write_text(etc_hosts)
        except Exception:
            self.teardown()
            raise
        return self

    def namespaces(self) -> list[str]:
        """The hosts' namespaces and the bridge's, if any."""
        return self.names + ([self.switch] if self.switch else [])

    def teardown(self) -> None:
        """Kill what runs in the hosts, remove the namespaces (and with them the bridge and the
        veths), any stray veth end and /etc/netns/<host>. Safe to call when nothing exists."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs.clear()
        listed = _run("ip", "netns", "list", check=False).stdout.split()
        for ns in self.namespaces():
            if ns in listed:
                # processes still in the namespace (a crashed run's): ours, by its name
                for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _run("ip", "netns", "delete", ns, check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        try:
            ETC_NETNS.rmdir()  # only if empty: other namespaces' files stay
        except OSError:
            pass
        for dev in self._stray_links():
            _run("ip", "link", "delete", "dev", dev, check=False)

    def _stray_links(self) -> list[str]:
        return [d for d in self.devs + self.ports + ([self.uplink_dev] if self.uplink else [])
                if _run("ip", "link", "show", "dev", d, check=False).returncode == 0]

    def leftovers(self) -> list[str]:
        """What of ours exists now: namespaces (a bridge lives in its own), veth ends in the
        root namespace and /etc/netns/<host> folders."""
        listed = _run("ip", "netns", "list", check=False).stdout.split()
        return ([ns for ns in self.namespaces() if ns in listed] + self._stray_links()
                + [str(ETC_NETNS / ns) for ns in self.names if (ETC_NETNS / ns).exists()])

    # -- use ---------------------------------------------------------------------------------

    def exec_prefix(self, i: int) -> list[str]:
        """What runs a command on host i: in its network namespace (and with its hostname)."""
        prefix = ["ip", "netns", "exec", self.names[i]]
        if self.hostnames:
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.names[i]]
        return prefix

    def popen(self, i: int, cmd: list[str], env: dict, log: Path, **kw) -> subprocess.Popen:
        """Start `cmd` on host i in a session of its own, output to `log`; teardown kills it."""
        with open(log, "wb") as out:
            p = subprocess.Popen([*self.exec_prefix(i), *cmd], env=env, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def counters(self) -> dict:
        """tx/rx bytes and packets of each veth end, read inside its namespace."""
        keys = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets")
        out = {}
        for ns, dev in zip(self.names, self.devs):
            files = " ".join(f"/sys/class/net/{dev}/statistics/{k}" for k in keys)
            text = _run("ip", "netns", "exec", ns, "sh", "-c", f"cat {files}").stdout.split()
            out[dev] = dict(zip(keys, map(int, text)))
        return out

    def measure_tcp(self, nbytes: int = 2_000_000, port: int = 29399) -> float:
        """Seconds to send `nbytes` over one TCP connection from host 0 to host 1 (until the
        receiver has read them all and answered one byte)."""
        recv = subprocess.Popen([*self.exec_prefix(1), sys.executable, "-c", _RECEIVER,
                                 self.addrs[1], str(port)], stdout=subprocess.PIPE, text=True)
        try:
            if recv.stdout.readline().strip() != "ready":
                raise RuntimeError("the TCP receiver on the second host did not start")
            out = subprocess.run([*self.exec_prefix(0), sys.executable, "-c", _SENDER,
                                  self.addrs[1], str(port), str(nbytes)], capture_output=True,
                                 text=True, timeout=60, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"the TCP sender failed: {out.stderr.strip()}")
            return float(out.stdout.strip())
        finally:
            try:
                recv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                recv.kill()
                recv.wait()


_RECEIVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
c.sendall(b"k"); c.close()
"""

_SENDER = """
import socket, sys, time
data = b"x" * int(sys.argv[3])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
t0 = time.perf_counter(); c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(1)
print(time.perf_counter() - t0)
"""
