"""Handles: the caller's side of an asynchronous collective."""

from __future__ import annotations

import threading


class Handle:
    """Completes once with a result or an exception; ``wait()`` returns or raises it."""

    __slots__ = ("name", "_event", "_result", "_error")

    def __init__(self, name: str):
        self.name = name
        self._event = threading.Event()
        self._result = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self):
        """Block until finished; return the result or raise the collective's error."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def set_result(self, result) -> None:
        if not self._event.is_set():
            self._result = result
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()
