"""Finding an elastic job's hosts: the user's ``--host-discovery-script`` (or fixed ``-H`` hosts), and the blacklist.

The script is run (with no arguments) every time the driver polls; each line
it prints names a host that may run workers now, as ``host`` or
``host:slots`` (``--slots`` when the count is left out). A script that fails
or prints a malformed line is reported, and the last good answer is kept.
"""

from __future__ import annotations

import random
import subprocess
import time
from typing import Protocol

from roundel.runner import spawn
from roundel.runner.hosts import parse_hosts

__all__ = ["Blacklist", "DiscoveryError", "FixedHosts", "HostDiscovery", "HostSource", "parse_discovery_output"]


class DiscoveryError(Exception):
    """The discovery script could not be run or printed something that is not a host list."""


def parse_discovery_output(text: str, default_slots: int) -> dict[str, int]:
    """``{host: slots}`` from the script's output; raise DiscoveryError for a malformed line."""
    hosts: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        spec = line if ":" in line else f"{line}:{default_slots}"
        try:
            [(name, slots)] = parse_hosts(spec)
        except ValueError as exc:
            raise DiscoveryError(f"line {lineno} ({line!r}) is not 'host' or 'host:slots': {exc}") from None
        if name in hosts:
            raise DiscoveryError(f"line {lineno}: host {name!r} is listed twice")
        hosts[name] = slots
    return hosts


class HostSource(Protocol):
    """Where an elastic job's hosts come from: a script, fixed hosts, Ray's nodes, Spark's tasks."""

    def poll(self) -> dict[str, int]:
        """The usable hosts now, ``{host: slots}``."""
        ...


class HostDiscovery:
    """Runs the discovery script and remembers its last good answer."""

    def __init__(self, script: str, default_slots: int, timeout_s: float = 30.0):
        self.script = script
        self.default_slots = default_slots
        self.timeout_s = timeout_s
        self.hosts: dict[str, int] = {}
        self._last_problem: str | None = None

    def poll(self) -> dict[str, int]:
        """Run the script once; return the hosts it names (the previous answer if it failed)."""
        try:
            done = subprocess.run([self.script], capture_output=True, text=True, timeout=self.timeout_s,
                                  stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                raise DiscoveryError(f"exited with code {done.returncode}: {done.stderr.strip()[-300:]}")
            self.hosts = parse_discovery_output(done.stdout, self.default_slots)
            self._last_problem = None
        except (OSError, subprocess.TimeoutExpired, DiscoveryError) as exc:
            problem = f"roundelrun: host discovery script {self.script} failed ({exc}); keeping the last host list"
            if problem != self._last_problem:  # say it once, not at every poll
                spawn.say(problem)
                self._last_problem = problem
        return dict(self.hosts)


class FixedHosts:
    """The hosts of ``-H``/``--hostfile`` in an elastic job (``--min-np`` without a discovery script):
    the same answer at every poll, as horovodrun's fixed-host elastic mode."""

    def __init__(self, hosts: dict[str, int]):
        self.hosts = dict(hosts)

    def poll(self) -> dict[str, int]:
        """The fixed ``{host: slots}``."""
        return dict(self.hosts)


class Blacklist:
    """Hosts whose workers failed: no worker runs on a host while it is listed.

    Without a cooldown range a host stays listed for the rest of the job.
    With ``(lo, hi)``, as Horovod: the k-th time a host is listed it stays so
    for ``lo * 2**k`` seconds plus a random fraction of ``lo``, kept within
    ``[lo, hi]``; then it is re-admitted. A failure while the host is still
    listed changes nothing.
    """

    def __init__(self, cooldown_range: tuple[float, float] | None = None, clock=time.monotonic,
                 uniform=random.uniform):
        self.cooldown_range = cooldown_range
        self._clock = clock
        self._uniform = uniform
        self._count: dict[str, int] = {}
        self._until: dict[str, float] = {}

    @staticmethod
    def cooldown(lo: float, hi: float, count: int, fraction: float) -> float:
        """Seconds of cooldown after a host's ``count``-th listing, ``fraction`` in [0, 1) being the
        random part: ``lo * 2**count + fraction * lo`` kept within ``[lo, hi]``."""
        return max(lo, min(hi, lo * 2 ** count + fraction * lo))

    def add(self, host: str) -> float:
        """List ``host`` after a failure there; return how many seconds it stays listed (inf: for good)."""
        if self.cooldown_range is None:
            self._until[host] = float("inf")
            return float("inf")
        if self.contains(host):  # already cooling down: Horovod neither counts nor extends it
            return self._until[host] - self._clock()
        lo, hi = self.cooldown_range
        count = self._count[host] = self._count.get(host, 0) + 1
        seconds = self.cooldown(lo, hi, count, self._uniform(0.0, 1.0))
        self._until[host] = self._clock() + seconds
        return seconds

    def contains(self, host: str) -> bool:
        """Whether ``host`` is listed now (re-admitting it if its cooldown is over)."""
        until = self._until.get(host)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[host]
            return False
        return True
