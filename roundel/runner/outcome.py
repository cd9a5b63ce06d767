"""What one rank's function did, as every launcher reports it: :class:`RankOutcome`.

``roundel.run`` (through the rendezvous store), ``roundel.ray`` (through
Ray's object store) and ``roundel.spark`` (through a pipe, then the store or
Spark's results) all carry one worker's end as a ``RankOutcome``, and the
driver turns it into the value or a :class:`RankFailedError`.

Its bytes (:meth:`RankOutcome.encode`) are a fixed magic, a JSON header
(kind, rank, error text, whether the error was roundel's own) and the
cloudpickled value. Reading a header never unpickles anything; the value is
unpickled only by :meth:`RankOutcome.result`, on the driver that asked for
it. The bytes travel only where they did before: the job's authenticated
rendezvous store, Ray's object store, a pipe between a Spark task and the
process it started, and Spark's own task results.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pickle
import struct
import traceback
from typing import Any, Callable

import cloudpickle

from roundel.errors import RoundelInternalError

__all__ = ["OutcomeKind", "RankFailedError", "RankOutcome"]

_MAGIC = b"roundel-outcome/1\n"
_HEADER_LENGTH = struct.Struct("!I")
_UNPICKLING_ERRORS = (pickle.UnpicklingError, AttributeError, ImportError, EOFError, TypeError, ValueError)


class RankFailedError(RuntimeError):
    """A rank's function raised (or the rank died): ``rank`` and the remote ``traceback_text``."""

    def __init__(self, rank: int | None, traceback_text: str, message: str):
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text


class OutcomeKind(enum.Enum):
    """How a rank's function ended."""

    RETURNED = "returned"
    """It returned a value."""
    RAISED = "raised"
    """It raised; ``error`` is the traceback."""
    REMOVED = "removed"
    """An elastic worker the driver left out of the next generation (its host left): ``error`` says why."""
    DIED = "died"
    """The rank ended without an outcome of its own (killed, its actor or process lost, stopped because
    another rank failed): ``error`` says what was seen."""


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """One rank's end: the pickled value it returned, or the text of why it did not.

    ``rank`` is None when the worker had no rank yet (an elastic worker
    before its first ``hvd.init()``). ``internal`` is True when the error was
    a ``RoundelInternalError``: the rank failed because the job broke under
    it (a peer was lost), not because of its own exception.
    """

    kind: OutcomeKind
    rank: int | None
    payload: bytes = b""  # the cloudpickled value when RETURNED
    error: str = ""
    internal: bool = False

    @property
    def ok(self) -> bool:
        """Whether the function returned a value."""
        return self.kind is OutcomeKind.RETURNED

    @classmethod
    def of_call(cls, fn: Callable, args: tuple = (), kwargs: dict | None = None,
                rank_of: Callable[[], int | None] = lambda: None,
                removed: type[BaseException] | None = None) -> "RankOutcome":
        """Call ``fn(*args, **kwargs)`` and return how it ended, its rank taken from ``rank_of()``
        afterwards (the function may be what gives the process its rank).

        A value that cannot be pickled is a failure with its traceback, as is any
        exception (even SystemExit or KeyboardInterrupt); an exception of type
        ``removed`` (elastic_join.WorkerRemoved) is REMOVED with its ``reason``.
        Only ``rank_of()``'s own exceptions propagate.
        """
        try:
            value = fn(*args, **(kwargs or {}))
            outcome = cls(OutcomeKind.RETURNED, None, payload=cloudpickle.dumps(value))
        except BaseException as exc:  # noqa: BLE001 - the driver gets every failure, with its traceback
            if removed is not None and isinstance(exc, removed):
                outcome = cls(OutcomeKind.REMOVED, None, error=str(getattr(exc, "reason", exc)))
            else:
                outcome = cls(OutcomeKind.RAISED, None, error=traceback.format_exc(),
                              internal=isinstance(exc, RoundelInternalError))
        return dataclasses.replace(outcome, rank=rank_of())

    @classmethod
    def died(cls, rank: int | None, why: str) -> "RankOutcome":
        """The outcome of a rank that ended without reporting one: ``why`` says what was seen."""
        return cls(OutcomeKind.DIED, rank, error=why)

    def encode(self) -> bytes:
        """The bytes that :meth:`decode` reads back."""
        header = json.dumps({"kind": self.kind.value, "rank": self.rank, "error": self.error,
                             "internal": self.internal}).encode()
        return _MAGIC + _HEADER_LENGTH.pack(len(header)) + header + self.payload

    @classmethod
    def decode(cls, data: bytes) -> "RankOutcome":
        """The outcome :meth:`encode` wrote to ``data``; nothing is unpickled.

        Raises ValueError when ``data`` is not such bytes (empty, cut short, another format).
        """
        data = bytes(data)
        start = len(_MAGIC) + _HEADER_LENGTH.size
        if not data.startswith(_MAGIC) or len(data) < start:
            raise ValueError(f"not a rank outcome ({len(data)} bytes{', empty' if not data else ''})")
        (length,) = _HEADER_LENGTH.unpack_from(data, len(_MAGIC))
        if len(data) < start + length:
            raise ValueError(f"rank outcome cut short: {len(data)} bytes, its header says at least {start + length}")
        try:
            header = json.loads(data[start:start + length])
            kind = OutcomeKind(header["kind"])
            rank, error, internal = header["rank"], header["error"], header["internal"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"rank outcome with a bad header: {exc}") from None
        if not (rank is None or isinstance(rank, int)) or not isinstance(error, str) or not isinstance(internal, bool):
            raise ValueError(f"rank outcome with a bad header: {header!r}")
        return cls(kind, rank, payload=data[start + length:], error=error, internal=internal)

    def failure(self, prefix: str, who: str | None = None, note: str = "") -> RankFailedError:
        """The RankFailedError for this outcome: ``"<prefix><who> raised:\\n<traceback><note>"`` (or
        ``died: <why>``, ``was removed: <why>``); ``who`` defaults to "rank N" ("a worker" without a rank)."""
        who = who or (f"rank {self.rank}" if self.rank is not None else "a worker")
        what = {OutcomeKind.RAISED: "raised:\n", OutcomeKind.DIED: "died: ",
                OutcomeKind.REMOVED: "was removed: "}.get(self.kind, "returned: ")
        return RankFailedError(self.rank, self.error, f"{prefix}{who} {what}{self.error}{note}")

    def result(self, prefix: str = "roundel: ") -> Any:
        """The value the function returned (unpickled here).

        Raises RankFailedError (:meth:`failure` with ``prefix``) when it did
        not return, or when its value cannot be unpickled in this process.
        """
        if not self.ok:
            raise self.failure(prefix)
        try:
            return cloudpickle.loads(self.payload)
        except _UNPICKLING_ERRORS as exc:
            who = f"rank {self.rank}" if self.rank is not None else "a worker"
            raise RankFailedError(self.rank, "", f"{prefix}{who}'s result could not be unpickled here: "
                                                 f"{type(exc).__name__}: {exc}") from exc
