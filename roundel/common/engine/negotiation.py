"""The coordinator's bookkeeping: which ranks submitted which names, and what runs next.

Pure logic, no I/O: the engine on rank 0 feeds it requests as they arrive and
asks it for the batches to send. A name becomes ready when every member of
its process set (other than ranks that have joined) has submitted it; ready
names are then checked for agreement and fused into batches in one order that
every rank executes.

In the steady state every rank, rank 0 included, submits cached names as a
mask of cache bits. Such a mask is only merged into the rank's outstanding
bits (one integer OR, whatever the number of names); the members' outstanding
masks are ANDed per process set, resuming where the last AND found a member
lacking, and the bits every member holds become ready names. Rank 0's work
per cycle is thus about one big-integer operation per rank plus one step per
ready name, not one step per rank and name. A name
that needs per-rank attention (a rank sent it in full, with data to reduce
here, while ranks join, or when it stalls, fails or is evicted) is
"loosened": its outstanding bits become per-rank submissions until it
completes.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import Iterable

from roundel.common.control.records import Batch, CachedBatch, Entry, OpKind, Request
from roundel.common.engine import small_allreduce
from roundel.common.engine.response_cache import CoordinatorCache
from roundel.ops import ReduceOp

JOIN_NAME = "__join__"

ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
}

_FUSABLE = (OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST)
_NOT_WITH_JOIN = (OpKind.ALLGATHER, OpKind.BROADCAST, OpKind.ALLTOALL, OpKind.REDUCESCATTER)
# Kinds whose batch a rank can rebuild from its own cached requests alone (allgather and alltoall
# also need every rank's first dimensions or splits).
_COMPACT = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER)
_FIRST = operator.itemgetter(0)
_PLANS_KEPT = 64  # take() plans, and groups of names ready together, remembered (a training step makes a few)


class _Pending:
    __slots__ = ("requests", "since", "warned", "by_bit", "data")

    def __init__(self, since: float):
        self.requests: dict[int, Request] = {}
        self.since = since
        self.warned = False
        self.by_bit: set[int] = set()  # ranks that submitted their cache bit
        self.data: dict[int, bytes] = {}  # rank -> its tensor's bytes (a small allreduce)

    def has(self, rank: int) -> bool:
        """Whether ``rank`` has submitted this name."""
        return rank in self.requests

    def submitters(self) -> tuple:
        """The members that have submitted this name, in order."""
        return tuple(sorted(self.requests))


def _bits_of(mask: int):
    """The positions of the set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def describe_ranks(values_by_rank: dict) -> str:
    """'rank 0: a; ranks 1, 2: b' — ranks grouped by equal value."""
    groups: dict = {}
    for rank in sorted(values_by_rank):
        groups.setdefault(repr(values_by_rank[rank]), []).append(rank)
    parts = []
    for value, ranks in groups.items():
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))}: {value}")
    return "; ".join(parts)


class Negotiator:
    """Matches requests across ranks by name and plans the batches to execute."""

    def __init__(self, size: int, cache_capacity: int, reduce_bytes: int = 0, separate_groups: bool = False):
        self.size = size
        self.process_sets: dict[int, tuple] = {0: tuple(range(size))}
        self._member_sets: dict[int, frozenset] = {0: frozenset(range(size))}  # for O(1) membership
        self.cache = CoordinatorCache(cache_capacity)
        self._pending: dict[tuple, _Pending] = {}
        self._ready: list = []  # (Entry, joined) or (None, Batch) for failures
        self._joined: list[int] = []
        self._left: set[int] = set()
        self._direct: list[tuple[tuple, Batch]] = []  # failures for some ranks only
        self._evictions: list[tuple[int, tuple]] = []
        self._agreed_requests: dict[tuple, dict] = {}  # every rank's request, for the cache
        self._from_cache: dict[tuple, int] = {}  # ready names every other rank sent as this unchanged bit
        self._cached_entries: dict[int, tuple] = {}  # bit -> (its cached requests, the agreed entry for them)
        self._cached_groups: dict[tuple, tuple] = {}  # (set id, bits ready together) -> what they made ready,
        # at a cache version (see _ready_from_cache)
        self._ready_from_masks = 0  # how many of the ready entries are such agreed entries
        self._plans: dict[tuple, tuple] = {}  # what take() made of the same such entries before
        self._compact: dict[int, CachedBatch] = {}  # id(batch) -> its compact form, from the last take()
        self._reduce_bytes = reduce_bytes  # small allreduces up to this size are reduced here
        self._reduced: dict[tuple, bytes] = {}  # ready names reduced here -> their result
        self._separate_groups = separate_groups  # HOROVOD_DISABLE_GROUP_FUSION: a group fuses only within itself
        self._outstanding: dict[int, int] = {}  # rank -> cache bits it sent by mask, not yet ready
        self._seen = 0  # bits in some rank's outstanding mask (a superset until the next _settle())
        self._settled = 0  # the same, exactly, as of the last _settle()
        self._seen_since: list[tuple] = []  # (when, the outstanding bits first seen then), oldest first
        self._loose = 0  # bits whose names take per-rank submissions until they complete
        self._scans: dict[int, tuple] = {}  # set id -> (index of the member the last AND stopped at, what the
        # members before it all hold); reset whenever an outstanding bit is taken away
        self._unsettled = False
        self._now = 0.0

    # ----------------------------------------------------------------- input
    def add_process_set(self, process_set_id: int, ranks: Iterable[int]) -> None:
        self._scans.pop(process_set_id, None)  # (positions in the members it had, if any)
        self.process_sets[process_set_id] = tuple(ranks)
        self._member_sets[process_set_id] = frozenset(self.process_sets[process_set_id])

    def remove_process_set(self, process_set_id: int) -> None:
        """Forget the set; its names still pending fail on the ranks that submitted them."""
        self._loosen(self.cache.set_bits(process_set_id))
        self._scans.pop(process_set_id, None)
        self.process_sets.pop(process_set_id, None)
        self._member_sets.pop(process_set_id, None)
        self._evictions.extend(self.cache.drop_process_set(process_set_id))
        for key in [k for k in self._pending if k[0] == process_set_id]:
            pending = self._pop_pending(key)
            self._fail_direct(pending.submitters(), _any_request(pending),
                              f"'{key[1]}' cannot complete: process set {process_set_id} was removed while "
                              "it was pending (submit it on every member before remove_process_set())",
                              "mismatch")

    def submit(self, rank: int, request: Request, now: float, by_bit: bool = False,
               data: bytes | None = None) -> None:
        """Record ``rank``'s request (``by_bit``: sent as its cache bit; ``data``: its tensor's bytes, for a
        small allreduce); the name may become ready."""
        key = (request.process_set_id, request.name)
        problem = self._submission_problem(rank, request)
        if problem:
            self._fail_direct((rank,), request, problem, "internal" if self._left else "mismatch")
            return
        if request.kind == OpKind.JOIN:
            self._join(rank, request, now)
            return
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(now)
        pending.requests[rank] = request  # a rank never has one name in flight twice (Engine.submit)
        if by_bit:
            pending.by_bit.add(rank)
        if data is not None:
            pending.data[rank] = data
        self._loosen_key(key)  # the other members' bits of this name must now be per-rank too
        self._check_ready(key)

    def submit_bit(self, rank: int, bit: int, sender_version: int, now: float, data: bytes | None = None) -> bool:
        """Record a cached submission; False if the bit is stale and the rank must resend."""
        entry = self.cache.lookup(bit, sender_version)
        if entry is None or rank not in entry[1]:
            return False
        self.submit(rank, entry[1][rank], now, by_bit=True, data=data)
        return True

    def submit_bits(self, rank: int, bits: int, sender_version: int, now: float,
                    data: dict | None = None) -> list[int]:
        """Record ``rank``'s cached submissions, a mask of cache ``bits`` at ``sender_version`` (``data``:
        bit -> tensor bytes of small allreduces); returns the stale bits, which the rank must resend.

        Bits that need no per-rank attention are only merged into the rank's
        outstanding mask; :meth:`take` finds the names every member sent.
        """
        self._now = now
        stale = bits & self.cache.changed_since(sender_version)
        bits ^= stale
        per_rank = bits & self._loose
        if data:
            for bit in data:
                if bits >> bit & 1 and not per_rank >> bit & 1:
                    self._loosen(1 << bit)
                    per_rank |= 1 << bit
        if self._joined or self._left:
            per_rank = bits
        for bit in _bits_of(per_rank):
            if not self.submit_bit(rank, bit, sender_version, now, data.get(bit) if data else None):
                stale |= 1 << bit
        bits &= ~per_rank
        if bits:
            self._outstanding[rank] = self._outstanding.get(rank, 0) | bits
            self._seen |= bits
            self._unsettled = True
        return list(_bits_of(stale))

    def submit_bits_of(self, ranks: tuple, bits: int, sender_version: int, now: float) -> list[int]:
        """:meth:`submit_bits` for each of ``ranks`` (none of them rank 0), which all sent the same mask and no
        data (a relay's merged submissions); returns the bits found stale, which each must resend.

        In the steady state this merges the mask into each rank's outstanding mask and nothing more.
        """
        if self._joined or self._left or bits & (self._loose | self.cache.changed_since(sender_version)):
            stale = 0
            for rank in ranks:
                for bit in self.submit_bits(rank, bits, sender_version, now):
                    stale |= 1 << bit
            return list(_bits_of(stale))
        self._now = now
        outstanding = self._outstanding
        if outstanding.keys().isdisjoint(ranks):  # the usual step: their first mask since their last names ran
            outstanding.update(dict.fromkeys(ranks, bits))
        else:
            for rank in ranks:
                outstanding[rank] = outstanding.get(rank, 0) | bits
        self._seen |= bits
        self._unsettled = True
        return []

    def rank_left(self, rank: int, reason: str) -> None:
        """``rank`` has shut down or died: fail every name that now cannot complete."""
        self._loosen(self._seen)
        self._left.add(rank)
        self._outstanding.pop(rank, None)
        self._scans.clear()
        if rank in self._joined:
            self._joined.remove(rank)
        for key in list(self._pending):
            members = self.process_sets.get(key[0], ())
            if rank in self._member_sets.get(key[0], ()):
                pending = self._pop_pending(key)
                request = _any_request(pending)
                targets = tuple(r for r in members if r not in self._left)
                self._fail_direct(targets, request, f"'{key[1]}' cannot complete: {reason}", "internal")
        if self._joined:
            self._fail_direct(tuple(self._joined), Request(JOIN_NAME, OpKind.JOIN, 0),
                              f"join() cannot complete: {reason}", "internal")
            self._joined.clear()

    def live_ranks(self) -> list[int] | range:
        """The ranks that have not shut down or been lost."""
        if not self._left:
            return range(self.size)
        return [r for r in range(self.size) if r not in self._left]

    def missing_ranks(self, process_set_id: int, name: str) -> tuple | None:
        """The ranks a pending name still waits for (joined ranks excepted); None if it is not pending."""
        if name == JOIN_NAME:
            return tuple(r for r in self.live_ranks() if r not in self._joined)
        self._loosen_key((process_set_id, name))
        pending = self._pending.get((process_set_id, name))
        if pending is None:
            return None
        members = self.process_sets.get(process_set_id, ())
        return tuple(r for r in members if not pending.has(r) and r not in self._joined)

    def fail_waits(self, waits: Iterable[tuple], message: str) -> None:
        """Fail the pending names in ``waits`` ((set id, name, label) triples) on the ranks that submitted them."""
        for set_id, name, _ in waits:
            if name == JOIN_NAME:
                if self._joined:
                    self._fail_direct(tuple(self._joined), Request(JOIN_NAME, OpKind.JOIN, 0), message,
                                      "deadlock")
                    self._joined.clear()
                continue
            self._loosen_key((set_id, name))
            if (set_id, name) in self._pending:
                pending = self._pop_pending((set_id, name))
                self._fail_direct(pending.submitters(), _any_request(pending), message, "deadlock")

    # ---------------------------------------------------------------- output
    def take(self, fusion_threshold: int) -> list[tuple[tuple, Batch]]:
        """The batches ready to run, each with the global ranks to send it to, in execution order.

        Ready entries that may share a backend call are fused up to
        ``fusion_threshold`` bytes; with ``separate_groups``, the tensors of a
        grouped call only with each other, and other tensors only with other
        ungrouped ones.
        """
        self._settle()
        if self._seen and self.cache.full():  # a cache put may evict a bit still outstanding
            self._loosen(self._seen)
        plan_key = self._plan_key(fusion_threshold)
        plan = self._plans.get(plan_key) if plan_key else None
        if plan is not None:  # the same entries as a step before: the same batches, nothing put in the cache
            batches, self._compact = plan
            self._ready.clear()
            self._ready_from_masks = 0
            self._agreed_requests.clear()
            self._from_cache.clear()
            return self.take_direct() + batches
        out: list = []  # (members, Batch) as it came, or [members, entries, bytes, request, joined] to fuse
        open_batches: dict[tuple, list] = {}
        for entry, extra in self._ready:
            if entry is None:
                out.append((self.process_sets.get(extra.process_set_id, ()), extra))
                continue
            request = entry.request
            members: tuple = self.process_sets[request.process_set_id]
            nbytes = entry_bytes(entry)
            # entries reduced here fuse only with each other (their batch needs no transport), and no
            # further than a control message carries
            reduced = (request.process_set_id, entry.name) in self._reduced
            fusion_key = (request.fusion_key(), extra, reduced, request.group if self._separate_groups else "")
            limit = min(fusion_threshold, small_allreduce.MESSAGE_DATA_BYTES) if reduced else fusion_threshold
            slot = open_batches.get(fusion_key)
            if (slot is not None and request.kind in _FUSABLE
                    and slot[2] + nbytes <= limit):
                slot[1].append(entry)
                slot[2] += nbytes
                continue
            slot = [members, [entry], nbytes, request, extra]
            out.append(slot)
            if request.kind in _FUSABLE:
                open_batches[fusion_key] = slot
        self._ready.clear()
        self._ready_from_masks = 0
        batches = []
        for item in out:
            if isinstance(item[1], Batch):
                batches.append((item[0], item[1]))
                continue
            members, entries, _, request, joined = item
            last = joined[-1] if request.kind == OpKind.JOIN else -1
            entries = tuple(self._cached(entry, joined) for entry in entries)
            batches.append((members, Batch(request.kind, request.process_set_id, entries,
                                           joined=joined, last_joined=last)))
        self._compact = {}
        evicted = {bit for bit, _ in self._evictions}
        for index, (members, batch) in enumerate(batches):
            compact = batch.kind in _COMPACT and batch.error is None and all(
                self._from_cache.get((batch.process_set_id, e.name), -1) == e.cache_bit >= 0
                and e.cache_bit not in evicted for e in batch.entries)
            if compact:
                batch = batch._replace(entries=tuple(sorted(batch.entries, key=lambda e: e.cache_bit)))
            if batch.error is None and (batch.process_set_id, batch.entries[0].name) in self._reduced:
                batch = batch._replace(reduced=b"".join(self._reduced.pop((batch.process_set_id, e.name))
                                                        for e in batch.entries))
            batches[index] = (members, batch)
            if compact:
                self._compact[id(batch)] = CachedBatch(batch.kind, batch.process_set_id,
                                                       sum(1 << e.cache_bit for e in batch.entries), batch.reduced)
        self._from_cache.clear()
        if plan_key and not self._evictions:  # (nothing was put in the cache)
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            self._plans[plan_key] = (batches, self._compact)
        return self.take_direct() + batches

    def _plan_key(self, fusion_threshold: int) -> tuple | None:
        """What identifies this take's batches when every ready entry is an agreed entry from masks (whose
        ids stay unique while a kept plan holds them) and no eviction is pending; else None."""
        if not self._ready or self._ready_from_masks != len(self._ready) or self._evictions:
            return None
        return (fusion_threshold, *map(id, map(_FIRST, self._ready)))

    def compact_form(self, batch: Batch) -> CachedBatch | None:
        """The bits standing for ``batch``, one of the last ``take()``'s, for its members other than rank 0.

        Only for a batch whose every name each of those members submitted as an
        unchanged cache bit (they hold its requests), still cached under that
        bit after this take's evictions; its entries are in bit order.
        """
        return self._compact.get(id(batch))

    def take_direct(self) -> list[tuple[tuple, Batch]]:
        """Only the failures addressed to some ranks directly (sent without waiting for the cycle)."""
        direct, self._direct = self._direct, []
        return direct

    def has_ready(self) -> bool:
        self._settle()
        return bool(self._ready or self._direct)

    def has_direct(self) -> bool:
        return bool(self._direct)

    def set_cache_capacity(self, capacity: int) -> None:
        """Resize the response cache (0 turns it off); entries that no longer fit are evicted."""
        self._loosen(self._seen)
        self._evictions.extend(self.cache.resize(capacity))

    def take_evictions(self) -> list[tuple[int, tuple]]:
        """Cache entries dropped since the last call, as (bit, (process_set_id, name))."""
        evicted, self._evictions = self._evictions, []
        return evicted

    def has_pending(self) -> bool:
        self._settle()
        return bool(self._pending or self._seen)

    def stalled(self, now: float, after_s: float) -> list[tuple[str, int, list[int], list[int], float]]:
        """Names waiting longer than ``after_s`` and not yet reported: (name, set id, missing, present, waited)."""
        self._loosen_waiting(now, after_s)
        report = []
        for (ps_id, name), pending in self._pending.items():
            waited = now - pending.since
            if pending.warned or waited < after_s:
                continue
            pending.warned = True
            members = self.process_sets.get(ps_id, ())
            missing = [r for r in members if not pending.has(r) and r not in self._joined]
            report.append((name, ps_id, missing, list(pending.submitters()), waited))
        return report

    def fail_stalled(self, now: float, after_s: float) -> None:
        """Fail on every member the names that have waited longer than ``after_s``."""
        self._loosen_waiting(now, after_s)
        for key in [k for k, p in self._pending.items() if now - p.since >= after_s]:
            pending = self._pop_pending(key)
            members = self.process_sets.get(key[0], ())
            missing = [r for r in members if not pending.has(r) and r not in self._joined]
            request = _any_request(pending)
            self._fail_direct(members, request, (
                f"'{key[1]}' stalled for {now - pending.since:.0f} s waiting for rank(s) "
                f"{', '.join(map(str, missing))}; shutting it down (stall shutdown time reached)"), "internal")

    # ------------------------------------------------------------- internals
    def _submission_problem(self, rank: int, request: Request) -> str | None:
        """Why ``rank`` may not submit ``request``, or None; O(1) but for ranks that have left."""
        members = self._member_sets.get(request.process_set_id)
        if members is None:
            return (f"process set {request.process_set_id} is not registered (it was removed, or "
                    "add_process_set() was not called on every rank)")
        if rank not in members:
            return (f"rank {rank} is not a member of process set {request.process_set_id} "
                    f"{list(self.process_sets[request.process_set_id])}")
        gone = sorted(r for r in self._left if r in members)
        if gone:
            return (f"'{request.name}' cannot run: rank(s) {', '.join(map(str, gone))} of its process "
                    "set have already shut down (a rank finished or failed before the others)")
        return None

    def _settle(self) -> None:
        """Make ready the cached names whose bit every member has sent by mask.

        Masks only gain bits until names complete, so an AND that stopped at a
        member lacking the candidates resumes there next time, when the
        candidates are among those the members before it all hold: the members
        of a set are scanned about once per completion, however the masks arrive.
        """
        if not self._unsettled:
            return
        self._unsettled = False
        completed = False
        for set_id, set_bits in self.cache.bits_by_set():
            candidates = set_bits & self._seen & ~self._loose
            members = self.process_sets.get(set_id) if candidates else None
            if members is None or len(self._outstanding) < len(members):  # some member holds no bit at all
                continue
            start, held = self._scans.get(set_id, (0, 0))
            if candidates & ~held:
                start = 0
            outstanding = self._outstanding
            common = functools.reduce(operator.and_, map(outstanding.get, itertools.islice(members, start, None),
                                                         itertools.repeat(0)), candidates)
            if not common:  # find the member the AND ran dry at, to resume there
                for index in range(start, len(members)):
                    before = candidates
                    candidates &= outstanding.get(members[index], 0)
                    if not candidates:
                        self._scans[set_id] = (index, before)
                        break
                continue
            candidates = common
            completed = True
            self._scans.clear()
            if set(outstanding.values()) == {candidates}:  # the usual step: every rank held just these
                self._outstanding = {}
            else:
                self._outstanding = {rank: rest for rank, held in outstanding.items()
                                     if (rest := held & ~candidates)}
            self._ready_from_cache(set_id, candidates, members)
        seen = self._seen  # exact, unless names just completed
        if completed:
            seen = 0
            for held in self._outstanding.values():
                seen |= held
        self._forget_seen(self._settled & ~seen)
        if seen & ~self._settled:
            self._seen_since.append((self._now, seen & ~self._settled))
        self._seen = self._settled = seen

    def _forget_seen(self, bits: int) -> None:
        """``bits`` are no longer outstanding: drop them from the record of when bits were first seen."""
        if bits:
            self._seen_since = [(when, rest) for when, held in self._seen_since if (rest := held & ~bits)]

    def _loosen(self, bits: int) -> None:
        """Turn the outstanding ``bits`` into per-rank submissions, and keep the pending ones per-rank
        until they complete."""
        moving = bits & self._seen
        self._seen ^= moving
        self._settled &= ~moving
        since = {bit: when for when, held in self._seen_since for bit in _bits_of(held & moving)}
        self._forget_seen(moving)
        for bit in _bits_of(bits & ~moving & ~self._loose):
            if self.cache.entry_key(bit) in self._pending:
                self._loose |= 1 << bit
        self._loose |= moving
        if not moving:
            return
        self._scans.clear()
        for rank, held in list(self._outstanding.items()):
            taken = held & moving
            if not taken:
                continue
            self._outstanding[rank] = held ^ taken
            for bit in _bits_of(taken):
                _, requests = self.cache.entry(bit)
                self.submit(rank, requests[rank], since.get(bit, self._now), by_bit=True)

    def _loosen_key(self, key: tuple) -> None:
        bit = self.cache.get_bit(key)
        if bit >= 0 and not self._loose >> bit & 1:
            self._loosen(1 << bit)

    def _loosen_waiting(self, now: float, after_s: float) -> None:
        """Loosen the outstanding bits first seen ``after_s`` or longer ago (to report or fail them)."""
        self._settle()
        old = 0
        for when, held in self._seen_since:
            if now - when >= after_s:
                old |= held
        if old:
            self._loosen(old)

    def _ready_from_cache(self, set_id: int, bits: int, members: tuple) -> None:
        """Every member of set ``set_id`` sent ``bits``: their cached requests, agreed before, run again as
        they are (never a pending name's: those bits are loose).

        The same bits ready together at the same cache version make the same entries ready: a steady
        step's names are found as one group, not bit by bit.
        """
        cache = self.cache
        group = self._cached_groups.get((set_id, bits))
        if group is None or group[0] != cache.version:
            ready, agreed, from_cache = [], {}, {}
            for bit in _bits_of(bits):
                key, requests = cache.entry(bit)
                known = self._cached_entries.get(bit)
                if known is None or known[0] is not requests:  # first time under this bit, or the entry changed
                    entry = self._agreed_entry(key, requests, members, ())
                    known = self._cached_entries[bit] = (requests, entry._replace(cache_bit=bit))
                ready.append((known[1], ()))
                agreed[key] = requests
                from_cache[key] = bit
            if len(self._cached_groups) >= _PLANS_KEPT:
                self._cached_groups.clear()
            group = self._cached_groups[(set_id, bits)] = (cache.version, ready, agreed, from_cache)
        else:
            cache.touch(group[2])  # used now, as entry() marks them
        self._ready.extend(group[1])
        self._agreed_requests.update(group[2])  # take() checks they are still cached under the bits
        self._from_cache.update(group[3])
        self._ready_from_masks += len(group[1])

    def _pop_pending(self, key: tuple) -> _Pending:
        """Stop tracking the pending name ``key`` (one that is pending) and return it."""
        pending = self._pending.pop(key)
        if self._loose:
            bit = self.cache.get_bit(key)
            if bit >= 0:
                self._loose &= ~(1 << bit)
        return pending

    def _fail_direct(self, targets: tuple, request: Request, message: str, error_type: str) -> None:
        entry = Entry(request.name, request)
        self._direct.append((targets, Batch(request.kind, request.process_set_id, (entry,),
                                            error=message, error_type=error_type)))

    def _join(self, rank: int, request: Request, now: float) -> None:
        self._loosen(self._seen)  # while ranks are joined, every name is checked rank by rank
        if rank not in self._joined:
            self._joined.append(rank)
        for key in list(self._pending):
            self._check_ready(key)
        live = [r for r in range(self.size) if r not in self._left]
        if set(self._joined) >= set(live):
            joined = tuple(self._joined)
            self._joined.clear()
            self._ready.append((Entry(JOIN_NAME, request), joined))

    def _check_ready(self, key: tuple) -> None:
        pending = self._pending.get(key)
        if pending is None:  # completed already, by the submissions a _loosen() made
            return
        members = self.process_sets[key[0]]
        if self._joined:
            member_set = self._member_sets[key[0]]
            joined = tuple(r for r in self._joined if r in member_set)
            if any(r not in pending.requests for r in members if r not in joined):
                return
        elif len(pending.requests) < len(members):  # only members submit, each once: a count will do
            return
        else:
            joined = ()
        self._pop_pending(key)
        requests = pending.requests
        if not joined and (
                all(r in pending.by_bit for r in members if r != 0) and self.cache.requests(key) == requests):
            # the very requests agreed and cached before: nothing to check again, and every
            # other member can rebuild the batch from its own cache
            self._from_cache[key] = self.cache.get_bit(key)
        else:
            problem = _disagreement(key[1], pending, members, joined)
            if problem:
                request = _any_request(pending)
                self._ready.append((None, Batch(request.kind, key[0], (Entry(key[1], request),),
                                                error=problem)))
                return
        entry = self._agreed_entry(key, requests, members, joined)
        self._agreed_requests[key] = requests  # no longer changed: the pending name is gone
        if not joined and len(pending.data) == len(members) and \
                small_allreduce.eligible(entry.request, self._reduce_bytes):
            reduced = small_allreduce.reduce(entry.request, [pending.data[r] for r in members])
            if reduced is not None:
                self._reduced[key] = reduced
        self._ready.append((entry, joined))

    def _agreed_entry(self, key, requests: dict, members: tuple, joined: tuple) -> Entry:
        request = requests[members[0] if members[0] in requests else min(requests)]  # the lowest rank's
        first_dims = splits = None
        if request.kind == OpKind.ALLGATHER:
            first_dims = tuple(requests[r].shape[0] if r in requests else 0 for r in members)
        elif request.kind == OpKind.ALLTOALL:
            splits = tuple(requests[r].splits if r in requests else (0,) * len(members) for r in members)
        return Entry(key[1], request, first_dims, splits)

    def _cached(self, entry: Entry, joined: tuple) -> Entry:
        """``entry`` with the cache bit it is stored under, if it can be cached.

        Called in execution order: ranks replay the cache changes in the order
        they receive the entries, so the coordinator must make them in that order.
        """
        key = (entry.request.process_set_id, entry.name)
        requests = self._agreed_requests.pop(key, None)
        if requests is not None and requests is self.cache.requests(key):  # still cached as agreed
            return entry  # (ready from masks: it carries the bit already)
        if requests is None or joined or not all(r.cacheable for r in requests.values()):
            return entry
        bit, evicted = self.cache.put(key, requests)
        self._evictions.extend(evicted)
        if bit >= 0 and key in self._pending:  # submitted again already: its masks count rank by rank
            self._loose |= 1 << bit
        return entry._replace(cache_bit=bit)


def _any_request(pending: _Pending) -> Request:
    """One of the requests submitted for a pending name."""
    return next(iter(pending.requests.values()))


def entry_bytes(entry: Entry) -> int:
    """The size of ``entry``'s tensor in bytes (an allgather's: the gathered result)."""
    request = entry.request
    itemsize = ITEMSIZE.get(request.dtype, 8)
    if entry.first_dims is not None:
        row = math.prod(request.shape[1:])
        return sum(entry.first_dims) * row * itemsize
    return math.prod(request.shape) * itemsize


def _disagreement(name: str, pending: _Pending, members: tuple, joined: tuple) -> str | None:
    """Why the submitted requests for ``name`` cannot run together, or None."""
    requests = pending.requests
    own_errors = {r: q.error for r, q in requests.items() if q.error}
    if own_errors:
        return f"'{name}' failed on rank(s) {', '.join(map(str, sorted(own_errors)))}: " + \
            "; ".join(f"rank {r}: {e}" for r, e in sorted(own_errors.items()))
    first = next(iter(requests.values()))
    if not all(q == first for q in requests.values()):  # identical requests (the steady state) agree
        problem = _field_disagreement(name, requests)
        if problem:
            return problem
    kind = first.kind
    if joined and kind in _NOT_WITH_JOIN:
        return (f"{kind.label} '{name}' cannot run while rank(s) {', '.join(map(str, joined))} have called "
                "join(); only allreduce (with joined ranks contributing zeros) and barrier can, as in Horovod")
    if kind == OpKind.BROADCAST:
        if first.root_rank not in members:  # a global rank, as in Horovod
            return (f"broadcast '{name}': root_rank {first.root_rank} is not a member of the process "
                    f"set {list(members)}")
        if first.root_rank in joined:
            return f"broadcast '{name}': root rank {first.root_rank} has already called join()"
    if kind == OpKind.REDUCESCATTER and len(first.shape) == 0:
        return f"reducescatter '{name}': a 0-d tensor cannot be scattered; give it at least one dimension"
    if kind == OpKind.ALLTOALL:
        for r, q in requests.items():
            if len(q.splits or ()) != len(members):
                return (f"alltoall '{name}': rank {r} gave {len(q.splits or ())} splits but the process "
                        f"set has {len(members)} ranks")
    return None


def _field_disagreement(name: str, requests: dict) -> str | None:
    """The first field on which the ranks' requests for ``name`` must agree but do not."""
    kinds = {r: q.kind.label for r, q in requests.items()}
    if len(set(kinds.values())) > 1:
        return f"Mismatched collective operations for '{name}': {describe_ranks(kinds)}"
    kind = next(iter(requests.values())).kind
    checks = [("data types", lambda q: q.dtype), ("devices", lambda q: q.device)]
    if kind in (OpKind.ALLREDUCE, OpKind.REDUCESCATTER):
        checks += [("reduction ops", lambda q: ReduceOp(q.reduce_op).name),
                   ("prescale factors", lambda q: q.prescale),
                   ("postscale factors", lambda q: q.postscale)]
    if kind in (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER):
        checks.append(("tensor shapes", lambda q: q.shape))
    if kind in (OpKind.ALLGATHER, OpKind.ALLTOALL):
        checks += [("tensor ranks", lambda q: len(q.shape)),
                   ("tensor shapes (beyond the first dimension)", lambda q: q.shape[1:])]
    if kind == OpKind.BARRIER:
        checks.append(("process set ranks", lambda q: q.shape))
    if kind == OpKind.BROADCAST:
        checks.append(("root ranks", lambda q: q.root_rank))
    for what, field in checks:
        values = {r: field(q) for r, q in requests.items()}
        if len(set(values.values())) > 1:
            return f"Mismatched {kind.label} {what} for '{name}': {describe_ranks(values)}"
    return None
