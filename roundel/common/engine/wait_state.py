"""What this rank's user threads are blocked on inside roundel, for deadlock detection.

A thread that waits for a handle (``synchronize``, a blocking collective,
``barrier``, ``join``) enters the tracker until the handle completes. The
engine thread reads a snapshot now and then and tells the coordinator; each
change bumps a sequence number, so the coordinator can confirm that a rank's
waits stayed the same over its grace period.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable


# the kind label of a replay slot's transfer waiting for the other ranks (not a collective a user waits for)
REPLAY_WAIT = "replay slot"


class WaitTracker:
    """The collectives this rank's threads wait for, with a change counter."""

    def __init__(self, on_enter: Callable[[], None] | None = None):
        """``on_enter`` is called each time a thread starts waiting."""
        self._lock = threading.Lock()
        self._on_enter = on_enter
        self._tokens = itertools.count()
        self._waiting: dict[int, tuple] = {}
        self._seq = 0

    def enter(self, what: tuple, notify: bool = True) -> int:
        """Record a thread waiting for ``what`` (process set id, name, kind label); return a token. ``notify``
        False: without calling ``on_enter`` (roundel's own wait, inside work it is already doing)."""
        with self._lock:
            token = next(self._tokens)
            self._waiting[token] = what
            self._seq += 1
        if notify and self._on_enter is not None:
            self._on_enter()
        return token

    def busy(self) -> bool:
        """Whether some thread waits now."""
        return bool(self._waiting)

    def leave(self, token: int) -> None:
        """The wait recorded under ``token`` has ended."""
        with self._lock:
            self._waiting.pop(token, None)
            self._seq += 1

    def snapshot(self) -> tuple[int, tuple]:
        """(sequence number, the distinct waited collectives) as of now."""
        with self._lock:
            return self._seq, tuple(sorted(set(self._waiting.values())))
