"""Handles: the caller's side of an asynchronous collective."""

from __future__ import annotations

import threading
from typing import Callable


class Handle:
    """Completes once with a result or an exception; ``wait()`` returns or raises it.

    A CUDA collective's handle completes once its batch is queued on the GPU: its ``then`` (see
    ``set_result``) orders the waiting thread's stream after the batch, and raises if the job broke
    before the GPU finished it.

    ``waits`` (a ``WaitTracker``) learns while a thread is blocked in ``wait()``
    on this handle's collective ``what`` (process set id, name, kind label);
    ``on_done`` is called once when the handle completes, with its error (None on success).
    """

    __slots__ = ("name", "_latch", "_done", "_result", "_error", "_then", "_waits", "_what", "_on_done", "_lock",
                 "_finished")

    def __init__(self, name: str, waits=None, what: tuple = (), on_done=None):
        self.name = name
        # held until the handle completes: a waiter takes and returns it (a step makes thousands of
        # handles, and a lock costs a fraction of an Event)
        self._latch = threading.Lock()
        self._latch.acquire()
        self._done = False
        self._result = None
        self._error: BaseException | None = None
        self._then: Callable[[object], None] | None = None
        self._waits = waits
        self._what = what
        self._on_done = on_done
        self._lock = threading.Lock()
        self._finished = False

    def done(self) -> bool:
        """True once the collective has finished, successfully or not (on a GPU: once it is queued there)."""
        return self._done

    def wait(self):
        """Block until finished; return the result or raise the collective's error."""
        if not self._done:
            token = None if self._waits is None else self._waits.enter(self._what)
            try:
                with self._latch:
                    pass
            finally:
                if token is not None:
                    self._waits.leave(token)
        if self._error is not None:
            raise self._error
        if self._then is not None:
            self._then(self._result)
        return self._result

    def set_result(self, result, then: Callable[[object], None] | None = None) -> None:
        """Complete with ``result``; ``then(result)``, where given, runs in every ``wait()`` that returns it (for
        a result still being computed on a GPU: the waiting thread's stream is ordered after it)."""
        self._complete(result, None, then)

    def set_error(self, error: BaseException) -> None:
        self._complete(None, error)

    def _complete(self, result, error, then=None) -> None:
        with self._lock:  # the executor and the engine thread may both try (an abort racing a result)
            if self._finished:
                return
            self._finished = True
            self._result, self._error, self._then = result, error, then
        if self._on_done is not None:  # before waking the waiter, who may reuse the name at once
            self._on_done(error)
        self._done = True
        self._latch.release()
