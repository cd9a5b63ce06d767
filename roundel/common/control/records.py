"""The records that cross the control wire between the ranks' engines and the coordinator on rank 0.

What ranks tell the coordinator (``Request``), what it tells them back
(``Batch``, ``CachedBatch`` and their ``Entry``), with the collective's kind
(``OpKind``), and the settings autotune puts in force (``TunedParams``; the
search itself is :mod:`roundel.common.engine.autotune`). These are plain,
immutable records; :mod:`roundel.common.control.codec` encodes them and
checks every field's type on the way in, against the annotations here.

Like the rest of :mod:`roundel.common.control`, this module stands below the
engine: it imports only the standard library and roundel's ground modules.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from roundel.ops import ReduceOp


class OpKind(enum.IntEnum):
    """The collective a request asks for."""

    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6

    @property
    def label(self) -> str:
        """The kind in lower case ("allreduce"), as the timeline and error messages name it."""
        return _LABELS[self]


_LABELS = {kind: kind.name.lower() for kind in OpKind}  # asked for on every submission: looked up, not built


class Request(NamedTuple):
    """One rank's description of one named collective.

    ``error`` carries a problem the submitting rank found in its own input; the
    coordinator then fails the name on every rank with that message. ``group``
    names the grouped call (``grouped_allreduce`` and the like) the tensor is
    part of, '' for none; a group's requests reach the coordinator together.
    """

    name: str
    kind: OpKind
    process_set_id: int
    dtype: str = ""
    shape: tuple = ()
    device: str = "cpu"
    reduce_op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root_rank: int = -1
    splits: tuple | None = None
    cacheable: bool = True
    error: str | None = None
    group: str = ""

    def result_scale(self, size: int) -> float:
        """The factor a reduction's result is scaled by among ``size`` members: the postscale, divided
        by ``size`` for an average."""
        return self.postscale / (size if self.reduce_op == ReduceOp.Average else 1)

    def fusion_key(self) -> tuple:
        """Requests with equal keys may share one fused backend call."""
        return (self.kind, self.process_set_id, self.dtype, self.device, self.reduce_op,
                self.prescale, self.postscale, self.root_rank)


class Entry(NamedTuple):
    """One agreed tensor inside a batch.

    ``first_dims`` (allgather) holds each set rank's first dimension;
    ``splits`` (alltoall) holds every set rank's send splits, row per sender.
    ``cache_bit`` is set when the coordinator cached this name under that bit.
    """

    name: str
    request: Request
    first_dims: tuple | None = None
    splits: tuple | None = None
    cache_bit: int = -1


class CachedBatch(NamedTuple):
    """A batch sent as cache bits: what the coordinator sends a rank for names that rank submitted as bits.

    Its entries are the names cached under the bits set in ``bits``, in
    ascending bit order (the coordinator orders the batch so), with each
    rank's own cached request; see ``RankCache.expand``. ``reduced`` is as in
    ``Batch``.
    """

    kind: OpKind
    process_set_id: int
    bits: int
    reduced: bytes | None = None


class Batch(NamedTuple):
    """Entries executed as one backend call (or failed together with ``error``).

    ``error_type`` picks the exception: "mismatch", "deadlock" or "internal"
    (the job's communication is broken).

    ``joined`` lists the global ranks that have called join() and so
    contribute neutral data instead of a tensor of their own.

    ``reduced`` holds the entries' results, one after another, when the
    coordinator reduced them from the data the ranks sent with their requests
    (:mod:`roundel.common.engine.small_allreduce`); the batch then needs no transport.
    """

    kind: OpKind
    process_set_id: int
    entries: tuple
    error: str | None = None
    error_type: str = "mismatch"
    joined: tuple = ()
    last_joined: int = -1
    reduced: bytes | None = None


class TunedParams(NamedTuple):
    """The settings in force; ``tuning`` is False once the search has ended and these are final."""

    fusion_threshold: int
    cycle_time_ms: float
    cache_enabled: bool
    tuning: bool
    hierarchical_allreduce: bool = False
    hierarchical_allgather: bool = False
    bucket_cap_mb: float = 0.0  # 0: each DistributedOptimizer's own bucket_cap_mb
