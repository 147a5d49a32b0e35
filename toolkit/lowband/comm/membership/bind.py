"""The one address every listener of this process binds: $LOWBAND_BIND_HOST, set by the
launchers, else loopback.

LOWBAND_BIND_HOST holds an address of this machine or an interface's name (eth0: its address).
Unset (a launched job's node without --bind), a process binds the address of the interface that
routes to its job's Lighthouse or rendezvous host (bind_host: found by connecting a UDP socket,
which sends nothing), and loopback when it has neither; a one-machine run's launcher sets
loopback. Every listener of a lowband process binds it, never the wildcard: the torchft
Lighthouse (launch/supervise.py), torchft's manager server (bound_manager_server), the heal
server (comm/membership/heal.py), the stores (bound_store_type: the world's, lowband's agent's) and gloo's
pairs (bind_gloo: the interface that holds it).
"""

from __future__ import annotations

import fcntl
import functools
import ipaddress
import os
import re
import socket
import struct
from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import urlsplit

from lowband.options import BIND_ENV, LIGHTHOUSE_ENV, RANK0_ENV, ConfigError

LOOPBACK = "127.0.0.1"
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def bind_host(peer: str | None = None) -> str:
    """$LOWBAND_BIND_HOST's address; unset, the address of the interface that routes to the
    job's Lighthouse (TORCHFT_LIGHTHOUSE), else to its rendezvous host (MASTER_ADDR), else to
    its first node (a Lighthouse role: the variable $LOWBAND_RANK0_ENV names), else to `peer`
    (lowband's agent: its rendezvous host), else loopback. Never the wildcard."""
    given = os.environ.get(BIND_ENV)
    if given:
        return resolve(given)
    peer = (urlsplit(os.environ.get(LIGHTHOUSE_ENV, "")).hostname
            or os.environ.get("MASTER_ADDR") or os.environ.get(os.environ.get(RANK0_ENV, ""))
            or peer)
    return route_to(peer) if peer else LOOPBACK


def resolve(value: str) -> str:
    """This machine's address for `value`: an address of it or an interface's name. Anything
    else is refused with one sentence (ConfigError)."""
    _refuse_wildcard(value)
    found = interfaces()
    if value in found:
        if not found[value]:
            raise ConfigError(f"interface '{value}' has no address to bind: give another "
                              f"interface or an address (--bind, {BIND_ENV}).")
        return found[value][0]
    try:
        address = str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        raise ConfigError(f"'{value}' is neither an interface of this machine "
                          f"({', '.join(sorted(found))}) nor an IP address: give one of them "
                          f"(--bind, {BIND_ENV}).") from None
    if not is_local(address):
        raise ConfigError(f"{address} is not an address of this machine, so nothing can listen "
                          f"on it: give one of its interfaces or addresses (--bind, {BIND_ENV}).")
    return address


def check_bind(value: str, here: bool) -> str:
    """A --bind value (an interface's name or an address), checked before a job starts: `here`
    (its processes run on this machine), it must resolve here; for remote nodes, whose
    interfaces this machine cannot see, it must look like one. One sentence if not."""
    if here:
        resolve(value)
        return value
    _refuse_wildcard(value)
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", value):
            raise ConfigError(f"--bind {value!r} is neither an interface name (eth0, at most 15 "
                              "characters) nor an IP address: give the nodes' site link as "
                              "one of them.") from None
    return value


def _refuse_wildcard(value: str) -> None:
    if value.strip("[]") in ("0.0.0.0", "::", "*", ""):
        raise ConfigError(f"'{value}' is every interface, which lowband never binds: give the "
                          f"interface or the address of the site link (--bind, {BIND_ENV}).")


def route_to(host: str) -> str:
    """The address of this machine's interface that routes to `host`."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(where)  # UDP: picks the route and source address, sends nothing
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"no route from this machine to {host} ({e.strerror or e}), so it "
                          f"cannot pick the interface to bind: give it with --bind "
                          f"({BIND_ENV}).") from None


def interfaces() -> dict[str, list[str]]:
    """This machine's interfaces and their addresses (IPv4 first; no link-local IPv6, which
    needs a scope to bind)."""
    out: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in out:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out[name].append(socket.inet_ntoa(raw[20:24]))
            except OSError:  # no IPv4 address
                pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                hexaddr, _, _, scope, _, name = line.split()
                if int(scope, 16) != 0x20 and name in out:  # 0x20: link-local
                    out[name].append(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    except OSError:  # no IPv6
        pass
    return out


def is_local(address: str) -> bool:
    """Whether `address` is one of this machine's: whether a socket can bind it (a secondary
    address too, which interfaces() does not list)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def interface_of(address: str) -> str | None:
    """The interface that holds `address` (None: a secondary address, not listed)."""
    return next((name for name, addrs in interfaces().items() if address in addrs), None)


def url_host(address: str) -> str:
    """`address` as the host of a URL or a host:port (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) names this machine's loopback only (localhost)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return all(ipaddress.ip_address(f[4][0].split("%")[0]).is_loopback for f in found)


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host` on `port` (0: a free one), listening."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


def bind_gloo() -> None:
    """gloo binds the interface that holds bind_host() (GLOO_SOCKET_IFNAME, unless given): by
    default it binds the address the host name resolves to (never the wildcard, so that stays
    for a secondary address, whose interface is not known here)."""
    interface = interface_of(bind_host())
    if interface is not None:
        os.environ.setdefault(GLOO_IFNAME, interface)


def world_store(rank: int, world: int, timeout: timedelta):
    """The world's store from MASTER_ADDR/MASTER_PORT, as torch's env:// makes it, with rank 0's
    server on bind_host(). Under torchrun's agent every rank is a client: the agent's process
    serves it (lowband's agent on its bind address too: launch/node.py)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return bound_store_type()(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              rank == 0 and not agent, timeout=timeout, multi_tenant=True)


_STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
               "multi_tenant", "master_listen_fd", "use_libuv")


@functools.cache
def bound_store_type():
    """torch's TCPStore whose server listens on one address only (BoundTCPStore): torch's own
    binds every interface unless given master_listen_fd, a socket bound here."""
    from torch.distributed import TCPStore

    class BoundTCPStore(TCPStore):
        """Its server on bind_host(), or on loopback when its host is a loopback name
        (localhost: a one-node job's own rendezvous), where its clients look for it."""

        def __init__(self, *args, **kwargs):
            kwargs.update(zip(_STORE_ARGS, args))
            if not kwargs.get("is_master") or kwargs.get("master_listen_fd") is not None:
                super().__init__(**kwargs)
                return
            host = LOOPBACK if is_loopback(kwargs["host_name"]) else bind_host()
            try:
                listener = listen_socket(host, kwargs.get("port", 0))
            except OSError as e:  # (torch's callers expect its RuntimeError: port in use)
                raise RuntimeError(f"cannot listen on {host}:{kwargs.get('port', 0)} "
                                   f"({e.strerror or e})") from None
            kwargs.update(port=listener.getsockname()[1], master_listen_fd=listener.fileno())
            try:
                super().__init__(**kwargs)
            except BaseException:
                listener.close()
                raise
            listener.detach()  # the store's server owns the socket now

    return BoundTCPStore


@contextmanager
def bound_manager_server(host: str):
    """While torchft's Manager is built, its ManagerServer binds `host`: torchft hard-codes its
    bind as f"[::]:{port}" (every interface), so the name torchft.manager looks up is replaced
    for that time by one that binds `host` (the port stays torchft's)."""
    import torchft.manager as manager

    server = manager.ManagerServer

    def manager_server(*args, bind: str, **kwargs):
        return server(*args, bind=f"{url_host(host)}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager.ManagerServer = manager_server
    try:
        yield
    finally:
        manager.ManagerServer = server
