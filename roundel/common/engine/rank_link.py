"""The engine's side on ranks 1..n-1: the link to rank 0's coordinator.

The link runs the engine thread of a rank other than 0. It forwards what the
rank queues to the coordinator (one bit per name the rank's cache already
holds, the full request otherwise), hands the batches the coordinator sends
back to the engine core's executor, and keeps the liveness duties of a rank:
heartbeats, reports of what this rank waits for (for deadlock detection), and
the check that rank 0 is alive. It reaches the core only through its public
methods (see :class:`roundel.common.engine.core.Engine`).

When relays are on (:mod:`roundel.common.engine.relay`) the rank above is
this host's relay, or for a relaying rank another host's relay or rank 0; on
a host's relaying rank (its first; the second on rank 0's host) the link also
runs that host's relay, in the same thread.
"""

from __future__ import annotations

import json
import logging
import selectors
import time

from roundel.common.control import channel as control_channel
from roundel.common.control import codec as control_codec
from roundel.common.control.messages import Abort, Bye, Deliver, Dispatch, Heartbeat, Submit, Tune, Waits
from roundel.common.control.records import CachedBatch
from roundel.common.engine import relay as relays, small_allreduce
from roundel.common.engine.core_api import EngineCore, EngineTools
from roundel.common.engine.liveness import BYE_GRACE_S, HEARTBEAT_S, TICK_S, describe_silence
from roundel.common.engine.requests import ProcessSetChange
from roundel.common.engine.response_cache import RankCache
from roundel.errors import RoundelInternalError

log = logging.getLogger("roundel")


class RankLink:
    """A rank's connection to the coordinator, and the loop of its engine thread.

    Connects at construction to rank 0 (``parent_key`` None) or to the relay
    whose address is under ``parent_key``; with ``relay_keys``, first starts
    this host's relay and publishes its address under them. Raises
    RoundelInternalError when the rank above cannot be reached or refuses
    this rank.
    """

    def __init__(self, engine: EngineCore, tools: EngineTools, secret: bytes, key_prefix: str,
                 parent_key: str | None, relay_keys: tuple = (), advertise_host: str = ""):
        self._engine = engine
        self._tools = tools
        settings = engine.settings
        self._cache = RankCache()
        self._sent_bits: dict[tuple, tuple] = {}  # (cache version, bit) -> key, for requests sent as bits
        self._relay: relays.Relay | None = None
        if relay_keys:
            self._relay = relays.Relay(engine.rank, engine.size, secret, advertise_host, tools.selector,
                                       self._send_up, engine.wake, engine.tuned.cycle_time_ms / 1000,
                                       settings.heartbeat_timeout_s, engine.host, self._cache.global_set_bits)
            record = relays.address_record(engine.rank, f"{advertise_host}:{self._relay.listener.port}",
                                           engine.host, self._relay.listener.local_name)
            for key in relay_keys:
                tools.rendezvous.set(key, record)
        try:
            self._connect_up(secret, key_prefix, parent_key)
        except BaseException:
            if self._relay is not None:
                self._relay.close(time.monotonic())
            raise
        if self._relay is not None:  # known once connected: under the tree's key may be rank 0, alone on its host
            self._relay.above_is_relay = self._above_rank != 0
        self._reader = control_channel.FrameReader(self._connection)
        self._heard = time.monotonic()
        self._lost = False
        self._sent_waits_seq = 0
        self._next_tick = 0.0
        self._last_heartbeat = 0.0
        tools.selector.register(self._connection, selectors.EVENT_READ, "coordinator")

    def _connect_up(self, secret: bytes, key_prefix: str, parent_key: str | None) -> None:
        """Connect to rank 0's coordinator (``parent_key`` None) or to the relay whose address is there."""
        engine = self._engine
        timeout = engine.settings.start_timeout_s
        if parent_key is None:
            self._above_rank, what = 0, "rank 0's coordinator"
            address = self._tools.rendezvous.get(key_prefix + "coordinator", timeout=timeout).decode()
            local = self._local_coordinator(key_prefix + "coordinator/local")
        else:
            found = json.loads(self._tools.rendezvous.get(parent_key, timeout=timeout))
            self._above_rank, address = found["rank"], found["address"]
            local = found["local"] if found["host"] == engine.host else None
            what = "rank 0's coordinator" if self._above_rank == 0 else f"the relay on rank {self._above_rank}"
        host, port = address.rsplit(":", 1)
        self._above_host = host
        self._above = ("rank 0, the coordinator" if self._above_rank == 0 else
                       f"rank {self._above_rank}, which relays this rank's control messages to rank 0")
        try:
            self._connection = control_channel.connect(
                host, int(port), secret, engine.rank, timeout,
                send_timeout_s=engine.settings.heartbeat_timeout_s, local_name=local)
        except OSError as exc:  # ChannelError and AuthenticationError are OSErrors too
            raise RoundelInternalError(
                f"rank {engine.rank} could not join {what} at {host}:{port}: {exc}; rank {self._above_rank} "
                "may have failed or exited (see its output)") from exc

    @property
    def peer(self) -> str:
        """How this rank reaches the rank above: its local socket's name, or ``host:port`` over TCP."""
        return self._connection.peer

    def _local_coordinator(self, key: str) -> str | None:
        """The name of the coordinator's local socket when it runs on this rank's host (see control.channel)."""
        rendezvous = self._tools.rendezvous
        if not rendezvous.check([key]):
            return None
        try:
            found = json.loads(rendezvous.get(key, timeout=self._engine.settings.start_timeout_s))
        except ValueError:
            return None
        if isinstance(found, dict) and found.get("host") == self._engine.host and isinstance(found.get("name"), str):
            return found["name"]
        return None

    def run(self) -> None:
        """The engine thread's loop; returns once the engine shuts down."""
        try:
            while not self._step(forwarding=True):
                pass
            self._leave()
        except Exception as exc:  # keep the user's threads from hanging on a dead engine
            log.exception("roundel engine thread failed")
            self._break(f"roundel's engine thread failed: {exc!r}")
        finally:  # what is still queued (a goodbye) goes out first, unless the rank above stops reading
            deadline = time.monotonic() + BYE_GRACE_S
            self._connection.drain(deadline)
            self._connection.close()
            if self._relay is not None:
                self._relay.close(deadline)

    def _step(self, forwarding: bool) -> bool:
        """One round of select (``forwarding``: what the rank queues goes up); True once the engine stops."""
        engine, relay = self._engine, self._relay
        timeout = self._next_tick - time.monotonic()
        held = relay.deadline() if relay is not None else None
        if held is not None:
            timeout = min(timeout, held - time.monotonic())
        for key, events in self._tools.selector.select(max(0.0, timeout)):
            data = key.data
            if data == "wake":
                if not forwarding:
                    engine.drain()
                elif self._forward():
                    return True
            elif data == "coordinator":
                if events & selectors.EVENT_WRITE:
                    self._flush()
                if events & selectors.EVENT_READ and not self._lost:
                    self._receive()
            elif relay is not None:
                relay.serve(data[1], events)
        now = time.monotonic()
        if relay is not None:
            relay.poll(now)
        return forwarding and now >= self._next_tick and self._tick()

    def _leave(self) -> None:
        """The engine stops: a relay first passes on its children's goodbyes (for a while), then this rank
        says its own, unless the job is broken."""
        relay = self._relay
        if relay is not None:
            deadline = time.monotonic() + BYE_GRACE_S
            while relay.children and not self._lost and time.monotonic() < deadline:
                self._next_tick = min(self._next_tick, time.monotonic() + 0.05)
                self._step(forwarding=False)
                relay.flush()
        if self._engine.broken is None:
            self._send(Bye())

    def _fail_inflight(self, error: Exception) -> None:
        self._engine.fail_inflight(error)
        self._sent_bits.clear()

    def _break(self, message: str) -> None:
        self._engine.break_job(message)
        self._sent_bits.clear()
        if self._relay is not None:  # the ranks below cannot go on either
            self._relay.abort_children(str(self._engine.broken))

    def _forward(self) -> bool:
        """Send what the rank queued to the coordinator; True once the engine is shutting down."""
        engine = self._engine
        items = engine.drain()
        if engine.broken is not None:
            self._fail_inflight(engine.broken)
        bits, full, bit_data, full_data, carried = 0, [], {}, [], 0
        for item in items:
            if isinstance(item, ProcessSetChange):  # only the coordinator on rank 0 needs it
                continue
            if engine.broken is not None:
                item.handle.set_error(engine.broken)
                continue
            request = item.request
            engine.register(item)
            key = (request.process_set_id, request.name)
            bit = self._cache.bit_for(key, request)
            if bit >= 0:
                item.sent_bit = (self._cache.version, bit)
                self._sent_bits[item.sent_bit] = key
                bits |= 1 << bit
                if item.data is not None:
                    bit_data[bit] = item.data
            else:
                full.append(request)
                full_data.append(item.data)
            carried += len(item.data) if item.data is not None else 0
            if carried >= small_allreduce.MESSAGE_DATA_BYTES:  # what is queued so far, in one message
                self._send(Submit(self._cache.version, bits, full, bit_data, full_data))
                bits, full, bit_data, full_data, carried = 0, [], {}, [], 0
        if engine.broken is None and (bits or full):
            self._send(Submit(self._cache.version, bits, full, bit_data, full_data))
        if engine.stopping:
            self._fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
            return True
        return False

    def _tick(self) -> bool:
        """Heartbeat, report what this rank waits for, and check the coordinator is alive."""
        engine = self._engine
        now = time.monotonic()
        self._next_tick = now + TICK_S
        if self._lost:
            return False
        seq, waits = engine.waits_snapshot()  # before draining: every waited name is then submitted
        if seq != self._sent_waits_seq:
            if self._forward():
                return True
            if engine.broken is None:
                self._send(Waits(seq, waits))
            self._sent_waits_seq = seq
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self._send(Heartbeat(engine.host))
        self._flush()  # gives up on a coordinator that took nothing for the send timeout
        if self._relay is not None:
            self._relay.tick(now)
        silent = now - self._heard
        if silent > engine.settings.heartbeat_timeout_s:
            self._lost = True
            reason = f"stopped responding: {describe_silence(silent, engine.settings.heartbeat_timeout_s)}"
            self._tools.losses.record(self._above_rank, self._above_host, reason)
            self._break(f"{self._above_named()} {reason}; the job's communication is broken")
        return False

    def _above_named(self) -> str:
        """The rank above, with its host: 'rank 0 (host h), the coordinator,'."""
        rank, what = self._above.split(", ", 1)
        return f"{rank} (host {self._above_host}), {what},"

    def _coordinator_gone(self, what: str) -> None:
        """Break the job after the connection to rank 0 failed (``what``, the default explanation).

        When another rank already found rank 0 stopped responding (the launcher then ends it, which
        closes this connection), that is the error here too.
        """
        recorded = self._tools.losses.recorded(self._above_rank)
        if recorded is None:
            self._break(what)
            return
        self._above_host = recorded.get("host", self._above_host)
        self._break(f"{self._above_named()} {recorded['reason']} (found by another rank); the job's "
                    "communication is broken")

    def _send(self, message) -> None:
        """Send one of this rank's messages up; on a relay, steady submissions join the ones held."""
        relay = self._relay
        if relay is not None:
            if relays.mergeable(message):
                relay.hold(message.version, self._engine.rank, message.bits, 0.0, time.monotonic())
                return
            relay.note_sent(self._engine.rank, message)
            relay.flush()
        self._send_up(message)

    def _send_up(self, message) -> None:
        try:
            control_channel.send(self._connection, message)
        except OSError as exc:
            self._send_failed(exc)
            return
        if self._connection.pending:
            control_channel.watch_writes(self._tools.selector, self._connection, "coordinator")

    def _flush(self) -> None:
        """Write what the connection to rank 0 holds queued; stop watching for writability once it is out."""
        if self._lost or not self._connection.pending:
            return
        try:
            self._connection.flush()
        except OSError as exc:
            self._send_failed(exc)
            return
        control_channel.watch_writes(self._tools.selector, self._connection, "coordinator")

    def _send_failed(self, exc: OSError) -> None:
        self._coordinator_gone(f"lost the connection to {self._above} ({exc}); rank {self._above_rank} "
                               "has shut down or died")

    def _receive(self) -> None:
        engine = self._engine
        try:
            data = self._connection.recv(control_channel.RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self._tools.selector.unregister(self._connection)
            self._lost = True
            self._coordinator_gone(f"lost the connection to {self._above}: rank {self._above_rank} has shut "
                                   "down or died (see its output)")
            return
        self._heard = time.monotonic()
        for message in self._reader.feed(data):
            if type(message) is Deliver:
                relay = self._relay
                if relay is not None and not relay.deliver(message.ranks, message.payload):
                    continue
                if relay is None and self._engine.rank not in message.ranks:
                    continue
                message = control_codec.decode(message.payload)
            self._handle(message)

    def _handle(self, message) -> None:
        """One message from the rank above, for this rank."""
        kind = type(message)
        if kind is Heartbeat:
            self._above_host = message.host
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
            self._accept(batches)
        elif kind is Tune:
            self._engine.retune(message.params)
        elif kind is Abort:
            self._break(message.message)

    def _accept(self, batches) -> None:
        """Hand agreed batches to the executor, remembering the cache bits they assign."""
        for batch in batches:
            works = []
            for entry in batch.entries:
                key = (batch.process_set_id, entry.name)
                work = self._engine.take_inflight(key)
                if work is not None:
                    if work.sent_bit is not None:
                        self._sent_bits.pop(work.sent_bit, None)
                    if entry.cache_bit >= 0:
                        self._cache.record(key, entry.cache_bit, work.request)
                works.append(work)
            self._engine.execute(batch, works)

    def _resend(self, stale) -> None:
        """Send in full the requests whose (cache version, bit) the coordinator found stale; the answer goes
        even when none of them is still in flight, so the coordinator knows nothing more is owed."""
        full, full_data = [], []
        for sent in stale:
            key = self._sent_bits.pop(sent, None)
            work = self._engine.inflight(key) if key else None
            if work is not None:
                work.sent_bit = None
                full.append(work.request)
                full_data.append(work.data)
        self._send(Submit(self._cache.version, 0, full, {}, full_data, resent=True))
