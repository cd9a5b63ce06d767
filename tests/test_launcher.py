"""roundelrun end to end: real launcher, real worker processes, real signals."""

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch_util import alive

WORKER = str(Path(__file__).parent / "scripts" / "worker.py")
LAUNCHER = [sys.executable, "-m", "roundel.runner.launch"]


def roundelrun(*args, timeout=30, **kwargs):
    return subprocess.run([*LAUNCHER, *args], capture_output=True, timeout=timeout, **kwargs)


def worker_pids(piddir):
    """Pids of every worker and grandchild that wrote a pid file in ``piddir``."""
    return [int(p) for f in Path(piddir).glob("*.pid") for p in f.read_text().split()]


def wait_for_pid_files(piddir, count, proc):
    deadline = time.monotonic() + 20
    while len(list(Path(piddir).glob("*.pid"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.05)


def lines(data: bytes):
    return data.decode(errors="replace").splitlines()


@pytest.mark.parametrize("np", [2, 3])
def test_output_is_prefixed(np):
    code = "import os,sys; r=os.environ['ROUNDEL_RANK']; print('hi', r); print('oops', r, file=sys.stderr)"
    result = roundelrun("-np", str(np), sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    assert sorted(lines(result.stdout)) == [f"[{r}]<stdout>:hi {r}" for r in range(np)]
    assert sorted(lines(result.stderr)) == [f"[{r}]<stderr>:oops {r}" for r in range(np)]


def test_partial_and_binary_lines():
    code = (
        "import sys; out = sys.stdout.buffer; out.write(b'a\\nb\\xff\\xfe\\x00c\\n'); out.flush(); "
        "sys.stderr.buffer.write(b'no newline')"
    )
    result = roundelrun("-np", "1", sys.executable, "-c", code)
    assert result.returncode == 0
    assert result.stdout == b"[0]<stdout>:a\n[0]<stdout>:b\xff\xfe\x00c\n"
    assert result.stderr == b"[0]<stderr>:no newline\n"


ENV_DUMP = (
    "import json, os\n"
    "from roundel.rendezvous.store import RendezvousClient\n"
    "e = os.environ\n"
    "c = RendezvousClient(e['ROUNDEL_RENDEZVOUS_ADDR'], int(e['ROUNDEL_RENDEZVOUS_PORT']),"
    " bytes.fromhex(e['ROUNDEL_SECRET']))\n"
    "c.set('rank' + e['ROUNDEL_RANK'], b'here')\n"
    "peers = [c.get('rank%d' % r, timeout=20).decode() for r in range(int(e['ROUNDEL_SIZE']))]\n"
    "print(json.dumps({'env': {k: v for k, v in e.items()"
    " if k.startswith(('ROUNDEL_', 'HOROVOD_', 'PYTHONUNBUFFERED', 'MY_'))}, 'peers': peers}))\n"
)


def run_env_dump(*args):
    result = roundelrun(*args, sys.executable, "-c", ENV_DUMP, env={**os.environ, "MY_INHERITED": "yes"})
    assert result.returncode == 0, result.stderr
    dumps = {}
    for line in lines(result.stdout):
        prefix, _, payload = line.partition(":")
        dumps[int(prefix[1:prefix.index("]")])] = json.loads(payload)
    return dumps


def test_identity_environment():
    dumps = run_env_dump("-np", "3")
    assert sorted(dumps) == [0, 1, 2]
    secrets = set()
    for rank, dump in dumps.items():
        env = dump["env"]
        expected = dict(rank=rank, size=3, local_rank=rank, local_size=3, cross_rank=0, cross_size=1)
        for name, value in expected.items():
            assert env["ROUNDEL_" + name.upper()] == str(value)
            assert env["HOROVOD_" + name.upper()] == str(value)
        assert env["ROUNDEL_HOSTNAME"] == env["HOROVOD_HOSTNAME"] == "localhost"
        assert env["ROUNDEL_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert len(bytes.fromhex(env["ROUNDEL_SECRET"])) == 32
        assert env["PYTHONUNBUFFERED"] == "1" and env["MY_INHERITED"] == "yes"
        assert dump["peers"] == ["here"] * 3  # every rank reached the job's rendezvous store
        secrets.add(env["ROUNDEL_SECRET"])
    assert len(secrets) == 1


def test_identity_on_two_local_hosts():
    dumps = run_env_dump("-np", "3", "-H", "localhost:2,127.0.0.1:2")
    table = [
        tuple(dumps[r]["env"]["ROUNDEL_" + f] for f in ("HOSTNAME", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"))
        for r in range(3)
    ]
    assert table == [
        ("localhost", "0", "2", "0", "2"),
        ("localhost", "1", "2", "0", "1"),
        ("127.0.0.1", "0", "1", "1", "2"),
    ]


def test_settings_flags_reach_workers():
    dumps = run_env_dump(
        "-np", "1", "--fusion-threshold-mb", "2", "--cycle-time-ms", "5", "--cache-capacity", "7",
        "--timeline-filename", "/tmp/tl.json", "--start-timeout", "12", "-x", "MY_SET=1", "-x", "MY_INHERITED",
    )
    env = dumps[0]["env"]
    assert env["ROUNDEL_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
    assert float(env["ROUNDEL_CYCLE_TIME"]) == 5.0
    assert env["ROUNDEL_CACHE_CAPACITY"] == "7"
    assert env["ROUNDEL_TIMELINE"] == "/tmp/tl.json"
    assert float(env["ROUNDEL_START_TIMEOUT"]) == 12.0
    assert env["MY_SET"] == "1" and env["MY_INHERITED"] == "yes"
    # --disable-cache has Horovod's meaning (no cached host checks, which roundel never keeps), not the response cache's
    assert run_env_dump("-np", "1", "--cache-capacity", "7", "--disable-cache")[0]["env"]["ROUNDEL_CACHE_CAPACITY"] == "7"


def test_failing_rank_stops_the_others(tmp_path):
    start = time.monotonic()
    result = roundelrun("-np", "3", sys.executable, WORKER, str(tmp_path), "sleep", "exit:3", "sleep")
    assert time.monotonic() - start < 10  # the sleeping ranks would run for 60 s
    assert result.returncode == 3
    assert lines(result.stderr)[-1] == "roundelrun: rank 1 (host localhost) exited with code 3; stopped the other ranks"
    pids = worker_pids(tmp_path)
    assert len(pids) == 6 and not any(alive(p) for p in pids)


RAISE_ON_RANK_1 = """
import torch, roundel.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(3), name="before")
if hvd.rank() == 1:
    raise ValueError("only rank 1 fails")
hvd.allreduce(torch.ones(3), name="after")  # rank 0 fails here, having lost rank 1
"""


def test_the_rank_that_failed_first_is_blamed(tmp_path):
    # rank 0's error (it lost rank 1) may reach the launcher before rank 1's own exit; rank 1 is named
    script = tmp_path / "fail.py"
    script.write_text(RAISE_ON_RANK_1)
    for _ in range(4):
        result = roundelrun("-np", "2", sys.executable, str(script), timeout=60)
        assert result.returncode == 1, result.stderr
        last = lines(result.stderr)[-1]
        assert last in ("roundelrun: rank 1 (host localhost) exited with code 1; stopped the other ranks",
                        "roundelrun: rank 1 (host localhost) failed first: ValueError: only rank 1 fails; "
                        "stopped the other ranks"), result.stderr


def test_rank_killed_by_signal(tmp_path):
    result = roundelrun("-np", "2", sys.executable, WORKER, str(tmp_path), "sleep", "sigkill")
    assert result.returncode == 128 + signal.SIGKILL
    assert lines(result.stderr)[-1] == (
        "roundelrun: rank 1 (host localhost) was killed by signal SIGKILL; stopped the other ranks"
    )
    assert not any(alive(p) for p in worker_pids(tmp_path))


def test_single_rank_failure_message(tmp_path):
    result = roundelrun("-np", "1", sys.executable, "-c", "import sys; sys.exit(300)")
    assert result.returncode == 44  # 300 & 0xFF, what the OS reports
    assert lines(result.stderr)[-1] == "roundelrun: rank 0 (host localhost) exited with code 44"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_is_forwarded(tmp_path, signum):
    proc = subprocess.Popen(
        [*LAUNCHER, "-np", "2", sys.executable, WORKER, str(tmp_path), "trap", "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_for_pid_files(tmp_path, 2, proc)
        start = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - start < 4
    assert proc.returncode == 128 + signum
    assert "[0]<stdout>:rank 0 got SIGTERM" in lines(out)
    assert lines(err)[-1] == f"roundelrun: received {signal.Signals(signum).name}; stopped all ranks"
    pids = worker_pids(tmp_path)
    assert len(pids) == 4 and not any(alive(p) for p in pids)


def test_worker_ignoring_sigterm_is_killed(tmp_path):
    proc = subprocess.Popen(
        [*LAUNCHER, "-np", "2", sys.executable, WORKER, str(tmp_path), "ignore", "sleep"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        wait_for_pid_files(tmp_path, 2, proc)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert 4 < time.monotonic() - start < 10  # the grace period, then SIGKILL
    assert proc.returncode == 130
    assert not any(alive(p) for p in worker_pids(tmp_path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["-np", "2", "--cycle-time-ms", "-1"], "--cycle-time-ms -1 must be >= 0"),
        (["-np", "2", "--fusion-threshold-mb", "abc"], "argument --fusion-threshold-mb: invalid float value: 'abc'"),
        (["-np", "2", "--fusion-threshold-mb", "-1"], "--fusion-threshold-mb -1 must be >= 0"),
        (["-np", "2", "--cache-capacity", "-2"], "--cache-capacity -2 must be >= 0"),
        (["-np", "0"], "-np must be at least 1, not 0"),
        (["-np", "5", "-H", "localhost:4"], r"requested -np 5 but the hosts offer only 4 slots \(localhost:4\)"),
        (["-np", "2", "-H", "localhost:x"], "slots of host 'localhost' must be a whole number, not 'x'"),
        (["-np", "2", "-H", "localhost:1,localhost:1"], "host 'localhost' is listed twice"),
        (["-np", "2", "--hostfile", "/nonexistent/hosts"], "cannot read hostfile"),
        (["-np", "2", "-x", "ROUNDEL_TEST_UNSET_VAR"], "ROUNDEL_TEST_UNSET_VAR is not set"),
        (["-np", "2", "-H", "no-such-host.invalid:2"], "cannot resolve host .no-such-host.invalid."),
    ],
)
def test_bad_arguments(tmp_path, args, message):
    marker = tmp_path / "started"
    result = roundelrun(*args, sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert result.returncode == 2
    assert result.stdout == b""
    assert "roundelrun: error: " in result.stderr.decode()
    assert re.search(message, result.stderr.decode()), result.stderr
    assert not marker.exists()


def test_bad_environment_setting_is_reported_before_start():
    result = roundelrun("-np", "1", "true", env={**os.environ, "HOROVOD_CYCLE_TIME": "fast"})
    assert result.returncode == 2
    assert "roundelrun: error: HOROVOD_CYCLE_TIME='fast' is not a number" in result.stderr.decode()


def test_missing_command():
    result = roundelrun("-np", "2")
    assert result.returncode == 2
    assert "usage: roundelrun" in result.stderr.decode()
    assert "roundelrun: error: no command given" in result.stderr.decode()
    assert roundelrun("-np", "2", "--").returncode == 2


def test_command_not_found():
    result = roundelrun("-np", "2", "/nonexistent/program")
    assert result.returncode == 127
    assert result.stderr.decode() == "roundelrun: error: cannot run /nonexistent/program: no such file or command\n"


def test_a_script_that_is_not_executable_gets_a_hint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('trained')\n")
    result = roundelrun("-np", "2", str(script), "--epochs", "1")
    assert result.returncode == 126
    assert result.stderr.decode() == (f"roundelrun: error: cannot run {script}: it is not executable; "
                                      f"did you mean `python {script} --epochs 1`?\n")
    result = roundelrun("-np", "1", "train.py", cwd=tmp_path)  # not on PATH either
    assert "did you mean `python train.py`?" in result.stderr.decode()


def test_command_options_are_not_launcher_options():
    result = roundelrun("-np", "1", "--", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-n", "--verbose")
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout) == ["[0]<stdout>:['-n', '--verbose']"]
    assert result.stderr == b""


def test_verbose_prints_the_plan():
    result = roundelrun("-np", "2", "--verbose", "true")
    assert result.returncode == 0
    err = lines(result.stderr)
    assert any(line.startswith("roundelrun: rendezvous server at 127.0.0.1:") for line in err)
    assert "roundelrun: rank 1 on localhost (local_rank 1/2, cross_rank 0/1): true" in err


def test_installed_script_and_run_function(capfd):
    from roundel.runner.launch import run

    assert run(["-np", "2", sys.executable, "-c", "print('via run')"]) == 0
    out, _ = capfd.readouterr()
    assert sorted(out.splitlines()) == ["[0]<stdout>:via run", "[1]<stdout>:via run"]
    script = Path(sys.executable).parent / "roundelrun"  # installed by `pip install -e .`
    result = subprocess.run([str(script), "-np", "1", "true"], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_launcher_does_not_import_frameworks():
    code = "import sys, roundel.runner.launch; print(sorted({'torch', 'tensorflow', 'jax'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    assert result.stdout == b"[]\n", result.stderr


@pytest.mark.parametrize("how", ["python", "elastic", "wrapper"])
def test_workers_end_when_the_launcher_is_killed(tmp_path, how):
    # SIGKILL gives roundelrun no chance to stop its workers; they must not train on forever. With a
    # wrapper script (roundelrun -np 2 ./train.sh), the script, its Python and what it runs in the
    # background all go.
    code = ("import os, time, roundel.torch as hvd; hvd.init(); "
            "open(os.path.join(%r, str(os.getpid())), 'w').close(); time.sleep(120)" % str(tmp_path))
    launcher_args, command, expected = ["-np", "2"], [sys.executable, "-c", code], 2
    if how == "elastic":
        script = tmp_path / "discover.sh"
        script.write_text("#!/bin/sh\necho localhost:2\n")
        script.chmod(0o755)
        launcher_args += ["--host-discovery-script", str(script)]
    if how == "wrapper":
        wrapper = tmp_path / "train.sh"
        wrapper.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/$$\nsleep 120 &\necho $! > {tmp_path}/$!\n"
                           f"{shlex.join(command)}\n")
        wrapper.chmod(0o755)
        command, expected = [str(wrapper)], 6  # per rank: the script, its background sleep, its Python
    proc = subprocess.Popen([*LAUNCHER, *launcher_args, *command],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < expected:
            assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
            time.sleep(0.1)
        pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if alive(p)]
        assert not left, f"workers {left} outlived the killed launcher"
    finally:
        for p in tmp_path.iterdir():
            if p.name.isdigit() and alive(int(p.name)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p.name), signal.SIGKILL)
