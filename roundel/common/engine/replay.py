"""The steady state without a round trip to rank 0: agreed batches replayed from what every rank has seen.

Every rank's executor runs the same sequence of global-set batches, so every
rank can learn from it, alike, which name follows which. Once the same name
has followed the last one run twice in a row, the schedule is *armed*: that
name, with the names that ran with it last time (as long as each followed
the one before twice in a row), becomes a *slot*, and a rank that has
submitted all of its names, as it submitted them last time, runs it on the
transport at once, without asking the coordinator. A training step after the
first few submits the same named gradients in the same order, so its
collectives cost the transfer and one thread hand-off.

Allreduces (sum or average), broadcasts and allgathers of CPU tensors are
replayed; a slot holds names of one kind. An allgather slot also remembers
every rank's first dimension from last time: they are the same this time, or
some rank's request differs and that rank gives the slot up.

No rank can tell alone that the others will follow the schedule, so each
slot's transfer carries one more element: 0 from a rank that brings its
tensors, 1 from a rank that gives the slot up (see
:mod:`roundel.common.engine.slot_plans` for where it travels: after a small
allreduce slot's tensors, at the head of each rank's row of a small broadcast
or allgather slot, or in a small transfer of its own before a large slot's
tensors move). That element
tells every rank, alike, whether the slot ran (the transfer also carries each
rank's wait in its previous slot, which tells rank 0 who came last, for the
straggler report, as negotiation does); a slot given up anywhere is
dropped everywhere, and its tensors go to the coordinator as usual (which
then runs them, or reports a mismatch on every rank). A rank gives the
current slot up when:

* it submits one of the slot's names unlike last time (another shape, dtype,
  operation), or had already sent one to the coordinator when it was armed;
* a batch from the coordinator (or autotune's new parameters) reaches its
  executor while the slot is pending: the coordinator only dispatches what
  every rank sent it, and every rank gives up the slot it stands at, so the
  transport sees the same calls in the same order everywhere (ranks never
  stand more than one slot apart: a slot runs once every rank has entered it).
  The smallest allreduces that rank 0 reduces itself from the data sent
  with the requests are not replayed: they move nothing on the transport, so
  they pass beside the slots. In a job of up to ``REPLAYS_SMALL_UP_TO`` ranks
  (the engine's), those the schedule could run (``runs_small``) go without
  their data instead, and are replayed once they repeat;
* it holds some of what the schedule expects, and one of its threads has
  been waiting (on anything) at two checks ``WAIT_GRACE_S`` apart while the
  slot still lacked a name, or it has held some of the slot's names but not
  all for ``PARTIAL_LIMIT_S`` (a program that polls): the program submits
  less than last time, or in another order; the coordinator then sorts it
  out, as without the schedule.

A rank that holds nothing of the schedule and waits gives nothing up: what it
waits for is with the coordinator, which answers it (a batch every rank
sent, which gives the slot up everywhere, or a small allreduce it reduced
itself, which passes beside), or finds the rank waiting for a collective
that ranks inside the slot's transfer have not sent (a join, a barrier,
another order), and then makes every rank give the slot up. So a rank that
leaves the job once its last small allreduce has returned (the others may
still wait for its result) leaves nobody inside a slot.

A rank that shuts down fails what it holds and leaves; a rank inside a slot
with it gets the transport's error once it has gone, as a rank inside a
transfer does.

Names the schedule does not expect go to the coordinator without giving the
slot up. This module holds the learning and the held collectives; the
executor runs the slots.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

from roundel.common.control.records import Batch, Entry, OpKind, Request
from roundel.ops import ReduceOp

# the same successor seen this many times in a row arms the schedule
ARM_AFTER = 2
# a step of the schedule given up this many times in a row is learned anew (a slot armed mid-step, while its
# names are still on their way to rank 0, is given up once and the next step's slot runs: that is not it)
UNLEARN_AFTER = 3
# how often the executor checks whether a thread waits while the pending slot lacks a name
WAIT_GRACE_S = 0.05
# a slot some of whose names have been held this long, without the others, is given up (nobody need wait)
PARTIAL_LIMIT_S = 1.0
# batches remembered for learning; beyond this (names that never repeat) the memory starts over
_REMEMBERED = 4096
_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int32", "int64"})
_REPLAYED_OPS = (ReduceOp.Sum, ReduceOp.Average)


class Slot(NamedTuple):
    """An armed batch: its names in the agreed order, this rank's requests for them, its serial number (the count
    of slots armed so far, alike on every rank), and, for an allgather, each name's first dimension on every rank
    last time (the same this time, or some rank's request differs and it gives the slot up)."""

    names: tuple
    requests: tuple
    serial: int
    first_dims: tuple = ()

    @property
    def kind(self) -> OpKind:
        return self.requests[0].kind

    @property
    def batch(self) -> Batch:
        """The slot as a batch of the global set, as the executor runs one."""
        dims = self.first_dims or (None,) * len(self.names)
        return Batch(self.kind, 0, tuple(Entry(n, r, first_dims=d) for n, r, d in zip(self.names, self.requests, dims)))


def replayable(batch: Batch, works: list) -> bool:
    """Whether ``batch`` may be replayed: an allreduce (sum or average, of a dtype the slot's agreement can travel
    in), a broadcast or an allgather of CPU tensors of the global set, every rank with a tensor, no error, not
    reduced by rank 0. Decided from the agreed batch, so alike on every rank (``works``, this rank's part, only
    lacks entries where a rank joined, which the batch says too)."""
    if batch.process_set_id != 0 or batch.error or batch.joined or batch.reduced is not None:
        return False
    request = batch.entries[0].request
    if request.device != "cpu" or None in works:
        return False
    if batch.kind == OpKind.ALLREDUCE:
        return request.dtype in _DTYPES and request.reduce_op in _REPLAYED_OPS
    return batch.kind in (OpKind.BROADCAST, OpKind.ALLGATHER)


class ScheduleReplay:
    """Learns the global set's batch sequence, holds the collectives the armed schedule expects, and decides,
    alike on every rank, which slot is pending. Thread-safe: the executor learns and resolves slots, the
    submitting threads ``take``.

    ``wake(serial)`` asks the executor to look at slot ``serial`` (complete, or to be given up);
    ``someone_waits()`` says whether a thread of this rank is blocked in a collective now.
    """

    def __init__(self, enabled: bool, wake: Callable[[int], None], someone_waits: Callable[[], bool],
                 small_allreduces: bool = False):
        """``small_allreduces``: the allreduces the schedule could run are left to it however small (see
        ``runs_small``)."""
        self.enabled = enabled
        self._small = enabled and small_allreduces
        self._wake = wake
        self._someone_waits = someone_waits
        self._lock = threading.Lock()
        self._after: dict[str, tuple[str, int]] = {}  # name -> (the name after it, times in a row)
        self._batch_of: dict[str, tuple] = {}  # name -> the names of the last batch it ran in
        self._misses: dict[str, int] = {}  # name -> slots armed after it given up in a row
        self._requests: dict[str, Request] = {}  # name -> this rank's request, when its batch was replayable
        self._first_dims: dict[str, tuple | None] = {}  # name -> every rank's first dimension (allgather)
        self._expected: dict[str, Request] = {}  # name -> request, of the armed slot and the ones sure to follow
        self._learned = 0  # bumped when the schedule's sure steps change
        self._expected_for: tuple = ()  # (learned, slot names) that _expected was found for
        self._last: str | None = None  # the global-set name run last
        self._slot: Slot | None = None
        self._serial = 0
        self._give_up = False  # this rank gives the pending slot up
        self._held: dict[str, Any] = {}  # name -> Work (executor's) held for the schedule
        self._negotiating: set[str] = set()  # global-set names sent to the coordinator, not yet dispatched back
        self._suspect = 0  # serial of the slot found incomplete with a thread waiting at the last check
        self._partial: tuple[int, int] = (0, 0)  # (serial, checks) of the slot found partly held
        self._running = 0  # serial of the slot taken to run, until it has run or been given up
        self.tuning = False  # while autotune searches, the coordinator must see every batch
        self.slots_run = 0  # slots every rank brought its tensors to
        self.slots_given_up = 0

    # ---------------------------------------------------------------- submitting threads
    def runs_small(self, request: Request) -> bool:
        """Whether an allreduce small enough for rank 0 to reduce from the requests' data goes without its data
        instead, for the schedule to replay once it repeats (alike on every rank: decided from the request).
        Rank 0's reduction saves a transfer after the negotiation's round trip; a replayed slot needs neither
        round trip, and on a fast small-message path (shared memory, the peer links) its transfer costs less."""
        return (self._small and request.process_set_id == 0 and request.device == "cpu"
                and request.dtype in _DTYPES and request.reduce_op in _REPLAYED_OPS)

    @property
    def armed(self) -> bool:
        """Whether a slot is pending (a hint, read without the lock)."""
        return self._slot is not None

    @property
    def pending_names(self) -> tuple:
        """The names of the armed slot, () when none is."""
        slot = self._slot
        return slot.names if slot is not None else ()

    def take(self, works: list, caller_waits: bool = False) -> list:
        """Hold the works the armed schedule expects; return the others, for the coordinator. A slot they
        complete is handed to the executor, unless the ``caller_waits`` for them at once (and then runs it)."""
        if not self.enabled:
            return works
        with self._lock:
            slot = self._slot
            others = []
            for work in works:
                request = work.request
                expected = self._expected.get(request.name) if slot is not None else None
                if expected is not None and request.process_set_id == 0:
                    if expected == request and not self._give_up:
                        self._held[request.name] = work
                        continue
                    self._give_up = True  # an expected name, unlike last time: the slot cannot run here
                others.append(work)
                if request.process_set_id == 0:
                    self._negotiating.add(request.name)
            if slot is not None and (self._give_up or (not caller_waits and self._complete(slot))):
                self._wake(slot.serial)
            return others

    def finished(self, key: tuple) -> None:
        """The collective ``(set id, name)`` completed or failed on this rank."""
        if self._negotiating and key[0] == 0:
            with self._lock:
                self._negotiating.discard(key[1])

    def fail(self, error: BaseException) -> None:
        """The job broke, or this rank shuts down: fail every held collective, disarm, learn from scratch."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
            self._slot = None
            self._forget()
        for work in held:
            work.handle.set_error(error)

    # ---------------------------------------------------------------- the executor
    def wait_timeout(self) -> float | None:
        """How long the executor may sleep before it checks the pending slot (None: as long as it likes)."""
        return WAIT_GRACE_S if self.enabled else None

    def overdue(self) -> bool:
        """Whether the pending slot should run now: it is ready (and no one ran it), or it lacks a name while this
        rank holds some of the schedule and a thread has waited at this check and the last, or while part of it
        has been held for ``PARTIAL_LIMIT_S`` (it is then given up)."""
        with self._lock:
            slot = self._slot
            if slot is None or self._running == slot.serial:
                return False
            if self._give_up or self._complete(slot):
                return True
            if any(name in self._held for name in slot.names):
                serial, checks = self._partial
                checks = checks + 1 if serial == slot.serial else 1
                self._partial = (slot.serial, checks)
                if checks * WAIT_GRACE_S >= PARTIAL_LIMIT_S:
                    self._give_up = True
                    return True
            if not self._held or not self._someone_waits():  # holding nothing: see the module's docstring
                self._suspect = 0
                return False
            if self._suspect != slot.serial:
                self._suspect = slot.serial
                return False
            self._give_up = True
            return True

    def dispatched(self, batch: Batch, works: list) -> None:
        """A batch from the coordinator runs next on this rank (a pending slot was resolved first, unless rank 0
        reduced it): learn from it, unless it carries an error (then only some ranks may see it) or rank 0
        reduced it (it moves nothing on the transport, so it passes beside the slots and is not one)."""
        if not self.enabled:
            return
        with self._lock:
            if batch.process_set_id == 0:
                for entry in batch.entries:
                    self._negotiating.discard(entry.name)
                if not batch.error and batch.reduced is None:
                    self._learn(tuple(e.name for e in batch.entries), batch, works)

    def retuned(self, tuning: bool) -> None:
        """Autotune put new parameters in force (at the same place in every rank's sequence): learn anew."""
        with self._lock:
            self.tuning = tuning
            self._forget()

    def begin(self, force_give_up: bool) -> tuple[Slot, list | None] | None:
        """Take the pending slot to run: (slot, its works) when this rank brings them all, (slot, None) when it
        gives the slot up (``force_give_up``: a batch from the coordinator came first); None if none is pending,
        or it is incomplete and not given up."""
        with self._lock:
            slot = self._slot
            if slot is None or self._running == slot.serial:
                return None
            complete = self._complete(slot) and all(
                self._held[name].request == request for name, request in zip(slot.names, slot.requests))
            if not (force_give_up or self._give_up or complete):
                return None
            self._running = slot.serial
            if force_give_up or self._give_up or not complete:
                return slot, None
            return slot, [self._held.pop(name) for name in slot.names]

    def begin_alone(self, request: Request) -> Slot | None:
        """Take the pending slot to run when ``request`` (of a collective whose thread waits for it, not held) is
        all of it, as last time, and the slot is not given up; else None, and nothing changes."""
        with self._lock:
            slot = self._slot
            if slot is None or self._running == slot.serial or self._give_up or slot.requests != (request,):
                return None
            self._running = slot.serial
            return slot

    def ready_now(self) -> int | None:
        """The serial of the pending slot if it is ready to run, else None (a hint, read without the lock)."""
        slot = self._slot
        if slot is not None and self._running != slot.serial and (
                self._give_up or all(name in self._held for name in slot.names)):
            return slot.serial
        return None

    def ran(self, slot: Slot) -> list:
        """Every rank brought ``slot``'s tensors: learn from it and arm the next slot. When none follows for sure,
        return the works held for later slots, for the coordinator."""
        with self._lock:
            self.slots_run += 1
            self._slot = None
            self._give_up = False
            if self._last is not None:
                self._misses.pop(self._last, None)
            self._learn(slot.names, None, None)
            if self._slot is not None or not self._held:
                return []
            held = list(self._held.values())
            self._held.clear()
            self._negotiating.update(w.request.name for w in held)
        return held

    def given_up(self, slot: Slot) -> list:
        """Some rank gave ``slot`` up: disarm (after ``UNLEARN_AFTER`` such in a row, unlearn the step into it);
        return the held works, for the coordinator."""
        with self._lock:
            self.slots_given_up += 1
            held = list(self._held.values())
            self._held.clear()
            self._slot = None
            self._give_up = False
            last = self._last
            if last is not None:
                misses = self._misses[last] = self._misses.get(last, 0) + 1
                if misses >= UNLEARN_AFTER:
                    del self._misses[last]
                    self._after[last] = (slot.names[0], 0)
                    self._learned += 1
            self._negotiating.update(w.request.name for w in held)
        return held

    # ---------------------------------------------------------------- under the lock
    def _complete(self, slot: Slot) -> bool:
        return all(name in self._held for name in slot.names)

    def _learn(self, names: tuple, batch: Batch | None, works: list | None) -> None:
        """Note that the global batch ``names`` runs next (``batch`` and this rank's ``works`` when it came from
        the coordinator), and arm what follows, when sure of it.

        The order is learned name by name, not batch by batch: rank 0 fuses what is ready within a cycle, so
        the same names may come in other batches from step to step while their order stays."""
        if len(self._after) >= _REMEMBERED:
            self._forget()
        if batch is not None and works is not None:
            fits = replayable(batch, works)
            for name, work, entry in zip(names, works, batch.entries):
                request = work.request if fits else None
                self._first_dims[name] = entry.first_dims
                if self._requests.get(name) != request:
                    self._learned += 1  # what the schedule expects must be found again
                    if request is None:
                        del self._requests[name]
                    else:
                        self._requests[name] = request
                self._batch_of[name] = names
        for name in names:
            last = self._last
            if last is not None:
                after, times = self._after.get(last, ("", 0))
                sure = times >= ARM_AFTER
                times = times + 1 if after == name else 1
                self._after[last] = (name, times)
                if sure != (times >= ARM_AFTER):
                    self._learned += 1
            self._last = name
        slot_names = self._next_slot()
        if slot_names is None or self.tuning:
            return
        self._serial += 1
        requests = tuple(self._requests[n] for n in slot_names)
        first_dims = tuple(self._first_dims.get(n) for n in slot_names) if requests[0].kind == OpKind.ALLGATHER else ()
        slot = self._slot = Slot(slot_names, requests, self._serial, first_dims)
        if self._expected_for != (self._learned, slot_names[0]):
            self._expected_for = (self._learned, slot_names[0])
            self._expected = self._expected_from(slot_names[0])
        # a name of the slot already sent to the coordinator can only come back from there
        self._give_up = any(name in self._negotiating for name in slot_names)
        if self._give_up or self._complete(slot):
            self._wake(slot.serial)

    def _sure_after(self, name: str) -> str | None:
        after, times = self._after.get(name, ("", 0))
        return after if times >= ARM_AFTER else None

    def _next_slot(self) -> tuple | None:
        """The names of the slot sure to come next: the name sure to follow the last, and those that ran with
        it last time after it, as long as each is sure to follow the one before; None if there is none."""
        first = self._sure_after(self._last) if self._last is not None else None
        if first is None or first not in self._requests:
            return None
        batch = self._batch_of[first]
        names = [first]
        kind = self._requests[first].kind
        for name in batch[batch.index(first) + 1:]:
            if self._sure_after(names[-1]) != name or name not in self._requests or self._requests[name].kind != kind:
                break
            names.append(name)
        return tuple(names)

    def _expected_from(self, first: str) -> dict:
        """name -> this rank's request, for ``first`` and every name sure to follow it."""
        expected: dict[str, Request] = {}
        name: str | None = first
        while name is not None and name not in expected and name in self._requests:
            expected[name] = self._requests[name]
            name = self._sure_after(name)
        return expected

    def _forget(self) -> None:
        """Drop what was learned of the order."""
        self._after.clear()
        self._batch_of.clear()
        self._misses.clear()
        self._requests.clear()
        self._first_dims.clear()
        self._expected.clear()
        self._last = None
        self._learned += 1
