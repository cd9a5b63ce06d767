"""How often the engine's liveness work runs on every rank, how a silent peer is described, and the
rendezvous store's record of lost ranks (``LostRankRecords``).

Both sides of the engine use these: the coordinator on rank 0 and the rank
link on the others (see :mod:`roundel.common.engine.core`).
"""

from __future__ import annotations

import json
import logging
import threading

log = logging.getLogger("roundel")

TICK_S = 0.25  # liveness checks (heartbeats, lost ranks, deadlocks) run this often, on every rank
HEARTBEAT_S = 1.0  # every rank and the coordinator send each other a heartbeat this often
BYE_GRACE_S = 5.0  # how long a leaving coordinator waits for the others' goodbyes
_STORE_CALL_S = 2.0  # the longest the engine thread waits for the rendezvous store's lost-rank records


def describe_silence(silent: float, timeout: float) -> str:
    """Why a peer silent for ``silent`` s counts as lost, for error messages."""
    return (f"no heartbeat for {silent:.1f} s (heartbeat timeout {timeout:g} s, "
            "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS); the process is stopped, hung outside Python, "
            "or its host or network is down")


class LostRankRecords:
    """The rendezvous store's record of lost ranks, ``<prefix>lost/<rank>``: written for the launcher
    (which names the lost rank and its host) and read by a rank that lost the one above it. Both calls
    are best effort and never wait long: the store may be gone with the launcher."""

    def __init__(self, rendezvous, key_prefix: str):
        self._rendezvous = rendezvous
        self._key_prefix = key_prefix

    def record(self, rank: int, host: str, reason: str) -> None:
        """Write that ``rank`` on ``host`` was lost, and why."""
        value = json.dumps({"rank": rank, "host": host, "reason": reason}).encode()

        def write():
            try:
                self._rendezvous.set(f"{self._key_prefix}lost/{rank}", value)
            except Exception as exc:
                log.debug("roundel could not record lost rank %d: %s", rank, exc)

        _run_briefly(write)

    def recorded(self, rank: int) -> dict | None:
        """What another rank wrote about ``rank`` (see ``record``), if anything."""
        key = f"{self._key_prefix}lost/{rank}"
        found = []

        def read():
            try:
                if self._rendezvous.check([key]):
                    found.append(json.loads(self._rendezvous.get(key, timeout=_STORE_CALL_S)))
            except Exception as exc:
                log.debug("roundel could not read the record of lost rank %d: %s", rank, exc)

        _run_briefly(read)
        return found[0] if found and isinstance(found[0], dict) and "reason" in found[0] else None


def _run_briefly(store_call) -> None:
    """Run ``store_call`` on a helper thread and wait at most _STORE_CALL_S for it (the engine thread must
    not hang on a store that left with the launcher)."""
    helper = threading.Thread(target=store_call, name="roundel-lost-key", daemon=True)
    helper.start()
    helper.join(_STORE_CALL_S)
