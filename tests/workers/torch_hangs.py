"""Liveness worker: ``torch_hangs.py SCENARIO[,SCENARIO...] [ARG]`` under roundelrun.

Each scenario provokes a situation that used to hang (diverged ranks, a
stopped rank, unnamed ops after a re-init, large control frames both ways) and checks it ends as documented:
the expected error on every surviving rank within a bound, or normal
completion. Ranks print ``MEASURED <seconds>`` for the timed part and
``CHECKS PASSED <scenario>``. In the stop scenarios the survivors exit with
status 3 after their checks so that roundelrun ends the job (the stopped rank
cannot exit by itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.errors import CollectiveDeadlockError
from _checks import check, expect_raises, make, to_np

SURVIVOR_EXIT = 3
HEARTBEAT_S = float(os.environ.get("ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS", "15"))


def passed(name: str, measured: float | None = None) -> None:
    if measured is not None:
        print(f"MEASURED {measured:.3f}", flush=True)
    print(f"CHECKS PASSED {name}", flush=True)


def allreduce_works(tag: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    x = make(rank, tag, (5,), torch.int64)
    check(hvd.allreduce(x, name=tag, op=hvd.Sum), sum(to_np(make(r, tag, (5,), torch.int64)) for r in range(size)),
          f"allreduce {tag}")


# ------------------------------------------------------------------ deadlock
def scenario_diverged():
    """Rank 0 in barrier, rank 1 in broadcast, rank 2 (if any) in an allreduce nobody else calls."""
    rank = hvd.rank()
    allreduce_works("warm")
    calls = {0: lambda: hvd.barrier(),
             1: lambda: hvd.broadcast(torch.ones(3), 1, name="diverged.bcast"),
             2: lambda: hvd.allreduce(torch.ones(2), name="diverged.ar")}
    start = time.monotonic()
    error = expect_raises(RuntimeError, calls[rank], "deadlock", "rank 0 waits for barrier '__barrier__.1'",
                          "rank 1 waits for broadcast 'diverged.bcast'", what="diverged ranks")
    took = time.monotonic() - start
    assert isinstance(error, CollectiveDeadlockError), type(error)
    if hvd.size() > 2:
        assert "rank 2 waits for allreduce 'diverged.ar'" in str(error), str(error)
    print(f"ERROR {type(error).__name__}: {error}", flush=True)
    allreduce_works("after.deadlock")  # the job goes on once the ranks agree
    passed("diverged", took)


def scenario_busy():
    """Rank 0 computes outside roundel for 3x the heartbeat timeout while the others wait: no error."""
    allreduce_works("warm")
    if hvd.rank() == 0:
        deadline = time.monotonic() + 3 * HEARTBEAT_S
        while time.monotonic() < deadline:  # busy in Python, holding the GIL most of the time
            sum(range(20000))
    allreduce_works("after.busy")
    passed("busy")


# ------------------------------------------------------------------ stopped ranks
def _stop_self_later(delay: float) -> None:
    def stop():
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGSTOP)
    threading.Thread(target=stop, daemon=True).start()


def _expect_lost(stopped: int, run) -> float:
    start = time.monotonic()
    error = expect_raises(hvd.HorovodInternalError, run, f"rank {stopped} (host ", "stopped responding",
                          what=f"survivor of stopped rank {stopped}")
    took = time.monotonic() - start
    print(f"ERROR {type(error).__name__}: {error}", flush=True)
    # later collectives fail at once too
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(1), name="later"),
                  f"rank {stopped}", what="a collective after the loss")
    return took


def scenario_stopped(stopped: str, name: str = "stopped", before_exit=None):
    """Rank ``stopped`` SIGSTOPs itself; the others wait in an allreduce it never joins."""
    stopped = int(stopped)
    allreduce_works("warm")
    if hvd.rank() == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    took = _expect_lost(stopped, lambda: hvd.allreduce(torch.ones(4), name="stopped.ar"))
    passed(name, took)
    if before_exit is not None:
        before_exit()
    sys.exit(SURVIVOR_EXIT)


def scenario_stopped_coordinator_seen_by_one(done_dir: str):
    """Rank 0 SIGSTOPs itself; only rank 1 can find it stopped (rank 2's heartbeat timeout is 60 s,
    set before init), so rank 2 learns of it when the launcher ends rank 0; it must report the same.
    Each survivor marks its checks done in ``done_dir`` and exits once both have (the launcher stops
    the job at the first exit)."""
    def both_done():
        open(os.path.join(done_dir, str(hvd.rank())), "w").close()
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(done_dir, r)) for r in ("1", "2")):
            assert time.monotonic() < deadline, "the other survivor did not finish its checks within 30 s"
            time.sleep(0.05)
    scenario_stopped("0", "stopped_coordinator_seen_by_one", both_done)


def scenario_stopped_caught():
    """Rank 1 SIGSTOPs itself; the others catch the error, take 2 s to save their work and exit 0."""
    allreduce_works("warm")
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    took = _expect_lost(1, lambda: hvd.allreduce(torch.ones(4), name="stopped.ar"))
    time.sleep(2.0)  # e.g. a checkpoint written in the except block: the launcher lets it finish
    passed("stopped_caught", took)


def scenario_reported_lost_then_exits():
    """Rank 0 reports the last rank lost in the store, as a rank's heartbeat check or a relay does; the last
    rank, failing at that moment, exits by itself with status 4 0.6 s later; the others wait to be ended."""
    runtime = basics.runtime()
    victim = hvd.size() - 1
    allreduce_works("warm")
    if hvd.rank() == 0:
        report = {"rank": victim, "host": "test", "reason": "reported by the test"}
        runtime.client.set(f"{runtime.prefix}lost/{victim}", json.dumps(report).encode())
    if hvd.rank() == victim:
        runtime.client.get(f"{runtime.prefix}lost/{victim}", timeout=60)
        print("EXITING", flush=True)
        time.sleep(0.6)
        os._exit(4)
    time.sleep(10)  # the launcher ends this rank once the last one exits


def scenario_stopped_in_transfer():
    """Rank 1 stops itself while every rank is inside 32 MiB allreduces."""
    allreduce_works("warm")
    big = torch.ones(8 << 20)
    if hvd.rank() == 1:
        _stop_self_later(0.3)
    longest = 0.0

    def loop():
        nonlocal longest
        for step in range(100000):
            start = time.monotonic()
            try:
                hvd.allreduce(big, name=f"big.{step % 4}")
            finally:
                longest = max(longest, time.monotonic() - start)

    _expect_lost(1, loop)
    passed("stopped_in_transfer", longest)
    sys.exit(SURVIVOR_EXIT)


def scenario_link_down(victim: str):
    """Rank ``victim`` (alone in its network namespace) takes its link down; every rank raises, it too."""
    victim = int(victim)
    allreduce_works("warm")
    if hvd.rank() == victim:
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True, timeout=10)
        lost = 0  # from the victim's side, the coordinator is the one that went silent
    else:
        lost = victim
    took = _expect_lost(lost, lambda: hvd.allreduce(torch.ones(4), name="link.ar"))
    passed("link_down", took)
    sys.exit(SURVIVOR_EXIT)


# ------------------------------------------------------------------ naming after re-init
def scenario_unnamed_reinit():
    """Unnamed ops agree per process set, and again after shutdown() + init()."""
    rank, size = hvd.rank(), hvd.size()
    solo = hvd.add_process_set([0])
    if rank == 0:  # extra unnamed ops on a set of rank 0 alone must not shift the global numbering
        for _ in range(3):
            hvd.allreduce(torch.ones(2), process_set=solo)
    for step in range(2):
        check(hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum), torch.full((2,), float(sum(range(size)))),
              f"unnamed allreduce {step}")
    hvd.shutdown()
    hvd.init()
    for step in range(3):  # the same unnamed names as a process that never ran before
        check(hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum), torch.full((2,), float(sum(range(size)))),
              f"unnamed allreduce after re-init {step}")
        got = hvd.allgather(torch.tensor([rank]))
        check(got, torch.arange(size), f"unnamed allgather after re-init {step}")
    passed("unnamed_reinit")


# ------------------------------------------------------------------ large control frames both ways
def scenario_many_small_at_once():
    """6,000 allreduces of 4 KiB submitted at once, twice (the second time as cache bits).

    Their data rides on the control channel (the coordinator reduces them), so
    rank 0 and the others send each other frames of megabytes at the same
    time. This used to end in "lost the connection to the coordinator (timed
    out)" after the heartbeat timeout: each end blocked in its send, waiting
    for the other to read.
    """
    rank, size = hvd.rank(), hvd.size()
    count = 6000
    start = time.monotonic()
    for step in range(2):
        tensors = [torch.full((1024,), float(i % 97 + rank)) for i in range(count)]
        handles = [hvd.allreduce_async(t, name=f"many.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for i, handle in enumerate(handles):
            expected = size * (i % 97) + size * (size - 1) // 2
            assert torch.equal(hvd.synchronize(handle), torch.full((1024,), float(expected))), (step, i)
    allreduce_works("after.many")
    passed("many_small_at_once", time.monotonic() - start)


# ------------------------------------------------------------------ collective errors
def scenario_mismatch_then_works():
    """A shape mismatch raises RuntimeError (and ValueError) on every rank; the next allreduce works."""
    rank = hvd.rank()
    shape = (3,) if rank == 0 else (4,)
    error = expect_raises(RuntimeError, lambda: hvd.allreduce(torch.ones(shape), name="mm"), "shape",
                          what="shape mismatch")
    assert isinstance(error, ValueError) and isinstance(error, hvd.CollectiveMismatchError), type(error)
    assert not isinstance(error, hvd.HorovodInternalError), type(error)
    allreduce_works("after.mismatch")
    passed("mismatch_then_works")


def scenario_join_gather():
    """After join() on the last rank, allgather and broadcast raise on the others; allreduce goes on."""
    rank, last = hvd.rank(), hvd.size() - 1
    if rank == last:
        hvd.join()
    else:
        expect_raises(RuntimeError, lambda: hvd.allgather(torch.ones(2, 1), name="jg.gather"), "join()",
                      what="allgather after join")
        expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), 0, name="jg.bcast"), "join()",
                      what="broadcast after join")
        check(hvd.allreduce(torch.ones(2), name="jg.ar", op=hvd.Sum), torch.full((2,), float(last)),
              "allreduce after join")
        hvd.join()
    allreduce_works("after.join")
    passed("join_gather")


def scenario_shutdown_right_after_init():
    """Rank 0 leaves at once after each init(): every rank's init() must have joined by then."""
    for _ in range(10):
        hvd.shutdown()
        hvd.init()
    allreduce_works("after.reinit")
    passed("shutdown_right_after_init")


SCENARIOS = {
    "shutdown_right_after_init": scenario_shutdown_right_after_init,
    "stopped_caught": scenario_stopped_caught,
    "diverged": scenario_diverged,
    "busy": scenario_busy,
    "stopped": scenario_stopped,
    "stopped_coordinator_seen_by_one": scenario_stopped_coordinator_seen_by_one,
    "stopped_in_transfer": scenario_stopped_in_transfer,
    "link_down": scenario_link_down,
    "unnamed_reinit": scenario_unnamed_reinit,
    "mismatch_then_works": scenario_mismatch_then_works,
    "join_gather": scenario_join_gather,
    "many_small_at_once": scenario_many_small_at_once,
    "reported_lost_then_exits": scenario_reported_lost_then_exits,
}


if __name__ == "__main__":
    print(f"PID {os.getpid()}", flush=True)
    if sys.argv[1] == "stopped_coordinator_seen_by_one" and os.environ.get("HOROVOD_RANK") == "2":
        os.environ["ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS"] = "60"
    hvd.init()
    for scenario in sys.argv[1].split(","):
        SCENARIOS[scenario](*sys.argv[2:])
    hvd.shutdown()
