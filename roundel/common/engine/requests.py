"""What a rank's engine queues besides requests: process set changes, for the coordinator on rank 0.

Every rank queues them (in order with the requests around them); ranks other
than 0 drop them, so they never cross the wire. The records that do travel
between the ranks and the coordinator (``Request``, ``Batch`` and the rest)
are in :mod:`roundel.common.control.records`.
"""

from __future__ import annotations

from typing import NamedTuple


class ProcessSetChange(NamedTuple):
    """A process set added (``ranks``: its members) or removed (``ranks`` None), queued on rank 0's engine
    in order with the requests around it."""

    set_id: int
    ranks: tuple | None = None
