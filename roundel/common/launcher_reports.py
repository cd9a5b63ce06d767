"""End-of-job reports a rank hands to roundelrun, which prints them once every rank's output is out.

Rank 0 makes its straggler table when it shuts down, while the ranks may
still print their last lines; written to rank 0's stderr, the table would
come before them in a log. Under roundelrun (whose store holds
``launch/prints-reports``) rank 0 writes it to the store as
``launch/report/<n>`` instead, and the launcher prints each one after it has
relayed every rank's output. Anywhere else (another launcher, an elastic job,
no launcher) the rank prints it itself.
"""

from __future__ import annotations

PRINTS_REPORTS = "launch/prints-reports"
_COUNTER = "launch/reports"


def _key(number: int) -> str:
    return f"launch/report/{number}"


def hand_over(client, lines: list[str]) -> bool:
    """Give ``lines`` to the launcher through the store ``client``; False when this launcher does not print
    reports, or the store cannot take it (the caller prints them then)."""
    try:
        if client is None or not client.check([PRINTS_REPORTS]):
            return False
        client.set(_key(client.add(_COUNTER, 1)), "\n".join(lines).encode())
        return True
    except Exception:  # noqa: BLE001 - the report then goes to this rank's stderr
        return False


def take_all(server) -> list[str]:
    """Every report handed over to the store ``server`` serves, in order, as lines."""
    lines: list[str] = []
    number = 1
    while (text := server.get(_key(number))) is not None:
        lines += bytes(text).decode(errors="replace").splitlines()
        number += 1
    return lines
