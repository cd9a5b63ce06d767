"""Which rank failed first: each uncaught exception is numbered in roundelrun's store.

When one rank fails the others fail soon after (they lose it), and the
exits reach the launcher in any order. A rank's uncaught exception is
reported (``sys.excepthook``) before the interpreter shuts roundel down,
which is what the other ranks notice; so the hook installed here takes the
next number of the store's counter ``launch/failures`` and writes
``launch/failed/<rank>`` (JSON: order, error) first, and the launcher blames
the lowest number. Only for ranks roundelrun started (``ROUNDEL_RANK`` set);
before ``init()`` (or after ``shutdown()``) the record goes through a client of
its own to the store the environment names. ``internal`` says the exception was
a ``RoundelInternalError``: the rank may have failed only because another left.
A rank that ends without an uncaught exception (``SystemExit``, ``os._exit``, a
signal) writes nothing: the launcher then blames it by its exit status before a
rank that only failed because it lost it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Callable

from roundel.errors import RoundelInternalError
from roundel.rendezvous.store import RendezvousClient

COUNTER = "launch/failures"
WRITE_TIMEOUT_S = 2.0
_installed = False


def failed_key(rank: int) -> str:
    """The store key of launched rank ``rank``'s failure record."""
    return f"launch/failed/{rank}"


def install(client_of: Callable[[], object]) -> None:
    """Record this rank's uncaught exception through the store client ``client_of()`` returns (None: not
    initialized, a client of its own), then hand it to the previous hook. Does nothing outside roundelrun,
    nor once installed."""
    global _installed
    rank = os.environ.get("ROUNDEL_RANK")
    if _installed or rank is None or not rank.isdigit():
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if not issubclass(kind, KeyboardInterrupt):
            _record(client_of(), int(rank), f"{kind.__name__}: {exc}", issubclass(kind, RoundelInternalError))
        previous(kind, exc, tb)

    sys.excepthook = hook


def _env_client():
    """A client of the store roundelrun's variables name (None without them); the caller closes it."""
    try:
        return RendezvousClient(os.environ["ROUNDEL_RENDEZVOUS_ADDR"], int(os.environ["ROUNDEL_RENDEZVOUS_PORT"]),
                                bytes.fromhex(os.environ["ROUNDEL_SECRET"]), connect_timeout=WRITE_TIMEOUT_S)
    except (KeyError, ValueError):
        return None


def _record(client, rank: int, error: str, internal: bool) -> None:
    """Number and write the failure through ``client`` (None: one of its own), waiting at most WRITE_TIMEOUT_S
    (the store may be gone)."""
    def write():
        own = None
        try:
            target = client if client is not None else (own := _env_client())
            if target is None:
                return
            order = target.add(COUNTER, 1)
            target.set(failed_key(rank), json.dumps({"order": order, "error": error[:500],
                                                     "internal": internal}).encode())
        except Exception:  # best effort: the launcher then names the first exit it saw
            pass
        finally:
            if own is not None:
                own.close()

    writer = threading.Thread(target=write, name="roundel-failure-record", daemon=True)
    writer.start()
    writer.join(WRITE_TIMEOUT_S)
