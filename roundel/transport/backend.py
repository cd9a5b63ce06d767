"""The interface a transport implements: collectives on contiguous CPU/GPU buffers.

The engine decides what runs and in which order; a backend only moves data.
Every call is blocking, operates on contiguous ``torch.Tensor`` buffers, and
raises ``RuntimeError`` when the transport fails (a peer died, a timeout).
A backend that can also run an allreduce on its own threads offers
``allreduce_async``; the executor then runs large allreduces on them in the
background, the large tensors of a fused batch side by side, each in its own
memory.
"""

from __future__ import annotations

import abc

from roundel.ops import ReduceOp


class Backend(abc.ABC):
    """One communicator over the members of a process set."""

    name: str = "backend"

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size

    @abc.abstractmethod
    def allreduce(self, tensor, op: ReduceOp) -> None:
        """Reduce ``tensor`` in place across members; ``op`` is Sum, Min, Max or Product."""

    #: ``allreduce_async(tensor, op)``, where offered: start :meth:`allreduce` on the transport's own
    #: threads and return a ``torch.futures.Future`` that completes once ``tensor`` holds the result
    #: (or fails with the transport's ``RuntimeError``). Calls run in the order they are made.
    allreduce_async = None

    @abc.abstractmethod
    def allgather(self, output, tensor) -> None:
        """Gather equal-sized ``tensor`` from every member into ``output`` (member-major, flat)."""

    @abc.abstractmethod
    def broadcast(self, tensor, root: int) -> None:
        """Overwrite ``tensor`` with the root member's copy."""

    @abc.abstractmethod
    def alltoall(self, output, tensor, output_splits: list[int], input_splits: list[int]) -> None:
        """Send ``input_splits[j]`` rows of ``tensor`` to member j; receive ``output_splits[j]`` rows from j."""

    @abc.abstractmethod
    def reducescatter(self, output, tensor, op: ReduceOp) -> None:
        """Reduce ``tensor`` (``size`` equal chunks, member-major) and keep this member's chunk in ``output``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every member has called barrier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator; later calls are undefined."""
