"""A real Slurm cluster for the tests: slurmctld here, one slurmd per network-namespace node.

``SlurmCluster(count, workdir)`` builds a bridge ``rdlsbr0`` with address
10.232.0.1/24 (the controller's, and the login host's) and, per compute node
``rdlnode<N>``, a network namespace ``rdl-s<N>`` joined to the bridge by a veth
pair with address 10.232.0.1N/24. It starts Debian's ``munged`` (its own
socket, the machine's key), ``slurmctld`` in this namespace and, per node, a
``slurmd`` entered into the node's network namespace with ``nsenter`` and given
a hostname of its own (``unshare --uts``) and an ``/etc/hosts`` that names every
node (``unshare --mount`` and a bind mount, so this machine's file is left
alone). Every file (configuration, state, spool, logs) lives in ``workdir``;
``srun``/``sbatch`` find the cluster through ``SLURM_CONF`` (:meth:`env`).
Jobs' tasks are forked by their node's slurmd, so they run in its namespaces
with the node's hostname and address, on this machine's file system.
``close()`` stops every daemon and removes the network.

Slurm 22.05 always loads a cgroup plugin: ``cgroup.conf`` names cgroup/v1,
which starts with no cgroup file system mounted, and the cluster tracks
processes with proctrack/linuxproc and binds nothing (task/none).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

BRIDGE = "rdlsbr0"
SUBNET = "10.232.0"
CONTROLLER_ADDR = f"{SUBNET}.1"
CONTROLLER_PORT = 6917  # not Slurm's default 6817, so a real controller on this machine is never confused
NODE_CPUS = 4
LOCK = "/tmp/roundel-slurm-tests.lock"
NEEDED = ("ip", "nsenter", "unshare", "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged",
          "srun", "sbatch", "sinfo")


def missing_tools() -> list[str]:
    """What a Slurm cluster needs that this machine lacks (root, iproute2, util-linux, slurm-wlm, munge)."""
    missing = [tool for tool in NEEDED if shutil.which(tool) is None]
    if not os.path.exists("/etc/munge/munge.key"):
        missing.append("/etc/munge/munge.key")
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def require_tools() -> None:
    """Skip on a developer's machine without Slurm; fail on CI (CI=true), where .ci/run installs it."""
    missing = missing_tools()
    if missing:
        message = f"the Slurm tests need {', '.join(missing)} (.ci/run installs slurm-wlm and munge)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _run(*cmd, check=True, env=None):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, timeout=30, env=env)


class SlurmCluster:
    """Compute nodes ``rdlnode1 .. rdlnodeN`` under one controller; see the module docstring."""

    def __init__(self, count: int, workdir: Path):
        self.count = count
        self.dir = workdir
        self.nodes = [f"rdlnode{i}" for i in range(1, count + 1)]
        self.namespaces = [f"rdl-s{i}" for i in range(1, count + 1)]
        self.addrs = [f"{SUBNET}.{10 + i}" for i in range(1, count + 1)]
        self.conf = workdir / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._remove_network()  # leftovers of a run that was killed
            self._build()
        except BaseException:
            self.close()
            raise

    def env(self) -> dict[str, str]:
        """The variables that point srun, sbatch and sinfo at this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _build(self) -> None:
        self._network()
        self._write_config()
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        self._start("munged", ["/usr/sbin/munged", "--foreground", "--force", "--socket", str(munge / "socket"),
                               "--key-file", "/etc/munge/munge.key", "--pid-file", str(munge / "pid"),
                               "--seed-file", str(munge / "seed"), "--log-file", str(munge / "log")])
        self._wait(lambda: (munge / "socket").exists(), "munged made no socket", "munged")
        self._start("slurmctld", ["/usr/sbin/slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node, namespace in zip(self.nodes, self.namespaces):
            inner = (f"mount --bind {self.dir / 'hosts'} /etc/hosts && hostname {node} && "
                     f"exec /usr/sbin/slurmd -D -f {self.conf} -N {node}")
            self._start(node, ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount",
                               "sh", "-c", inner])
        self._wait(self._all_idle, "the nodes did not become idle", *self.daemons)

    def _network(self) -> None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{CONTROLLER_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for i, (namespace, addr) in enumerate(zip(self.namespaces, self.addrs), 1):
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", f"rdlsv{i}", "type", "veth", "peer", "name", f"rdlsp{i}")
            _run("ip", "link", "set", f"rdlsv{i}", "master", BRIDGE, "up")
            _run("ip", "link", "set", f"rdlsp{i}", "netns", namespace)
            _run("ip", "-n", namespace, "link", "set", f"rdlsp{i}", "name", "eth0")
            _run("ip", "-n", namespace, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "link", "set", "lo", "up")

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        controller = socket.gethostname()
        nodes = "\n".join(f"NodeName={node} NodeAddr={addr} CPUs={NODE_CPUS} State=UNKNOWN"
                          for node, addr in zip(self.nodes, self.addrs))
        self.conf.write_text(f"""\
ClusterName=roundeltest
SlurmctldHost={controller}({CONTROLLER_ADDR})
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
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        hosts = ["127.0.0.1\tlocalhost", f"{CONTROLLER_ADDR}\t{controller}"]
        hosts += [f"{addr}\t{node}" for node, addr in zip(self.nodes, self.addrs)]
        (d / "hosts").write_text("\n".join(hosts) + "\n")

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                              start_new_session=True)

    def _all_idle(self) -> bool:
        out = _run("sinfo", "-h", "-N", "-o", "%N %t", check=False, env={**os.environ, **self.env()}).stdout
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

    def _remove_network(self) -> None:
        for i, namespace in enumerate(self.namespaces, 1):
            for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", namespace, check=False)
            _run("ip", "link", "del", f"rdlsv{i}", check=False)
        _run("ip", "link", "del", BRIDGE, check=False)

    def close(self) -> None:
        for proc in reversed(list(self.daemons.values())):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.daemons.clear()
        self._remove_network()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A two-node Slurm cluster for every test of a module (import this fixture into the test module)."""
    require_tools()
    cluster = SlurmCluster(2, tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.close()
