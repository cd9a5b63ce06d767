"""One clear line, not a traceback through roundel's internals, for roundel's own errors.

When a script dies of an uncaught roundel error (an operation before
``init()``, a bad setting, a failed peer), each rank prints
``roundel: <ErrorType>: <message>`` and the line of the script that called
roundel. Every other exception keeps its full traceback, and so do roundel's
own with ``HOROVOD_LOG_LEVEL=debug`` (or ``trace``), which ``roundelrun
--verbose`` sets.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

__all__ = ["install_short_tracebacks", "short_report"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent)  # the roundel package
_VERBOSE_LEVELS = ("debug", "trace")


def _verbose() -> bool:
    for name in ("ROUNDEL_LOG_LEVEL", "HOROVOD_LOG_LEVEL"):
        value = os.environ.get(name)
        if value:
            return value.strip().lower() in _VERBOSE_LEVELS
    return False


def _inside_roundel(filename: str) -> bool:
    try:
        return str(Path(filename).resolve()).startswith(_PACKAGE_DIR + os.sep)
    except OSError:
        return False


def _caller(tb) -> traceback.FrameSummary | None:
    """The last frame outside roundel before the traceback enters roundel."""
    caller = None
    for frame in traceback.extract_tb(tb):
        if _inside_roundel(frame.filename):
            return caller
        caller = frame
    return caller


def short_report(exc: BaseException) -> str:
    """``roundel: <ErrorType>: <message> (at FILE, line N, in FUNC)``, and how to see the whole traceback."""
    where = _caller(exc.__traceback__)
    at = f" (at {where.filename}, line {where.lineno}, in {where.name})" if where is not None else ""
    return (f"roundel: {type(exc).__name__}: {exc}{at} "
            f"[the full traceback: HOROVOD_LOG_LEVEL=debug or roundelrun --verbose]")


def install_short_tracebacks(error_type: type[BaseException]) -> None:
    """Make uncaught ``error_type`` exceptions print :func:`short_report` (unless the log level is
    debug); everything else goes to the hook that was installed before."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        if isinstance(exc, error_type) and not _verbose():
            print(short_report(exc), file=sys.stderr, flush=True)
            return
        previous(kind, exc, tb)

    sys.excepthook = hook
