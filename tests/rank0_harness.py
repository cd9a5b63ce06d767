"""Rank 0's real engine in this test's process, with the other ranks played by the test.

The engine runs its listener, authenticated channel, codec and coordinator as
in a job; its transport moves no data, so only the control plane is under
test. Each other rank is a real control connection opened here, which sends
and reads the protocol's messages as the test chooses.
"""

from __future__ import annotations

import dataclasses
import os
import threading

from roundel.common.control import channel as control_channel
from roundel.common.control.messages import Heartbeat
from roundel.common.engine.core import Engine
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.common.settings import Settings
from roundel.transport.backend import Backend


class Store:
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


class NoData(Backend):
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


def start_rank0(size: int, **settings) -> tuple[Engine, dict]:
    """Rank 0's engine for a job of ``size`` ranks (``settings`` replace the defaults) and a connection
    for each other rank, every one of which has said hello."""
    secret, store = os.urandom(32), Store()
    chosen = dataclasses.replace(Settings.from_env({}), start_timeout_s=60.0, heartbeat_timeout_s=60.0)
    chosen = dataclasses.replace(chosen, **settings)
    started: dict = {}
    starter = threading.Thread(target=lambda: started.update(engine=Engine(
        0, size, chosen, secret, store, "", "127.0.0.1", ProcessSetRegistry(tuple(range(size)), NoData(0, size)))))
    starter.start()
    host, port = store.get("coordinator").decode().rsplit(":", 1)
    peers = {rank: control_channel.connect(host, int(port), secret, rank, 60.0, send_timeout_s=60.0)
             for rank in range(1, size)}
    for connection in peers.values():
        connection.send(Heartbeat("test"))
    starter.join(60)
    return started["engine"], peers
