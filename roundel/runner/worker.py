"""The launcher's view of one started worker: :class:`Worker`, whatever runs it.

The launcher (:mod:`roundel.runner.launch`) and the elastic driver
(:mod:`roundel.runner.elastic_driver`) supervise workers only through this
interface: wait for the end and read the exit status, signal the worker
(SIGTERM to stop it, SIGCONT so that a stopped one handles that, SIGKILL),
and say where it runs. Its implementations are a process on this machine and
one over ssh (:mod:`roundel.runner.spawn`), a Ray actor
(:class:`roundel.ray.elastic.ActorWorker`) and a process a Spark task runs
(:class:`roundel.spark.elastic.TaskWorker`).
"""

from __future__ import annotations

import abc
import collections

from roundel.runner.hosts import SlotInfo

__all__ = ["Worker"]


class Worker(abc.ABC):
    """One started worker of ``slot``: its exit status once it has ended, and the means to stop it.

    An exit status follows the ``subprocess`` convention: 0 for success, a
    positive code for failure, minus the signal number for death by a
    signal (a Ray actor or Spark task that is gone counts as ``-SIGKILL``).
    """

    remote = False
    """Whether the worker's own exit status is recorded in the rendezvous store by the other end of an
    ssh connection (``launch/exit/<rank>``) rather than seen here."""

    def __init__(self, slot: SlotInfo):
        self.slot = slot
        self.stderr_tail: collections.deque = collections.deque(maxlen=5)
        """The last lines of the worker's stderr, for error reports (empty when they are not seen here)."""

    @property
    def rank(self) -> int:
        """The rank of the worker's slot (an elastic worker's start number: it learns its rank when it joins)."""
        return self.slot.rank

    @property
    def host(self) -> str:
        """The host the worker runs on, as the plan or the discovery named it."""
        return self.slot.hostname

    @property
    @abc.abstractmethod
    def returncode(self) -> int | None:
        """The exit status once the worker has ended, None while it runs."""

    @property
    @abc.abstractmethod
    def where(self) -> str:
        """Where the worker runs, for the launcher's messages."""

    @abc.abstractmethod
    def wait(self) -> int:
        """Block until the worker has ended; return its exit status."""

    @abc.abstractmethod
    def signal_group(self, signum: int) -> None:
        """Deliver ``signum`` (SIGTERM, SIGCONT or SIGKILL) to the worker and all it started; never
        raises for a worker already gone. A worker that cannot be paused ignores SIGCONT."""

    def join_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker's output to be relayed completely (nothing to
        wait for when its output does not pass through this process)."""
