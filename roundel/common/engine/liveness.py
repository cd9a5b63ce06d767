"""How often the engine's liveness work runs on every rank, and how a silent peer is described.

Both sides of the engine use these: the coordinator on rank 0 and the rank
link on the others (see :mod:`roundel.common.engine.core`).
"""

TICK_S = 0.25  # liveness checks (heartbeats, lost ranks, deadlocks) run this often, on every rank
HEARTBEAT_S = 1.0  # every rank and the coordinator send each other a heartbeat this often
BYE_GRACE_S = 5.0  # how long a leaving coordinator waits for the others' goodbyes


def describe_silence(silent: float, timeout: float) -> str:
    """Why a peer silent for ``silent`` s counts as lost, for error messages."""
    return (f"no heartbeat for {silent:.1f} s (heartbeat timeout {timeout:g} s, "
            "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS); the process is stopped, hung outside Python, "
            "or its host or network is down")
