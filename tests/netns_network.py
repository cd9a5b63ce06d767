"""Network-namespace hosts on a bridge: the network under the tests' simulated machines.

``NamespaceNetwork(tag, subnet, count)`` builds, in this machine's root
namespace, a bridge ``rdl<tag>br0`` with address ``<subnet>.1/24`` and, per
host ``i`` (1-based), a namespace ``rdl-<tag><i>`` joined to it by a veth pair,
with address ``<subnet>.<10+i>/24`` on its ``eth0``. Nothing outside that
subnet and these names is touched; ``remove()`` kills what runs in the
namespaces and deletes them with the bridge (also what a killed run left).

:meth:`enter` gives the command prefix that runs a program in a host's network
namespace with a hostname of its own and, optionally, an ``/etc/hosts`` of its
own (a mount namespace with a bind mount, so this machine's file is left
alone): what a real host or pod would have.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest


def missing_tools(tools, files=()) -> list[str]:
    """Of ``tools`` (commands) and ``files``, those this machine lacks, and "root" when not run as root."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    missing += [path for path in files if not os.path.exists(path)]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def require(missing: list[str], tests: str, installs: str) -> None:
    """Skip ``tests`` when ``missing`` is not empty on a developer's machine; fail on CI (CI=true), where
    .ci/run ``installs`` them, so that these tests can never be skipped silently there."""
    if missing:
        message = f"{tests} need {', '.join(missing)} (.ci/run installs {installs})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def run(*cmd, check=True, env=None) -> subprocess.CompletedProcess:
    """Run a setup command (30 s at most); its output as text."""
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=30, env=env)


def stop(daemons) -> None:
    """Stop daemons started with ``start_new_session=True``: SIGTERM to each one's process group, SIGKILL
    after 10 s."""
    for proc in daemons:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class NamespaceNetwork:
    """Hosts ``rdl-<tag>1 .. rdl-<tag>N`` on bridge ``rdl<tag>br0``; see the module docstring."""

    def __init__(self, tag: str, subnet: str, count: int):
        self.bridge = f"rdl{tag}br0"
        self.gateway = f"{subnet}.1"
        self.namespaces = [f"rdl-{tag}{i}" for i in range(1, count + 1)]
        self.addrs = [f"{subnet}.{10 + i}" for i in range(1, count + 1)]
        self._veths = [f"rdl{tag}v{i}" for i in range(1, count + 1)]
        self._tag = tag

    def build(self) -> None:
        """Create the bridge and the namespaces (after removing any left by a killed run)."""
        self.remove()
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for i, (namespace, addr, veth) in enumerate(zip(self.namespaces, self.addrs, self._veths), 1):
            peer = f"rdl{self._tag}p{i}"
            run("ip", "netns", "add", namespace)
            run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            run("ip", "link", "set", veth, "master", self.bridge, "up")
            run("ip", "link", "set", peer, "netns", namespace)
            run("ip", "-n", namespace, "link", "set", peer, "name", "eth0")
            run("ip", "-n", namespace, "addr", "add", f"{addr}/24", "dev", "eth0")
            run("ip", "-n", namespace, "link", "set", "eth0", "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")

    def enter(self, index: int, hostname: str, hosts_file=None) -> list[str]:
        """The command prefix that runs ``sh -c SCRIPT`` in host ``index``'s (0-based) network namespace,
        as ``hostname``, with ``hosts_file`` as its /etc/hosts when given; append the script."""
        setup = f"mount --bind {hosts_file} /etc/hosts && " if hosts_file else ""
        return ["nsenter", f"--net=/run/netns/{self.namespaces[index]}", "unshare", "--uts", "--mount",
                "sh", "-c", f'{setup}hostname {hostname} && exec "$0" "$@"']

    def pids(self, index: int) -> set[int]:
        """Pids of every process in host ``index``'s (0-based) network namespace."""
        return {int(p) for p in run("ip", "netns", "pids", self.namespaces[index], check=False).stdout.split()}

    def remove(self) -> None:
        """Kill what runs in the namespaces; delete them, their veths and the bridge."""
        for index, (namespace, veth) in enumerate(zip(self.namespaces, self._veths)):
            for pid in self.pids(index):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run("ip", "netns", "del", namespace, check=False)
            run("ip", "link", "del", veth, check=False)
        run("ip", "link", "del", self.bridge, check=False)
