"""Rank 0's deadlock check while a rank owes it the resend of a stale cache bit.

A rank sends a cached name as a bit of its response cache. When rank 0's cache
has moved on since (thousands of names evict each other), rank 0 asks for the
request in full. Until the answer arrives, rank 0 does not hold that rank's
submission, while the rank already reports waiting for the name. On a loaded
machine the answer can take longer than the deadlock check's grace: rank 0 then
took the rank for one that waits on a name it never submitted, and failed the
name everywhere as a deadlock. Rank 0's real engine runs in this process (see
``rank0_harness``); rank 1 is played here over a real control connection.
"""

from __future__ import annotations

import select
import threading
import time

import torch
from rank0_harness import start_rank0

from roundel.common.control import channel as control_channel
from roundel.common.control.messages import Dispatch, Heartbeat, Submit, Waits
from roundel.common.control.records import OpKind, Request

ANSWER_AFTER_S = 2.0  # four times the deadlock check's grace


def _allreduce(name: str) -> Request:
    return Request(name, OpKind.ALLREDUCE, 0, dtype="float32", shape=(4,))


def _next_dispatch(connection, reader, timeout: float) -> Dispatch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([connection], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        data = connection.recv(control_channel.RECV_BYTES)
        assert data, "rank 0 closed the connection"
        for message in reader.feed(data):
            if type(message) is Dispatch:
                return message
    raise AssertionError(f"no Dispatch from rank 0 within {timeout} s")


def test_a_rank_that_owes_a_resend_is_not_taken_for_deadlocked():
    engine, peers = start_rank0(2, coordinator_reduce_bytes=0)
    rank1 = peers[1]
    reader = control_channel.FrameReader(rank1)
    try:
        # a first name, which rank 0's cache takes as bit 0: its cache version moves on
        warm = _allreduce("warm")
        handle = engine.submit(warm, torch.zeros(4), torch.zeros(4))
        rank1.send(Submit(0, 0, [warm], {}, [None]))
        version = _next_dispatch(rank1, reader, 10).version
        handle.wait()
        assert version > 0

        # rank 1 sends "x" as a bit of its cache as it was before that name: stale at rank 0
        outcome: dict = {}
        x = engine.submit(_allreduce("x"), torch.zeros(4), torch.zeros(4))
        waiter = threading.Thread(target=lambda: outcome.update(result=_wait(x)))
        waiter.start()
        rank1.send(Submit(0, 1 << 0, [], {}, []))
        rank1.send(Waits(1, ((0, "x", "allreduce"),)))
        asked = _next_dispatch(rank1, reader, 10)
        assert asked.resend, asked

        # rank 1 stays alive and blocked on "x" and answers late
        answer_at = time.monotonic() + ANSWER_AFTER_S
        while time.monotonic() < answer_at and waiter.is_alive():
            rank1.send(Heartbeat("test"))
            time.sleep(0.1)
        assert waiter.is_alive(), f"rank 0's 'x' ended before rank 1 resent it: {outcome}"
        rank1.send(Submit(version, 0, [_allreduce("x")], {}, [None], resent=True))
        waiter.join(10)
        assert outcome.get("result") == "ok", outcome
    finally:
        rank1.close()
        engine.shutdown()


def _wait(handle) -> str:
    try:
        handle.wait()
    except Exception as exc:  # the outcome is asserted by the test
        return f"{type(exc).__name__}: {exc}"
    return "ok"
