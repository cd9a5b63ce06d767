"""Presents roundel's authenticated rendezvous store to torch.distributed as a ``Store``.

Gloo bootstraps its connections through a c10d store; this adapter lets it use
the launcher's store (which admits only holders of the job's secret) instead
of an open TCPStore.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


class RendezvousStore(dist.Store):
    """A c10d Store backed by a ``RendezvousClient``; keys live under ``prefix``.

    As in c10d, a timeout of zero means no timeout. A wait for a missing key
    raises ``RendezvousTimeout`` when its timeout passes, and any request raises
    ``RendezvousError`` when the store stops answering (see rendezvous.py for
    that bound), so Gloo's bootstrap never waits on a vanished launcher.
    """

    def __init__(self, client, prefix: str, timeout: timedelta):
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._timeout = _seconds(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key, value):
        if isinstance(value, str):
            value = value.encode()
        self._client.set(self._key(key), bytes(value))

    def get(self, key):
        return self._client.get(self._key(key), timeout=self._timeout)

    def add(self, key, amount):
        return self._client.add(self._key(key), int(amount))

    def check(self, keys):
        return self._client.check([self._key(k) for k in keys])

    def wait(self, keys, timeout=None):
        """Wait until every one of ``keys`` is set; ``timeout`` bounds the whole wait, not each key."""
        seconds = self._timeout if timeout is None else _seconds(timeout)
        deadline = None if seconds is None else time.monotonic() + seconds
        for key in keys:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._client.get(self._key(key), timeout=left)

    def delete_key(self, key):
        return self._client.delete(self._key(key))

    def num_keys(self):
        return self._client.num_keys()

    def set_timeout(self, timeout):
        self._timeout = _seconds(timeout)


def _seconds(timeout: timedelta) -> float | None:
    """c10d's timeout in seconds; None for zero (c10d's "no timeout")."""
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None
