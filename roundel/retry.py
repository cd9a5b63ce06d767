"""Pauses between tries: doubling from a first pause up to a cap, within a deadline if there is one.

The one backoff of roundel's retry loops (a rank joining the coordinator, a
rendezvous client connecting, a server's accept loop after a failed accept).
Standard library only: it stands on the ground floor, below every package.
"""

from __future__ import annotations

import random
import time

__all__ = ["Backoff"]


class Backoff:
    """Pauses of ``first`` seconds, doubling after each up to ``cap``.

    With ``deadline`` (a ``time.monotonic()`` value) :meth:`pause` gives up,
    without sleeping, when the next pause would reach it. With ``jitter``
    each pause is spread uniformly over ``1 ± jitter`` of its length (so that
    many waiters do not come back at once); the deadline check uses the
    unspread length.
    """

    def __init__(self, first: float, cap: float, deadline: float | None = None, jitter: float = 0.0):
        if not 0 < first <= cap:
            raise ValueError(f"Backoff(first={first!r}, cap={cap!r}): need 0 < first <= cap")
        if not 0 <= jitter < 1:
            raise ValueError(f"Backoff(jitter={jitter!r}): need 0 <= jitter < 1")
        self._first = first
        self._cap = cap
        self._deadline = deadline
        self._jitter = jitter
        self._next = first

    def pause(self) -> bool:
        """Sleep the next pause and double the one after (up to the cap); return True. Return False
        without sleeping when the pause would reach the deadline: time to give up."""
        delay = self._next
        if self._deadline is not None and time.monotonic() + delay >= self._deadline:
            return False
        time.sleep(delay * random.uniform(1 - self._jitter, 1 + self._jitter) if self._jitter else delay)
        self._next = min(delay * 2, self._cap)
        return True

    def reset(self) -> None:
        """Start again from the first pause (after a success)."""
        self._next = self._first
