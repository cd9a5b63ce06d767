"""The door between the engine core and its two sides, the coordinator (rank 0) and the rank link.

Each side sees its rank's engine only as an ``EngineCore``: the dozen
operations below on its queue, its table of work in flight and its
executor, plus four facts about the rank. What else a side needs (the
engine thread's selector, the timeline, the rendezvous store and its
lost-rank records) it is handed in ``EngineTools`` when it is made; no
side sets a member of the core or of the other.
"""

from __future__ import annotations

import selectors
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from roundel.common.control.records import Batch, CachedBatch, TunedParams
from roundel.common.engine.executor import Work
from roundel.common.engine.liveness import LostRankRecords
from roundel.common.engine.requests import ProcessSetChange
from roundel.common.engine.timeline import Timeline
from roundel.common.settings import Settings
from roundel.errors import RoundelInternalError

QueueItem = Work | ProcessSetChange  # what the engine thread drains: a collective, or a process-set change
WorkKey = tuple[int, str]  # (process set id, name): one collective in flight on a rank


class EngineCore(Protocol):
    """What the coordinator and the rank link use of their rank's engine (``roundel.common.engine.core.Engine``)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def tuned(self) -> TunedParams:
        """The fusion threshold, cycle time and cache in force."""

    @property
    def broken(self) -> RoundelInternalError | None:
        """The error that broke the job's communication, or None."""

    @property
    def stopping(self) -> bool:
        """Whether the engine is shutting down."""

    def wake(self) -> None:
        """Wake the engine thread from its select."""

    def drain(self) -> list[QueueItem]:
        """Take everything queued for the engine thread, in order."""

    def waits_snapshot(self) -> tuple:
        """(sequence, what this rank's threads wait for now)."""

    def register(self, work: Work) -> None:
        """Track ``work`` as in flight."""

    def inflight(self, key: WorkKey) -> Work | None:
        """The work in flight under ``key``, or None."""

    def take_inflight(self, key: WorkKey) -> Work | None:
        """Stop tracking the work under ``key`` and return it."""

    def execute(self, batch: Batch | CachedBatch, works: list[Work | None]) -> None:
        """Hand an agreed batch and this rank's work for its entries to the executor."""

    def accept_batches(self, batches: Iterable[Batch | CachedBatch]) -> None:
        """Match agreed batches with the work in flight and hand them to the executor."""

    def executor_idle(self) -> bool:
        """Whether the executor has nothing queued or running."""

    def retune(self, params: TunedParams) -> None:
        """Put tuned parameters in force on this rank."""

    def fail_inflight(self, error: Exception) -> None:
        """Fail every collective in flight with ``error``."""

    def break_job(self, message: str) -> None:
        """Mark the job's communication broken: fail what is in flight and every later call."""


@dataclass(frozen=True)
class EngineTools:
    """What the engine hands a side besides itself."""

    selector: selectors.BaseSelector  # the engine thread's: sockets registered here wake it
    timeline: Timeline
    rendezvous: Any  # the job's rendezvous store client (set, get, check)
    losses: LostRankRecords
