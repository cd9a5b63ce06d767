"""The messages between a rank's engine and the coordinator on rank 0, as typed records.

Each travels as one authenticated frame (:mod:`roundel.common.control.channel`)
in the data-only codec (:mod:`roundel.common.control.codec`), which rebuilds
only these records and checks every field's type on the way in.

A rank sends ``Submit``, ``Waits``, ``Heartbeat`` and ``Bye``; the coordinator
sends ``Dispatch``, ``Tune``, ``Abort`` and ``Heartbeat``. Between a relay and
the rank above it (:mod:`roundel.common.engine.relay`) travel also ``Merged``,
``Relayed``, ``Joined`` and ``Lost`` upward, and ``Deliver`` downward.
"""

from __future__ import annotations

from typing import NamedTuple

from roundel.common.control.records import TunedParams


class Submit(NamedTuple):
    """Requests a rank queued: ``bits`` (a mask of cache bits, at cache ``version``) and ``full`` Requests.

    Small allreduces carry their tensor's bytes (:mod:`roundel.common.engine.small_allreduce`): ``bit_data``
    maps a cache bit to them, ``full_data`` holds them (or None) for each of ``full`` in turn.
    ``resent`` marks the answer to a ``Dispatch`` that asked for a resend (sent even when nothing is left
    to resend): until it arrives, rank 0 knows the rank may still owe it submissions.
    """

    version: int
    bits: int
    full: list
    bit_data: dict
    full_data: list
    resent: bool = False


class Waits(NamedTuple):
    """What the rank's threads wait for, numbered ``sequence``: (process set id, name, kind) triples."""

    sequence: int
    waits: tuple


class Heartbeat(NamedTuple):
    """Sent every second both ways; ``host`` is the sender's host name (for error messages)."""

    host: str


class Bye(NamedTuple):
    """The rank is shutting down on purpose."""


class Dispatch(NamedTuple):
    """Batches to run (``Batch`` or ``CachedBatch``), cache bits ``evicted``, and (version, bit) pairs to ``resend`` in full.

    ``version`` is the coordinator's cache version once these are applied.
    """

    version: int
    batches: list
    evicted: list
    resend: list


class Tune(NamedTuple):
    """Autotune's new settings, in force from the batches after this message."""

    params: TunedParams


class Abort(NamedTuple):
    """The job's communication is broken; ``message`` says why."""

    message: str


class Merged(NamedTuple):
    """Steady submissions of ranks below a relay, at cache ``version``: ``groups`` of (the ranks, the mask of
    cache bits each sent, how long each rank's mask was held on the way), packed by ``relay.pack_group``;
    ``matched``: the bits every rank of the sender's subtree has sent since they last all had, -1 when all of
    them are in ``join()`` (for a relay above it; rank 0 takes its own AND)."""

    version: int
    groups: list
    matched: int = 0


class Relayed(NamedTuple):
    """A message ``rank`` (below the relay that sends this) sent, as that rank encoded it."""

    rank: int
    payload: bytes


class Joined(NamedTuple):
    """``rank``, of host ``host``, joined below the relay that sends this."""

    rank: int
    host: str


class Lost(NamedTuple):
    """``rank``, below the relay that sends this, is gone without a goodbye; ``reason`` says how."""

    rank: int
    reason: str


class Deliver(NamedTuple):
    """To a relay: hand ``payload`` (an encoded message) to each of ``ranks``, itself or ranks below it."""

    ranks: tuple
    payload: bytes
