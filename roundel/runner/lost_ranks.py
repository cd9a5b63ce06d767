"""What the workers recorded about ranks they declared lost (stopped, hung, or cut off), and which
rank's uncaught exception came first (:mod:`roundel.common.failures`).

A rank whose peers stop hearing its heartbeats is declared lost by the rank
that noticed; that rank writes ``<prefix>lost/<rank>`` to the rendezvous
store (JSON: rank, host, reason). The launcher reads these keys when the job
fails, to name the lost rank rather than the survivor that exited first.
"""

from __future__ import annotations

import json

from roundel.common import failures

EXIT_GRACE_S = 1.0
"""How long a worker reported lost may take to exit by itself before the launcher kills it: a rank that
fails closes its connections before it has exited (a relay then reports it lost at once), and its own exit
status is the one to report."""


def lost_ranks(server, ranks, prefix: str = "init0/") -> list[dict]:
    """The records under ``<prefix>lost/<rank>`` for each of ``ranks`` that has one, by rank."""
    records = []
    for rank in ranks:
        raw = server.get(f"{prefix}lost/{rank}")
        if raw is None:
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def describe_lost(record: dict) -> str:
    """'rank 1 (host node2) was lost: <reason>' for one record."""
    return f"rank {record.get('rank')} (host {record.get('host')}) was lost: {record.get('reason')}"


def failure_records(server, ranks) -> dict[int, tuple[int, str, bool]]:
    """rank -> (order, "<Type>: <message>", internal) of each of ``ranks`` that recorded its uncaught exception;
    ``internal``: a RoundelInternalError, which a rank raises when another left the job under it."""
    found = {}
    for rank in ranks:
        raw = server.get(failures.failed_key(rank))
        try:
            record = json.loads(raw) if raw is not None else None
            found[rank] = (int(record["order"]), str(record["error"]), bool(record.get("internal", False)))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return found
