"""No hang, ever: faults that used to hang a job end in bounded time on every rank.

Each test runs ``tests/workers/torch_hangs.py`` under the real launcher with a
3 s heartbeat timeout and checks, on every surviving rank, the error and how
long it took (``MEASURED``), the launcher's exit status and last lines, and
that no worker process is left afterwards. Covered: ranks blocked on
different collectives (deadlock detection), a rank busy outside roundel for
three heartbeat timeouts (no false alarm), a rank stopped with SIGSTOP while
the others negotiate or are inside a large transfer (with the Gloo timeout at
120 s, to show the release does not wait for it), unnamed collectives after
shutdown() + init() and per process set, and collective errors that leave the
job usable (mismatch; allgather/broadcast after join()), thousands of small
allreduces submitted at once (megabytes of control frames both ways), and a rank whose
network link goes down on a network-namespace host (see ``netns_util``).
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from launch_util import LAUNCHER, WORKERS_DIR, alive, assert_checks_passed, describe, rank_lines, run_command, run_job
from netns_util import LAUNCHER_ADDR, SSH_PORT, NetnsHosts, require_tools

WORKER = "torch_hangs.py"
HEARTBEAT_S = 3.0
ENV = {"ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS": HEARTBEAT_S, "HOROVOD_GLOO_TIMEOUT_SECONDS": 120}
LOST_BOUND_S = HEARTBEAT_S + 5.0  # detection at the timeout, plus scheduling margin on a loaded machine
SURVIVOR_EXIT = 3


def _measured(result, rank: int) -> float:
    values = [float(line.split()[1]) for line in rank_lines(result.stdout, rank, "stdout")
              if line.startswith("MEASURED ")]
    assert len(values) == 1, f"rank {rank} printed no MEASURED line\n" + describe(result)
    return values[0]


def _errors(result, rank: int) -> list[str]:
    return [line for line in rank_lines(result.stdout, rank, "stdout") if line.startswith("ERROR ")]


def _assert_nothing_left(result) -> None:
    """Every worker pid the job printed is gone (or a zombie about to be reaped)."""
    pids = [int(line.split()[1]) for line in rank_lines(result.stdout, None, "stdout") if line.startswith("PID ")]
    assert pids, describe(result)
    deadline = time.monotonic() + 10
    left = pids
    while left and time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        time.sleep(0.2)
    assert not left, f"worker processes {left} are still running\n" + describe(result)


def _run(np: int, *args, timeout: float = 90):
    return run_job(np, WORKER, *args, env=ENV, timeout=timeout)


@pytest.mark.parametrize("np", [2, 3])
def test_diverged_ranks_raise_on_every_rank(np):
    # rank 0 in barrier(), rank 1 in broadcast(), rank 2 in an allreduce nobody else calls
    result = _run(np, "diverged", timeout=60)
    assert_checks_passed(result, np, "diverged")
    for rank in range(np):
        assert _measured(result, rank) < 5, describe(result)
        (error,) = _errors(result, rank)
        assert error.startswith("ERROR CollectiveDeadlockError: roundel detected a deadlock"), describe(result)
        assert "rank 0 waits for barrier '__barrier__.1'" in error, describe(result)
        assert "rank 1 waits for broadcast 'diverged.bcast'" in error, describe(result)
    _assert_nothing_left(result)


def _assert_lost(result, np: int, stopped: int, scenario: str) -> None:
    assert result.returncode == SURVIVOR_EXIT, describe(result)
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"roundelrun: rank {stopped} (host ") and " was lost: stopped responding" in last, \
        describe(result)
    for rank in range(np):
        if rank == stopped:
            continue
        assert "CHECKS PASSED " + scenario in rank_lines(result.stdout, rank, "stdout"), describe(result)
        assert _measured(result, rank) < LOST_BOUND_S, describe(result)
        assert any(f"rank {stopped} (host " in line and "stopped responding" in line
                   for line in _errors(result, rank)), describe(result)
    _assert_nothing_left(result)


@pytest.mark.parametrize("stopped", [1, 0])
def test_stopped_rank_fails_the_others_within_the_heartbeat_timeout(stopped):
    # 3 ranks; the stopped one (SIGSTOP, so it can neither exit nor answer) must be named and killed
    result = _run(3, "stopped", stopped)
    _assert_lost(result, 3, stopped, "stopped")


def test_a_rank_that_learns_of_a_stopped_coordinator_from_its_end_names_the_cause(tmp_path):
    # only rank 1 can find rank 0 stopped; the launcher then ends rank 0, which closes rank 2's
    # connection to it: rank 2 must still say that rank 0 stopped responding, not just that it went away
    result = _run(3, "stopped_coordinator_seen_by_one", str(tmp_path))
    _assert_lost(result, 3, 0, "stopped_coordinator_seen_by_one")
    assert any("(found by another rank)" in line for line in _errors(result, 2)), describe(result)


def test_stopped_rank_is_killed_when_the_others_handle_the_error_and_exit_0():
    # a stopped rank never exits: the launcher kills it once the others record it lost, lets them
    # finish their error handling, and still fails the job naming it
    result = _run(3, "stopped_caught")
    assert result.returncode == 1, describe(result)
    for rank in (0, 2):
        assert "CHECKS PASSED stopped_caught" in rank_lines(result.stdout, rank, "stdout"), describe(result)
        assert _measured(result, rank) < LOST_BOUND_S, describe(result)
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("roundelrun: rank 1 (host ") and "stopped responding" in last \
        and last.endswith("it was killed"), describe(result)
    _assert_nothing_left(result)


def test_a_rank_reported_lost_that_exits_by_itself_is_named_by_its_own_status():
    # the launcher polls the store's lost records every 0.25 s: before the grace it killed the rank at
    # once and reported "it was killed", hiding the status 4 it exited with 0.6 s after the report
    result = _run(2, "reported_lost_then_exits", timeout=60)
    assert result.returncode == 4, describe(result)
    assert "EXITING" in rank_lines(result.stdout, 1, "stdout"), describe(result)
    assert "it was killed" not in result.stderr, describe(result)
    assert any(line.startswith("roundelrun: rank 1 (host ") and "exited with code 4" in line
               for line in result.stderr.splitlines()), describe(result)
    _assert_nothing_left(result)


@pytest.mark.parametrize("np", [2, 3, 5])
def test_rank_stopped_inside_a_large_transfer_releases_the_others(np):
    # the survivors are inside 32 MiB allreduces (shared memory, whose wait at 5 ranks reads from only
    # some members; Gloo timeout 120 s) when rank 1 stops
    result = _run(np, "stopped_in_transfer")
    _assert_lost(result, np, 1, "stopped_in_transfer")


# Scenarios that must end normally share one job per size (each launch costs seconds); every scenario
# prints its own CHECKS PASSED line, so a failure still names the one that failed.
COMPLETING = (
    # init() returns on rank 0 only once every rank has joined its coordinator, as Horovod's init();
    # before, a rank still connecting when rank 0 shut down got "connection refused"
    "shutdown_right_after_init",
    # rank 0 computes for 3 heartbeat timeouts while the others wait in an allreduce: no false alarm
    "busy",
    # thousands of small allreduces at once: megabytes of control frames from rank 0 and from the
    # others at the same time must not stall the control channel
    "many_small_at_once",
    # unnamed collectives after shutdown() + init() and beside a process set's own unnamed ops; a
    # mismatch is a RuntimeError and the next allreduce works; allgather/broadcast raise after join()
    "unnamed_reinit",
    "mismatch_then_works",
    "join_gather",
)


@pytest.mark.parametrize("np", [2, 3])
def test_busy_ranks_many_small_allreduces_reinit_and_collective_errors_leave_the_job_usable(np):
    result = _run(np, ",".join(COMPLETING), timeout=180)
    assert_checks_passed(result, np, *COMPLETING)
    output = result.stdout + result.stderr
    assert "deadlock" not in output, "busy: a rank busy outside roundel was taken for a deadlock\n" + describe(result)
    assert "stopped responding" not in output, "busy: a busy rank was reported lost\n" + describe(result)
    assert "lost the connection" not in result.stdout, \
        "many_small_at_once: the control channel stalled\n" + describe(result)
    _assert_nothing_left(result)


def test_link_down_on_a_host_fails_every_rank(tmp_path):
    # rank 0 on this machine, rank 1 on rdl-h1, rank 2 on rdl-h2; rank 2 takes rdl-h2's link down.
    # Its output cannot reach the launcher any more, and neither can the launcher's stop signal:
    # nothing left in the namespaces proves rank 2 gave up by itself.
    require_tools()
    net = NetnsHosts(2, tmp_path)
    h1, h2 = net.addrs
    try:
        command = [*LAUNCHER, "-p", str(SSH_PORT), "-i", net.key, "-np", "3", "-H",
                   f"{LAUNCHER_ADDR}:1,{h1}:1,{h2}:1", sys.executable, str(WORKERS_DIR / WORKER), "link_down", "2"]
        result = run_command(command, env={**net.ssh_env(), **ENV}, timeout=120)
        assert result.returncode == SURVIVOR_EXIT, describe(result)
        assert any(line.startswith(f"roundelrun: rank 2 (host {h2}) was lost: stopped responding")
                   for line in result.stderr.splitlines()), describe(result)
        for rank in (0, 1):
            assert "CHECKS PASSED link_down" in rank_lines(result.stdout, rank, "stdout"), describe(result)
            assert _measured(result, rank) < LOST_BOUND_S, describe(result)
            assert any("rank 2 (host " in line for line in _errors(result, rank)), describe(result)
        assert not _workers_left(net, timeout=45), "worker processes left in the namespaces"
    finally:
        subprocess.run(["ip", "-n", net.names[1], "link", "set", "eth0", "up"], timeout=10)
        net.close()


def _workers_left(net, timeout: float) -> list[int]:
    """Python processes still running in the namespaces after up to ``timeout`` s (an sshd session
    of the cut link may linger until TCP gives up; it is not ours to wait for)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for name in net.names:
            for pid in net.pids(name):
                try:
                    if "python" in psutil.Process(pid).name():
                        left.append(pid)
                except psutil.NoSuchProcess:
                    pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
