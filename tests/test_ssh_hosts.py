"""roundelrun across hosts over ssh, with hosts simulated by network namespaces running real sshd.

See ``netns_util`` for the test network (10.231.0.0/24): the launcher is
10.231.0.1 and the hosts rdl-h1/rdl-h2 are 10.231.0.11/12, sshd on port 2222.
Every launch passes ``-p 2222`` and ``-i KEY`` the way users pass them.
"""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_util import LAUNCHER, WORKERS_DIR, alive, assert_checks_passed, clean_env, describe, rank_lines, run_command
from netns_util import LAUNCHER_ADDR, SSH_PORT
from netns_util import two_hosts as hosts  # noqa: F401 (a fixture)

WORKER = str(Path(__file__).parent / "scripts" / "worker.py")
COLLECTIVES = str(WORKERS_DIR / "torch_collectives.py")


def launch_args(hosts, *extra):
    return [*LAUNCHER, "-p", str(SSH_PORT), "-i", hosts.key, *extra]


def run(hosts, *args, timeout=120, env=None):
    return run_command(launch_args(hosts, *map(str, args)), env={**hosts.ssh_env(), **(env or {})},
                       timeout=timeout)


def test_two_hosts_two_slots_collective(hosts):
    h1, h2 = hosts.addrs
    result = run(hosts, "-np", 4, "-H", f"{h1}:2,{h2}:2", sys.executable, COLLECTIVES, "allreduce", timeout=180)
    assert_checks_passed(result, 4, "allreduce")
    assert not hosts.leftovers()


def test_uneven_slots_with_launcher_host(hosts, tmp_path):
    h1, h2 = hosts.addrs
    code = ("import roundel.torch as hvd, torch, os; hvd.init(); "
            "s = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item(); "
            "print('ID', hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), "
            "hvd.cross_size(), s, os.getcwd())")
    result = run_command([*launch_args(hosts, "-np", "5", "-H", f"{LAUNCHER_ADDR}:1,{h1}:3,{h2}:1",
                                       "--output-filename", str(tmp_path / "logs")),
                          sys.executable, "-c", code], env=hosts.ssh_env(), timeout=180)
    assert result.returncode == 0, describe(result)
    ids = sorted(tuple(line.split()[1:]) for line in rank_lines(result.stdout, stream="stdout")
                 if line.startswith("ID"))
    cwd = str(Path.cwd())
    # rank, size, local_rank, local_size, cross_rank, cross_size as Horovod assigns them
    assert ids == [
        ("0", "5", "0", "1", "0", "3", "10.0", cwd),
        ("1", "5", "0", "3", "1", "3", "10.0", cwd),
        ("2", "5", "1", "3", "0", "1", "10.0", cwd),
        ("3", "5", "2", "3", "0", "1", "10.0", cwd),
        ("4", "5", "0", "1", "2", "3", "10.0", cwd),
    ]
    assert (tmp_path / "logs" / "rank.3" / "stdout").read_text().startswith("ID 3 5 2 3")
    assert not hosts.leftovers()


def test_host_that_is_down(hosts):
    h1 = hosts.addrs[0]
    down = "10.231.0.99"  # on the test network, but no host answers there
    start = time.monotonic()
    result = run(hosts, "--start-timeout", 3, "-np", 2, "-H", f"{h1}:1,{down}:1", sys.executable, "-c",
                 "import time; time.sleep(60)", timeout=60)
    assert time.monotonic() - start < 30
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert f"rank 1 (host {down}): could not start on host {down} over ssh (exit 255)" in last, describe(result)
    assert not hosts.leftovers()


def test_process_killed_on_remote_host(hosts, tmp_path):
    h1, h2 = hosts.addrs
    start = time.monotonic()
    result = run(hosts, "-np", 4, "-H", f"{h1}:2,{h2}:2", sys.executable, WORKER, tmp_path,
                 "sleep", "sleep", "sigkill", "sleep", timeout=60)
    assert time.monotonic() - start < 30  # the others would sleep 60 s
    assert result.returncode == 128 + signal.SIGKILL, describe(result)
    assert result.stderr.strip().splitlines()[-1] == (
        f"roundelrun: rank 2 (host {h2}) was killed by signal SIGKILL; stopped the other ranks")
    assert not hosts.leftovers(), "processes left in the namespaces"


def test_remote_exit_code_and_ssh_failure(hosts):
    h1 = hosts.addrs[0]
    result = run(hosts, "-np", 1, "-H", f"{h1}:1", sys.executable, "-c", "import sys; sys.exit(7)")
    assert result.returncode == 7
    assert result.stderr.strip().splitlines()[-1] == f"roundelrun: rank 0 (host {h1}) exited with code 7"
    # a key the hosts do not accept: ssh fails, and the message names the host
    bad = subprocess.run([*LAUNCHER, "-p", str(SSH_PORT), "-np", "1", "-H", f"{h1}:1", "true"],
                         capture_output=True, text=True, timeout=60,
                         env=clean_env({**hosts.ssh_env(), "ROUNDEL_SSH_ARGS": hosts.ssh_env()["ROUNDEL_SSH_ARGS"]
                                        + " -o IdentitiesOnly=yes -o IdentityFile=/dev/null"}))
    assert bad.returncode == 255
    assert f"could not start on host {h1} over ssh (exit 255)" in bad.stderr, bad.stderr
    assert "Permission denied" in bad.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_every_host(hosts, tmp_path, signum):
    h1, h2 = hosts.addrs
    proc = subprocess.Popen(
        launch_args(hosts, "-np", "5", "-H", f"localhost:1,{h1}:2,{h2}:2", sys.executable, WORKER, str(tmp_path),
                    "sleep", "sleep", "ignore", "trap", "sleep"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(hosts.ssh_env()))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 5:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        pids = [int(p) for f in tmp_path.glob("*.pid") for p in f.read_text().split()]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert err.strip().splitlines()[-1] == f"roundelrun: received {signal.Signals(signum).name}; stopped all ranks"
    assert "rank 3 got SIGTERM" in out
    assert not hosts.leftovers(), "processes left in the namespaces"
    assert not [p for p in pids if alive(p)]


def test_the_launchers_environment_reaches_a_remote_worker_never_on_a_command_line(hosts):
    h1 = hosts.addrs[0]
    value = f"only-in-the-launcher-{time.monotonic_ns()}"
    code = ("import os, time; print('ENV', os.environ.get('MY_DATA_PATH'), os.environ.get('MY_VALUE'), "
            "os.environ.get('HOROVOD_RANK'), os.environ.get('OMP_NUM_THREADS'), "
            "os.environ.get('SSH_CLIENT', '').split()[:1], flush=True); time.sleep(3)")
    proc = subprocess.Popen(launch_args(hosts, "-np", "1", "-H", f"{h1}:1", "-x", "MY_VALUE=v", sys.executable,
                                        "-c", code),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env({**hosts.ssh_env(), "MY_DATA_PATH": value, "OMP_NUM_THREADS": "2",
                                           "SSH_CLIENT": "launcher-session 1 2"}))
    listings = []
    try:
        while proc.poll() is None:  # every process's command line, as ps shows them, while the job runs
            listings.append(subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    # set only in the launcher's environment (no -x), as horovodrun exports it; ssh's own SSH_CLIENT kept
    assert rank_lines(out, 0, "stdout") == [f"ENV {value} v 0 2 ['{LAUNCHER_ADDR}']"], out + err
    assert len(listings) >= 5 and any("roundel.runner.remote" in listing for listing in listings)
    assert not [listing for listing in listings if value in listing], "the variable was on a command line"


def test_strict_host_key_checking_yes_with_a_known_key(hosts, tmp_path):
    h1 = hosts.addrs[0]
    host_key = (hosts.dir / "host_key.pub").read_text().split()
    known = tmp_path / "known_hosts"
    known.write_text(f"[{h1}]:{SSH_PORT} {host_key[0]} {host_key[1]}\n")
    own_known = {"ROUNDEL_SSH_ARGS": f"-o UserKnownHostsFile={known} -o LogLevel=ERROR"}
    code = "import os; print('ON', os.environ['ROUNDEL_HOSTNAME'])"
    result = run(hosts, "--ssh-strict-host-key-checking", "yes", "-np", 1, "-H", f"{h1}:1", sys.executable, "-c",
                 code, env=own_known)
    assert result.returncode == 0, describe(result)
    assert rank_lines(result.stdout, 0, "stdout") == [f"ON {h1}"]
    known.write_text("")  # the key is unknown now: "yes" refuses the host, where accept-new would add it
    refused = run(hosts, "--ssh-strict-host-key-checking", "yes", "-np", 1, "-H", f"{h1}:1", "true", env=own_known)
    assert refused.returncode == 255, describe(refused)
    assert "Host key verification failed" in refused.stderr, describe(refused)
    assert known.read_text() == ""
    # without the flag, ssh's own policy holds (roundel adds no accept-new): refused too, and told how to proceed
    default = run(hosts, "-np", 1, "-H", f"{h1}:1", "true", env=own_known)
    assert default.returncode == 255, describe(default)
    assert "--ssh-strict-host-key-checking accept-new" in default.stderr, describe(default)
    assert known.read_text() == ""
    assert not hosts.leftovers()


STOPPER = """
import os, signal, sys, time
rank = int(os.environ["ROUNDEL_RANK"])
if rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL can end it, stopped or not
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
time.sleep(3)
sys.exit(1)
"""


def test_stopped_remote_worker_is_killed_when_the_job_stops(hosts):
    h1, h2 = hosts.addrs
    start = time.monotonic()
    result = run(hosts, "-np", 2, "-H", f"{h1}:1,{h2}:1", sys.executable, "-c", STOPPER, timeout=90)
    assert result.returncode == 1, describe(result)
    assert time.monotonic() - start < 45
    assert result.stderr.strip().splitlines()[-1] == \
        f"roundelrun: rank 0 (host {h1}) exited with code 1; stopped the other ranks"
    assert not hosts.leftovers(), "processes left in the namespaces"
