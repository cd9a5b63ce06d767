"""Relays: one rank per host carries its host's control messages to rank 0, merging their cache bits.

Without relays rank 0 reads, checks and answers one frame per rank per
cycle, about 30 µs each in Python: 30 ms per cycle at 1,024 ranks. In a job
of at least ``relay_from_ranks`` ranks, each host's first rank (local rank 0)
is a relay instead: the other ranks of its host connect to it, and the
hosts' relays form a tree with at most ``relay_fanout`` of them under each
relay (:func:`parent_key`). On rank 0's own host the second rank relays, for
the others there and for the top of the tree, and is rank 0's only child:
rank 0 hears one frame per step, not one per rank or per host. Where rank 0
is alone on its host, the top of the tree connects to rank 0 itself.

Upward, a relay holds the steady-state submissions of the ranks below it (a
mask of cache bits and nothing else) and sends them on as one ``Merged``
message, grouped by mask, when a name can go no further without the ranks
above. It keeps its part of the AND rank 0 takes: the bits its own rank and
each child have sent since they last all had (a child relay's part is what
its whole subtree has, which it reports in ``Merged.matched``). What is held
goes up as soon as that AND gains a bit; after the cycle time when a bit
held is not one of the global process set's (its set may not need the
others); else after ``SUBTREE_WAIT_S``. Rank 0 thus hears one message per
child and step however the ranks' submissions are spread in time. A rank in
``join()`` is left out of the AND until it submits again. Each rank's time
held travels with it, for rank 0's straggler record. Anything else a rank
sends goes up as ``Relayed`` after what was held, so each rank's messages
keep their order. ``Joined`` and ``Lost`` tell the ranks above of the ranks
below.

Downward, rank 0 sends each child a ``Deliver`` (ranks, encoded message);
a relay hands its own rank's share to its link, sends the message as it is
to each child it names, and a ``Deliver`` of their own to children that
relay for ranks it names (:func:`fan_out`).

A relay heartbeats its children and watches them as the coordinator watches
its peers: a child that dies or goes silent is reported up as ``Lost``, which
breaks the job. A relay that loses the rank above it tells its children why
(``Abort``); when a relay dies, its children lose their connection and break.
"""

from __future__ import annotations

import array
import functools
import itertools
import json
import logging
import operator
import queue
import selectors
import time
from typing import Callable

from roundel.common.control import channel as control_channel, codec as control_codec
from roundel.common.control.messages import Abort, Bye, Deliver, Heartbeat, Joined, Lost, Merged, Relayed, Submit
from roundel.common.control.records import OpKind
from roundel.common.engine.liveness import HEARTBEAT_S, describe_silence

log = logging.getLogger("roundel")

BYE = control_codec.encode(Bye())  # a goodbye, as every rank encodes it
SUBTREE_WAIT_S = 0.05  # the default of Relay's subtree_wait_s


def host_key(prefix: str, host: str) -> str:
    """Where the relay of ``host`` (or rank 0, on its own host) publishes its address."""
    return f"{prefix}relay/host/{host}"


def leader_key(prefix: str, cross_rank: int) -> str:
    """Where the relay of the host with cross rank ``cross_rank`` publishes its address."""
    return f"{prefix}relay/leader/{cross_rank}"


def relay_local_rank(cross_rank: int) -> int:
    """The local rank that relays for its host: the first, but the second on rank 0's host (cross rank 0),
    whose first is rank 0 itself."""
    return 1 if cross_rank == 0 else 0


def parent_key(prefix: str, host: str, local_rank: int, cross_rank: int, fanout: int) -> str | None:
    """The key of the address a rank other than 0 connects to when relays are on; None: rank 0's own.

    A rank that does not relay connects to its host's relay. The relay on rank 0's host connects to
    rank 0; any other connects to the relay of host ``(cross_rank - 1) // fanout``: the relays form a
    tree of ``fanout`` under each, with rank 0's host's relay at the top (or rank 0, alone on its host,
    which then publishes its own address under that key).
    """
    if local_rank != relay_local_rank(cross_rank):
        return host_key(prefix, host)
    return None if cross_rank == 0 else leader_key(prefix, (cross_rank - 1) // fanout)


def address_record(rank: int, address: str, host: str, local_name: str | None) -> bytes:
    """What a relay (or rank 0) publishes under its keys: its rank, ``host:port``, host, local socket."""
    return json.dumps({"rank": rank, "address": address, "host": host, "local": local_name}).encode()


def fan_out(ranks, route: dict) -> dict[int, list]:
    """``ranks`` by the child they are reached through (``route``: rank -> child); unknown ranks are left out."""
    by_child: dict[int, list] = {}
    for rank in ranks:
        child = route.get(rank)
        if child is not None:
            by_child.setdefault(child, []).append(rank)
    return by_child


def addressed(child: int, targets: list, payload: bytes) -> bytes:
    """What goes to ``child`` so that ``payload`` reaches ``targets`` (the child alone: the payload itself)."""
    if len(targets) == 1 and targets[0] == child:
        return payload
    return control_codec.encode(Deliver(tuple(targets), payload))


def mergeable(message) -> bool:
    """True for a steady submission, cache bits and nothing else, which a relay holds and merges; anything
    else goes up as it is."""
    return type(message) is Submit and not message.full and not message.bit_data and not message.resent


def pack_group(ranks, bits: int, held) -> tuple:
    """One group of a ``Merged`` message: the ranks (uint32) and the seconds each was held (float32) as
    bytes, which decode at C speed however many ranks there are."""
    return array.array("I", ranks).tobytes(), bits, array.array("f", held).tobytes()


def unpack_group(group) -> tuple:
    """(ranks, mask, seconds held) of a packed group; ValueError when it is malformed."""
    try:
        packed_ranks, bits, packed_held = group
        ranks, held = array.array("I", packed_ranks), array.array("f", packed_held)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a malformed group of merged submissions ({exc})") from None
    if not isinstance(bits, int) or len(ranks) != len(held):
        raise ValueError("a malformed group of merged submissions")
    return ranks, bits, held


def to_all_below(payload: bytes) -> bytes:
    """What goes to a relay so that ``payload`` reaches it and every rank below it."""
    return control_codec.encode(Deliver((), payload))


class Relay:
    """The relay on a host's relaying rank: its children's connections, merged upward and fanned out downward.

    Runs on that rank's engine thread, in its ``selector`` (children are
    registered with the data ``("child", rank)``: pass their events to
    :meth:`serve`). ``up(message)`` sends a message to the rank above;
    ``wake()`` interrupts the thread's select when a child connects;
    ``global_bits()`` is the mask of cache bits this rank knows as names of
    the global process set; ``above_is_relay``: the rank above is a relay,
    not rank 0 (a rank's link sets it once it has connected);
    ``subtree_wait_s``: how long a global name's submissions wait for the
    rest of the subtree at most.
    """

    def __init__(self, rank: int, size: int, secret: bytes, advertise_host: str, selector,
                 up: Callable[[object], None], wake: Callable[[], None], hold_s: float,
                 heartbeat_timeout_s: float, host: str, global_bits: Callable[[], int] = int,
                 above_is_relay: bool = False, subtree_wait_s: float = SUBTREE_WAIT_S):
        self.rank = rank
        self._size = size
        self._selector = selector
        self._up = up
        self._host = host
        self._hold_s = hold_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._children: dict[int, control_channel.Connection] = {}
        self._readers: dict[int, control_channel.FrameReader] = {}
        self._heard: dict[int, float] = {}
        self._hosts: dict[int, str] = {}
        self._route: dict[int, int] = {}  # rank below -> the child it is reached through (a child: itself)
        self._held: dict[int, list] = {}  # rank -> [mask, when held here, seconds held below]
        self._held_bits = 0  # every bit held
        self._held_version = 0
        self._held_since: float | None = None
        self._unmatched: dict[int, int] = {}  # own rank or child -> bits sent that not all of them have yet
        self._unchecked = False  # more sent since the subtree's AND was last taken
        self._in_join: set[int] = set()
        self._global_bits = global_bits
        self.above_is_relay = above_is_relay
        self._subtree_wait_s = subtree_wait_s
        self._accepted: "queue.SimpleQueue" = queue.SimpleQueue()
        self._last_heartbeat = 0.0
        self._wake = wake
        self.listener = control_channel.Listener(advertise_host, secret, self._connection_accepted,
                                                 send_timeout_s=heartbeat_timeout_s)

    @property
    def children(self) -> int:
        """How many ranks are connected to this relay."""
        return len(self._children)

    def _connection_accepted(self, connection: control_channel.Connection) -> None:
        self._accepted.put(connection)
        self._wake()

    # ------------------------------------------------------------------ upward
    def hold(self, version: int, rank: int, bits: int, waited: float, now: float) -> None:
        """Hold ``rank``'s mask of cache ``bits`` (at cache ``version``, already held ``waited`` seconds)."""
        self._at_version(version, now)
        entry = self._held.get(rank)
        if entry is None:
            self._held[rank] = [bits, now, waited]
            if self._held_since is None:
                self._held_since = now
        else:
            entry[0] |= bits
        self._held_bits |= bits
        if rank == self.rank:
            self._sent(rank, bits)

    def note_sent(self, rank: int, message) -> None:
        """``message``, of this relay's own rank or a child's, goes up as it is (not held): its cache bits
        count for the subtree's AND, and a ``join()`` leaves the rank out of it until it submits again."""
        if type(message) is not Submit:
            return
        if any(request.kind == OpKind.JOIN for request in message.full):
            self._in_join.add(rank)
            self._unchecked = True
        else:
            self._in_join.discard(rank)
        if message.bits:
            self._at_version(message.version, time.monotonic())
            self._sent(rank, message.bits)

    def _sent(self, rank: int, bits: int) -> None:
        """``rank`` (this relay's or a child's; a child relay: every rank of its subtree) sent ``bits``."""
        unmatched = self._unmatched
        unmatched[rank] = unmatched.get(rank, 0) | bits
        self._unchecked = True
        if self._in_join:
            self._in_join.discard(rank)

    def _at_version(self, version: int, now: float) -> None:
        """Bits of cache ``version`` come: at another version than those held, those go up first."""
        if version != self._held_version:
            self.flush(now)
            self._unmatched.clear()  # the bits name other requests now
            self._held_version = version

    def _matched(self) -> int:
        """The bits this relay's rank and each child have sent since they last all had (a child in
        ``join()`` excepted; -1 when all are in it); from now on they count as not sent."""
        self._unchecked = False
        unmatched, in_join = self._unmatched, self._in_join
        children = self._children.keys() if not in_join else [c for c in self._children if c not in in_join]
        own = -1 if self.rank in in_join else unmatched.get(self.rank, 0)
        matched = functools.reduce(operator.and_, map(unmatched.get, children, itertools.repeat(0)), own)
        if matched:
            self._unmatched = {rank: bits & ~matched for rank, bits in unmatched.items()}
        return matched

    def flush(self, now: float | None = None, matched: int = 0) -> None:
        """Send what is held up as one Merged message, with ``matched``, the bits the subtree has matched."""
        if not self._held and not (matched and self.above_is_relay):
            return
        now = time.monotonic() if now is None else now
        groups: dict[int, tuple] = {}
        for rank, (bits, since, waited) in self._held.items():
            group = groups.get(bits)
            if group is None:
                group = groups[bits] = ([], array.array("f"))
            group[0].append(rank)
            group[1].append(waited + now - since)
        self._held.clear()
        self._held_bits = 0
        self._held_since = None
        self._up(Merged(self._held_version, [pack_group(ranks, bits, held) for bits, (ranks, held) in groups.items()],
                        matched))

    def send_up(self, message) -> None:
        """Send ``message`` up after what is held (each rank's messages keep their order)."""
        self.flush()
        self._up(message)

    def deadline(self) -> float | None:
        """When what is held must go up at the latest (None: nothing held)."""
        if self._held_since is None:
            return None
        return self._held_since + (self._hold_s if self._held_bits & ~self._global_bits() else self._subtree_wait_s)

    def poll(self, now: float) -> None:
        """After a round of select: take new children; send what is held (and the subtree's AND, to a relay
        above) once this relay's rank and every child have sent some bit since they last all had, or at the
        deadline."""
        while not self._accepted.empty():
            self._adopt(self._accepted.get())
        matched = self._matched() if self._unchecked else 0
        deadline = self.deadline() if self._held else None
        if (matched and (self._held or self.above_is_relay)) or (deadline is not None and now >= deadline):
            self.flush(now, matched)  # with nothing held and rank 0 above, matched bits need not go: it ANDs all

    def _adopt(self, connection: control_channel.Connection) -> None:
        rank = connection.rank
        if rank in self._children or rank in self._route or not 0 < rank < self._size or rank == self.rank:
            log.warning("roundel relay on rank %d refused a connection claiming rank %d", self.rank, rank)
            connection.close()
            return
        self._children[rank] = connection
        self._readers[rank] = control_channel.FrameReader(connection)
        self._route[rank] = rank
        self._heard[rank] = time.monotonic()
        self._selector.register(connection, selectors.EVENT_READ, ("child", rank))
        self._send_child(rank, Heartbeat(self._host))
        self._up(Joined(rank, ""))  # before anything it sends

    def serve(self, child: int, events: int) -> None:
        """A child's connection is writable and/or readable."""
        connection = self._children.get(child)
        if connection is None:
            return
        if events & selectors.EVENT_WRITE:
            try:
                connection.flush()
            except OSError:
                pass  # shut down: the read below sees it closed
            else:
                self._watch(child)
        if not events & selectors.EVENT_READ:
            return
        try:
            data = connection.recv(control_channel.RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self._lose(child, f"died (crashed or was killed) or lost its connection to its relay, rank {self.rank}")
            return
        now = time.monotonic()
        self._heard[child] = now
        for message in self._readers[child].feed(data):
            if child not in self._children:
                return
            self._from_child(child, message, now)

    def _from_child(self, child: int, message, now: float) -> None:
        kind = type(message)
        if mergeable(message):
            self.hold(message.version, child, message.bits, 0.0, now)
            self._sent(child, message.bits)
        elif kind is Heartbeat:
            if self._hosts.get(child) != message.host:  # its host, for rank 0's messages (no order to keep)
                self._hosts[child] = message.host
                self._up(Joined(child, message.host))
        elif kind is Merged:
            for group in message.groups:
                try:
                    ranks, bits, waited = unpack_group(group)
                except ValueError as exc:
                    log.error("roundel relay on rank %d: rank %d sent %s; ignored", self.rank, child, exc)
                    continue
                for rank, seconds in zip(ranks, waited):
                    if self._route.get(rank) == child:
                        self.hold(message.version, rank, bits, seconds, now)
            if message.matched == -1:  # the child's whole subtree is in join()
                self._in_join.add(child)
                self._unchecked = True
            elif message.matched:
                self._at_version(message.version, now)
                self._sent(child, message.matched)
            else:
                self._in_join.discard(child)
        elif kind is Joined:
            if 0 < message.rank < self._size and message.rank != self.rank and \
                    self._route.get(message.rank, child) == child:
                self._route[message.rank] = child
                self.send_up(message)
        elif kind is Lost or kind is Relayed:
            if self._route.get(message.rank) == child:
                if kind is Lost or message.payload == BYE:
                    self._forget(message.rank)
                self.send_up(message)
        elif kind is Bye:
            self.send_up(Relayed(child, BYE))
            self._drop(child)
        else:
            self.note_sent(child, message)
            self.send_up(Relayed(child, control_codec.encode(message)))

    def _forget(self, rank: int) -> None:
        """``rank`` is gone: so is every rank reached through it."""
        for below in [r for r, via in self._route.items() if via == rank or r == rank]:
            del self._route[below]
            self._held.pop(below, None)
            self._unmatched.pop(below, None)
            self._in_join.discard(below)
        self._held.pop(rank, None)
        self._unchecked = True  # the ranks left may all have sent some bit now

    def _drop(self, child: int) -> None:
        connection = self._children.pop(child, None)
        if connection is None:
            return
        self._selector.unregister(connection)
        connection.close()
        self._readers.pop(child, None)
        self._heard.pop(child, None)
        self._hosts.pop(child, None)
        self._forget(child)

    def _lose(self, child: int, reason: str) -> None:
        self._drop(child)
        self.send_up(Lost(child, reason))

    # ---------------------------------------------------------------- downward
    def deliver(self, ranks, payload: bytes) -> bool:
        """Hand ``payload`` (an encoded message) on to ``ranks`` below (none named: every rank below); True
        when this rank is one of them."""
        if not ranks:
            relaying = {via for rank, via in self._route.items() if via != rank}
            onward = to_all_below(payload) if relaying else payload
            for child in list(self._children):
                self._send_child_encoded(child, onward if child in relaying else payload)
            return True
        for child, targets in fan_out(ranks, self._route).items():
            self._send_child_encoded(child, addressed(child, targets, payload))
        return self.rank in ranks

    def abort_children(self, message: str) -> None:
        """Tell every child the job is broken (this relay lost the rank above it)."""
        payload = control_codec.encode(Abort(message))
        for child in list(self._children):
            self._send_child_encoded(child, payload)

    def _send_child(self, child: int, message) -> None:
        self._send_child_encoded(child, control_codec.encode(message))

    def _send_child_encoded(self, child: int, payload: bytes) -> None:
        connection = self._children.get(child)
        if connection is None:
            return
        try:
            connection.send_encoded(payload)
        except OSError:
            return  # a closed child is noticed by select and dropped there
        self._watch(child)

    def _watch(self, child: int) -> None:
        control_channel.watch_writes(self._selector, self._children[child], ("child", child))

    # ---------------------------------------------------------------- liveness
    def tick(self, now: float) -> None:
        """Heartbeat the children each second; report one silent for the heartbeat timeout as lost."""
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            payload = control_codec.encode(Heartbeat(self._host))
            for child in list(self._children):
                self._send_child_encoded(child, payload)
        for child, connection in list(self._children.items()):
            if connection.pending:
                try:
                    connection.flush()  # gives up on a child that took nothing for the send timeout
                except OSError:
                    pass
            silent = now - self._heard.get(child, now)
            if silent > self._heartbeat_timeout_s:
                self._lose(child, f"stopped responding: {describe_silence(silent, self._heartbeat_timeout_s)}")

    def close(self, deadline: float) -> None:
        """Stop accepting; write out what is queued for the children (until ``deadline``) and close them."""
        self.listener.close()
        for connection in self._children.values():
            connection.drain(deadline)
            connection.close()
        self._children.clear()
