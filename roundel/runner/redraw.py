"""Turning a worker's raw output into what the launcher shows.

Progress bars (Keras' ``fit``, tqdm) redraw one line with carriage returns,
backspaces and ANSI escape codes. On a terminal the launcher passes those
redraws through live, putting the rank prefix back after every carriage
return (:class:`LivePrefixer`). Pipes and files get finished lines only,
each holding the last state of its redrawn line (:class:`LineAssembler`).
"""

from __future__ import annotations

import codecs
import re

__all__ = ["LineAssembler", "LivePrefixer"]

_ESCAPE = r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])"
"""ANSI escape sequences: CSI (colours, cursor moves), OSC (titles, links), and two-character ones."""

_CONTROL = re.compile(rf"(\r\n|\r|\n|\x08|{_ESCAPE}|\x1b)")
_WHOLE_ESCAPE = re.compile(_ESCAPE)
_LONGEST_ESCAPE = 256


def _decoder():
    return codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")


class LineAssembler:
    """Collects raw output and returns the finished lines, as a terminal would have left them.

    A carriage return moves back to the start of the line and a backspace one
    character left; what follows overwrites what was there. Escape codes are
    dropped. Bytes that are not UTF-8 pass through unchanged.
    """

    def __init__(self):
        self._decoder = _decoder()
        self._line: list[str] = []
        self._column = 0
        self._held = ""  # an escape sequence or "\r" cut off at the end of the last chunk

    def feed(self, data: bytes) -> list[bytes]:
        """The lines (each ending in ``\\n``) that ``data`` finished."""
        finished = []
        text = self._held + self._decoder.decode(data)
        text, self._held = _hold_back(text)
        for piece in _CONTROL.split(text):
            if not piece:
                continue
            if piece in ("\n", "\r\n"):
                finished.append(self._take())
            elif piece == "\r":
                self._column = 0
            elif piece == "\b":
                self._column = max(0, self._column - 1)
            elif piece.startswith("\x1b"):
                continue
            else:
                self._write(piece)
        return finished

    def flush(self) -> list[bytes]:
        """The unfinished last line (as a finished one), if any, at the end of the output."""
        tail, self._held = self._held + self._decoder.decode(b"", final=True), ""
        finished = self.feed(tail.encode("utf-8", errors="surrogateescape"))
        self._held = ""
        return finished + ([self._take()] if self._line else [])

    def _write(self, text: str) -> None:
        end = self._column + len(text)
        if end > len(self._line):
            self._line.extend(" " * (end - len(self._line)))
        self._line[self._column:end] = text
        self._column = end

    def _take(self) -> bytes:
        line = "".join(self._line) + "\n"
        self._line, self._column = [], 0
        return line.encode("utf-8", errors="surrogateescape")


def _hold_back(text: str) -> tuple[str, str]:
    """``text`` split before a trailing ``\\r`` (it may start ``\\r\\n``) or an escape sequence
    that the next chunk may complete."""
    if text.endswith("\r"):
        return text[:-1], "\r"
    start = text.rfind("\x1b", max(0, len(text) - _LONGEST_ESCAPE))
    if start >= 0 and not _WHOLE_ESCAPE.match(text, start):
        return text[:start], text[start:]
    return text, ""


class LivePrefixer:
    """Passes raw output through for a terminal, with ``prefix`` at the start of every line
    and again after every carriage return, so that a redrawn line keeps its rank prefix."""

    def __init__(self, prefix: bytes):
        self._prefix = prefix
        self._at_start = True

    def feed(self, data: bytes, prefix: bytes | None = None) -> bytes:
        """``data`` with the prefix (``prefix`` when given, e.g. with a fresh timestamp) inserted."""
        prefix = self._prefix if prefix is None else prefix
        out = bytearray()
        for piece in re.split(rb"(\r\n|\r|\n)", data):
            if not piece:
                continue
            if piece in (b"\n", b"\r\n", b"\r"):
                if self._at_start:
                    if piece == b"\r":
                        continue  # a redraw of an empty line: nothing to put back yet
                    out += prefix  # an empty line keeps its prefix, as in a pipe
                out += piece
                self._at_start = True
                continue
            if self._at_start:
                out += prefix
                self._at_start = False
            out += piece
        return bytes(out)

    def finish(self) -> bytes:
        """A closing newline if the output ended in the middle of a line."""
        if self._at_start:
            return b""
        self._at_start = True
        return b"\n"
