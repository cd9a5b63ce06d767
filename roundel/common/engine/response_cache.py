"""The response cache: negotiated names remembered under small bit numbers.

Once a name has been agreed, a rank that submits it again with the same
request sends only its bit. The coordinator owns the cache and announces every
change in its messages; ranks keep a mirror. Each change bumps a version
number that travels with both sides' messages, so the coordinator can tell
when a rank used a bit that has since been evicted or reassigned and ask it to
send the full request instead.
"""

from __future__ import annotations

import collections

from roundel.common.control.records import Batch, CachedBatch, Entry, Request

Key = tuple  # (process_set_id, name)


class CoordinatorCache:
    """The authoritative cache, kept by the coordinator on rank 0."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.version = 0
        self._bits: "collections.OrderedDict[Key, int]" = collections.OrderedDict()
        self._entries: dict[int, tuple[Key, dict]] = {}
        self._changed_at: dict[int, int] = {}
        self._set_bits: dict[int, int] = {}  # process set id -> mask of its names' bits
        self._stale: tuple[int, int, int] = (-1, -1, 0)  # (version, sender version, changed_since's mask)

    def lookup(self, bit: int, sender_version: int) -> tuple[Key, dict] | None:
        """The (key, requests by rank) under ``bit``, or None if the sender's view is stale."""
        entry = self._entries.get(bit)
        if entry is None or self._changed_at.get(bit, 0) > sender_version:
            return None
        self._bits.move_to_end(entry[0])
        return entry

    def entry(self, bit: int) -> tuple[Key, dict]:
        """The (key, requests by rank) under ``bit``, whatever the sender's version; marks it used."""
        entry = self._entries[bit]
        self._bits.move_to_end(entry[0])
        return entry

    def touch(self, keys) -> None:
        """Mark the cached ``keys`` used (the least recently used entry is evicted first)."""
        move = self._bits.move_to_end
        for key in keys:
            move(key)

    def entry_key(self, bit: int) -> Key | None:
        """The key under ``bit``, or None."""
        entry = self._entries.get(bit)
        return None if entry is None else entry[0]

    def changed_since(self, sender_version: int) -> int:
        """The mask of bits evicted or reassigned after ``sender_version`` (stale in a sender's view)."""
        if sender_version >= self.version:
            return 0
        if self._stale[:2] != (self.version, sender_version):
            mask = 0
            for bit, changed in self._changed_at.items():
                if changed > sender_version:
                    mask |= 1 << bit
            self._stale = (self.version, sender_version, mask)
        return self._stale[2]

    def bits_by_set(self):
        """(process set id, mask of the bits of its names) pairs."""
        return self._set_bits.items()

    def set_bits(self, process_set_id: int) -> int:
        """The mask of the bits of process set ``process_set_id``'s names."""
        return self._set_bits.get(process_set_id, 0)

    def full(self) -> bool:
        """Whether the next new entry evicts one."""
        return len(self._bits) >= self.capacity

    def requests(self, key: Key) -> dict | None:
        """The requests (by rank) cached under ``key``, or None."""
        bit = self._bits.get(key, -1)
        return self._entries[bit][1] if bit >= 0 else None

    def get_bit(self, key: Key) -> int:
        """The bit ``key`` is cached under, or -1."""
        return self._bits.get(key, -1)

    def bit_of(self, key: Key, rank: int, request) -> int:
        """The bit ``key`` is cached under if ``rank``'s cached request is ``request``, else -1."""
        bit = self._bits.get(key, -1)
        return bit if bit >= 0 and self._entries[bit][1].get(rank) == request else -1

    def put(self, key: Key, requests: dict) -> tuple[int, list[tuple[int, Key]]]:
        """Cache ``requests`` (by rank) under ``key``; return its bit and the entries evicted."""
        if self.capacity <= 0:
            return -1, []
        evicted = []
        bit = self._bits.get(key, -1)
        if bit >= 0:
            if self._entries[bit][1] == requests:
                self._bits.move_to_end(key)
                return bit, []
        elif len(self._bits) < self.capacity:
            bit = len(self._bits)
            while bit in self._entries:
                bit += 1
        else:
            old_key, bit = self._bits.popitem(last=False)
            evicted.append((bit, old_key))
            self._set_bits[old_key[0]] &= ~(1 << bit)
        self._set_bits[key[0]] = self._set_bits.get(key[0], 0) | 1 << bit
        self.version += 1
        self._bits[key] = bit
        self._bits.move_to_end(key)
        self._entries[bit] = (key, requests)
        self._changed_at[bit] = self.version
        return bit, evicted

    def resize(self, capacity: int) -> list[tuple[int, Key]]:
        """Hold at most ``capacity`` entries from now on; return the (bit, key) pairs evicted to fit."""
        self.capacity = capacity
        evicted = []
        while len(self._bits) > max(capacity, 0):
            key, bit = self._bits.popitem(last=False)
            del self._entries[bit]
            self._set_bits[key[0]] &= ~(1 << bit)
            evicted.append((bit, key))
        if evicted:
            self.version += 1
            for bit, _ in evicted:
                self._changed_at[bit] = self.version
        return evicted

    def drop_process_set(self, process_set_id: int) -> list[tuple[int, Key]]:
        """Forget every name of a removed process set; return the dropped (bit, key) pairs."""
        dropped = [(bit, key) for key, bit in self._bits.items() if key[0] == process_set_id]
        self._set_bits.pop(process_set_id, None)
        if dropped:
            self.version += 1
        for bit, key in dropped:
            del self._bits[key]
            del self._entries[bit]
            self._changed_at[bit] = self.version
        return dropped


class RankCache:
    """A rank's mirror of the coordinator's cache: which of its requests have bits."""

    def __init__(self):
        self.version = 0
        self._by_key: dict[Key, tuple[int, Request]] = {}
        self._keys_by_bit: dict[int, Key] = {}
        self._global_bits = 0

    def bit_for(self, key: Key, request: tuple) -> int:
        """The bit to send for ``request`` under ``key``, or -1 to send it in full."""
        cached = self._by_key.get(key)
        if cached is not None and cached[1] == request:
            return cached[0]
        return -1

    def record(self, key: Key, bit: int, request: Request) -> None:
        """Remember that the coordinator cached ``request`` under ``bit``."""
        stale = self._keys_by_bit.pop(bit, None)
        if stale is not None and stale != key:
            self._by_key.pop(stale, None)
        previous = self._by_key.get(key)
        if previous is not None and previous[0] != bit:
            self._keys_by_bit.pop(previous[0], None)
            self._global_bits &= ~(1 << previous[0])
        self._by_key[key] = (bit, request)
        self._keys_by_bit[bit] = key
        if key[0] == 0:
            self._global_bits |= 1 << bit
        else:
            self._global_bits &= ~(1 << bit)

    def global_set_bits(self) -> int:
        """The mask of this mirror's bits whose names are in the global process set (id 0)."""
        return self._global_bits

    def expand(self, cached: CachedBatch) -> Batch:
        """The batch a ``CachedBatch`` stands for, from this rank's cached requests.

        Raises KeyError for a bit this mirror does not hold (a protocol error).
        """
        entries, bits, bit = [], cached.bits, 0
        while bits:
            if bits & 1:
                key = self._keys_by_bit[bit]
                entries.append(Entry(key[1], self._by_key[key][1], cache_bit=bit))
            bits >>= 1
            bit += 1
        return Batch(cached.kind, cached.process_set_id, tuple(entries), reduced=cached.reduced)

    def evict(self, bits) -> None:
        """Forget the entries under ``bits``."""
        for bit in bits:
            key = self._keys_by_bit.pop(bit, None)
            if key is not None:
                self._by_key.pop(key, None)
            self._global_bits &= ~(1 << bit)
