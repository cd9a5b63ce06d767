"""roundelrun's ssh hardening on this machine: host names, the known-hosts policy, what is forwarded,
and stopping stopped workers.

The ssh commands the launcher builds are checked with a stand-in ``ssh`` on
PATH that records its arguments and the spec it gets on stdin, and fails as
an unreachable host would; real ssh runs are in test_ssh_hosts.py.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_util import LAUNCHER, alive, describe, rank_lines, run_command
from roundel.runner import hosts, spawn

REMOTE = "192.0.2.7"  # TEST-NET-1: routable in form, never a real host; the stand-in ssh answers for it

FAKE_SSH = """#!{python}
import json, sys
line = sys.stdin.readline()
with open({record!r}, "w") as f:
    json.dump({{"argv": sys.argv[1:], "spec": json.loads(line) if line else None}}, f)
sys.stderr.write("ssh: connect to host {remote} port 22: Connection timed out\\n")
sys.exit(255)
"""


@pytest.fixture
def fake_ssh(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "ssh.json"
    script = bindir / "ssh"
    script.write_text(FAKE_SSH.format(python=sys.executable, record=str(record), remote=REMOTE))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}, record


@pytest.mark.parametrize("name", [
    "-oProxyCommand=touch /tmp/pwned", "-l", "a b", "a;b", "a|b", "a&b", "a$(id)", "a`id`", "a>b", "a'b", 'a"b',
    "a\\b", "a\x01b", "a\nb", "a\tb", "a*b", "a?b", "a!b", "a{b}", "a(b)", "a~b",
])
def test_unsafe_host_names_are_refused(name):
    with pytest.raises(ValueError, match="host name"):
        hosts.validate_hostname(name)
    with pytest.raises(ValueError, match="host name"):
        spawn.ssh_command(name, "true")


@pytest.mark.parametrize("name", ["node-1", "node_1.example.com", "10.0.0.1", "fe80::1%eth0", "[::1]", "root@node1"])
def test_usual_host_names_are_accepted(name):
    assert hosts.validate_hostname(name) == name


def test_hostfile_and_command_line_reject_option_like_hosts(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("good slots=1\n-oProxyCommand=sh slots=1\n")
    with pytest.raises(ValueError, match=r"line 2: host name '-oProxyCommand=sh' starts with '-'"):
        hosts.parse_hostfile(str(hostfile))
    marker = tmp_path / "pwned"
    result = run_command([*LAUNCHER, "-np", "1", "-H", f"-oProxyCommand=touch {marker}:1", "true"], timeout=30)
    assert result.returncode == 2, describe(result)
    assert f"host name '-oProxyCommand=touch {marker}'" in result.stderr
    result = run_command([*LAUNCHER, "-np", "1", "-H", "bad$(touch x)host:1", "true"], timeout=30)
    assert result.returncode == 2 and "host name 'bad$(touch x)host' contains ' ', '$', '(', ')'" in result.stderr
    assert not marker.exists()


def test_strict_host_key_policy_reaches_ssh_first(fake_ssh):
    env, record = fake_ssh
    env["ROUNDEL_SSH_ARGS"] = "-o StrictHostKeyChecking=no -o LogLevel=ERROR"
    result = run_command([*LAUNCHER, "--ssh-strict-host-key-checking", "yes", "--start-timeout", "5", "-np", "1",
                          "-H", f"{REMOTE}:1", "true"], env=env, timeout=60)
    assert result.returncode == 255, describe(result)
    argv = json.loads(record.read_text())["argv"]
    strict = [argv[i + 1] for i, word in enumerate(argv) if word == "-o" and "StrictHostKeyChecking" in argv[i + 1]]
    # ssh keeps the first value given for an option: the flag's, then ROUNDEL_SSH_ARGS'
    assert strict == ["StrictHostKeyChecking=yes", "StrictHostKeyChecking=no"]
    assert argv[argv.index("--") + 1] == REMOTE
    assert f"could not start on host {REMOTE} over ssh (exit 255)" in result.stderr
    default = run_command([*LAUNCHER, "--start-timeout", "5", "-np", "1", "-H", f"{REMOTE}:1", "true"],
                          env={"PATH": env["PATH"]}, timeout=60)
    assert default.returncode == 255, describe(default)
    argv = json.loads(record.read_text())["argv"]
    assert not [w for w in argv if "StrictHostKeyChecking" in w]  # the user's ssh configuration decides
    bad = run_command([*LAUNCHER, "--ssh-strict-host-key-checking", "maybe", "-np", "1", "true"], timeout=30)
    assert bad.returncode == 2 and "invalid choice: 'maybe'" in bad.stderr


def _effective_host_key_checking(command: list[str], config: Path) -> str:
    """What ssh itself (``ssh -G``) would use for StrictHostKeyChecking with ``command``'s options."""
    options = command[1:command.index("--")]
    result = subprocess.run(["ssh", "-G", "-F", str(config), *options, REMOTE], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())["stricthostkeychecking"]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's ssh client (ssh -G)")
def test_user_ssh_config_host_key_policy_stays_in_force(tmp_path):
    """A user's ``StrictHostKeyChecking yes`` holds unless --ssh-strict-host-key-checking says otherwise."""
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  StrictHostKeyChecking yes\n")
    assert _effective_host_key_checking(spawn.ssh_command(REMOTE, "true"), config) == "true"
    flagged = spawn.ssh_command(REMOTE, "true", extra_args=spawn.strict_host_key_args("accept-new"))
    assert _effective_host_key_checking(flagged, config) == "accept-new"


def test_unknown_host_key_failure_names_the_flag(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "ssh"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('Host key verification failed.\\n')\n"
                      "sys.exit(255)\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = run_command([*LAUNCHER, "--start-timeout", "5", "-np", "1", "-H", f"{REMOTE}:1", "true"],
                         env={"PATH": f"{bindir}:{os.environ['PATH']}"}, timeout=60)
    assert result.returncode == 255, describe(result)
    assert "Host key verification failed" in result.stderr
    assert "--ssh-strict-host-key-checking accept-new" in result.stderr, describe(result)


def test_the_launchers_environment_goes_to_remote_hosts_on_stdin_as_horovodrun(fake_ssh):
    env, record = fake_ssh
    env.update({"MY_DATA_PATH": "/data/only-in-the-launcher", "NCCL_DEBUG": "INFO", "HOSTNAME": "launcher-box",
                "PWD": "/launcher/cwd", "SSH_AUTH_SOCK": "/tmp/agent", "DISPLAY": ":0", "SHELL": "/bin/zsh",
                "BASH_FUNC_f%%": "() { :; }", "XDG_RUNTIME_DIR": "/run/user/0"})
    result = run_command([*LAUNCHER, "--start-timeout", "5", "-np", "1", "-H", f"{REMOTE}:1", "true"],
                         env=env, timeout=60)
    assert result.returncode == 255, describe(result)
    seen = json.loads(record.read_text())
    sent = seen["spec"]["env"]
    assert sent["MY_DATA_PATH"] == "/data/only-in-the-launcher" and sent["NCCL_DEBUG"] == "INFO"
    assert sent["ROUNDEL_RANK"] == "0" and "ROUNDEL_SECRET" in sent and "PATH" in sent
    for name in ("HOSTNAME", "PWD", "SSH_AUTH_SOCK", "DISPLAY", "SHELL", "BASH_FUNC_f%%", "XDG_RUNTIME_DIR", "HOME"):
        assert name not in sent, f"{name} of the launcher's host was sent"
    argv = " ".join(seen["argv"])
    assert "only-in-the-launcher" not in argv and sent["ROUNDEL_SECRET"] not in argv


def test_remote_env_listed_sends_only_needed_variables(fake_ssh):
    env, record = fake_ssh
    env.update({"AWS_SECRET_ACCESS_KEY": "x", "GITHUB_TOKEN": "t", "MY_SETTING": "kept", "NCCL_DEBUG": "INFO",
                "OMP_NUM_THREADS": "3", "HOROVOD_FUSION_THRESHOLD": "1024"})
    result = run_command([*LAUNCHER, "--start-timeout", "5", "--remote-env", "listed", "-np", "1",
                          "-H", f"{REMOTE}:1", "-x", "MY_SETTING", "-x", "MY_OTHER=2", "true"], env=env, timeout=60)
    assert result.returncode == 255, describe(result)
    sent = json.loads(record.read_text())["spec"]["env"]
    assert "AWS_SECRET_ACCESS_KEY" not in sent and "GITHUB_TOKEN" not in sent
    assert sent["MY_SETTING"] == "kept" and sent["MY_OTHER"] == "2"
    assert sent["NCCL_DEBUG"] == "INFO" and sent["OMP_NUM_THREADS"] == "3" and sent["HOROVOD_FUSION_THRESHOLD"] == "1024"
    assert sent["ROUNDEL_RANK"] == "0" and sent["HOROVOD_RANK"] == "0" and "ROUNDEL_SECRET" in sent
    assert "PATH" in sent
    assert set(sent) <= {*spawn.FORWARDED_NAMES, "MY_SETTING", "MY_OTHER"} | \
        {k for k in sent if k.startswith(spawn.FORWARDED_PREFIXES)}
    bad = run_command([*LAUNCHER, "-np", "1", "-H", f"{REMOTE}:1", "true"],
                      env={**env, "ROUNDEL_REMOTE_ENV": "some"}, timeout=60)
    assert bad.returncode == 2 and "ROUNDEL_REMOTE_ENV='some': use one of all, listed" in bad.stderr, describe(bad)


STOPPER = """
import os, signal, sys, time
rank, piddir = int(os.environ["ROUNDEL_RANK"]), sys.argv[1]
open(os.path.join(piddir, f"{rank}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(piddir, f"{rank}.tmp"), os.path.join(piddir, f"{rank}.pid"))
if rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL can end it, stopped or not
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)
else:
    for _ in range(200):
        if os.path.exists(os.path.join(piddir, "1.pid")):
            break
        time.sleep(0.05)
    time.sleep(0.5)
    sys.exit(1)
"""


def test_stopped_worker_is_killed_when_the_job_stops(tmp_path):
    start = time.monotonic()
    result = run_command([*LAUNCHER, "-np", "2", sys.executable, "-c", STOPPER, str(tmp_path)], timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, describe(result)
    assert result.stderr.strip().splitlines()[-1] == \
        "roundelrun: rank 0 (host localhost) exited with code 1; stopped the other ranks"
    assert elapsed < spawn.GRACE_SECONDS + 20, elapsed
    pids = [int(p.read_text()) for p in Path(tmp_path).glob("*.pid")]
    assert len(pids) == 2
    left = [p for p in pids if alive(p)]
    assert not left, f"left running: {left}"
    assert rank_lines(result.stdout) == []
