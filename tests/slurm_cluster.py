"""A real Slurm cluster for the tests: slurmctld here, one slurmd per network-namespace node.

``SlurmCluster(count, workdir)`` builds a network (tests/netns_network.py)
whose bridge has address 10.232.0.1/24 (the controller's, and the login
host's) and whose namespace ``rdl-s<N>``, address 10.232.0.1N, is compute node
``rdlnode<N>``. It starts Debian's ``munged`` (its own socket, the machine's
key), ``slurmctld`` in this namespace and, per node, a ``slurmd`` entered into
the node's network namespace with ``nsenter`` and given the node's hostname
and an ``/etc/hosts`` that names every node. Every file (configuration, state, spool, logs) lives in ``workdir``;
``srun``/``sbatch`` find the cluster through ``SLURM_CONF`` (:meth:`env`).
Jobs' tasks are forked by their node's slurmd, so they run in its namespaces
with the node's hostname and address, on this machine's file system.
``close()`` stops every daemon and removes the network.

A finished job's record is kept for 4 s (MinJobAge), not 300: ``sbatch --wait``
then asks about its job every 2 s instead of after 2 s, 8 s, 32 s...

Slurm 22.05 always loads a cgroup plugin: ``cgroup.conf`` names cgroup/v1,
which starts with no cgroup file system mounted, and the cluster tracks
processes with proctrack/linuxproc and binds nothing (task/none).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

import netns_network
from netns_network import NamespaceNetwork, run, stop

SUBNET = "10.232.0"
CONTROLLER_PORT = 6917  # not Slurm's default 6817, so a real controller on this machine is never confused
NODE_CPUS = 4
LOCK = "/tmp/roundel-slurm-tests.lock"
NEEDED = ("ip", "nsenter", "unshare", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged",
          "srun", "sbatch", "sinfo")


def require_tools() -> None:
    """Skip on a developer's machine without Slurm; fail on CI (CI=true), where .ci/run installs it."""
    netns_network.require(netns_network.missing_tools(NEEDED, ["/etc/munge/munge.key"]), "the Slurm tests",
                          "slurm-wlm and munge")


class SlurmCluster:
    """Compute nodes ``rdlnode1 .. rdlnodeN`` under one controller; see the module docstring."""

    def __init__(self, count: int, workdir: Path):
        self.count = count
        self.dir = workdir
        self.nodes = [f"rdlnode{i}" for i in range(1, count + 1)]
        self.net = NamespaceNetwork("s", SUBNET, count)
        self.conf = workdir / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def env(self) -> dict[str, str]:
        """The variables that point srun, sbatch and sinfo at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _build(self) -> None:
        self.net.build()
        self._write_config()
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        self._start("munged", ["/usr/sbin/munged", "--foreground", "--force", "--socket", str(munge / "socket"),
                               "--key-file", "/etc/munge/munge.key", "--pid-file", str(munge / "pid"),
                               "--seed-file", str(munge / "seed"), "--log-file", str(munge / "log")])
        self._wait(lambda: (munge / "socket").exists(), "munged made no socket", "munged")
        self._start("slurmctld", ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(self.conf)])
        for index, node in enumerate(self.nodes):
            self._start(node, [*self.net.enter(index, node, self.dir / "hosts"),
                               "/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(self._all_idle, "the nodes did not become idle", *self.daemons)

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        controller = socket.gethostname()
        nodes = "\n".join(f"NodeName={node} NodeAddr={addr} CPUs={NODE_CPUS} State=UNKNOWN"
                          for node, addr in zip(self.nodes, self.net.addrs))
        self.conf.write_text(f"""\
ClusterName=roundeltest
SlurmctldHost={controller}({self.net.gateway})
SlurmctldPort={CONTROLLER_PORT}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d / 'munge' / 'socket'}
CredType=cred/munge
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'spool'}/slurmd.%n.pid
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log'}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=5
MinJobAge=4
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        hosts = ["127.0.0.1\tlocalhost", f"{self.net.gateway}\t{controller}"]
        hosts += [f"{addr}\t{node}" for node, addr in zip(self.nodes, self.net.addrs)]
        (d / "hosts").write_text("\n".join(hosts) + "\n")

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                              start_new_session=True)

    def _all_idle(self) -> bool:
        out = run("sinfo", "-h", "-N", "-o", "%N %t", check=False, env={**os.environ, **self.env()}).stdout
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready, what: str, *daemons: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name in daemons if self.daemons[name].poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} (exited: {dead or 'none'}):\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        """Every daemon's log, for a failure's message."""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    def processes_left(self, marker: str, timeout: float = 10.0) -> list[str]:
        """Command lines of processes still running, after ``timeout`` s, whose command line holds ``marker``."""
        deadline = time.monotonic() + timeout
        while True:
            found = []
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if marker in cmdline:
                    found.append(f"{pid}: {cmdline}")
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def close(self) -> None:
        stop(reversed(list(self.daemons.values())))
        self.daemons.clear()
        self.net.remove()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster for every test of a module (import this fixture into the test module)."""
    require_tools()
    cluster = SlurmCluster(2, tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.close()
