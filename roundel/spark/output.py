"""A rank's output, carried from its Spark task to the driver through the job's store.

Spark keeps an executor's output in that executor's log; ``roundel.spark``
shows the ranks' output where the job was started instead, as ``roundelrun``
does. The task reads its child's stdout and stderr and puts each batch of
finished lines under ``spark/out/<label>/<n>`` (``n`` counting from 0 per
label); the driver prints them in order, each line prefixed
``[<label>]<stdout>:`` or ``[<label>]<stderr>:``, and drops them from the store.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import BinaryIO, Callable, Iterable, TextIO

__all__ = ["Printer", "Sender"]

_STREAMS = {b"o": "stdout", b"e": "stderr"}
_READ_SIZE = 65536
_POLL_S = 0.1


def _key(label: str, n: int) -> str:
    return f"spark/out/{label}/{n}"


class Sender:
    """Task side: relays a child's pipes to the store under ``label``, keeping the last lines of its
    stderr in ``stderr_tail`` when given."""

    def __init__(self, client, label: str, stderr_tail: collections.deque | None = None):
        self._client = client
        self._tail = stderr_tail
        self._label = label
        self._next = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def relay(self, pipe: BinaryIO, stream: str) -> None:
        """Start relaying ``pipe`` (the child's ``"stdout"`` or ``"stderr"``) until it closes."""
        tag = b"o" if stream == "stdout" else b"e"
        thread = threading.Thread(target=self._copy, args=(pipe, tag), name=f"roundel-spark-{stream}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the pipes to be relayed completely."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _send(self, tag: bytes, data: bytes) -> None:
        if tag == b"e" and self._tail is not None:
            self._tail.extend(data.splitlines(keepends=True))
        with self._lock:
            n, self._next = self._next, self._next + 1
            try:
                self._client.set(_key(self._label, n), tag + data)
            except Exception:  # noqa: BLE001 - the driver is gone: keep draining so the child never blocks
                pass

    def _copy(self, pipe: BinaryIO, tag: bytes) -> None:
        pending = b""
        with pipe:
            while True:
                try:
                    data = pipe.read1(_READ_SIZE)
                except (OSError, ValueError):
                    data = b""
                if not data:
                    break
                pending += data
                cut = pending.rfind(b"\n") + 1
                if cut:
                    self._send(tag, pending[:cut])
                    pending = pending[cut:]
        if pending:
            self._send(tag, pending + b"\n")


class Printer:
    """Driver side: prints what the tasks sent, per label in order, until stopped; ``shown`` maps a
    label to the prefix's name (default the label itself)."""

    def __init__(self, server, labels: Callable[[], Iterable[str]], stdout: TextIO, stderr: TextIO,
                 timestamps: bool = False, shown: Callable[[str], str] = str):
        self._server = server
        self._labels = labels
        self._shown = shown
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._timestamps = timestamps
        self._next: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="roundel-spark-output", daemon=True)

    def start(self) -> "Printer":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Print what has arrived and stop."""
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        for label in list(self._labels()):
            while True:
                n = self._next.get(label, 0)
                value = self._server.pop(_key(label, n))
                if value is None:
                    break
                self._next[label] = n + 1
                self._print(label, _STREAMS.get(value[:1], "stderr"), value[1:])

    def _print(self, label: str, stream: str, data: bytes) -> None:
        stamp = time.asctime() if self._timestamps else ""
        name = self._shown(label)
        text = "".join(f"{stamp}[{name}]<{stream}>:{line}\n"
                       for line in data.decode(errors="replace").rstrip("\n").split("\n"))
        out = self._streams[stream]
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass  # our own output is gone; keep draining the store
