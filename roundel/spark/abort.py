"""How the first failed rank of a ``roundel.spark`` job stops the others.

A failed rank (its function raised, or its process died) is counted under
``spark/failures``; the first one also writes its rank under
``spark/abort``. Every task watches that key and stops its own rank's
process when it appears, and the driver reports that rank's error.
"""

from __future__ import annotations

__all__ = ["ABORT_KEY", "first_failure", "record_failure"]

ABORT_KEY = "spark/abort"
_FAILURES_KEY = "spark/failures"


def record_failure(client, rank: int) -> None:
    """Count ``rank``'s failure; the first one recorded names the rank that stops the job."""
    if client.add(_FAILURES_KEY, 1) == 1:
        client.set(ABORT_KEY, str(rank).encode())


def first_failure(server) -> int | None:
    """The rank whose failure stopped the job, or None (driver side, on the store's server)."""
    raw = server.get(ABORT_KEY)
    return int(raw) if raw is not None else None
