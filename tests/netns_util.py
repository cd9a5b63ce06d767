"""Simulated hosts for launcher tests: Linux network namespaces, each running a real sshd.

``NetnsHosts`` builds a network (tests/netns_network.py) whose bridge has
address 10.231.0.1/24 (the launcher's own address on the test network) and,
per simulated host, a namespace ``rdl-h<N>`` with address 10.231.0.1N/24 and
Debian's ``/usr/sbin/sshd``
listening on port 2222 with a host key, client key and ``authorized_keys``
made by the test (root login by key only). Nothing outside 10.231.0.0/24 and
these names is touched; ``close()`` stops the sshds and removes everything.
Namespaces share this machine's file system, so the same Python and checkout
paths work inside them. A file lock keeps two test runs on one machine from
building the network at the same time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import netns_network
from netns_network import NamespaceNetwork, run as _run, stop

SUBNET = "10.231.0"
LAUNCHER_ADDR = f"{SUBNET}.1"
SSH_PORT = 2222
LOCK = "/tmp/roundel-netns-tests.lock"
NEEDED = ("ip", "ssh", "ssh-keygen", "/usr/sbin/sshd")


def missing_tools() -> list[str]:
    """What these tests need that this machine lacks (root, iproute2, openssh client and server)."""
    return netns_network.missing_tools(NEEDED)


def require_tools() -> None:
    """Skip when tools are missing on a developer's machine; fail on CI, where .ci/run installs them."""
    netns_network.require(missing_tools(), "network-namespace ssh tests", "openssh-server")


class NetnsHosts:
    """Simulated hosts ``rdl-h1 .. rdl-hN`` with sshd; see the module docstring."""

    def __init__(self, count: int, workdir: Path):
        self.count = count
        self.dir = workdir
        self.net = NamespaceNetwork("h", SUBNET, count)
        self.names = self.net.namespaces
        self.addrs = self.net.addrs
        self.sshd: dict[str, subprocess.Popen] = {}
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def key(self) -> str:
        return str(self.dir / "id_ed25519")

    def ssh_env(self) -> dict:
        """The ``ROUNDEL_SSH_ARGS`` that keep host keys in this test's own known_hosts file."""
        return {"ROUNDEL_SSH_ARGS": f"-o UserKnownHostsFile={self.dir / 'known_hosts'} "
                                    f"-o StrictHostKeyChecking=no -o LogLevel=ERROR"}

    def _build(self) -> None:
        d = self.dir
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
        os.makedirs("/run/sshd", exist_ok=True)
        self.net.build()
        for name, addr in zip(self.names, self.addrs):
            config = d / f"sshd_{name}.conf"
            config.write_text(
                f"Port {SSH_PORT}\nListenAddress {addr}\nHostKey {d / 'host_key'}\n"
                f"PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n"
                f"KbdInteractiveAuthentication no\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
                f"StrictModes no\nUsePAM no\nPidFile none\nLogLevel ERROR\n")
            log = open(d / f"sshd_{name}.log", "w")
            self.sshd[name] = subprocess.Popen(
                ["ip", "netns", "exec", name, "/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                stdout=log, stderr=log, start_new_session=True)
        for name, addr in zip(self.names, self.addrs):
            self._wait_for_sshd(name, addr)

    def _wait_for_sshd(self, name: str, addr: str) -> None:
        deadline = time.monotonic() + 20
        while True:
            probe = subprocess.run(
                ["ssh", "-i", self.key, "-p", str(SSH_PORT), "-o", "BatchMode=yes",
                 *self.ssh_env()["ROUNDEL_SSH_ARGS"].split(), addr, "true"],
                capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline or self.sshd[name].poll() is not None:
                log = (self.dir / f"sshd_{name}.log").read_text()
                raise RuntimeError(f"sshd in {name} did not come up: {probe.stderr}\n{log}")
            time.sleep(0.2)

    def shape(self, rate: str = "1gbit") -> None:
        """Limit what each host sends to the others to ``rate`` (a ``tc`` rate such as ``1gbit``).

        A token bucket on each namespace's ``eth0``; ranks on one host talk
        through its loopback and are not limited. ``close()`` removes it with
        the namespaces.
        """
        for name in self.names:
            _run("ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "eth0", "root",
                 "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")

    def pids(self, name: str) -> set[int]:
        """Pids of every process in namespace ``name`` except its sshd listener."""
        daemon = self.sshd.get(name)
        return self.net.pids(self.names.index(name)) - ({daemon.pid} if daemon else set())

    def leftovers(self, timeout: float = 10.0) -> dict[str, set[int]]:
        """Processes still running in any namespace after ``timeout`` seconds of waiting for them to go."""
        deadline = time.monotonic() + timeout
        while True:
            left = {name: self.pids(name) for name in self.names}
            left = {name: pids for name, pids in left.items() if pids}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def close(self) -> None:
        stop(self.sshd.values())
        self.sshd.clear()
        self.net.remove()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two simulated hosts for every test of a module (import this fixture into the test module)."""
    require_tools()
    net = NetnsHosts(2, tmp_path_factory.mktemp("netns"))
    yield net
    net.close()
