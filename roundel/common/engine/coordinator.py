"""The coordinator on rank 0: matches every rank's requests and sends back what to run.

Rank 0's engine owns one ``Coordinator`` and runs its loop on the engine
thread (:meth:`Coordinator.run`). It accepts the other ranks' control
connections, feeds their requests and rank 0's own to the ``Negotiator``,
dispatches the agreed batches (rank 0's to its own executor through the
engine), and watches the job: heartbeats both ways, ranks that go silent
(lost), deadlocks between ranks, stalls, and the goodbyes at shutdown. The
messages are the records of :mod:`roundel.common.control.messages`.

With relays (:mod:`roundel.common.engine.relay`) most ranks reach the
coordinator through a relay: their messages arrive wrapped (``Relayed``, or
their steady submissions ``Merged``), and what goes to them is addressed
(``Deliver``) to the child they are reached through (``_route``).
"""

from __future__ import annotations

import logging
import queue
import selectors
import sys
import threading
import time
from typing import Callable

from roundel.common import launcher_reports
from roundel.common.control import channel as control_channel, codec as control_codec
from roundel.common.control.messages import (Abort, Bye, Dispatch, Heartbeat, Joined, Lost, Merged, Relayed, Submit,
                                              Tune, Waits)
from roundel.common.engine import autotune, deadlock, relay, small_allreduce
from roundel.common.engine.core_api import EngineCore, EngineTools
from roundel.common.engine.liveness import BYE_GRACE_S, HEARTBEAT_S, TICK_S, describe_silence
from roundel.common.engine.metrics import METRICS, MetricsServer
from roundel.common.engine.negotiation import Negotiator
from roundel.common.engine.requests import ProcessSetChange
from roundel.common.engine.stragglers import StragglerTracker
from roundel.common.engine.wait_state import REPLAY_WAIT
from roundel.errors import RoundelInternalError

log = logging.getLogger("roundel")

_STALL_POLL_S = 1.0
_DEADLOCK_GRACE_S = 0.5
# a rank inside one replay slot's transfer this long (at most) makes every rank give up its slot
_SLOT_NUDGE_MAX_S = 10.0


def _dispatches(version: int, outbox: list, evicted: list, resends: list) -> list:
    """``outbox``'s batches in consecutive Dispatch messages, each carrying results (``reduced``) of at most
    ``small_allreduce.MESSAGE_DATA_BYTES`` unless one batch alone does; the evictions and resend requests go
    with the first, so a rank applies them before any of the batches."""
    runs: list[list] = []
    run: list = []
    carried = 0
    for batch in outbox:
        size = len(batch.reduced) if batch.reduced else 0
        if run and carried + size > small_allreduce.MESSAGE_DATA_BYTES:
            runs.append(run)
            run, carried = [], 0
        run.append(batch)
        carried += size
    runs.append(run)
    return [Dispatch(version, run, evicted, resends) if i == 0 else Dispatch(version, run, [], [])
            for i, run in enumerate(runs)]


class Coordinator:
    """Rank 0's coordination of the job over rank 0's own engine core.

    ``tunable_hierarchy``: whether the job's transport can switch hierarchical operations (autotune's
    choice); ``bucketed()``: whether gradients are reduced in buckets (autotune then tunes their size).
    """

    def __init__(self, engine: EngineCore, tools: EngineTools, secret: bytes, advertise_host: str,
                 tunable_hierarchy: bool, bucketed: Callable[[], bool]):
        self._engine = engine
        self._tools = tools
        size, settings = engine.size, engine.settings
        self._negotiator = Negotiator(size, settings.cache_capacity, settings.coordinator_reduce_bytes,
                                      separate_groups=settings.disable_group_fusion)
        self._autotuner = autotune.Autotuner(settings, tunable_hierarchy, bucketed) if settings.autotune else None
        self._peers: dict[int, control_channel.Connection] = {}
        self._route: dict[int, int] = {}  # a rank reached through a relay -> the peer it is reached through
        self._below: dict[int, set] = {}  # a peer that relays -> the ranks reached through it
        self._readers: dict[int, control_channel.FrameReader] = {}
        self._outbox: dict[int, list] = {}
        self._resends: dict[int, list] = {}
        self._unanswered: dict[int, int] = {}  # rank -> resend requests sent to it and not yet answered
        self._finishing_since: float | None = None
        self._accepted: "queue.SimpleQueue" = queue.SimpleQueue()
        self._last_dispatch = 0.0
        self._next_tick = 0.0
        self._last_heartbeat = 0.0
        self._next_stall_check = 0.0
        self._heard: dict[int, float] = {}  # peer rank -> when it was last heard from
        self._hosts: dict[int, str] = {0: engine.host}
        self._abort_sent = False  # every peer has been told the job is broken
        self._rank_waits: dict[int, tuple] = {}  # peer rank -> (sequence, waits)
        self._deadlock_seen: tuple | None = None  # (since, {rank: sequence}) while a deadlock holds
        self._in_slot: dict[int, tuple] = {}  # rank -> (the replayed slot it waits in, since when)
        self._slot_waits: "queue.SimpleQueue[list]" = queue.SimpleQueue()  # replayed slots' waits, for stragglers
        self._last_nudge = 0.0
        self._stragglers = StragglerTracker(size)
        self._metrics: MetricsServer | None = None  # the Prometheus endpoint, with settings.metrics_port
        self._submitted_at: dict[tuple, float] = {}  # rank 0's names -> when it submitted them (for metrics)
        if settings.metrics_port:
            self._metrics = MetricsServer(settings.metrics_port)
            self._metrics.announce(engine.host)
            METRICS.collectors.append(self._gauges)
        self._ever_connected: set[int] = set()  # peers may join and leave (bye) before the last joins
        self.all_connected = threading.Event()  # every other rank has joined: init() may return
        if size == 1:
            self.all_connected.set()
        self._awaiting_idle = False  # ready names held back until the executor is idle
        self._listener = control_channel.Listener(advertise_host, secret, self._connection_accepted,
                                                  backlog=max(128, size),
                                                  send_timeout_s=settings.heartbeat_timeout_s)
        self.port = self._listener.port
        self.local_name = self._listener.local_name  # its local socket's name, None where there is none

    def wants_idle_wake(self) -> bool:
        """Called by the executor's thread when it went idle: True (once) if ready names are held back
        until then, so that the engine thread should wake and dispatch them."""
        wanted, self._awaiting_idle = self._awaiting_idle, False
        return wanted

    def missing_peers(self) -> list[int]:
        """The ranks that never joined the coordinator."""
        return sorted(set(range(1, self._engine.size)) - self._ever_connected)

    def _apply_control(self, change: ProcessSetChange) -> None:
        """A process-set change rank 0 queued, in order with its requests around it."""
        if change.ranks is not None:
            self._negotiator.add_process_set(change.set_id, change.ranks)
        else:
            self._negotiator.remove_process_set(change.set_id)

    def _connection_accepted(self, connection: control_channel.Connection) -> None:
        """Called by the listener's handshake threads: hand the connection to the coordinator loop."""
        self._accepted.put(connection)
        if self._engine.stopping:
            connection.close()  # nobody will take it
        else:
            self._engine.wake()

    def run(self) -> None:
        """The engine thread's loop on rank 0, until shutdown; a failure breaks the job on every rank."""
        try:
            while not self._step():
                pass
        except Exception as exc:
            log.exception("roundel coordinator failed")
            self._break_job(f"roundel's coordinator on rank 0 failed: {exc!r}")
        finally:
            if self._autotuner is not None:
                self._autotuner.close()
            if self._metrics is not None:
                self._metrics.close()
                METRICS.collectors.remove(self._gauges)
            self._listener.close()
            deadline = time.monotonic() + BYE_GRACE_S  # last messages (an abort) go out, unless a peer stops reading
            for sock in self._peers.values():
                sock.drain(deadline)
                sock.close()

    def _step(self) -> bool:
        if self._finishing_since is not None:  # leaving: wait for byes in bounded steps, never block
            return self._finish()
        timeout = self._timeout()
        self._tools.timeline.cycle()
        for key, events in self._tools.selector.select(timeout):
            if key.data == "wake":
                self._wake()
            else:
                self._serve(key.data, events)
        now = time.monotonic()
        if self._engine.stopping:
            return self._finish()
        if now >= self._next_tick:
            self._tick(now)
        self._check_stalls(now)
        self._dispatch(now)
        return False

    def _timeout(self) -> float | None:
        negotiator = self._negotiator
        waits = [self._next_tick - time.monotonic()]
        if negotiator.has_ready():  # held back while the executor is busy: wake on idle or at the cycle
            waits.append(self._last_dispatch + self._engine.tuned.cycle_time_ms / 1000 - time.monotonic())
        if negotiator.has_pending() and self._engine.settings.stall_check_enabled:
            waits.append(_STALL_POLL_S)
        return max(0.0, min(waits))

    def _wake(self) -> None:
        items = self._engine.drain()
        while not self._accepted.empty():
            sock = self._accepted.get()
            rank = sock.rank
            if rank in self._peers or rank in self._route or not 0 < rank < self._engine.size:
                log.warning("roundel coordinator refused a second connection claiming rank %d", rank)
                sock.close()
                continue
            self._peers[rank] = sock
            self._readers[rank] = control_channel.FrameReader(sock)
            self._tools.selector.register(sock, selectors.EVENT_READ, rank)
            self._ever_connected.add(rank)
            if len(self._ever_connected) == self._engine.size - 1:
                self.all_connected.set()
            if self._abort_sent:  # joined after the others were told: this one is told too
                self._send_peer(rank, Abort(str(self._engine.broken)))
        if self._engine.broken is not None:
            self._engine.fail_inflight(self._engine.broken)
        now = time.monotonic()
        engine, negotiator, timeline = self._engine, self._negotiator, self._tools.timeline
        bit_of, own_bits, submitted = negotiator.cache.bit_of, 0, False  # own cached requests: one mask, as a rank
        register, counted = engine.register, self._metrics is not None
        for item in items:
            if isinstance(item, ProcessSetChange):
                self._submit_own_bits(own_bits, now)
                own_bits = 0
                self._apply_control(item)
            elif engine.broken is not None:
                item.handle.set_error(engine.broken)
            else:
                request = item.request
                key = (request.process_set_id, request.name)
                register(item)
                if timeline.active:
                    timeline.rank_ready(request.name, request.kind.label, 0)
                bit = -1 if item.data is not None else bit_of(key, 0, request)
                if bit >= 0:
                    own_bits |= 1 << bit
                else:
                    negotiator.submit(0, request, now, data=item.data)
                submitted = True
                if counted:
                    self._submitted_at[key] = now
        self._submit_own_bits(own_bits, now)
        if submitted:
            self._stragglers.arrived(0, now)

    def _submit_own_bits(self, bits: int, now: float) -> None:
        if bits:  # at the cache's own version: never stale
            self._negotiator.submit_bits(0, bits, self._negotiator.cache.version, now)

    def _serve(self, rank: int, events: int) -> None:
        """A peer's connection is writable (queued messages go out) and/or readable."""
        if events & selectors.EVENT_WRITE:
            self._flush_peer(rank)
        if events & selectors.EVENT_READ and rank in self._peers:
            self._receive(rank)

    def _flush_peer(self, rank: int) -> None:
        connection = self._peers.get(rank)
        if connection is None:
            return
        try:
            connection.flush()
        except OSError:
            return  # shut down: select reports it closed, and it is dropped there
        control_channel.watch_writes(self._tools.selector, connection, rank)

    def _receive(self, rank: int) -> None:
        sock = self._peers[rank]
        try:
            data = sock.recv(control_channel.RECV_BYTES)
        except OSError:
            data = b""
        if not data:  # gone without saying goodbye: the job cannot go on, so every rank is told
            reason = f"rank {rank} died (crashed or was killed) or lost its connection to the coordinator"
            self._drop_peer(rank, reason)
            self._break_job(f"{reason}; the job's communication is broken")
            return
        now = time.monotonic()
        self._heard[rank] = now
        for message in self._readers[rank].feed(data):
            if rank not in self._peers:
                return
            kind = type(message)
            if kind is Merged:
                self._merged(rank, message, now)
            elif kind is Relayed:
                self._relayed(rank, message, now)
            elif kind is Joined:
                self._joined(rank, message.rank, message.host)
            elif kind is Lost:
                if self._route.get(message.rank) == rank:
                    self._lose_peer(message.rank, message.reason)
            else:
                self._handle(rank, message, now)

    def _handle(self, rank: int, message, now: float) -> None:
        """A message of ``rank``'s, straight from it or through a relay."""
        kind = type(message)
        negotiator = self._negotiator
        if kind is Heartbeat:
            self._hosts[rank] = message.host
        elif kind is Waits:
            self._rank_waits[rank] = (message.sequence, message.waits)
        elif kind is Submit:
            if message.resent:
                self._resend_answered(rank)
            self._stragglers.arrived(rank, now)
            version = message.version
            if self._tools.timeline.active:
                self._timeline_cached_arrivals(rank, message.bits, version)
            stale = [(version, bit) for bit in negotiator.submit_bits(rank, message.bits, version, now,
                                                                      message.bit_data)]
            full_data = message.full_data if len(message.full_data) == len(message.full) else ()
            for index, request in enumerate(message.full):
                if self._tools.timeline.active:
                    self._tools.timeline.rank_ready(request.name, request.kind.label, rank)
                negotiator.submit(rank, request, now, data=full_data[index] if full_data else None)
            if stale:
                self._resends.setdefault(rank, []).extend(stale)
        elif kind is Bye:
            self._drop_peer(rank, f"rank {rank} has shut down: it finished, called hvd.shutdown(), "
                                  "or failed and exited (its own output says which)")

    def _merged(self, child: int, message: Merged, now: float) -> None:
        """Steady submissions of ranks below the relay ``child``, grouped by mask."""
        version, route, negotiator = message.version, self._route, self._negotiator
        timeline: list | None = [] if self._tools.timeline.active else None  # (s held, rank, mask) of each rank
        for group in message.groups:
            try:
                ranks, bits, waited = relay.unpack_group(group)
            except ValueError as exc:
                log.error("roundel coordinator: rank %d sent %s; ignored", child, exc)
                continue
            listed = ranks.tolist()  # int objects made once, for the lookups below
            named = set(listed)
            named.discard(child)  # the relay's own rank is a peer
            if not named <= self._below.get(child, set()):
                log.warning("roundel coordinator ignored submissions relayed by rank %d for ranks it does not "
                            "relay: %s", child, sorted(rank for rank in named if route.get(rank) != child))
                continue
            self._stragglers.arrived_many(ranks, now, waited)
            if timeline is not None:
                timeline += [(held, rank, bits) for held, rank in zip(waited.tolist(), listed)]
            stale = negotiator.submit_bits_of(listed, bits, version, now)
            for rank in listed if stale else ():
                self._resends.setdefault(rank, []).extend((version, bit) for bit in stale)
        for held, rank, bits in sorted(timeline or (), reverse=True):  # the earliest first: it opens the name
            self._timeline_cached_arrivals(rank, bits, version, held)

    def _relayed(self, child: int, message: Relayed, now: float) -> None:
        """A message of a rank below the relay ``child``, as that rank sent it."""
        if self._route.get(message.rank) != child:
            return
        try:
            inner = control_codec.decode(message.payload)
        except control_codec.DecodeError as exc:
            log.error("roundel coordinator: rank %d relayed a message of rank %d that does not decode (%s)",
                      child, message.rank, exc)
            return
        if type(inner) in (Heartbeat, Waits, Submit, Bye):
            self._handle(message.rank, inner, now)

    def _joined(self, child: int, rank: int, host: str) -> None:
        """``rank`` joined below the relay ``child`` (again, once its host is known)."""
        if not 0 < rank < self._engine.size or rank in self._peers or self._route.get(rank, child) != child:
            log.warning("roundel coordinator refused rank %d relayed by rank %d: it is already connected", rank,
                        child)
            return
        if host:
            self._hosts[rank] = host
        if rank in self._route:
            return
        self._route[rank] = child
        self._below.setdefault(child, set()).add(rank)
        self._ever_connected.add(rank)
        if len(self._ever_connected) == self._engine.size - 1:
            self.all_connected.set()
        if self._abort_sent:
            self._send_peer(rank, Abort(str(self._engine.broken)))

    def _timeline_cached_arrivals(self, rank: int, bits: int, version: int, held_s: float = 0.0) -> None:
        """The timeline's marks for ``rank``'s cached submissions, which a relay held for ``held_s``."""
        for bit in range(bits.bit_length()):
            cached = self._negotiator.cache.lookup(bit, version) if bits >> bit & 1 else None
            if cached is not None and rank in cached[1]:
                request = cached[1][rank]
                self._tools.timeline.rank_ready(request.name, request.kind.label, rank, held_s)

    def _drop_peer(self, rank: int, reason: str) -> None:
        """``rank`` is gone (its connection or its relay says so), and so is every rank reached through it."""
        sock = self._peers.pop(rank, None)
        if sock is not None:
            self._tools.selector.unregister(sock)
            sock.close()
            self._readers.pop(rank, None)
            self._heard.pop(rank, None)
        elif rank in self._route:
            self._below[self._route.pop(rank)].discard(rank)
        else:
            return
        self._rank_waits.pop(rank, None)
        self._unanswered.pop(rank, None)
        self._negotiator.rank_left(rank, reason)
        for below in sorted(self._below.pop(rank, ())):
            del self._route[below]
            self._rank_waits.pop(below, None)
            self._unanswered.pop(below, None)
            self._negotiator.rank_left(below, f"rank {below} lost its relay: {reason}")

    def _tick(self, now: float) -> None:
        """Heartbeat every peer, declare silent ones lost, and look for a deadlock."""
        self._next_tick = now + TICK_S
        own = self._engine.waits_snapshot()  # before draining: every name rank 0 waits for is then submitted
        self._wake()
        self._heartbeat_peers(now)
        for rank in [rank for rank, connection in self._peers.items() if connection.pending]:
            self._flush_peer(rank)  # gives up on a peer that took nothing for the send timeout
        timeout = self._engine.settings.heartbeat_timeout_s
        for rank in list(self._peers):
            silent = now - self._heard.setdefault(rank, now)
            if silent > timeout:
                self._lose_peer(rank, f"stopped responding: {describe_silence(silent, timeout)}")
        self._check_deadlock(now, own)
        self._nudge_replay(now, own)
        self._count_slot_waits(now)
        for line in self._stragglers.warnings(now, self._hosts):
            log.warning("%s", line)

    def _heartbeat_peers(self, now: float) -> None:
        beat = now - self._last_heartbeat >= HEARTBEAT_S
        if beat:
            self._last_heartbeat = now
        for rank in list(self._peers):
            if beat or rank not in self._heard:  # a new peer learns rank 0's host at once
                self._send_peer(rank, Heartbeat(self._engine.host))

    def _lose_peer(self, rank: int, reason: str) -> None:
        host = self._hosts.get(rank, "unknown")
        self._tools.losses.record(rank, host, reason)
        named = f"rank {rank} (host {host}) {reason}"
        self._drop_peer(rank, named)
        self._break_job(f"{named}; the job's communication is broken")

    def _check_deadlock(self, now: float, own: tuple) -> None:
        """Fail the waited names once every involved rank has been blocked on them, unchanged, for the grace."""
        if self._engine.broken is not None:
            return
        if not own and not any(waits for _, waits in self._rank_waits.values()):  # nobody blocked: the usual
            self._deadlock_seen = None
            return
        states = dict(self._rank_waits)
        states[0] = own
        for rank in self._unanswered:  # it may still owe the resend of a name it waits for: not blocked
            states.pop(rank, None)
        negotiator = self._negotiator
        live = [r for r in negotiator.live_ranks() if r == 0 or r in self._peers or r in self._route]
        stuck = deadlock.deadlocked_ranks({r: w for r, (_, w) in states.items()}, live,
                                          negotiator.missing_ranks)
        if not stuck:
            self._deadlock_seen = None
            return
        seqs = {r: states[r][0] for r in stuck}
        if self._deadlock_seen is None or self._deadlock_seen[1] != seqs:
            self._deadlock_seen = (now, seqs)
            return
        if now - self._deadlock_seen[0] < _DEADLOCK_GRACE_S:
            return
        # only ranks heard from since (alive, still blocked alike) count: a stopped rank's last report is
        # stale (e.g. sent before the request it names); the heartbeat timeout deals with that rank
        if any(r != 0 and self._heard.get(self._route.get(r, r), 0.0) <= self._deadlock_seen[0] for r in stuck):
            return
        self._deadlock_seen = None
        message = ("roundel detected a deadlock: these ranks are blocked on collectives that can never "
                   "complete because the ranks called different collectives (or in a different order): "
                   f"{deadlock.describe(stuck, negotiator.missing_ranks)}. These collectives fail on every "
                   "rank that submitted them; later collectives work once the ranks call matching ones")
        log.error("%s", message)
        METRICS.count("roundel_deadlocks_total")
        for waits in stuck.values():
            negotiator.fail_waits(waits, message)

    def note_slot_waits(self, waits_ms: list) -> None:
        """Every rank's wait in a replayed slot (from any thread): the rank that waited least came last."""
        self._slot_waits.put(waits_ms)

    def _count_slot_waits(self, now: float) -> None:
        """Give the straggler record one cycle per replayed slot: a rank arrived as much before the last as it
        waited longer than the last."""
        everyone = range(self._engine.size)
        while True:
            try:
                waits_ms = self._slot_waits.get_nowait()
            except queue.Empty:
                return
            self._stragglers.arrived_many(everyone, now, [ms / 1e3 for ms in waits_ms])
            self._stragglers.cycle(everyone)

    def _nudge_replay(self, now: float, own: tuple) -> None:
        """When a rank has been inside one replayed slot's transfer (``REPLAY_WAIT`` in its waits), waiting for a
        rank that is late, for a quarter of the collective timeout (at most ``_SLOT_NUDGE_MAX_S``), or for a rank
        that waits for it here (``_slot_crossed``) at two ticks, announce the settings in force again: every rank
        gives up its pending slot on that (see ``replay``), so the slot's collectives come here and wait as long
        as they must, as collectives that were never replayed do, instead of running into the transport's
        timeout (or, crossed, the deadlock check finds them)."""
        if not self._engine.settings.steady_replay or self._engine.broken is not None:
            return
        states = dict(self._rank_waits)
        states[0] = own
        for rank in [rank for rank in self._in_slot if rank not in states]:
            del self._in_slot[rank]
        for rank, (_, waits) in states.items():
            slot = next((name for _, name, label in waits if label == REPLAY_WAIT), None)
            if slot is None:
                self._in_slot.pop(rank, None)
            elif self._in_slot.get(rank, (None,))[0] != slot:
                self._in_slot[rank] = (slot, now)
        limit = min(self._engine.settings.collective_timeout_s / 4, _SLOT_NUDGE_MAX_S)
        if self._slot_crossed(states):  # not late: blocked on each other, so at the next tick
            limit = TICK_S
        if any(now - since >= limit and since > self._last_nudge for _, since in self._in_slot.values()):
            self._last_nudge = now
            params = self._engine.tuned
            self._engine.retune(params)
            self._broadcast(control_codec.encode(Tune(params)))

    def _slot_crossed(self, states: dict) -> bool:
        """Whether a rank outside the slots waits for a collective pending here that a rank inside a slot's
        transfer has not sent (a join, a barrier, another order): neither can go on until the slot is given up."""
        in_slot = self._in_slot
        if not in_slot:
            return False
        waited = {(set_id, name) for rank, (_, waits) in states.items() if rank not in in_slot
                  for set_id, name, label in waits if label != REPLAY_WAIT}
        missing = self._negotiator.missing_ranks
        return any(not in_slot.keys().isdisjoint(missing(set_id, name) or ()) for set_id, name in waited)

    def _check_stalls(self, now: float) -> None:
        settings = self._engine.settings
        if not settings.stall_check_enabled or now < self._next_stall_check:
            return
        self._next_stall_check = now + _STALL_POLL_S
        for name, ps_id, missing, present, waited in self._negotiator.stalled(now, settings.stall_check_time_s):
            METRICS.count("roundel_stall_warnings_total")
            log.warning(
                "roundel stall: '%s' (process set %d) has waited %.0f s; submitted by rank(s) %s, "
                "not yet by rank(s) %s. Those ranks may be running different code, be stuck, or "
                "be skipping this collective.", name, ps_id, waited,
                ", ".join(map(str, present)), ", ".join(map(str, missing)))
        if settings.stall_shutdown_time_s > 0:
            self._negotiator.fail_stalled(now, settings.stall_shutdown_time_s)

    def _dispatch(self, now: float) -> None:
        """Send what is ready: at once while the pipeline is idle, else batched per cycle time.

        Holding ready names back while rank 0's executor is busy lets them
        accumulate and fuse; an idle executor means nobody gains from waiting.
        """
        negotiator = self._negotiator
        due = self._engine.executor_idle() or now - self._last_dispatch >= self._engine.tuned.cycle_time_ms / 1000
        batches = []
        if due and negotiator.has_ready():
            batches = negotiator.take(self._engine.tuned.fusion_threshold)
            self._last_dispatch = now
            if any(batch.error is None for _, batch in batches):
                self._stragglers.cycle(negotiator.live_ranks())
        elif negotiator.has_direct():
            batches = negotiator.take_direct()
        if self._metrics is not None:
            self._count_negotiated(batches, now)
        self._awaiting_idle = negotiator.has_ready()
        if self._tools.timeline.active:
            for _, batch in batches:
                for entry in batch.entries:
                    self._tools.timeline.negotiated(entry.name)
        evicted = [bit for bit, _ in negotiator.take_evictions()]
        if not (batches or evicted or self._resends):
            return  # nothing to send (most wake-ups: a submission that completed nothing)
        version = negotiator.cache.version
        everyone = negotiator.process_sets[0]
        if batches and all(members is everyone for members, _ in batches):  # the usual case: one message for all
            mine = [batch for _, batch in batches]
            self._send_everyone([negotiator.compact_form(batch) or batch for batch in mine], evicted, version)
            self._accept_own(mine, batches)
            return
        mine = []
        for members, batch in batches:
            sent = negotiator.compact_form(batch) or batch  # bits where the members hold the requests
            for member in members:
                if member == 0:
                    mine.append(batch)
                elif member in self._peers or member in self._route:
                    self._outbox.setdefault(member, []).append(sent)
        targets = set(self._outbox) | set(self._resends) | (set(self._peers) | set(self._route) if evicted else set())
        encoded: dict[tuple, list] = {}  # ranks getting the same batches share one encoding
        by_peer: dict[tuple, tuple] = {}  # (peer, id of the payloads) -> (payloads, ranks reached through it)
        for rank in targets:
            outbox, resends = self._outbox.get(rank, []), self._resends.get(rank, [])
            same = (tuple(map(id, outbox)), bool(resends))
            payloads = None if resends else encoded.get(same)
            if payloads is None:
                payloads = [control_codec.encode(message)
                            for message in _dispatches(version, outbox, evicted, resends)]
                if not resends:
                    encoded[same] = payloads
            peer = self._route.get(rank, rank)
            by_peer.setdefault((peer, id(payloads)), (payloads, []))[1].append(rank)
        for (peer, _), (payloads, ranks) in by_peer.items():
            for payload in payloads:
                self._send_peer_encoded(peer, relay.addressed(peer, ranks, payload))
        self._outbox.clear()
        self._resends_sent()
        self._accept_own(mine, batches)

    def _accept_own(self, mine: list, batches: list) -> None:
        """Rank 0's batches to its executor, after the others' messages are out (its executor waits for them
        in the collective anyway); then autotune scores the dispatch."""
        if mine:
            self._engine.accept_batches(mine)
        if self._autotuner is not None and not self._autotuner.done:
            self._autotune(self._autotuner, batches)

    def _send_everyone(self, outbox: list, evicted: list, version: int) -> None:
        """The batches of ``outbox`` to every other rank, one message per peer (a rank owed resends gets its
        own, with them)."""
        payloads = [control_codec.encode(message) for message in _dispatches(version, outbox, evicted, [])]
        to_all_below = [relay.to_all_below(payload) for payload in payloads] if self._below else []
        owed = self._resends
        for peer in list(self._peers):
            below = self._below.get(peer)
            if owed and (peer in owed or (below and not owed.keys().isdisjoint(below))):
                reach = [rank for rank in (peer, *sorted(below or ())) if rank not in owed]
                for payload in payloads if reach else ():
                    self._send_peer_encoded(peer, relay.addressed(peer, reach, payload))
                continue
            for payload in to_all_below if below else payloads:
                self._send_peer_encoded(peer, payload)
        for rank, resends in list(owed.items()):
            for message in _dispatches(version, outbox, evicted, resends):
                self._send_peer(rank, message)
        self._resends_sent()

    def _resends_sent(self) -> None:
        """The resend requests just sent are owed an answer each (see ``Submit.resent``)."""
        unanswered = self._unanswered
        for rank in self._resends:
            unanswered[rank] = unanswered.get(rank, 0) + 1
        self._resends.clear()

    def _resend_answered(self, rank: int) -> None:
        left = self._unanswered.get(rank, 0) - 1
        if left > 0:
            self._unanswered[rank] = left
        else:
            self._unanswered.pop(rank, None)

    def _autotune(self, autotuner: autotune.Autotuner, batches) -> None:
        """Score the dispatched batches; apply and announce new settings when a sample ends."""
        params = autotuner.observe(batches)
        if params is None:
            return
        if params.cache_enabled != self._engine.tuned.cache_enabled:
            self._negotiator.set_cache_capacity(self._engine.settings.cache_capacity if params.cache_enabled else 0)
        self._engine.retune(params)
        self._broadcast(control_codec.encode(Tune(params)))

    def _send_peer(self, rank: int, message) -> None:
        """Send ``message`` to ``rank``, straight or through its relay."""
        peer = self._route.get(rank, rank)
        self._send_peer_encoded(peer, relay.addressed(peer, [rank], control_codec.encode(message)))

    def _broadcast(self, payload: bytes) -> None:
        """Send an encoded message to every other rank: one message to each peer."""
        for peer in list(self._peers):
            self._send_peer_encoded(peer, relay.to_all_below(payload) if self._below.get(peer) else payload)

    def _send_peer_encoded(self, rank: int, payload: bytes) -> None:
        connection = self._peers.get(rank)
        if connection is None:
            return
        try:
            connection.send_encoded(payload)
        except OSError:
            return  # a closed peer is noticed by select and dropped there
        if connection.pending:
            control_channel.watch_writes(self._tools.selector, connection, rank)

    def _break_job(self, message: str) -> None:
        """Break the job on rank 0 and tell every other rank, once: the first error is the one they get
        (when many ranks go at once, the others hear one Abort each, not one per rank lost)."""
        self._engine.break_job(message)
        if self._abort_sent:
            return
        self._abort_sent = True
        self._broadcast(control_codec.encode(Abort(str(self._engine.broken))))

    def _count_negotiated(self, batches: list, now: float) -> None:
        for _, batch in batches:
            for entry in batch.entries:
                submitted = self._submitted_at.pop((batch.process_set_id, entry.name), None)
                if submitted is not None:
                    METRICS.observe("roundel_negotiation_seconds", now - submitted)

    def _gauges(self) -> list:
        """The per-rank gauges of the metrics endpoint, read at each scrape."""
        rows: list[tuple[str, tuple, float]] = [("roundel_ranks", (), float(self._engine.size))]
        for rank, share, lag in self._stragglers.shares():
            rows.append(("roundel_rank_last_ratio", (("rank", str(rank)),), share))
            rows.append(("roundel_rank_lag_seconds", (("rank", str(rank)),), lag))
        return rows

    def _report_stragglers(self) -> None:
        """The end-of-job straggler table on rank 0's stderr (``straggler_report``: on, off, or auto: when
        the job ran longer than a minute)."""
        wanted = self._engine.settings.straggler_report
        if wanted == "off" or (wanted == "auto" and time.monotonic() - self._stragglers.started < 60.0):
            return
        lines = self._stragglers.report(self._hosts)
        if lines and not launcher_reports.hand_over(self._tools.rendezvous, lines):  # roundelrun prints it last
            sys.stderr.write("\n".join(lines) + "\n")
            sys.stderr.flush()

    def _finish(self) -> bool:
        """Rank 0 is leaving: fail what needs it, let the others say goodbye, then stop."""
        if self._finishing_since is None:
            self._finishing_since = time.monotonic()
            self._report_stragglers()
            self._negotiator.rank_left(0, "rank 0 has shut down: it finished, called hvd.shutdown(), "
                                          "or failed and exited (its own output says which)")
            self._engine.fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
        self._dispatch(time.monotonic() + 1.0)
        self._heartbeat_peers(time.monotonic())  # the others wait for rank 0's goodbye, not a timeout
        waited = time.monotonic() - self._finishing_since
        if self._peers and waited < BYE_GRACE_S:
            for key, events in self._tools.selector.select(0.1):
                if key.data == "wake":
                    self._engine.drain()
                else:
                    self._serve(key.data, events)
            return False
        return True
