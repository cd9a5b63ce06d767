"""The background engine: queue → negotiate → fuse → execute → complete handles.

Every rank runs a negotiation thread and an executor thread. Rank 0's
negotiation thread is also the coordinator: it accepts the other ranks'
control connections, feeds their requests to the ``Negotiator`` and sends the
agreed batches back. Other ranks' negotiation threads forward their queued
requests (a cache bit for names already agreed, the full request otherwise)
and hand the batches they receive to their executor. In the steady state both
directions carry bits only: a batch whose names every receiving rank sent as
unchanged cache bits goes back as a ``CachedBatch`` (the bits, rebuilt from
the rank's own cache), the coordinator skips re-checking those requests, and
peers that get the same batches share one encoding of the message.

The threads sleep in ``select`` until work is queued, a message arrives, a
dispatch delay (the cycle time) runs out, or the next liveness tick is due
(every quarter second). On each tick:

* heartbeats: every rank and the coordinator send each other a heartbeat
  each second, from the engine threads (so a rank busy outside roundel still
  sends them). A peer silent for the heartbeat timeout is declared lost: its
  key ``<prefix>lost/<rank>`` is written to the rendezvous store for the
  launcher, and every pending and future collective raises
  ``HorovodInternalError`` naming it (the coordinator tells the other ranks;
  a rank that loses the coordinator breaks itself).
* deadlock detection: each rank reports what its threads wait for (see
  ``wait_state``); when ranks are blocked on collectives that can never
  complete (``deadlock``), unchanged over a short grace, those collectives
  fail on every rank with ``CollectiveDeadlockError`` and the job goes on.
* the stall warning, while names are pending.

The fusion threshold, cycle time and response cache in force are
``tuned`` (:mod:`roundel.common.autotune`): the configured settings, or with
autotune what rank 0's tuner chose; rank 0 sends each change to the other
ranks right after the batches dispatched under the previous settings.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import selectors
import socket
import threading
import time

from roundel.common import autotune, control_channel, control_codec, deadlock
from roundel.common.control_messages import Abort, Bye, Dispatch, Heartbeat, Submit, Tune, Waits
from roundel.common.executor import Executor, Work
from roundel.common.handles import Handle
from roundel.common.negotiation import Negotiator
from roundel.common.requests import CachedBatch, Request
from roundel.common.response_cache import RankCache
from roundel.common.settings import Settings
from roundel.common.timeline import Timeline
from roundel.common.wait_state import WaitTracker
from roundel.errors import RoundelInternalError

log = logging.getLogger("roundel")

_STALL_POLL_S = 1.0
_BYE_GRACE_S = 5.0
_ABANDON_S = 1.0
_TICK_S = 0.25
_HEARTBEAT_S = 1.0
_DEADLOCK_GRACE_S = 0.5
_LOST_KEY_WRITE_S = 2.0


class Engine:
    """One rank's engine; create it after the global backend, stop it with ``shutdown()``."""

    def __init__(self, rank: int, size: int, settings: Settings, secret: bytes,
                 rendezvous, key_prefix: str, advertise_host: str, process_sets: dict,
                 timeline: Timeline | None = None):
        self.rank = rank
        self.size = size
        self.settings = settings
        if settings.autotune:
            autotune.require_scikit_learn()  # on every rank, before anything starts
        self.tuned = autotune.initial_params(settings)  # what the coordinator applies; rank 0 decides
        self._autotuner = autotune.Autotuner(settings) if settings.autotune and rank == 0 else None
        self._process_sets = process_sets
        self._lock = threading.Lock()
        self._queue: list = []
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._broken: RoundelInternalError | None = None
        self._inflight: dict[tuple, Work] = {}
        self._names_in_flight: set[tuple] = set()  # (set id, name) submitted here and not finished
        self._sent_bits: dict[tuple, tuple] = {}  # (cache version, bit) -> key
        self._cache = RankCache()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._awaiting_idle = False
        self.timeline = timeline or Timeline()  # recorded on rank 0 only, once a file is started
        self.executor = Executor(process_sets, self._transport_failed, self._executor_idle, self.timeline)
        self._stopped = threading.Event()
        self._rendezvous = rendezvous
        self._key_prefix = key_prefix
        self._host = os.environ.get("ROUNDEL_HOSTNAME") or socket.gethostname()
        self._waits = WaitTracker()
        self._next_tick = 0.0
        self._last_heartbeat = 0.0

        key = key_prefix + "coordinator"
        if rank == 0:
            self._negotiator = Negotiator(size, settings.cache_capacity)
            self._peers: dict[int, control_channel.Connection] = {}
            self._readers: dict[int, control_channel.FrameReader] = {}
            self._outbox: dict[int, list] = {}
            self._resends: dict[int, list] = {}
            self._finishing_since: float | None = None
            self._accepted: "queue.SimpleQueue" = queue.SimpleQueue()
            self._last_dispatch = 0.0
            self._next_stall_check = 0.0
            self._heard: dict[int, float] = {}  # peer rank -> when it was last heard from
            self._hosts: dict[int, str] = {0: self._host}
            self._rank_waits: dict[int, tuple] = {}  # peer rank -> (sequence, waits)
            self._deadlock_seen: tuple | None = None  # (since, {rank: sequence}) while a deadlock holds
            self._ever_connected: set[int] = set()  # peers may join and leave (bye) before the last joins
            self._all_connected = threading.Event()  # every other rank has joined: init() may return
            if size == 1:
                self._all_connected.set()
            self._listener = control_channel.Listener(advertise_host, secret, self._connection_accepted,
                                                      backlog=max(128, size),
                                                      send_timeout_s=settings.heartbeat_timeout_s)
            rendezvous.set(key, f"{advertise_host}:{self._listener.port}".encode())
            target = self._coordinator_loop
        else:
            address = rendezvous.get(key, timeout=settings.start_timeout_s).decode()
            host, port = address.rsplit(":", 1)
            try:
                self._coordinator = control_channel.connect(host, int(port), secret, rank, settings.start_timeout_s,
                                                            send_timeout_s=settings.heartbeat_timeout_s)
            except OSError as exc:  # ChannelError and AuthenticationError are OSErrors too
                raise RoundelInternalError(
                    f"rank {rank} could not join rank 0's coordinator at {host}:{port}: {exc}; rank 0 may have "
                    "failed or exited (see its output)") from exc
            self._coordinator_reader = control_channel.FrameReader(self._coordinator)
            self._heard_coordinator = time.monotonic()
            self._coordinator_host = host
            self._coordinator_lost = False
            self._sent_waits_seq = 0
            self._selector.register(self._coordinator, selectors.EVENT_READ, "coordinator")
            target = self._rank_loop
        self._thread = threading.Thread(target=target, name="roundel-engine", daemon=True)
        self._thread.start()
        if rank == 0:
            self._await_peers(settings.start_timeout_s)

    def _await_peers(self, timeout_s: float) -> None:
        """Return once every other rank has joined the coordinator (init() is collective, as in Horovod:
        a rank 0 that shuts down right after init() must not refuse a rank still connecting).
        Raises RoundelInternalError naming the missing ranks after ``timeout_s``."""
        if self._all_connected.wait(timeout_s):
            return
        missing = sorted(set(range(1, self.size)) - set(self._ever_connected))
        self.shutdown()
        raise RoundelInternalError(
            f"rank(s) {', '.join(map(str, missing))} did not join rank 0's coordinator within {timeout_s:g} s "
            "(HOROVOD_START_TIMEOUT); check that every rank started and can reach rank 0")

    # ------------------------------------------------------------ user side
    def submit(self, request: Request, tensor, output) -> Handle:
        """Queue one collective; return its handle. Raises if the job's communication has failed."""
        key = (request.process_set_id, request.name)
        with self._lock:
            if key in self._names_in_flight:
                raise ValueError(
                    f"'{request.name}' is already in flight on rank {self.rank} (submitted and not yet "
                    "finished); give each in-flight collective a unique name, or synchronize the first one")
            self._names_in_flight.add(key)
        handle = Handle(request.name, self._waits, (request.process_set_id, request.name, request.kind.label),
                        on_done=lambda: self._name_done(key))
        try:
            self._enqueue(Work(request, tensor, output, handle))
        except BaseException:
            self._name_done(key)
            raise
        return handle

    def _name_done(self, key: tuple) -> None:
        with self._lock:
            self._names_in_flight.discard(key)

    def control(self, message: tuple) -> None:
        """Queue a process-set change (applied in order with the requests around it)."""
        self._enqueue(message)

    def _enqueue(self, item) -> None:
        if self._broken is not None:
            raise RoundelInternalError(str(self._broken))
        with self._lock:
            if self._stopping:
                raise RoundelInternalError("roundel is shutting down; no new collectives are accepted")
            self._queue.append(item)
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            os.write(self._wake_w, b"x")

    def shutdown(self) -> bool:
        """Leave the job: tell the coordinator, stop both threads, release sockets.

        Returns False when the executor was still inside a transport call
        (after a failure) and was left to finish in the background.
        """
        with self._lock:
            if self._stopping:
                return True
            self._stopping = True
        os.write(self._wake_w, b"s")
        self._thread.join(_BYE_GRACE_S + 5)
        # after a failure the running batch may wait on a departed peer until the transport times
        # out; it ends in the background once a peer closes its side
        stopped = self.executor.stop(_ABANDON_S if self._broken else self.settings.collective_timeout_s)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        return stopped

    @property
    def broken(self) -> RoundelInternalError | None:
        return self._broken

    # ---------------------------------------------------------- shared steps
    def _drain(self) -> list:
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            items, self._queue = self._queue, []
            self._wake_pending = False
        return items

    def _transport_failed(self, error: RoundelInternalError) -> None:
        if self._broken is None:
            self._broken = error
        try:
            os.write(self._wake_w, b"f")
        except OSError:
            pass

    def _executor_idle(self) -> None:
        if self._awaiting_idle:
            self._awaiting_idle = False
            try:
                os.write(self._wake_w, b"i")
            except OSError:
                pass

    def _fail_inflight(self, error: Exception) -> None:
        for work in self._inflight.values():
            work.handle.set_error(error)
        self._inflight.clear()
        self._sent_bits.clear()

    def _break(self, message: str) -> None:
        if self._broken is None:
            self._broken = RoundelInternalError(message)
        self._fail_inflight(self._broken)
        self.executor.abort(self._broken)

    def _register(self, work: Work) -> None:
        """Track ``work`` as in flight (submit() keeps names unique among this rank's in-flight work)."""
        self._inflight[(work.request.process_set_id, work.request.name)] = work

    def _accept_batches(self, batches) -> None:
        """Match agreed batches with local work and hand them to the executor."""
        for batch in batches:
            works = []
            for entry in batch.entries:
                key = (batch.process_set_id, entry.name)
                work = self._inflight.pop(key, None)
                if work is not None:
                    if work.sent_bit is not None:
                        self._sent_bits.pop(work.sent_bit, None)
                    if entry.cache_bit >= 0:
                        self._cache.record(key, entry.cache_bit, work.request)
                works.append(work)
            self.executor.put(batch, works)

    def _apply_control(self, message: tuple) -> None:
        if self.rank != 0:
            return
        if message[0] == "add_process_set":
            self._negotiator.add_process_set(message[1], message[2])
        elif message[0] == "remove_process_set":
            self._negotiator.remove_process_set(message[1])

    # -------------------------------------------------------- rank 1..n-1
    def _rank_loop(self) -> None:
        try:
            while True:
                for key, _ in self._selector.select(max(0.0, self._next_tick - time.monotonic())):
                    if key.data == "wake":
                        if self._rank_wake():
                            return
                    else:
                        self._rank_receive()
                if time.monotonic() >= self._next_tick and self._rank_tick():
                    return
        except Exception as exc:  # keep the user's threads from hanging on a dead engine
            log.exception("roundel engine thread failed")
            self._break(f"roundel's engine thread failed: {exc!r}")
        finally:
            self._coordinator.close()

    def _rank_wake(self) -> bool:
        items = self._drain()
        if self._broken is not None:
            self._fail_inflight(self._broken)
        bits, full = 0, []
        for item in items:
            if isinstance(item, tuple):
                self._apply_control(item)
                continue
            if self._broken is not None:
                item.handle.set_error(self._broken)
                continue
            request = item.request
            self._register(item)
            key = (request.process_set_id, request.name)
            bit = self._cache.bit_for(key, request)
            if bit >= 0:
                item.sent_bit = (self._cache.version, bit)
                self._sent_bits[item.sent_bit] = key
                bits |= 1 << bit
            else:
                full.append(request)
        if self._broken is None and (bits or full):
            self._send(Submit(self._cache.version, bits, full))
        if self._stopping:
            if self._broken is None:
                self._send(Bye())
            self._fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
            return True
        return False

    def _rank_tick(self) -> bool:
        """Heartbeat, report what this rank waits for, and check the coordinator is alive."""
        now = time.monotonic()
        self._next_tick = now + _TICK_S
        if self._coordinator_lost:
            return False
        seq, waits = self._waits.snapshot()  # before draining: every waited name is then submitted
        if seq != self._sent_waits_seq:
            if self._rank_wake():
                return True
            if self._broken is None:
                self._send(Waits(seq, waits))
            self._sent_waits_seq = seq
        if now - self._last_heartbeat >= _HEARTBEAT_S:
            self._last_heartbeat = now
            self._send(Heartbeat(self._host))
        silent = now - self._heard_coordinator
        if silent > self.settings.heartbeat_timeout_s:
            self._coordinator_lost = True
            reason = f"stopped responding: {_silence(silent, self.settings.heartbeat_timeout_s)}"
            self._record_lost(0, self._coordinator_host, reason)
            self._break(f"rank 0 (host {self._coordinator_host}), the coordinator, {reason}; "
                        "the job's communication is broken")
        return False

    def _record_lost(self, rank: int, host: str, reason: str) -> None:
        """Write ``<prefix>lost/<rank>`` to the rendezvous store for the launcher; never waits long."""
        value = json.dumps({"rank": rank, "host": host, "reason": reason}).encode()

        def write():
            try:
                self._rendezvous.set(f"{self._key_prefix}lost/{rank}", value)
            except Exception as exc:  # best effort: the store may be gone with the launcher
                log.debug("roundel could not record lost rank %d: %s", rank, exc)

        writer = threading.Thread(target=write, name="roundel-lost-key", daemon=True)
        writer.start()
        writer.join(_LOST_KEY_WRITE_S)

    def _send(self, message) -> None:
        try:
            control_channel.send(self._coordinator, message)
        except OSError as exc:
            self._break(f"lost the connection to the coordinator on rank 0 ({exc}); "
                        "rank 0 has shut down or died")

    def _rank_receive(self) -> None:
        try:
            data = self._coordinator.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(self._coordinator)
            self._coordinator_lost = True
            self._break("lost the connection to the coordinator on rank 0: rank 0 has shut down "
                        "or died (see its output)")
            return
        self._heard_coordinator = time.monotonic()
        for message in self._coordinator_reader.feed(data):
            kind = type(message)
            if kind is Heartbeat:
                self._coordinator_host = message.host
            elif kind is Dispatch:
                self._cache.evict(message.evicted)
                self._cache.version = message.version
                if message.resend:
                    self._resend(message.resend)
                try:
                    batches = [self._cache.expand(b) if isinstance(b, CachedBatch) else b for b in message.batches]
                except KeyError as exc:
                    self._break(f"the coordinator sent cache bit {exc} that this rank does not hold "
                                "(are all ranks running the same roundel version?)")
                    return
                self._accept_batches(batches)
            elif kind is Tune:
                self.tuned = message.params
            elif kind is Abort:
                self._break(message.message)

    def _resend(self, stale) -> None:
        """Send in full the requests whose (cache version, bit) the coordinator found stale."""
        full = []
        for sent in stale:
            key = self._sent_bits.pop(sent, None)
            work = self._inflight.get(key) if key else None
            if work is not None:
                work.sent_bit = None
                full.append(work.request)
        if full:
            self._send(Submit(self._cache.version, 0, full))

    # ------------------------------------------------------ rank 0: coordinator
    def _connection_accepted(self, connection: control_channel.Connection) -> None:
        """Called by the listener's handshake threads: hand the connection to the coordinator loop."""
        self._accepted.put(connection)
        try:
            os.write(self._wake_w, b"a")
        except OSError:
            connection.close()  # the engine is shutting down

    def _coordinator_loop(self) -> None:
        try:
            while not self._coordinator_step():
                pass
        except Exception as exc:
            log.exception("roundel coordinator failed")
            self._break(f"roundel's coordinator on rank 0 failed: {exc!r}")
            self._broadcast_abort(str(self._broken))
        finally:
            if self._autotuner is not None:
                self._autotuner.close()
            self._listener.close()
            for sock in self._peers.values():
                sock.close()

    def _coordinator_step(self) -> bool:
        if self._finishing_since is not None:  # leaving: wait for byes in bounded steps, never block
            return self._coordinator_finish()
        timeout = self._coordinator_timeout()
        self.timeline.cycle()
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                self._coordinator_wake()
            else:
                self._coordinator_receive(key.data)
        now = time.monotonic()
        if self._stopping:
            return self._coordinator_finish()
        if now >= self._next_tick:
            self._coordinator_tick(now)
        self._check_stalls(now)
        self._dispatch(now)
        return False

    def _coordinator_timeout(self) -> float | None:
        negotiator = self._negotiator
        waits = [self._next_tick - time.monotonic()]
        if negotiator.has_ready():  # held back while the executor is busy: wake on idle or at the cycle
            waits.append(self._last_dispatch + self.tuned.cycle_time_ms / 1000 - time.monotonic())
        if negotiator.has_pending() and self.settings.stall_check_enabled:
            waits.append(_STALL_POLL_S)
        return max(0.0, min(waits))

    def _coordinator_wake(self) -> None:
        items = self._drain()
        while not self._accepted.empty():
            sock = self._accepted.get()
            rank = sock.rank
            if rank in self._peers or not 0 < rank < self.size:
                log.warning("roundel coordinator refused a second connection claiming rank %d", rank)
                sock.close()
                continue
            self._peers[rank] = sock
            self._readers[rank] = control_channel.FrameReader(sock)
            self._selector.register(sock, selectors.EVENT_READ, rank)
            self._ever_connected.add(rank)
            if len(self._ever_connected) == self.size - 1:
                self._all_connected.set()
        if self._broken is not None:
            self._fail_inflight(self._broken)
        now = time.monotonic()
        for item in items:
            if isinstance(item, tuple):
                self._apply_control(item)
            elif self._broken is not None:
                item.handle.set_error(self._broken)
            else:
                self._register(item)
                if self.timeline.active:
                    self.timeline.rank_ready(item.request.name, item.request.kind.label, 0)
                self._negotiator.submit(0, item.request, now)

    def _coordinator_receive(self, rank: int) -> None:
        sock = self._peers[rank]
        try:
            data = sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:  # gone without saying goodbye: the job cannot go on, so every rank is told
            reason = f"rank {rank} died (crashed or was killed) or lost its connection to the coordinator"
            self._drop_peer(rank, reason)
            self._break(f"{reason}; the job's communication is broken")
            self._broadcast_abort(str(self._broken))
            return
        now = time.monotonic()
        self._heard[rank] = now
        negotiator = self._negotiator
        for message in self._readers[rank].feed(data):
            kind = type(message)
            if kind is Heartbeat:
                self._hosts[rank] = message.host
            elif kind is Waits:
                self._rank_waits[rank] = (message.sequence, message.waits)
            elif kind is Submit:
                version, bits = message.version, message.bits
                stale = []
                bit = 0
                while bits:
                    if bits & 1:
                        if self.timeline.active:
                            self._timeline_cached_arrival(rank, bit, version)
                        if not negotiator.submit_bit(rank, bit, version, now):
                            stale.append((version, bit))
                    bits >>= 1
                    bit += 1
                for request in message.full:
                    if self.timeline.active:
                        self.timeline.rank_ready(request.name, request.kind.label, rank)
                    negotiator.submit(rank, request, now)
                if stale:
                    self._resends.setdefault(rank, []).extend(stale)
            elif kind is Bye:
                self._drop_peer(rank, f"rank {rank} has shut down: it finished, called hvd.shutdown(), "
                                      "or failed and exited (its own output says which)")
                return

    def _timeline_cached_arrival(self, rank: int, bit: int, version: int) -> None:
        cached = self._negotiator.cache.lookup(bit, version)
        if cached is not None and rank in cached[1]:
            request = cached[1][rank]
            self.timeline.rank_ready(request.name, request.kind.label, rank)

    def _drop_peer(self, rank: int, reason: str) -> None:
        sock = self._peers.pop(rank, None)
        if sock is None:
            return
        self._selector.unregister(sock)
        sock.close()
        self._readers.pop(rank, None)
        self._heard.pop(rank, None)
        self._rank_waits.pop(rank, None)
        self._negotiator.rank_left(rank, reason)

    def _coordinator_tick(self, now: float) -> None:
        """Heartbeat every peer, declare silent ones lost, and look for a deadlock."""
        self._next_tick = now + _TICK_S
        own = self._waits.snapshot()  # before draining: every name rank 0 waits for is then submitted
        self._coordinator_wake()
        self._heartbeat_peers(now)
        timeout = self.settings.heartbeat_timeout_s
        for rank in list(self._peers):
            silent = now - self._heard.setdefault(rank, now)
            if silent > timeout:
                self._lose_peer(rank, f"stopped responding: {_silence(silent, timeout)}")
        self._check_deadlock(now, own)

    def _heartbeat_peers(self, now: float) -> None:
        beat = now - self._last_heartbeat >= _HEARTBEAT_S
        if beat:
            self._last_heartbeat = now
        for rank in list(self._peers):
            if beat or rank not in self._heard:  # a new peer learns rank 0's host at once
                self._send_peer(rank, Heartbeat(self._host))

    def _lose_peer(self, rank: int, reason: str) -> None:
        host = self._hosts.get(rank, "unknown")
        self._record_lost(rank, host, reason)
        named = f"rank {rank} (host {host}) {reason}"
        self._drop_peer(rank, named)
        self._break(f"{named}; the job's communication is broken")
        self._broadcast_abort(str(self._broken))

    def _check_deadlock(self, now: float, own: tuple) -> None:
        """Fail the waited names once every involved rank has been blocked on them, unchanged, for the grace."""
        if self._broken is not None:
            return
        states = dict(self._rank_waits)
        states[0] = own
        negotiator = self._negotiator
        live = [r for r in negotiator.live_ranks() if r == 0 or r in self._peers]
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
        if any(r != 0 and self._heard.get(r, 0.0) <= self._deadlock_seen[0] for r in stuck):
            return
        self._deadlock_seen = None
        message = ("roundel detected a deadlock: these ranks are blocked on collectives that can never "
                   "complete because the ranks called different collectives (or in a different order): "
                   f"{deadlock.describe(stuck, negotiator.missing_ranks)}. These collectives fail on every "
                   "rank that submitted them; later collectives work once the ranks call matching ones")
        log.error("%s", message)
        for waits in stuck.values():
            negotiator.fail_waits(waits, message)

    def _check_stalls(self, now: float) -> None:
        settings = self.settings
        if not settings.stall_check_enabled or now < self._next_stall_check:
            return
        self._next_stall_check = now + _STALL_POLL_S
        for name, ps_id, missing, present, waited in self._negotiator.stalled(now, settings.stall_check_time_s):
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
        due = self.executor.idle() or now - self._last_dispatch >= self.tuned.cycle_time_ms / 1000
        batches = []
        if due and negotiator.has_ready():
            batches = negotiator.take(self.tuned.fusion_threshold)
            self._last_dispatch = now
        elif negotiator.has_direct():
            batches = negotiator.take_direct()
        self._awaiting_idle = negotiator.has_ready()
        if self.timeline.active:
            for _, batch in batches:
                for entry in batch.entries:
                    self.timeline.negotiated(entry.name)
        mine = []
        for members, batch in batches:
            sent = negotiator.compact_form(batch) or batch  # bits where the members hold the requests
            for member in members:
                if member == 0:
                    mine.append(batch)
                elif member in self._peers:
                    self._outbox.setdefault(member, []).append(sent)
        if mine:
            self._accept_batches(mine)
        evicted = [bit for bit, _ in negotiator.take_evictions()]
        version = negotiator.cache.version
        targets = set(self._outbox) | set(self._resends) | (set(self._peers) if evicted else set())
        encoded: dict[tuple, bytes] = {}  # peers getting the same batches share one encoding
        for rank in targets:
            outbox, resends = self._outbox.get(rank, []), self._resends.get(rank, [])
            same = (tuple(map(id, outbox)), bool(resends))
            payload = None if resends else encoded.get(same)
            if payload is None:
                payload = control_codec.encode(Dispatch(version, outbox, evicted, resends))
                if not resends:
                    encoded[same] = payload
            self._send_peer_encoded(rank, payload)
        self._outbox.clear()
        self._resends.clear()
        if self._autotuner is not None and not self._autotuner.done:
            self._autotune(batches)

    def _autotune(self, batches) -> None:
        """Score the dispatched batches; apply and announce new settings when a sample ends."""
        params = self._autotuner.observe(batches)
        if params is None:
            return
        if params.cache_enabled != self.tuned.cache_enabled:
            self._negotiator.set_cache_capacity(self.settings.cache_capacity if params.cache_enabled else 0)
        self.tuned = params
        for rank in list(self._peers):
            self._send_peer(rank, Tune(params))

    def _send_peer(self, rank: int, message) -> None:
        self._send_peer_encoded(rank, control_codec.encode(message))

    def _send_peer_encoded(self, rank: int, payload: bytes) -> None:
        try:
            self._peers[rank].send_encoded(payload)
        except (OSError, KeyError):
            pass  # a closed peer is noticed by select and dropped there

    def _broadcast_abort(self, message: str) -> None:
        for sock in self._peers.values():
            try:
                control_channel.send(sock, Abort(message))
            except OSError:
                pass

    def _coordinator_finish(self) -> bool:
        """Rank 0 is leaving: fail what needs it, let the others say goodbye, then stop."""
        if self._finishing_since is None:
            self._finishing_since = time.monotonic()
            self._negotiator.rank_left(0, "rank 0 has shut down: it finished, called hvd.shutdown(), "
                                          "or failed and exited (its own output says which)")
            self._fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
        self._dispatch(time.monotonic() + 1.0)
        self._heartbeat_peers(time.monotonic())  # the others wait for rank 0's goodbye, not a timeout
        waited = time.monotonic() - self._finishing_since
        if self._peers and waited < _BYE_GRACE_S:
            for key, _ in self._selector.select(0.1):
                if key.data == "wake":
                    self._drain()
                else:
                    self._coordinator_receive(key.data)
            return False
        return True


def _silence(silent: float, timeout: float) -> str:
    return (f"no heartbeat for {silent:.1f} s (heartbeat timeout {timeout:g} s, "
            "ROUNDEL_HEARTBEAT_TIMEOUT_SECONDS); the process is stopped, hung outside Python, "
            "or its host or network is down")
