"""Which of this machine's addresses other hosts can reach.

Used by ``roundelrun`` to bind and advertise its rendezvous store, and by a
worker started under another launcher to advertise the store it runs on
rank 0. No packet is sent to find a route: a UDP socket is "connected" and
asked which local address the kernel chose.
"""

from __future__ import annotations

import ipaddress
import socket

import psutil

__all__ = ["interface_address", "is_loopback", "resolve", "route_source", "reachable_address"]


def interface_address(names: str) -> str:
    """The first IPv4 (else IPv6) address of the first interface of ``names`` (one name, or a
    comma-separated list such as ``eth0,ib0``) that exists on this machine and has an address.

    Hosts whose interfaces are named differently can share one list: each uses
    the ones it has. Raises ValueError naming the interfaces that exist when
    none of ``names`` does or has an address.
    """
    addrs = psutil.net_if_addrs()
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    for name in wanted:
        for family in (socket.AF_INET, socket.AF_INET6):
            for entry in addrs.get(name, ()):
                if entry.family == family:
                    return entry.address.split("%", 1)[0]
    listed = ", ".join(repr(n) for n in wanted)
    if not any(name in addrs for name in wanted):
        what = f"network interface {listed} does not exist" if len(wanted) == 1 else \
            f"none of the network interfaces {listed} exists"
        raise ValueError(f"{what} on {socket.gethostname()} (interfaces: {', '.join(sorted(addrs))})")
    raise ValueError(f"network interface(s) {listed} have no IP address on {socket.gethostname()}")


def resolve(host: str) -> str:
    """The first IPv4 (else IPv6) address of ``host``; raises ValueError if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])  # an IPv4 or IPv6 address: a str already


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def route_source(host: str, port: int = 9) -> str | None:
    """The address of this machine's interface that routes to ``host``, or None if none does."""
    try:
        addr = resolve(host)
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None


def _first_non_loopback() -> str | None:
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and not is_loopback(entry.address):
                return entry.address
    return None


def reachable_address(towards: str | None = None, nics: str = "") -> str:
    """An address of this machine that other hosts of the job can reach.

    In order: that of the interfaces ``nics`` names (the job's network
    interface setting, as :func:`interface_address` takes it); the interface
    routing to ``towards``; the address this host's name resolves to; the
    first non-loopback IPv4 address; 127.0.0.1. Raises ValueError when none
    of ``nics`` exists here.
    """
    if nics:
        return interface_address(nics)
    if towards:
        source = route_source(towards)
        if source:
            return source
    try:
        own = resolve(socket.gethostname())
        if not is_loopback(own):
            return own
    except ValueError:
        pass
    return _first_non_loopback() or "127.0.0.1"
