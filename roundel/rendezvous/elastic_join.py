"""How elastic workers and ``roundelrun``'s elastic driver agree on each generation of the job.

A generation is one fixed membership: a communicator of ``size`` ranks. The
driver starts each worker with a stable id (``host:slot``) instead of a
rank. Whenever a worker needs a communicator (at its first ``init()`` and at
every reset) it *joins*: it writes its join count under ``join/<id>`` and
waits for ``assign/<id>/<count>``. The driver forms the next generation only
once every live worker it keeps has joined, so no worker is still inside the
previous generation's collectives, and answers each join with the worker's
identity in the new generation (or tells a worker it no longer needs to
exit). Survivors keep their relative order, so the new rank 0 is the oldest
surviving rank and holds the current state.

``hosts_version`` counts the membership changes the driver has planned;
rank 0 compares it with the version its generation started at when the
training loop commits, and every rank then leaves for the next generation
together.

When a member of a generation fails, the driver marks that generation
*abandoned* (``abandoned_key``). A worker still connecting to it (waiting
on a store key, in Gloo's connect, or for its peers at rank 0's
coordinator) watches that key while it does (:func:`connect_within`) and
leaves at once for the next generation instead of waiting for a peer that
will never come.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import threading
import time
from typing import Callable, TypeVar

from roundel.errors import RoundelInternalError
from roundel.rendezvous.identity import Identity
from roundel.rendezvous.store import RendezvousError, RendezvousTimeout

__all__ = ["HOSTS_VERSION_KEY", "JOIN_GRACE_S", "WORKER_ID", "Assignment", "GenerationAbandoned", "HostUpdate",
           "JoinError", "WorkerRemoved", "abandoned_key", "assign_key", "connect_within", "host_update_notice",
           "hosts_update_key", "hosts_version", "join", "join_key", "key_prefix", "read_host_update_notice",
           "removal", "worker_id"]

WORKER_ID = "ROUNDEL_ELASTIC_WORKER_ID"
"""Environment variable naming an elastic worker (its presence makes ``init()`` join a generation)."""

JOIN_GRACE_S = 10.0
"""How much longer than the driver's own bound (``--elastic-timeout``, or ``--start-timeout`` for the first
generation) a worker waits for its place: the driver decides first and ends the job saying why; a worker gives
up by itself only when the driver no longer answers."""

HOSTS_VERSION_KEY = "elastic/hosts_version"


def join_key(worker_id: str) -> str:
    return f"elastic/join/{worker_id}"


def assign_key(worker_id: str, count: int) -> str:
    return f"elastic/assign/{worker_id}/{count}"


class HostUpdate(enum.IntFlag):
    """What a membership change did to the hosts (Horovod's ``HostUpdateResult``, same values)."""

    NO_UPDATE = 0
    REMOVED = 1
    ADDED = 2
    MIXED = 3


def hosts_update_key(version: int) -> str:
    """Set by the driver when it plans membership change number ``version``: its notice."""
    return f"elastic/hosts_update/{version}"


def host_update_notice(update: HostUpdate) -> bytes:
    """The driver's notice of a membership change: when it was planned (wall clock) and what it does."""
    return json.dumps({"timestamp": time.time(), "update": int(update)}).encode()


def read_host_update_notice(raw: bytes) -> tuple[float, HostUpdate]:
    """``(timestamp, update)`` of a notice, as Horovod's workers receive them."""
    notice = json.loads(raw)
    return notice["timestamp"], HostUpdate(notice["update"])


def abandoned_key(generation: int) -> str:
    """Set by the driver (to the reason) once a member of ``generation`` has failed."""
    return f"elastic/abandoned/{generation}"


def key_prefix(generation: int) -> str:
    """The store prefix of ``generation``'s communicator; its ranks report a lost peer under ``<prefix>lost/<rank>``."""
    return f"gen{generation}/"


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A worker's place in one generation."""

    generation: int
    identity: Identity
    hosts_version: int

    def encode(self) -> bytes:
        return json.dumps({"generation": self.generation, "hosts_version": self.hosts_version,
                           "identity": dataclasses.asdict(self.identity)}).encode()


class JoinError(RoundelInternalError):
    """The driver formed no generation for this worker in time (or could not be reached)."""


class GenerationAbandoned(RoundelInternalError):
    """The driver gave up the generation this worker was connecting to (a member failed while it formed)."""


class WorkerRemoved(SystemExit):
    """This worker is not part of the next generation (its host left the job): it exits with status 0."""

    def __init__(self, reason: str):
        super().__init__(0)
        self.reason = reason


_joins = 0


def join(client, worker_id: str, timeout_s: float) -> Assignment:
    """Ask the driver for this worker's place in the next generation and wait for it.

    Raises WorkerRemoved when the driver leaves this worker out, and
    JoinError when no generation is formed within ``timeout_s``.
    """
    global _joins
    _joins += 1
    count = _joins
    try:
        client.set(join_key(worker_id), str(count).encode())
        answer = json.loads(client.get(assign_key(worker_id, count), timeout_s))
    except Exception as exc:
        raise JoinError(
            f"elastic worker {worker_id} was not given a place in the job within {timeout_s:g} s (roundelrun's "
            f"--elastic-timeout, or --start-timeout for the first generation, and {JOIN_GRACE_S:g} s more): "
            f"{exc}") from exc
    if "removed" in answer:
        print(f"roundel: elastic worker {worker_id} leaves the job: {answer['removed']}", file=sys.stderr,
              flush=True)
        raise WorkerRemoved(answer["removed"])
    return Assignment(answer["generation"], Identity(**answer["identity"]), answer["hosts_version"])


def removal(reason: str) -> bytes:
    """The driver's answer to a join from a worker it leaves out."""
    return json.dumps({"removed": reason}).encode()


def hosts_version(client) -> int:
    """The number of membership changes the driver has planned so far."""
    if not client.check([HOSTS_VERSION_KEY]):
        return 0
    return int(client.get(HOSTS_VERSION_KEY, 0))


def worker_id(environ=None) -> str | None:
    """This process's elastic worker id, or None outside an elastic job."""
    return (os.environ if environ is None else environ).get(WORKER_ID)


WATCH_POLL_S = 1.0
"""Longest server-side wait of one look at a key the driver may set (the answer comes as soon as it is)."""

_Connected = TypeVar("_Connected")


def connect_within(client, generation: int, connect: Callable[[], _Connected],
                   discard: Callable[[_Connected], None]) -> _Connected:
    """``connect()``'s result, run on a helper thread while this thread watches whether the driver
    abandons ``generation``.

    Raises GenerationAbandoned as soon as it does (``connect()`` is left to
    end by its own timeouts, and ``discard`` closes what it returns if it
    ever succeeds), and what ``connect()`` raises otherwise.
    """
    lock = threading.Lock()
    decided = threading.Event()
    outcome: list = []  # the first of ("done", result), ("failed", error), ("abandoned", reason)

    def decide(kind: str, value) -> bool:
        with lock:
            if outcome:
                return False
            outcome.append((kind, value))
        decided.set()
        return True

    def run_connect() -> None:
        try:
            result = connect()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            decide("failed", exc)
            return
        if not decide("done", result):
            discard(result)

    def watch() -> None:
        key = abandoned_key(generation)
        while not decided.is_set():
            try:
                reason = client.get(key, WATCH_POLL_S).decode()
            except RendezvousTimeout:
                continue
            except RendezvousError:  # the store is gone or the client closed: connect() fails on its own
                return
            decide("abandoned", reason)
            return

    threading.Thread(target=run_connect, name="roundel-elastic-connect", daemon=True).start()
    threading.Thread(target=watch, name="roundel-elastic-abandoned", daemon=True).start()
    decided.wait()
    kind, value = outcome[0]
    if kind == "done":
        return value
    if kind == "failed":
        raise value
    raise GenerationAbandoned(f"generation {generation} was abandoned while it formed ({value}); "
                              "joining the next one")
