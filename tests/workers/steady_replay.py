"""Worker for tests/test_steady_replay.py: the replayed steady state, and every way of leaving it.

Each scenario first trains a few steps of a fixed schedule (named allreduces submitted asynchronously,
then waited for, as a DistributedOptimizer does) until the schedule is replayed, checks every result,
then makes the ranks leave the schedule in one way and checks that each rank gets the right result or
error, in bounded time, and that the job goes on. ``scenario <name>`` prints MEASURED <seconds> where
the time of leaving matters.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError
from _checks import run_scenarios

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
# the schedule: in these jobs of 2 and 3 ranks every one is replayed, the loss too (see ScheduleReplay.runs_small)
SHAPES = {"step.a": (33, 40), "step.b": (1100,), "step.c": (64, 33), "step.loss": (1,)}


def _counts() -> tuple[int, int]:
    return basics.runtime().engine.replay_counts


def _expected(step: int, name: str, shape) -> torch.Tensor:
    """Every rank's contribution is (rank + 1) * (step + 1) * arange: their sum, known to every rank."""
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return base * (step + 1) * sum(r + 1 for r in range(SIZE))


def _mine_of(rank: int, step: int, shape) -> torch.Tensor:
    base = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    return base * (step + 1) * (rank + 1)


def _mine(step: int, shape) -> torch.Tensor:
    return _mine_of(RANK, step, shape)


def train(steps: int, first: int = 0, names=tuple(SHAPES)) -> None:
    """``steps`` steps of the fixed schedule: submit every name, then wait for each; check each result."""
    for step in range(first, first + steps):
        handles = [(name, hvd.allreduce_async(_mine(step, SHAPES[name]), name=name, op=hvd.Sum)) for name in names]
        for name, handle in handles:
            result = hvd.synchronize(handle)
            assert torch.equal(result, _expected(step, name, SHAPES[name])), (step, name, result)


def steady() -> int:
    """Train until the schedule is replayed; return the step to go on from."""
    train(8)
    ran, _ = _counts()
    assert ran > 0, f"rank {RANK}: no slot was replayed after 8 steady steps ({_counts()})"
    return 8


def scenario_steady() -> None:
    """The schedule is replayed (each rank alike), the results are exact, and averages and scales are right."""
    step = steady()
    before = _counts()
    train(20, step)
    ran, given_up = (a - b for a, b in zip(_counts(), before))
    assert ran >= 20, f"rank {RANK}: only {ran} slots replayed in 20 steady steps"
    assert given_up == 0, f"rank {RANK}: {given_up} slots given up in a steady loop"
    hvd.barrier()  # every slot before it has been counted on every rank
    everyone = hvd.allgather_object(_counts(), name="replay.counts")
    assert len(set(everyone)) == 1, f"ranks replayed differently: {everyone}"
    for i in range(6):  # average with scales, blocking, replayed after the first few
        out = hvd.allreduce(torch.full((4,), float(RANK + 1)), name="avg", op=hvd.Average,
                            prescale_factor=2.0, postscale_factor=0.5)
        assert torch.allclose(out, torch.full((4,), (SIZE + 1) / 2)), out
    for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.float64):  # each slot dtype's agreement
        before = _counts()
        for i in range(8):
            mine = torch.full((4096,), RANK + i, dtype=dtype)
            out = hvd.allreduce(mine, name=f"typed.{dtype}", op=hvd.Sum)
            assert torch.equal(out, torch.full((4096,), sum(r + i for r in range(SIZE)), dtype=dtype)), (dtype, out)
        ran, given_up = (a - b for a, b in zip(_counts(), before))  # the slot armed before the loop is given up
        assert ran >= 4 and given_up <= 1, f"rank {RANK}: {dtype} slots ran {ran} times, given up {given_up}"
    for i in range(6):  # a large tensor: agreed first, then reduced in its own memory
        big = torch.full((300_000,), float(RANK + 1))
        assert torch.equal(hvd.allreduce(big, name="big", op=hvd.Sum), torch.full((300_000,), float(sum(
            r + 1 for r in range(SIZE)))))


def _mismatched(reduce, name: str, usual_shape) -> None:
    """Rank 1 sums ``name`` (with ``reduce``) in another shape than the others' ``usual_shape``: every rank gets the
    mismatch error."""
    shape = (3, 6) if RANK == 1 else usual_shape
    try:
        reduce(torch.ones(shape), name=name, op=hvd.Sum)
    except CollectiveMismatchError as exc:
        assert name in str(exc), exc
    else:
        raise AssertionError(f"rank {RANK}: no mismatch error")


def scenario_mismatch() -> None:
    """One rank changes a replayed name's shape: every rank gets the mismatch error, and training goes on."""
    step = steady()
    start = time.monotonic()
    _mismatched(hvd.allreduce, "step.a", SHAPES["step.a"])
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
    train(6, step)


def scenario_other_order() -> None:
    """After the steady state, the ranks wait for two replayed names in opposite orders, each blocking: a
    deadlock, which every rank is told of, as without replay; then training goes on."""
    step = steady()
    first, second = ("step.a", "step.b") if RANK == 0 else ("step.b", "step.a")
    start = time.monotonic()
    try:
        hvd.allreduce(_mine(step, SHAPES[first]), name=first, op=hvd.Sum)
        hvd.allreduce(_mine(step, SHAPES[second]), name=second, op=hvd.Sum)
    except CollectiveDeadlockError as exc:
        assert first in str(exc), exc
    else:
        raise AssertionError(f"rank {RANK}: no deadlock error")
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
    train(6, step + 1)


def scenario_fewer_names() -> None:
    """A step submits only some of the names the schedule fuses together: they run without the others."""
    step = steady()
    start = time.monotonic()
    for extra in range(3):
        train(1, step + extra, names=("step.a",))
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
    train(6, step + 3)


def scenario_polled() -> None:
    """A step submits only some of the fused names and polls instead of waiting: they still run."""
    step = steady()
    start = time.monotonic()
    handle = hvd.allreduce_async(_mine(step, SHAPES["step.a"]), name="step.a", op=hvd.Sum)
    while not hvd.poll(handle):
        time.sleep(0.001)
    assert torch.equal(hvd.synchronize(handle), _expected(step, "step.a", SHAPES["step.a"]))
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
    train(6, step + 1)


def scenario_shape_changes_back() -> None:
    """A schedule of one name that follows itself; one step (an epoch's last batch) has another shape on every
    rank; the step after it has the usual shape again. Every result is right and nothing fails."""
    for step in range(14):
        shape = (60, 30) if step == 8 else (40, 30)  # both larger than what rank 0 reduces itself
        out = hvd.allreduce(_mine(step, shape), name="solo", op=hvd.Sum)
        assert torch.equal(out, _expected(step, "solo", shape)), (step, out)
    assert _counts()[0] > 0, _counts()


def scenario_join() -> None:
    """Rank 1 runs out of data after the steady state and joins; the others go on (rank 1 adds zeros)."""
    step = steady()
    if RANK == 1:
        last = hvd.join()
        assert last in range(SIZE), last
        return
    start = time.monotonic()
    for extra in range(3):
        out = hvd.allreduce(_mine(step + extra, SHAPES["step.a"]), name="step.a", op=hvd.Sum)
        if extra == 0:  # rank 1 waits in join() for what the others hold in a slot: rank 0 sorts that out
            print(f"JOINED_STEP {time.monotonic() - start:.3f}", flush=True)
        want = _expected(step + extra, "step.a", SHAPES["step.a"]) * 0
        for r in range(SIZE):
            if r != 1:
                want += _mine_of(r, step + extra, SHAPES["step.a"])
        assert torch.equal(out, want), (out, want)
    hvd.join()


def scenario_late_rank() -> None:
    """Rank 1 falls behind by longer than the transport's timeout in the steady state: the others wait in
    replayed slots, are released to wait on rank 0's coordinator instead, and nothing times out."""
    step = steady()
    timeout = float(os.environ["HOROVOD_GLOO_TIMEOUT_SECONDS"])
    if RANK == 1:
        time.sleep(2.5 * timeout)
    start = time.monotonic()
    train(4, step)
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)


def scenario_rank_dies() -> None:
    """Rank 1 dies in the steady state: every other rank's replayed collective fails, promptly."""
    step = steady()
    if RANK == 1:
        time.sleep(0.3)
        os._exit(17)
    start = time.monotonic()
    try:
        train(50, step)
    except hvd.HorovodInternalError as exc:
        print(f"ERROR {exc}", flush=True)
        print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
        sys.exit(3)
    raise AssertionError("the job went on without rank 1")


def scenario_last_metric() -> None:
    """The job ends with a small allreduce (a test metric) after the steady state: rank 1 waits for it a second
    before rank 0 submits it, and rank 0 leaves the job as soon as it has the result. Rank 1 gets it at once.
    (A Max: rank 0 reduces it from the requests, so it passes beside the slot the others may stand in.)"""
    steady()
    if RANK == 0:
        time.sleep(1.0)  # evaluating
    start = time.monotonic()
    out = hvd.allreduce(torch.tensor([float(RANK), 1.0]), name="test_metrics", op=hvd.Max)
    assert torch.equal(out, torch.tensor([float(SIZE - 1), 1.0])), out
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)


def scenario_other_kinds() -> None:
    """Broadcasts and allgathers (each rank gathering its own number of rows) are replayed like allreduces; a step
    where one rank gathers more rows, and one where a rank names another root, leave the schedule with the usual
    result or error on every rank, and the loop goes on."""
    root = 1 % SIZE

    def step(i: int, first_rows: int = 1, my_root: int = root) -> None:
        """Broadcast from ``my_root`` (a small tensor, a few bools, one too large for a slot's rows), then gather
        RANK + 1 rows from each rank but rank 0's ``first_rows``, alone and as a group of two int8 tensors."""
        value = torch.full((300,), float(100 * RANK + i))
        hvd.broadcast_(value, root_rank=my_root, name="kinds.broadcast")
        assert torch.equal(value, torch.full((300,), float(100 * my_root + i))), (i, value)
        flags = hvd.broadcast(torch.tensor([RANK == 0, i % 2 == 0, RANK != 0]), root_rank=my_root, name="kinds.flags")
        assert flags.tolist() == [my_root == 0, i % 2 == 0, my_root != 0], (i, flags)
        large = hvd.broadcast(torch.full((70_000,), float(RANK + i)), root_rank=my_root, name="kinds.large")
        assert torch.equal(large, torch.full((70_000,), float(my_root + i))), (i, large[:4])
        sizes = [first_rows] + [r + 1 for r in range(1, SIZE)]
        gathered = hvd.allgather(torch.full((sizes[RANK], 5), float(RANK + i)), name="kinds.allgather")
        expected = torch.cat([torch.full((n, 5), float(r + i)) for r, n in enumerate(sizes)])
        assert torch.equal(gathered, expected), (i, gathered)
        rows, column = hvd.grouped_allgather([torch.full((sizes[RANK], 3), RANK + i, dtype=torch.int8),
                                              torch.full((RANK + 1,), -RANK, dtype=torch.int8)], name="kinds.group")
        assert torch.equal(rows, torch.cat([torch.full((n, 3), r + i, dtype=torch.int8)
                                            for r, n in enumerate(sizes)])), (i, rows)
        assert column.tolist() == [-r for r in range(SIZE) for _ in range(r + 1)], (i, column)

    for i in range(6):
        step(i)
    before = _counts()
    for i in range(6, 16):
        step(i)
    ran, given_up = (a - b for a, b in zip(_counts(), before))
    assert ran >= 40 and given_up == 0, f"rank {RANK}: broadcast/allgather slots ran {ran}, given up {given_up}"
    for i in range(16, 20):  # rank 0 gathers 7 rows at step 17 only
        step(i, first_rows=7 if i == 17 else 1)
    try:
        step(20, my_root=0 if RANK == SIZE - 1 else root)
    except CollectiveMismatchError as exc:
        assert "kinds.broadcast" in str(exc), exc
    else:
        raise AssertionError(f"rank {RANK}: no mismatch error for a broadcast with another root")
    for i in range(21, 25):
        step(i)


def scenario_mixed_threads() -> None:
    """A replayed large allreduce that rank 0 waits for at once (its own thread runs the slot) and the others
    submit, then wait for later (their executor runs it, as it runs large batches): every rank moves it the same
    way, and the results are exact. Before, rank 0's links and the others' Gloo call waited for each other until
    the transport's timeout."""
    before = _counts()
    for step in range(10):
        mine = torch.full((300_000,), float(RANK + step))
        expected = torch.full((300_000,), float(sum(r + step for r in range(SIZE))))
        if RANK == 0:
            result = hvd.allreduce(mine, name="mixed", op=hvd.Sum)
        else:
            handle = hvd.allreduce_async(mine, name="mixed", op=hvd.Sum)
            time.sleep(0.02)
            result = hvd.synchronize(handle)
        assert torch.equal(result, expected), (step, result)
    ran = _counts()[0] - before[0]
    assert ran >= 6, f"rank {RANK}: only {ran} of 10 steps replayed"


def scenario_caller_runs() -> None:
    """A replayed collective that a blocking call of roundel's common layer waits for (here broadcast_object's,
    which every framework uses) runs on the calling thread, not handed to the executor's thread and back."""
    backend = basics.runtime().engine.job_backend
    threads: list = []
    for method in ("allreduce", "allgather", "broadcast"):
        def recorded(*args, _call=getattr(backend, method)):
            threads.append(threading.current_thread() is threading.main_thread())
            return _call(*args)
        setattr(backend, method, recorded)
    for i in range(30):
        if i == 10:
            ran_before, threads[:] = _counts()[0], []
        assert hvd.broadcast_object({"step": i, "from": RANK}, root_rank=0, name="caller.object") == \
            {"step": i, "from": 0}, i
    ran = _counts()[0] - ran_before
    for method in ("allreduce", "allgather", "broadcast"):
        delattr(backend, method)  # the class's own again
    on_caller = sum(threads)
    assert ran >= 30 and on_caller >= 0.9 * len(threads), \
        f"rank {RANK}: {ran} slots ran, {on_caller} of {len(threads)} transport calls on the calling thread"


def _alone_runs() -> list:
    """Record, per blocking call that the engine offered to run at once (one named as the pending slot), whether the
    executor did (True) or found it was not that slot alone (False)."""
    executor = basics.runtime().engine.executor
    outcomes: list = []

    def recorded(work, _call=executor.run_alone):
        outcomes.append(_call(work))
        return outcomes[-1]

    executor.run_alone = recorded
    return outcomes


def _alone_loop(first: int, steps: int) -> None:
    """Blocking allreduces of one tensor each, as a loop that averages a metric does: in place, then not."""
    for step in range(first, first + steps):
        out = hvd.allreduce_(_mine(step, (40, 30)), name="alone", op=hvd.Sum)
        assert torch.equal(out, _expected(step, "alone", (40, 30))), (step, out)
        metric = hvd.allreduce(torch.full((3,), float(RANK + step)), name="alone.metric")
        assert torch.equal(metric, torch.full((3,), step + (SIZE - 1) / 2)), (step, metric)


def scenario_alone() -> None:
    """A blocking allreduce that alone is the replayed slot runs straight from the call (no queue, no registered
    handle); the results are exact; one rank's other shape is a mismatch on every rank, and the ranks blocking in
    opposite orders a deadlock every rank is told of, as without replay; the loop goes on after each."""
    outcomes = _alone_runs()
    _alone_loop(0, 12)
    assert sum(outcomes) >= 16, f"rank {RANK}: {sum(outcomes)} of 24 blocking calls ran at once"
    offered = len(outcomes)
    start = time.monotonic()
    _mismatched(hvd.allreduce_, "alone", (40, 30))
    # rank 1's call was not the slot; the others ran the slot at once, learned there that rank 1 gave it up, and
    # sent theirs to rank 0
    assert outcomes[offered:] == [RANK != 1], (RANK, outcomes[offered:])
    hvd.allreduce(torch.zeros(3), name="alone.metric")  # where the loop was
    _alone_loop(12, 8)
    first, second = ("alone", "alone.metric") if RANK == 0 else ("alone.metric", "alone")
    offered = len(outcomes)
    try:
        hvd.allreduce(torch.ones(40, 30), name=first, op=hvd.Sum)
        hvd.allreduce(torch.ones(40, 30), name=second, op=hvd.Sum)
    except CollectiveDeadlockError as exc:
        assert first in str(exc), exc
    else:
        raise AssertionError(f"rank {RANK}: no deadlock error")
    # rank 0 stood in the slot; the others' first call was not the slot, so not even offered
    assert outcomes[offered:offered + 1] == ([True] if RANK == 0 else []), (RANK, outcomes[offered:])
    print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
    before = sum(outcomes)
    _alone_loop(20, 12)
    assert sum(outcomes) - before >= 16, f"rank {RANK}: {sum(outcomes) - before} of 24 calls ran at once after"


def scenario_alone_rank_dies() -> None:
    """Rank 1 dies while the others loop on blocking replayed allreduces that run straight from the call: theirs
    fails, promptly."""
    outcomes = _alone_runs()
    _alone_loop(0, 12)
    assert sum(outcomes) >= 16, f"rank {RANK}: {sum(outcomes)} of 24 blocking calls ran at once"
    if RANK == 1:
        time.sleep(0.3)
        os._exit(17)
    start = time.monotonic()
    try:
        _alone_loop(12, 1000)
    except hvd.HorovodInternalError as exc:
        print(f"ERROR {exc}", flush=True)
        print(f"MEASURED {time.monotonic() - start:.3f}", flush=True)
        sys.exit(3)
    raise AssertionError("the job went on without rank 1")


def scenario_off() -> None:
    """With ROUNDEL_STEADY_REPLAY=0 nothing is replayed."""
    train(12)
    assert _counts() == (0, 0), _counts()


SCENARIOS = {
    "steady": scenario_steady,
    "mismatch": scenario_mismatch,
    "other_order": scenario_other_order,
    "fewer_names": scenario_fewer_names,
    "polled": scenario_polled,
    "shape_changes_back": scenario_shape_changes_back,
    "join": scenario_join,
    "late_rank": scenario_late_rank,
    "rank_dies": scenario_rank_dies,
    "alone": scenario_alone,
    "alone_rank_dies": scenario_alone_rank_dies,
    "last_metric": scenario_last_metric,
    "off": scenario_off,
    "other_kinds": scenario_other_kinds,
    "mixed_threads": scenario_mixed_threads,
    "caller_runs": scenario_caller_runs,
}

if __name__ == "__main__":
    run_scenarios(SCENARIOS, sys.argv, RANK)
    hvd.shutdown()
