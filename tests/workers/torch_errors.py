"""Error-case worker: ``torch_errors.py SCENARIO[,SCENARIO...] [ARGS...]``.

Run under roundelrun (or plain ``python`` for the single-process scenarios).
Each scenario provokes one kind of failure and checks that it surfaces as the
documented exception, with a message naming the ranks and what differed, on
every rank, and that the job goes on working afterwards where it should.
Every rank prints ``CHECKS PASSED <scenario>`` when its checks hold.

Scenarios that call ``hvd.init()`` themselves (``before_init``, ``reinit``,
``bad_settings``) run before any init; every other scenario list starts with
an ``hvd.init()`` done here.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import torch

import roundel.torch as hvd
from roundel.common import basics
from roundel.errors import SettingsError
from _checks import check, expect_raises, make, run_scenarios, to_np

NO_INIT = {"before_init", "reinit", "bad_settings"}
RANK = SIZE = None
ODD = None  # the rank whose request differs from the others' (the last one)
_ok_count = 0


def job_still_works(tag: str) -> None:
    """A correct allreduce (and a cached second round of it) after an error gives the NumPy sum."""
    global _ok_count
    _ok_count += 1
    for round_ in range(2):
        name = f"after.{tag}.{_ok_count}"
        x = make(RANK, name, (5,), torch.int64)
        expected = sum(to_np(make(r, name, (5,), torch.int64)) for r in range(SIZE))
        check(hvd.allreduce(x, name=name, op=hvd.Sum), expected, f"allreduce after {tag} (round {round_})")


def others_and_odd(values_by_rank: dict) -> list[str]:
    """The message fragments naming the ranks that agreed and the odd rank, as describe_ranks writes them."""
    normal = [r for r in range(SIZE) if r != ODD]
    label = "rank" if len(normal) == 1 else "ranks"
    return [f"{label} {', '.join(map(str, normal))}: {values_by_rank['normal']!r}",
            f"rank {ODD}: {values_by_rank['odd']!r}"]


def expect_mismatch(fn, *needles, what):
    return expect_raises(hvd.CollectiveMismatchError, fn, *needles, what=what)


def tell_the_others(event: str) -> None:
    """Record ``event`` in the job's rendezvous store, for the ranks that ``wait_for`` it."""
    runtime = basics.runtime()
    runtime.client.set(f"{runtime.prefix}test/{event}", b"1")


def wait_for(event: str) -> None:
    """Block until a rank has called ``tell_the_others(event)``."""
    runtime = basics.runtime()
    runtime.client.get(f"{runtime.prefix}test/{event}", timeout=60)


# ------------------------------------------------------------------ mismatches
def scenario_mismatch():
    odd = RANK == ODD
    f32 = torch.ones(3)

    # shape
    x = torch.ones(4 if odd else 3)
    expect_mismatch(lambda: hvd.allreduce(x, name="mm.shape"), "'mm.shape'", "tensor shapes",
                    *others_and_odd({"normal": (3,), "odd": (4,)}), what="shape mismatch")
    job_still_works("shape")

    # dtype
    x = torch.ones(3, dtype=torch.float64 if odd else torch.float32)
    expect_mismatch(lambda: hvd.allreduce(x, name="mm.dtype"), "'mm.dtype'", "data types",
                    *others_and_odd({"normal": "float32", "odd": "float64"}), what="dtype mismatch")
    job_still_works("dtype")

    # reduce op
    expect_mismatch(lambda: hvd.allreduce(f32, name="mm.op", op=hvd.Max if odd else hvd.Sum), "'mm.op'",
                    "reduction ops", *others_and_odd({"normal": "Sum", "odd": "Max"}), what="op mismatch")
    job_still_works("op")

    # prescale / postscale factors
    expect_mismatch(lambda: hvd.allreduce(f32, name="mm.pre", op=hvd.Sum, prescale_factor=2.0 if odd else 1.0),
                    "'mm.pre'", "prescale factors", *others_and_odd({"normal": 1.0, "odd": 2.0}),
                    what="prescale mismatch")
    expect_mismatch(lambda: hvd.allreduce(f32, name="mm.post", op=hvd.Sum, postscale_factor=0.5 if odd else 1.0),
                    "'mm.post'", "postscale factors", *others_and_odd({"normal": 1.0, "odd": 0.5}),
                    what="postscale mismatch")
    job_still_works("scale")

    # broadcast root rank
    expect_mismatch(lambda: hvd.broadcast(f32, 1 if odd else 0, name="mm.root"), "'mm.root'", "root ranks",
                    *others_and_odd({"normal": 0, "odd": 1}), what="root mismatch")
    # a root outside the job is refused as well (all ranks agree on it, so it is the only problem)
    expect_mismatch(lambda: hvd.broadcast(f32, SIZE + 5, name="mm.root.out"), "'mm.root.out'",
                    f"root_rank {SIZE + 5}", what="root outside the set")
    job_still_works("root")

    # two collective kinds under one name
    def kinds():
        if odd:
            return hvd.allgather(f32, name="mm.kind")
        return hvd.allreduce(f32, name="mm.kind")
    expect_mismatch(kinds, "'mm.kind'", "Mismatched collective operations",
                    *others_and_odd({"normal": "allreduce", "odd": "allgather"}), what="kind mismatch")
    job_still_works("kind")

    # allgather: the first dimension may differ, the trailing ones may not
    x = torch.ones(2 + RANK, 4 if odd else 3)
    expect_mismatch(lambda: hvd.allgather(x, name="mm.gather"), "'mm.gather'", "beyond the first dimension",
                    *others_and_odd({"normal": (3,), "odd": (4,)}), what="allgather trailing dims")
    x = torch.ones(2, 3, 1) if odd else torch.ones(2, 3)
    expect_mismatch(lambda: hvd.allgather(x, name="mm.gather.ndim"), "'mm.gather.ndim'", "tensor ranks",
                    *others_and_odd({"normal": 2, "odd": 3}), what="allgather number of dims")
    job_still_works("allgather")

    # alltoall: splits that do not sum to the first dimension (on the odd rank only) fail everywhere
    x = torch.arange(SIZE * 2, dtype=torch.float32)
    splits = [2] * SIZE
    if odd:
        splits[0] = 3
    expect_mismatch(lambda: hvd.alltoall(x, splits=splits, name="mm.a2a"), "'mm.a2a'", f"rank {ODD}",
                    "must be non-negative and sum to the first dimension", what="alltoall bad splits")
    # ... a negative split
    bad = [2] * SIZE
    if odd:
        bad[0], bad[1] = -1, 5
    expect_mismatch(lambda: hvd.alltoall(x, splits=bad, name="mm.a2a.neg"), "'mm.a2a.neg'", f"rank {ODD}",
                    "non-negative", what="alltoall negative split")
    # ... the wrong number of splits (sums are right)
    count = [2 * SIZE] if odd else [2] * SIZE
    expect_mismatch(lambda: hvd.alltoall(x, splits=count, name="mm.a2a.count"), "'mm.a2a.count'",
                    f"rank {ODD} gave 1 splits", f"has {SIZE} ranks", what="alltoall split count")
    # ... no splits and a first dimension that does not divide evenly
    y = torch.ones(SIZE + 1 if odd else SIZE)
    expect_mismatch(lambda: hvd.alltoall(y, name="mm.a2a.even"), "'mm.a2a.even'", f"rank {ODD}",
                    "divide evenly", what="alltoall uneven without splits")
    job_still_works("alltoall")

    # reducescatter shape mismatch
    x = torch.ones(SIZE * 2 + (1 if odd else 0))
    expect_mismatch(lambda: hvd.reducescatter(x, name="mm.rs", op=hvd.Sum), "'mm.rs'", "tensor shapes",
                    *others_and_odd({"normal": (SIZE * 2,), "odd": (SIZE * 2 + 1,)}), what="reducescatter shape")
    job_still_works("reducescatter")


def scenario_mismatch_cached():
    """A name negotiated (and cached) once, then submitted with a different shape on one rank."""
    odd = RANK == ODD
    for step in range(3):
        x = make(RANK, "cached", (4,), torch.float32)
        expected = sum(to_np(make(r, "cached", (4,), torch.float32)) for r in range(SIZE))
        check(hvd.allreduce(x, name="mm.cached", op=hvd.Sum), expected, f"cached allreduce step {step}")
    x = torch.ones(5 if odd else 4)
    expect_mismatch(lambda: hvd.allreduce(x, name="mm.cached", op=hvd.Sum), "'mm.cached'", "tensor shapes",
                    *others_and_odd({"normal": (4,), "odd": (5,)}), what="mismatch after caching")
    # the name works again with agreeing requests
    x = make(RANK, "cached", (4,), torch.float32)
    expected = sum(to_np(make(r, "cached", (4,), torch.float32)) for r in range(SIZE))
    check(hvd.allreduce(x, name="mm.cached", op=hvd.Sum), expected, "cached allreduce after the mismatch")
    job_still_works("cached")


def scenario_duplicate():
    """One rank submits a name again while its first submission is in flight: ValueError at once, there only.

    The first submission is not disturbed: it completes with the others' as
    usual, and nothing changes on the other ranks. The duplicating rank is the
    last one, then rank 0 (the coordinator). A grouped call with one member's
    name in flight queues none of its tensors, so the group can run later.
    """
    x = torch.ones(3)
    for dup_rank in (SIZE - 1, 0):
        name = f"dup.name.{dup_rank}"
        if RANK == dup_rank:
            first = hvd.allreduce_async(x, name=name, op=hvd.Sum)
            error = expect_raises(ValueError, lambda: hvd.allreduce_async(x, name=name), f"'{name}'",
                                  "already in flight", f"rank {dup_rank}",
                                  what=f"duplicate on rank {dup_rank} (the duplicating rank)")
            assert not isinstance(error, hvd.HorovodInternalError), type(error)
            tell_the_others(f"{name} refused")
            check(hvd.synchronize(first), np.full(3, float(SIZE)), "the first submission completes")
        else:
            wait_for(f"{name} refused")  # the duplicating rank's first submission stays in flight until then
            check(hvd.allreduce(x, name=name, op=hvd.Sum), np.full(3, float(SIZE)), "the others are not disturbed")
        job_still_works(f"duplicate on rank {dup_rank}")
        # the name is free again: used twice in a row (the second time from the cache), it works
        for _ in range(2):
            check(hvd.allreduce(torch.ones(3), name=name, op=hvd.Sum), np.full(3, float(SIZE)), "name reused")
    # a grouped call with one member's name in flight is refused whole: none of its tensors is queued
    group = "dup.group"
    if RANK == SIZE - 1:
        first = hvd.allreduce_async(x, name=f"{group}.1", op=hvd.Sum)
        expect_raises(ValueError, lambda: hvd.grouped_allreduce_async([x, x, x], name=group, op=hvd.Sum),
                      f"'{group}.1'", "already in flight", what="a grouped call with a member's name in flight")
        tell_the_others(f"{group} refused")
        check(hvd.synchronize(first), np.full(3, float(SIZE)), "the member's name submitted first completes")
    else:
        wait_for(f"{group} refused")  # so that the last rank's first submission is in flight at its grouped call
        check(hvd.allreduce(x, name=f"{group}.1", op=hvd.Sum), np.full(3, float(SIZE)), "the others' member name")
    for i, out in enumerate(hvd.grouped_allreduce([x, x, x], name=group, op=hvd.Sum)):
        check(out, np.full(3, float(SIZE)), f"the grouped call after the refused one [{i}]")


# ----------------------------------------------------------- init / shutdown
def _op_calls():
    t = torch.ones(2)
    return {
        "rank()": hvd.rank, "size()": hvd.size, "local_rank()": hvd.local_rank,
        "allreduce": lambda: hvd.allreduce(t), "allreduce_async": lambda: hvd.allreduce_async(t),
        "allgather": lambda: hvd.allgather(t), "broadcast": lambda: hvd.broadcast(t, 0),
        "alltoall": lambda: hvd.alltoall(t), "reducescatter": lambda: hvd.reducescatter(t),
        "barrier": hvd.barrier, "add_process_set()": lambda: hvd.add_process_set([0]),
        "broadcast_object": lambda: hvd.broadcast_object({"a": 1}),
    }


def _expect_not_initialized(when: str):
    assert not hvd.is_initialized(), f"is_initialized() is True {when}"
    for label, call in _op_calls().items():
        exc = expect_raises(hvd.NotInitializedError, call, "hvd.init()", what=f"{label} {when}")
        assert isinstance(exc, ValueError), f"{label}: NotInitializedError is not a ValueError"
        assert "not been initialized" in str(exc), f"{label}: unclear message {exc}"


def scenario_before_init():
    _expect_not_initialized("before init()")
    exc = expect_raises(hvd.NotInitializedError, lambda: hvd.allreduce(torch.ones(2)), "allreduce",
                        what="message names the op")
    print(f"before-init message: {exc}", flush=True)


def scenario_reinit():
    global RANK, SIZE
    for round_ in range(3):
        hvd.init()
        assert hvd.is_initialized()
        hvd.init()  # a second call while initialized does nothing
        RANK, SIZE = hvd.rank(), hvd.size()
        assert SIZE == int(os.environ.get("ROUNDEL_SIZE", "1")), f"size {SIZE} after init #{round_}"
        for step in range(2):  # the second step goes through the response cache
            x = make(RANK, f"reinit{round_}", (6,), torch.float32)
            expected = sum(to_np(make(r, f"reinit{round_}", (6,), torch.float32)) for r in range(SIZE))
            check(hvd.allreduce(x, name="reinit.ar", op=hvd.Sum), expected, f"allreduce after init #{round_}")
        gathered = hvd.allgather(torch.full((RANK + 1,), RANK), name="reinit.ag")
        check(gathered, np.concatenate([np.full(r + 1, r) for r in range(SIZE)]), "allgather after re-init")
        start = time.monotonic()
        hvd.shutdown()
        took = time.monotonic() - start
        assert took < 4, f"shutdown #{round_} took {took:.1f} s (waiting for the other ranks' goodbyes?)"
        hvd.shutdown()  # harmless when already shut down
        _expect_not_initialized(f"after shutdown #{round_}")


def scenario_bad_settings():
    """``argv[2:]`` are VAR=VALUE (set here) or VAR (already in the environment); each alone must stop
    init() with an error naming VAR; with them gone, init() works."""
    pairs = [a.split("=", 1) if "=" in a else (a, os.environ[a]) for a in sys.argv[2:]]
    assert pairs, "bad_settings needs VAR=VALUE or VAR arguments"
    for var, _ in pairs:
        os.environ.pop(var, None)
    for var, value in pairs:
        os.environ[var] = value
        exc = expect_raises(SettingsError, hvd.init, var, repr(value), what=f"init with {var}={value!r}")
        assert isinstance(exc, ValueError)
        assert not hvd.is_initialized(), f"init with {var}={value!r} left roundel initialized"
        print(f"bad setting {var}: {exc}", flush=True)
        del os.environ[var]
    hvd.init()  # with the settings fixed, the job starts
    check(hvd.allreduce(torch.ones(2), name="settings.ok", op=hvd.Sum), np.full(2, float(hvd.size())),
          "allreduce once the settings are fixed")
    hvd.shutdown()


# ------------------------------------------------------------ peer failures
def _survive_sigterm():
    """roundelrun stops the other ranks once one dies; this rank must first finish its checks."""
    signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM from roundelrun", file=sys.stderr, flush=True))


def _expect_internal(fn, what, *needles):
    start = time.monotonic()
    exc = expect_raises(hvd.HorovodInternalError, fn, *needles, what=what)
    waited = time.monotonic() - start
    print(f"{what}: HorovodInternalError after {waited:.2f} s: {exc}", flush=True)
    return waited


def scenario_killed():
    """Rank 1 SIGKILLs itself 0.5 s after the others block in an allreduce it never submits."""
    check(hvd.allreduce(torch.ones(2), name="killed.warmup", op=hvd.Sum), np.full(2, float(SIZE)), "warm-up")
    if RANK == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    _survive_sigterm()
    waited = _expect_internal(lambda: hvd.allreduce(torch.ones(1000), name="killed.ar"),
                              "allreduce while rank 1 dies", "rank 1")
    print(f"MEASURED {waited:.3f}", flush=True)
    # later collectives fail at once too
    waited = _expect_internal(lambda: hvd.allreduce(torch.ones(3), name="killed.after"),
                              "allreduce after rank 1 died", "rank")
    assert waited < 5, f"a collective after the death took {waited:.1f} s to fail"


def scenario_killed_in_transfer():
    """Rank 1 SIGKILLs itself while large allreduces are moving data."""
    check(hvd.allreduce(torch.ones(2), name="killed.warmup", op=hvd.Sum), np.full(2, float(SIZE)), "warm-up")
    big = torch.ones(4 * 1024 * 1024)
    if RANK == 1:
        import threading
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    else:
        _survive_sigterm()
    start = time.monotonic()
    try:
        for step in range(100000):
            hvd.allreduce(big, name=f"transfer.{step % 4}", op=hvd.Sum)
            if time.monotonic() - start > 60:
                raise AssertionError("rank 1 never died?")
    except hvd.HorovodInternalError as exc:
        waited = time.monotonic() - start
        print(f"MEASURED {waited:.3f}", flush=True)
        print(f"transfer: HorovodInternalError after {waited:.2f} s ({step} steps): {exc}", flush=True)
    assert RANK != 1
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(3), name="after.transfer"),
                  what="allreduce after the transfer failure")


def scenario_early_exit():
    """Rank 1 finishes (exit 0) while the others still run collectives; they error, nobody hangs."""
    check(hvd.allreduce(torch.ones(2), name="early.warmup", op=hvd.Sum), np.full(2, float(SIZE)), "warm-up")
    pair = hvd.add_process_set([r for r in range(SIZE) if r != 1]) if SIZE > 2 else None
    if RANK == 1:
        time.sleep(0.5)
        return  # the script ends (exit 0, atexit shuts roundel down); the others carry on without it
    # rank 0 is already waiting when rank 1 leaves; the other ranks submit after it left
    if RANK != 0:
        time.sleep(1.5)
    waited = _expect_internal(lambda: hvd.allreduce(torch.ones(4), name="early.ar"),
                              "allreduce after rank 1 left", "rank", "1", "shut down")
    assert waited < 10, f"took {waited:.1f} s"
    waited = _expect_internal(lambda: hvd.allgather(torch.ones(1), name="early.ag"),
                              "allgather after rank 1 left", "rank(s) 1")
    assert waited < 5, f"took {waited:.1f} s"
    if pair is not None:  # a process set without rank 1 keeps working
        got = hvd.allreduce(torch.full((3,), float(RANK)), name="early.pair", op=hvd.Sum, process_set=pair)
        check(got, np.full(3, float(sum(pair.ranks))), "allreduce on a set without the departed rank")


# --------------------------------------------------------------------- stall
def scenario_stall():
    """Rank 1 submits 'stall.late' ~3 s after the others (HOROVOD_STALL_CHECK_TIME_SECONDS=1)."""
    if RANK == 1:
        time.sleep(3)
    x = make(RANK, "stall", (5,), torch.float32)
    expected = sum(to_np(make(r, "stall", (5,), torch.float32)) for r in range(SIZE))
    check(hvd.allreduce(x, name="stall.late", op=hvd.Sum), expected, "the stalled allreduce completes")
    job_still_works("stall")


def scenario_stall_shutdown():
    """HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=2: a name rank 1 skips fails on the waiting ranks; the job goes on."""
    start = time.monotonic()
    if RANK != 1:
        waited = _expect_internal(lambda: hvd.allreduce(torch.ones(3), name="stall.dead"),
                                  "stalled allreduce", "'stall.dead' stalled", "rank(s) 1", "stall shutdown")
        assert 1.5 < waited < 10, f"stall shutdown after {waited:.1f} s (configured: 2 s)"
    time.sleep(max(0.0, 3.5 - (time.monotonic() - start)))  # rank 1 is busy elsewhere for 3.5 s
    job_still_works("stall shutdown")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in dict(globals()).items() if name.startswith("scenario_")}

if __name__ == "__main__":
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid> shows where a rank hangs
    names = sys.argv[1].split(",")
    if not NO_INIT.intersection(names):
        hvd.init()
        RANK, SIZE = hvd.rank(), hvd.size()
        ODD = SIZE - 1
    run_scenarios(SCENARIOS, sys.argv[:2], int(os.environ.get("ROUNDEL_RANK", "0")))
