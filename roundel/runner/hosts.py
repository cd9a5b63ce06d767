"""Which hosts a job runs on, how many slots each offers, and which rank goes where.

Host lists come from ``-H a:2,b:2`` or a hostfile of ``host slots=N`` lines.
Ranks are assigned the way Horovod does: hosts in the order given, filled
one after another.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket

import psutil

from roundel.rendezvous.identity import Identity

__all__ = ["SlotInfo", "assign_slots", "format_hosts", "is_local_host", "parse_hostfile", "parse_hosts",
           "validate_hostname"]


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """One rank's place: its host and rank numbers as Horovod defines them."""

    hostname: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def to_identity(self) -> Identity:
        """The Identity a worker in this slot is started with."""
        return Identity(
            rank=self.rank,
            size=self.size,
            local_rank=self.local_rank,
            local_size=self.local_size,
            cross_rank=self.cross_rank,
            cross_size=self.cross_size,
            hostname=self.hostname,
        )


_HOST_CHARS = re.compile(r"[A-Za-z0-9._:%\[\]@-]+")


def validate_hostname(name: str, where: str = "host") -> str:
    """Return ``name`` if it is safe to hand to ssh as a host; raise ValueError naming it otherwise.

    A host name (or ``user@host``, IPv4, IPv6 address) may hold letters, digits
    and ``. _ - : % [ ] @``, and must not start with ``-`` (ssh would read it as
    an option). Whitespace, shell metacharacters and control characters are refused.
    """
    if not name:
        raise ValueError(f"{where}: '' is not a host name (an empty entry in the host list?)")
    if name.startswith("-"):
        raise ValueError(f"{where}: host name {name!r} starts with '-', which ssh would take for an option; "
                         "fix the host list")
    if not _HOST_CHARS.fullmatch(name):
        bad = sorted({c for c in name if not _HOST_CHARS.fullmatch(c)})
        raise ValueError(f"{where}: host name {name!r} contains {', '.join(map(repr, bad))}; host names may hold "
                         "only letters, digits and . _ - : % [ ] @")
    return name


def _check_slots(raw: str, host: str, where: str) -> int:
    try:
        slots = int(raw)
    except ValueError:
        raise ValueError(f"{where}: slots of host {host!r} must be a whole number, not {raw!r}") from None
    if slots < 1:
        raise ValueError(f"{where}: host {host!r} must offer at least 1 slot, not {slots}")
    return slots


def _no_duplicates(hosts: list[tuple[str, int]], where: str) -> list[tuple[str, int]]:
    seen = set()
    for name, _ in hosts:
        if name in seen:
            raise ValueError(f"{where}: host {name!r} is listed twice; give it once with its total slots")
        seen.add(name)
    if not hosts:
        raise ValueError(f"{where}: no hosts given")
    return hosts


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """Parse ``"a:2,b:2"`` (slots default to 1) into ``[("a", 2), ("b", 2)]``; raise ValueError if malformed."""
    where = f"-H {spec!r}"
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        hosts.append((validate_hostname(name, where), _check_slots(slots, name, where)))
    return _no_duplicates(hosts, where)


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """Parse a hostfile of ``host slots=N`` lines (``#`` comments, blank lines; slots default to 1).

    Raises ValueError naming the file and line of a malformed entry, and
    OSError if the file cannot be read.
    """
    hosts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            where = f"hostfile {path} line {lineno}"
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            name, slots = validate_hostname(fields[0], where), 1
            for field in fields[1:]:
                key, sep, value = field.partition("=")
                if key != "slots" or not sep:
                    raise ValueError(f"{where}: expected 'host slots=N', got {line.strip()!r}")
                slots = _check_slots(value, name, where)
            hosts.append((name, slots))
    return _no_duplicates(hosts, f"hostfile {path}")


def format_hosts(hosts: list[tuple[str, int]]) -> str:
    """The ``-H`` form of a host list, e.g. ``"a:2,b:2"``."""
    return ",".join(f"{name}:{slots}" for name, slots in hosts)


def assign_slots(hosts: list[tuple[str, int]], np: int) -> list[SlotInfo]:
    """Place ``np`` ranks on ``hosts``, filling each host before the next.

    ``local_rank`` counts ranks within a host and ``local_size`` is how many
    ranks that host runs; ``cross_rank`` is the host's index among the hosts
    running a rank with the same ``local_rank``, and ``cross_size`` how many
    such hosts there are. Raises ValueError if ``np`` < 1 or exceeds the slots.
    """
    total = sum(slots for _, slots in hosts)
    if np < 1:
        raise ValueError(f"-np must be at least 1, not {np}")
    if np > total:
        if not hosts:
            raise ValueError(f"requested -np {np} but no host is given: list hosts with -H or --hostfile")
        last, slots = hosts[-1]
        more = format_hosts([*hosts[:-1], (last, slots + np - total)])
        raise ValueError(f"requested -np {np} but the hosts offer only {total} slot{'s' if total != 1 else ''} "
                         f"({format_hosts(hosts)}): give the hosts {np} slots in all (-H {more}) or add hosts, "
                         f"or lower -np to {total}")
    used = []  # (hostname, ranks placed on it), for hosts that get at least one rank
    remaining = np
    for name, slots in hosts:
        if remaining == 0:
            break
        count = min(slots, remaining)
        used.append((name, count))
        remaining -= count
    slots_out = []
    rank = 0
    for host_index, (name, local_size) in enumerate(used):
        for local_rank in range(local_size):
            peers = [i for i, (_, n) in enumerate(used) if n > local_rank]
            slots_out.append(
                SlotInfo(
                    hostname=name,
                    rank=rank,
                    size=np,
                    local_rank=local_rank,
                    local_size=local_size,
                    cross_rank=peers.index(host_index),
                    cross_size=len(peers),
                )
            )
            rank += 1
    return slots_out


def _local_addresses() -> set[str]:
    addrs = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                addrs.add(entry.address.split("%", 1)[0])
    return addrs


def is_local_host(name: str) -> bool:
    """Whether ``name`` (a host name or address) refers to this machine."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    local = _local_addresses()
    if name in local:
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return any(addr in local or ipaddress.ip_address(addr).is_loopback for addr in resolved)
