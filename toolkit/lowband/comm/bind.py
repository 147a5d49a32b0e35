"""The one address every listener of this process binds: $LOWBAND_BIND_HOST, set by the launchers, else loopback.

LOWBAND_BIND_HOST holds an address of this machine, an interface's name (eth0: its address) or
route:HOST (the address of the interface that routes to HOST: a launched job's default on a
node, found by connecting a UDP socket, which sends nothing). Every listener of a lowband
process binds it: the torchft Lighthouse and manager server (comm/elastic.py, launch/supervise.py),
the heal server, the world's TCPStore (world_store) and gloo's pairs (bind_gloo: the interface
that holds it), never the wildcard.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from contextlib import contextmanager
from datetime import timedelta

from lowband.options import ConfigError

BIND_ENV = "LOWBAND_BIND_HOST"
LOOPBACK = "127.0.0.1"
ROUTE = "route:"
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def bind_host() -> str:
    return resolve(os.environ.get(BIND_ENV) or LOOPBACK)


def resolve(value: str) -> str:
    """This machine's address for `value`: an address of it, an interface's name or route:HOST.
    Anything else is refused with one sentence (ConfigError)."""
    if value.startswith(ROUTE):
        return route_to(value[len(ROUTE):])
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
    if address not in {a for addrs in found.values() for a in addrs}:
        raise ConfigError(f"{address} is not an address of this machine, so nothing can listen "
                          f"on it: give one of its interfaces or addresses (--bind, {BIND_ENV}).")
    return address


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


def interface_of(address: str) -> str:
    """The interface that holds `address`."""
    return next(name for name, addrs in interfaces().items() if address in addrs)


def url_host(address: str) -> str:
    """`address` as the host of a URL or a host:port (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def listen_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound to bind_host() on `port` (0: a free one), listening."""
    host = bind_host()
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(128)
    return s


def bind_gloo() -> None:
    """gloo binds the interface that holds bind_host() (GLOO_SOCKET_IFNAME, unless given): by
    default it would bind the address the hostname resolves to."""
    os.environ.setdefault(GLOO_IFNAME, interface_of(bind_host()))


def world_store(rank: int, world: int, timeout: timedelta):
    """The world's store for init_process_group from MASTER_ADDR/MASTER_PORT, as torch's env://
    makes it, but with rank 0's server on bind_host() (a socket bound here: torch's own binds
    every interface). None under torchrun's agent, whose own process serves the store."""
    from torch.distributed import PrefixStore, TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    port = int(os.environ["MASTER_PORT"])
    listener = listen_socket(port) if rank == 0 else None
    store = TCPStore(os.environ["MASTER_ADDR"], port, world, rank == 0, timeout=timeout,
                     multi_tenant=True,
                     **({"master_listen_fd": listener.fileno()} if listener else {}))
    if listener is not None:
        listener.detach()  # the store's server owns the socket now
    return PrefixStore("default_pg", store)


@contextmanager
def bound_torchft(host: str):
    """While torchft's Manager is built, its listeners bind `host` (comm/bind.py): torchft
    hard-codes its ManagerServer's bind as f"[::]:{port}" (every interface) and its HTTP
    checkpoint server's as ("", 0), so the two names torchft.manager and its HTTP transport
    look up are replaced for that time by ones that bind `host` (the port stays torchft's)."""
    import torchft.checkpointing.http_transport as http
    import torchft.manager as manager

    server, http_server = manager.ManagerServer, http._IPv6HTTPServer

    def manager_server(*args, bind: str, **kwargs):
        return server(*args, bind=f"{url_host(host)}:{bind.rsplit(':', 1)[1]}", **kwargs)

    class HostHTTPServer(http_server):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def server_bind(self):
            self.server_address = (host, self.server_address[1])
            super().server_bind()

    manager.ManagerServer, http._IPv6HTTPServer = manager_server, HostHTTPServer
    try:
        yield
    finally:
        manager.ManagerServer, http._IPv6HTTPServer = server, http_server


def bound_checkpoint_server(manager, host: str) -> None:
    """torchft serves a healing group the state over HTTP (http.server), bound to `host`
    (bound_torchft), and names it by socket.gethostname(), which need not resolve to `host`:
    its address names `host`. Its access line per request (`"GET /checkpoint/4/full HTTP/1.1"
    200 -`, on replica group 0's first rank the terminal) is dropped: heals are membership
    events already."""
    transport = getattr(manager, "_checkpoint_transport", None)
    server = getattr(transport, "_server", None)
    if server is not None:
        server.RequestHandlerClass.log_message = lambda *args: None
        port = server.socket.getsockname()[1]
        transport.address = lambda: f"http://{url_host(host)}:{port}/checkpoint/"
