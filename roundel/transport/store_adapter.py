"""Presents roundel's authenticated rendezvous store to torch.distributed as a ``Store``.

Gloo bootstraps its connections through a c10d store; this adapter lets it use
the launcher's store (which admits only holders of the job's secret) instead
of an open TCPStore.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class RendezvousStore(dist.Store):
    """A c10d Store backed by a ``RendezvousClient``; keys live under ``prefix``."""

    def __init__(self, client, prefix: str, timeout: timedelta):
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._timeout = timeout.total_seconds()

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
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        for key in keys:
            self._client.get(self._key(key), timeout=seconds)

    def delete_key(self, key):
        return self._client.delete(self._key(key))

    def num_keys(self):
        return self._client.num_keys()

    def set_timeout(self, timeout):
        self._timeout = timeout.total_seconds()
