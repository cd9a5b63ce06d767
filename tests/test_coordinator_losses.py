"""Rank 0's coordinator when several ranks vanish at once: every survivor is told once.

Rank 0's real engine (listener, authenticated channel, codec, coordinator)
runs in this process with a transport that moves no data; the other ranks are
real control connections opened here. When many ranks of a large job go at
once (a host lost, or the launcher ending the job), rank 0 used to send every
survivor one Abort per rank lost: N^2 messages at N ranks.
"""

from __future__ import annotations

import selectors
import time

from rank0_harness import start_rank0

from roundel.common.control import channel as control_channel
from roundel.common.control.messages import Abort

SIZE = 6


def _aborts_heard(connections: dict, seconds: float) -> dict:
    """Abort messages each connection receives within ``seconds``."""
    readers = {rank: control_channel.FrameReader(c) for rank, c in connections.items()}
    counts = {rank: 0 for rank in connections}
    selector = selectors.DefaultSelector()
    for rank, connection in connections.items():
        selector.register(connection, selectors.EVENT_READ, rank)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key, _ in selector.select(0.1):
            data = key.fileobj.recv(control_channel.RECV_BYTES)
            if not data:
                selector.unregister(key.fileobj)
                continue
            counts[key.data] += sum(type(m) is Abort for m in readers[key.data].feed(data))
    selector.close()
    return counts


def test_survivors_hear_one_abort_when_several_ranks_vanish_at_once():
    engine, peers = start_rank0(SIZE)
    try:
        for rank in (1, 2, 3):  # gone without a goodbye, at once
            peers.pop(rank).close()
        counts = _aborts_heard(peers, 2.0)
        assert counts == {4: 1, 5: 1}, counts
        assert any(f"rank {r} died" in str(engine.broken) for r in (1, 2, 3)), engine.broken
    finally:
        for connection in peers.values():
            connection.close()
        engine.shutdown()
