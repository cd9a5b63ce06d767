"""Secrets and exposure: what an outsider on the network (or in torchrun's store) can and cannot do.

* srun: the job secret is not derivable from public facts (job id, step id,
  uid, node list, port), and rank 0's store does not listen on every interface;
  on two network-namespace hosts, every roundel and Gloo socket listens on the
  host's job address only.
* torchrun: torchrun's unauthenticated TCPStore holds no usable secret.
* The secret file rank 0 hands the other ranks: private, checked, removed.
* srun: rank 0's store port is not predictable from the job id, so another
  process holding that port does not stop the job.
* Objects: bytes injected into broadcast_object/allgather_object, a forged
  size, and bytes replayed from an earlier call or init() are refused before
  anything is allocated or unpickled.
* Gloo: a flood of idle connections to a worker's Gloo port does not kill it;
  a burst past a low hard open-file limit aborts the rank, and the launcher
  names the cause.
"""

import collections
import hashlib
import json
import os
import resource
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from launch_util import LAUNCHER, WORKERS_DIR, assert_checks_passed, clean_env, describe, rank_lines, run_job
from netns_util import NetnsHosts, require_tools
from roundel.rendezvous.store import RendezvousClient, RendezvousError

WORKER = str(WORKERS_DIR / "secrets_worker.py")
BIN = Path(sys.executable).parent
WAIT_S = 60
Address = collections.namedtuple("Address", "ip port")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(directory: Path, ranks: int, procs) -> list[int]:
    """The pids the workers wrote once initialized; fails if one exits first or none come in time."""
    deadline = time.monotonic() + WAIT_S
    while True:
        files = [directory / f"ready.{r}" for r in range(ranks)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            _stop(procs)
            outputs = [p.communicate() for p in procs]
            pytest.fail(f"the job did not get ready (exit statuses {[p.returncode for p in procs]}): {outputs}")
        time.sleep(0.1)


def _stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _finish(procs, timeout=WAIT_S) -> list[tuple[int, str, str]]:
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        _stop(procs)
    return results


def _authenticates(host: str, port: int, secret: bytes) -> bool:
    try:
        RendezvousClient(host, port, secret, connect_timeout=5).close()
    except RendezvousError:
        return False
    return True


def _listening(pid: int) -> list[Address]:
    """The TCP sockets process ``pid`` listens on, read from /proc in its own network namespace
    (psutil reads the caller's namespace, which misses a process in another one)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw_ip, raw_port = fields[1].split(":")
            packed = bytes.fromhex(raw_ip)
            if table == "tcp":  # little-endian 32-bit words
                ip = socket.inet_ntop(socket.AF_INET, packed[::-1])
            else:
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(packed[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append(Address(ip, int(raw_port, 16)))
    return found


def test_srun_secret_not_derivable_and_store_not_on_every_interface(tmp_path):
    """A 2-rank srun job without ROUNDEL_SECRET; an outsider knowing the job's public facts is refused."""
    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()  # stands for the port formula (a fixed port could clash with other tests)
    public = {"SLURM_JOB_ID": "5151", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": 2, "ROUNDEL_RENDEZVOUS_PORT": port}
    procs = [subprocess.Popen([sys.executable, WORKER, "hold", str(tmp_path)],
                              env=clean_env({**public, "SLURM_PROCID": r, "SLURM_LOCALID": r, "HOME": home,
                                             "OMP_NUM_THREADS": 1}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        pids = _wait_ready(tmp_path, 2, procs)
        # the secret roundel derived before from the job's public facts
        seed = f"roundel-slurm/{public['SLURM_JOB_ID']}/{public['SLURM_STEP_ID']}/{os.getuid()}"
        assert not _authenticates("localhost", port, hashlib.sha256(seed.encode()).digest()), \
            "the store accepted a secret derived from public facts"
        addresses = [a.ip for a in _listening(pids[0]) if a.port == port]
        assert addresses and not set(addresses) & {"0.0.0.0", "::"}, addresses
        jobs = home / ".roundel" / "jobs"
        assert stat.S_IMODE(jobs.stat().st_mode) == 0o700
        assert list(jobs.iterdir()) == []  # every rank joined: rank 0 removed the secret file
        (tmp_path / "go").touch()
        results = _finish(procs)
    finally:
        _stop(procs)
    for code, out, err in results:
        assert code == 0 and "CHECKS PASSED hold" in out, (code, out, err)


@pytest.mark.parametrize("exported", [False, True], ids=["made-secret", "exported-secret"])
def test_srun_store_port_cannot_be_taken_first(tmp_path, exported):
    """Another process holds the port the job id used to predict (20000 + (job * 16 + step) % 30000):
    rank 0 listens on a free port and the other rank learns it from the private file only."""
    home = tmp_path / "home"
    home.mkdir()
    job_id, step_id = 5000 + os.getpid() % 1000, 3
    predicted = 20000 + (job_id * 16 + step_id) % 30000
    squatter = socket.socket()
    try:
        squatter.bind(("0.0.0.0", predicted))
        squatter.listen()
    except OSError as exc:
        squatter.close()
        pytest.skip(f"port {predicted} is not free here: {exc}")
    public = {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": step_id, "SLURM_STEP_NODELIST": "localhost",
              "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": 2, "HOME": home, "OMP_NUM_THREADS": 1}
    if exported:
        public["ROUNDEL_SECRET"] = "cd" * 32
    procs = [subprocess.Popen([sys.executable, WORKER, "hold", str(tmp_path)],
                              env=clean_env({**public, "SLURM_PROCID": r, "SLURM_LOCALID": r}),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        pids = _wait_ready(tmp_path, 2, procs)
        assert predicted not in {a.port for a in _listening(pids[0])}
        assert list((home / ".roundel" / "jobs").iterdir()) == []  # the file served and is gone
        (tmp_path / "go").touch()
        results = _finish(procs)
    finally:
        _stop(procs)
        squatter.close()
    for code, out, err in results:
        assert code == 0 and "CHECKS PASSED hold" in out, (code, out, err)


def test_srun_on_two_hosts_listens_on_the_job_network_only(tmp_path):
    """Two network-namespace hosts sharing the file system (as a shared home): rank 0's store and every
    rank's Gloo port listen on the host's job address, and the secret file is the only channel."""
    require_tools()
    (tmp_path / "netns").mkdir()
    net = NetnsHosts(2, tmp_path / "netns")
    procs = []
    try:
        public = {"SLURM_JOB_ID": "6262", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": ",".join(net.addrs),
                  "SLURM_STEP_NUM_NODES": 2, "SLURM_STEP_NUM_TASKS": 2, "SLURM_LOCALID": 0,
                  "ROUNDEL_SECRET_DIR": tmp_path / "jobs", "OMP_NUM_THREADS": 1}
        procs = [subprocess.Popen(["ip", "netns", "exec", name, sys.executable, WORKER, "hold", str(tmp_path)],
                                  env=clean_env({**public, "SLURM_PROCID": r}), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r, name in enumerate(net.names)]
        pids = _wait_ready(tmp_path, 2, procs)
        for pid, addr in zip(pids, net.addrs):  # the store, the control channel and Gloo
            assert {a.ip for a in _listening(pid)} == {addr}, _listening(pid)
        (tmp_path / "go").touch()
        results = _finish(procs)
    finally:
        _stop(procs)
        net.close()
    for code, out, err in results:
        assert code == 0 and "CHECKS PASSED hold" in out, (code, out, err)


def test_torchrun_store_holds_no_usable_secret(tmp_path):
    """Everything torchrun's TCPStore holds for roundel, tried as a secret, is refused by roundel's store."""
    master_port = _free_port()
    command = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(master_port), WORKER,
               "hold", str(tmp_path)]
    proc = subprocess.Popen(command, env=clean_env({"HOME": tmp_path, "OMP_NUM_THREADS": 1}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(tmp_path, 2, [proc])
        outsider = TCPStore("127.0.0.1", master_port, is_master=False, timeout=timedelta(seconds=10))
        value = outsider.get("roundel/none/0/init0/rendezvous").decode()  # a predictable key
        entry = json.loads(value)
        host, port = entry[0], int(entry[1])
        candidates = set()
        for item in entry:
            text = str(item)
            candidates.add(text.encode())
            try:
                candidates.add(bytes.fromhex(text))
            except ValueError:
                pass
        stolen = [c for c in candidates if _authenticates(host, port, c)]
        assert not stolen, f"torchrun's store gave away roundel's secret: {value}"
        assert list((tmp_path / ".roundel" / "jobs").iterdir()) == []  # the secret file served and is gone
        del outsider
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        _stop([proc])
    assert proc.returncode == 0 and out.count("CHECKS PASSED hold") == 2, (out, err)


def test_forged_objects_refused_before_unpickling(tmp_path):
    result = run_job(2, "secrets_worker.py", "forge", tmp_path, env={"OMP_NUM_THREADS": 1}, timeout=90)
    assert not (tmp_path / "pwned").exists(), "an injected pickle ran on a receiving rank\n" + describe(result)
    assert_checks_passed(result, 2, "forge")
    assert result.stdout.count("REFUSED object from rank 0 failed authentication") == 4, describe(result)


def test_replayed_objects_refused(tmp_path):
    """A payload or size record of an earlier call, or of an earlier init(), is refused with the reason."""
    result = run_job(2, "secrets_worker.py", "replay", tmp_path, env={"OMP_NUM_THREADS": 1}, timeout=90)
    assert_checks_passed(result, 2, "replay")
    assert result.stdout.count("REFUSED object from rank 0 in 'broadcast_object.state.data' was replayed") == 1
    assert result.stdout.count("REFUSED object from rank 0 in 'broadcast_object.state.size' was replayed") == 1
    assert result.stdout.count("REFUSED object from rank 0 failed authentication in 'broadcast_object.state.size'")\
        == 1, describe(result)


def test_gloo_connection_flood_does_not_kill_the_job(tmp_path):
    """1,100 idle connections to a worker's Gloo port, with the workers' soft open-file limit at 256."""
    connections = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * connections:
        pytest.skip(f"needs a hard open-file limit of at least {2 * connections} (ulimit -Hn is {hard})")
    if soft != resource.RLIM_INFINITY and soft < connections + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (connections + 200, hard))
    command = shlex.join([*LAUNCHER, "-np", "2", sys.executable, WORKER, "hold", str(tmp_path)])
    proc = subprocess.Popen(["bash", "-c", f"ulimit -Sn 256 && exec {command}"],
                            env=clean_env({"OMP_NUM_THREADS": 1}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sockets = []
    try:
        pids = _wait_ready(tmp_path, 2, [proc])
        ports = [a for a in _listening(pids[1])]  # rank 1 listens for Gloo only
        assert ports, "rank 1 has no listening socket"
        for i in range(connections):
            address = ports[i % len(ports)]
            try:
                sockets.append(socket.create_connection((address.ip, address.port), timeout=10))
            except OSError:  # the worker is gone (Gloo aborts it when it runs out of descriptors)
                break
        time.sleep(1)  # let the worker accept them
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        for sock in sockets:
            sock.close()
        _stop([proc])
    result = subprocess.CompletedProcess(command, proc.returncode, out, err)
    assert_checks_passed(result, 2, "hold")
    limits = [line.split()[1:] for line in rank_lines(out, stream="stdout") if line.startswith("NOFILE")]
    assert len(limits) == 2 and all(soft == hard for soft, hard in limits), limits  # raised at init()


def test_gloo_descriptor_exhaustion_is_named(tmp_path):
    """A burst of connections to a rank's Gloo port under a low hard open-file limit aborts the rank (Gloo
    keeps every accepted connection): the launcher says why and what to do."""
    command = shlex.join([*LAUNCHER, "-np", "2", sys.executable, WORKER, "hold", str(tmp_path)])
    proc = subprocess.Popen(["bash", "-c", f"ulimit -n 300 && exec {command}"],
                            env=clean_env({"OMP_NUM_THREADS": 1}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_ready(tmp_path, 2, [proc])
        address = _listening(pids[1])[0]  # rank 1 listens for Gloo only
        for _ in range(600):
            try:
                socket.create_connection((address.ip, address.port), timeout=5).close()
            except OSError:
                break
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        _stop([proc])
    assert proc.returncode != 0, out
    assert "rank 1 (host localhost) was killed by signal SIGABRT; it ran out of file descriptors" in err, err
    assert "ulimit -Hn" in err and "--network-interface" in err


def test_secret_file_is_private_and_checked(tmp_path):
    from roundel.rendezvous import secret_file

    env = {"ROUNDEL_SECRET_DIR": str(tmp_path / "jobs")}
    path = secret_file.job_secret_path("srun", "77.0.init0", env)
    job = secret_file.JobSecret(os.urandom(32), "10.231.0.1", 4321)
    secret_file.publish(path, job)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert secret_file.read(path, 1) == job

    path.chmod(0o640)
    with pytest.raises(secret_file.SecretFileError, match="mode is 640"):
        secret_file.read(path, 1)
    path.chmod(0o600)
    path.parent.chmod(0o770)
    with pytest.raises(secret_file.SecretFileError, match="other users can write"):
        secret_file.read(path, 1)
    path.parent.chmod(0o700)
    link = path.with_name("link")
    link.symlink_to(path)
    with pytest.raises(secret_file.SecretFileError, match="refusing"):
        secret_file.read(link, 1)
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, -1)
        with pytest.raises(secret_file.SecretFileError, match="belongs to uid 65534"):
            secret_file.read(path, 1)
    secret_file.remove(path)
    assert not path.exists()


def test_rank_without_the_secret_file_says_what_to_do(tmp_path):
    """A rank that cannot see rank 0's file (another host, no shared home) fails in time, saying how to fix it."""
    env = clean_env({"SLURM_PROCID": 1, "SLURM_LOCALID": 0, "SLURM_STEP_NUM_TASKS": 2, "SLURM_JOB_ID": "31",
                     "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "localhost", "ROUNDEL_START_TIMEOUT": "2",
                     "ROUNDEL_RENDEZVOUS_PORT": _free_port(), "ROUNDEL_SECRET_DIR": tmp_path / "jobs"})
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", "import roundel.torch as hvd; hvd.init()"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and time.monotonic() - started < 30
    assert "export ROUNDEL_SECRET=$(openssl rand -hex 32)" in result.stderr, result.stderr
