"""Which rank failed first: each uncaught exception is numbered in roundelrun's store.

When one rank fails the others fail soon after (they lose it), and the
exits reach the launcher in any order. A rank's uncaught exception is
reported (``sys.excepthook``) before the interpreter shuts roundel down,
which is what the other ranks notice; so the hook installed here takes the
next number of the store's counter ``launch/failures`` and writes
``launch/failed/<rank>`` (JSON: order, error) first, and the launcher blames
the lowest number. Only for ranks roundelrun started (``ROUNDEL_RANK`` set);
a rank that dies without a Python exception (a signal, ``os._exit``) writes
nothing, and the launcher then names the first exit it saw.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Callable

COUNTER = "launch/failures"
WRITE_TIMEOUT_S = 2.0


def failed_key(rank: int) -> str:
    """The store key of launched rank ``rank``'s failure record."""
    return f"launch/failed/{rank}"


def install(client_of: Callable[[], object]) -> None:
    """Record this rank's uncaught exception through the store client ``client_of()`` returns (None: not
    initialized, nothing recorded), then hand it to the previous hook. Does nothing outside roundelrun."""
    rank = os.environ.get("ROUNDEL_RANK")
    if rank is None or not rank.isdigit():
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        client = client_of()
        if client is not None and not issubclass(kind, KeyboardInterrupt):
            _record(client, int(rank), f"{kind.__name__}: {exc}")
        previous(kind, exc, tb)

    sys.excepthook = hook


def _record(client, rank: int, error: str) -> None:
    """Number and write the failure, waiting at most WRITE_TIMEOUT_S (the store may be gone)."""
    def write():
        try:
            order = client.add(COUNTER, 1)
            client.set(failed_key(rank), json.dumps({"order": order, "error": error[:500]}).encode())
        except Exception:  # best effort: the launcher then names the first exit it saw
            pass

    writer = threading.Thread(target=write, name="roundel-failure-record", daemon=True)
    writer.start()
    writer.join(WRITE_TIMEOUT_S)
