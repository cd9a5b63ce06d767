"""Rank 0's coordinator when several ranks vanish at once: every survivor is told once.

Rank 0's real engine (listener, authenticated channel, codec, coordinator)
runs in this process with a transport that moves no data; the other ranks are
real control connections opened here. When many ranks of a large job go at
once (a host lost, or the launcher ending the job), rank 0 used to send every
survivor one Abort per rank lost: N^2 messages at N ranks.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import threading
import time

from roundel.common.control import channel as control_channel
from roundel.common.control.messages import Abort, Heartbeat
from roundel.common.engine.core import Engine
from roundel.common.settings import Settings
from roundel.transport.backend import Backend

SIZE = 6


class _Store:
    """The engine's view of the rendezvous store, in this process."""

    def __init__(self):
        self._values: dict = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout: float = 60.0) -> bytes:
        with self._changed:
            assert self._changed.wait_for(lambda: key in self._values, timeout), key
            return self._values[key]

    def check(self, keys) -> bool:
        return all(key in self._values for key in keys)


class _NoData(Backend):
    """A transport that completes every collective at once: only the control plane is under test."""

    name = "none"

    def allreduce(self, tensor, op):
        pass

    def allgather(self, output, tensor):
        pass

    def broadcast(self, tensor, root):
        pass

    def alltoall(self, output, tensor, output_splits, input_splits):
        pass

    def reducescatter(self, output, tensor, op):
        pass

    def barrier(self):
        pass

    def close(self):
        pass


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
    secret, store = os.urandom(32), _Store()
    settings = dataclasses.replace(Settings.from_env({}), start_timeout_s=60.0, heartbeat_timeout_s=60.0)
    started: dict = {}
    starter = threading.Thread(target=lambda: started.update(engine=Engine(
        0, SIZE, settings, secret, store, "", "127.0.0.1", {0: (tuple(range(SIZE)), _NoData(0, SIZE))})))
    starter.start()
    host, port = store.get("coordinator").decode().rsplit(":", 1)
    peers = {rank: control_channel.connect(host, int(port), secret, rank, 60.0, send_timeout_s=60.0)
             for rank in range(1, SIZE)}
    for connection in peers.values():
        connection.send(Heartbeat("test"))
    starter.join(60)
    engine = started["engine"]
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
