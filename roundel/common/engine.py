"""The background engine: queue → negotiate → fuse → execute → complete handles.

Every rank runs a negotiation thread and an executor thread. On rank 0 the
negotiation thread runs the coordinator (:mod:`roundel.common.coordinator`),
which matches every rank's requests and sends the agreed batches back. Other
ranks' negotiation threads forward their queued requests (a cache bit for
names already agreed, the full request otherwise) and hand the batches they
receive to their executor. In the steady state both
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

import functools
import json
import logging
import os
import selectors
import socket
import threading
import time

from roundel.common import autotune, control_channel, small_allreduce
from roundel.common.control_messages import Abort, Bye, Dispatch, Heartbeat, Submit, Tune, Waits
from roundel.common.coordinator import Coordinator
from roundel.common.liveness import BYE_GRACE_S, HEARTBEAT_S, TICK_S, describe_silence
from roundel.common.executor import Executor, Work
from roundel.common.handles import Handle
from roundel.common.metrics import METRICS
from roundel.common.negotiation import entry_bytes
from roundel.common.requests import CachedBatch, Entry, ProcessSetChange, Request
from roundel.common.response_cache import RankCache
from roundel.common.settings import Settings
from roundel.common.timeline import Timeline
from roundel.common.wait_state import WaitTracker
from roundel.errors import RoundelInternalError

log = logging.getLogger("roundel")

_ABANDON_S = 1.0
_LOST_KEY_WRITE_S = 2.0


def _run_briefly(store_call) -> None:
    """Run ``store_call`` on a helper thread and wait at most _LOST_KEY_WRITE_S for it (the rendezvous
    store may be gone with the launcher; the engine thread must not hang on it)."""
    helper = threading.Thread(target=store_call, name="roundel-lost-key", daemon=True)
    helper.start()
    helper.join(_LOST_KEY_WRITE_S)


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
        self.bucketed = False  # whether a DistributedOptimizer reduces gradients in buckets (autotune's question)
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
        self.selector = selectors.DefaultSelector()
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.timeline = timeline or Timeline()  # recorded on rank 0 only, once a file is started
        self.executor = Executor(process_sets, self._transport_failed, self._executor_idle, self.timeline)
        self._stopped = threading.Event()
        self._rendezvous = rendezvous
        self._key_prefix = key_prefix
        self.host = os.environ.get("ROUNDEL_HOSTNAME") or socket.gethostname()
        self._waits = WaitTracker()
        self._next_tick = 0.0
        self._last_heartbeat = 0.0

        key = key_prefix + "coordinator"
        self._coordinator: Coordinator | None = None
        if rank == 0:
            self._coordinator = Coordinator(self, size, settings, secret, advertise_host)
            if self._coordinator.local_name is not None:  # before the address: ranks that read it find this
                rendezvous.set(key + "/local", json.dumps(
                    {"host": self.host, "name": self._coordinator.local_name}).encode())
            rendezvous.set(key, f"{advertise_host}:{self._coordinator.port}".encode())
            target = self._coordinator.run
        else:
            address = rendezvous.get(key, timeout=settings.start_timeout_s).decode()
            host, port = address.rsplit(":", 1)
            try:
                self._to_coordinator = control_channel.connect(host, int(port), secret, rank, settings.start_timeout_s,
                                                            send_timeout_s=settings.heartbeat_timeout_s,
                                                            local_name=self._local_coordinator(key + "/local"))
            except OSError as exc:  # ChannelError and AuthenticationError are OSErrors too
                raise RoundelInternalError(
                    f"rank {rank} could not join rank 0's coordinator at {host}:{port}: {exc}; rank 0 may have "
                    "failed or exited (see its output)") from exc
            self._coordinator_reader = control_channel.FrameReader(self._to_coordinator)
            self._heard_coordinator = time.monotonic()
            self._coordinator_host = host
            self._coordinator_lost = False
            self._sent_waits_seq = 0
            self.selector.register(self._to_coordinator, selectors.EVENT_READ, "coordinator")
            target = self._rank_loop
        self._thread = threading.Thread(target=target, name="roundel-engine", daemon=True)
        self._thread.start()
        if rank == 0:
            self._await_peers(settings.start_timeout_s)

    def _local_coordinator(self, key: str) -> str | None:
        """The name of the coordinator's local socket when it runs on this rank's host (see control_channel)."""
        if not self._rendezvous.check([key]):
            return None
        try:
            found = json.loads(self._rendezvous.get(key, timeout=self.settings.start_timeout_s))
        except ValueError:
            return None
        if isinstance(found, dict) and found.get("host") == self.host and isinstance(found.get("name"), str):
            return found["name"]
        return None

    def _await_peers(self, timeout_s: float) -> None:
        """Return once every other rank has joined the coordinator (init() is collective, as in Horovod:
        a rank 0 that shuts down right after init() must not refuse a rank still connecting).
        Raises RoundelInternalError naming the missing ranks after ``timeout_s``."""
        if self._coordinator.all_connected.wait(timeout_s):
            return
        missing = self._coordinator.missing_peers()
        self.shutdown()
        raise RoundelInternalError(
            f"rank(s) {', '.join(map(str, missing))} did not join rank 0's coordinator within {timeout_s:g} s "
            "(HOROVOD_START_TIMEOUT); check that every rank started and can reach rank 0")

    # ------------------------------------------------------------ user side
    def submit(self, request: Request, tensor, output) -> Handle:
        """Queue one collective; return its handle. Raises if the job's communication has failed."""
        return self.submit_group([(request, tensor, output)])[0]

    def submit_group(self, parts: list) -> list:
        """Queue collectives, ``(request, tensor, output)`` each, to reach the coordinator in one message
        (a grouped call's tensors, so that they become ready, and fuse, together); return their handles.

        All or none: raises, queuing nothing, when one of the names is already in flight on this rank or
        the job's communication has failed.
        """
        keys = [(request.process_set_id, request.name) for request, _, _ in parts]
        with self._lock:
            clash = next((key for key in keys if key in self._names_in_flight), None)
            if clash is not None:
                raise ValueError(
                    f"'{clash[1]}' is already in flight on rank {self.rank} (submitted and not yet "
                    "finished); give each in-flight collective a unique name, or synchronize the first one")
            self._names_in_flight.update(keys)
        works = []
        counted = self._coordinator is not None and self._coordinator.metrics is not None
        for (request, tensor, output), key in zip(parts, keys):
            if counted:
                done = functools.partial(self._counted_done, key, request, time.monotonic())
            else:
                done = functools.partial(self._name_done, key)
            handle = Handle(request.name, self._waits, (request.process_set_id, request.name, request.kind.label),
                            on_done=done)
            data = None
            if small_allreduce.eligible(request, self.settings.coordinator_reduce_bytes):
                data = small_allreduce.snapshot(tensor)
            works.append(Work(request, tensor, output, handle, data))
        try:
            self._enqueue(*works)
        except BaseException:
            for key in keys:
                self._name_done(key)
            raise
        return [work.handle for work in works]

    def _name_done(self, key: tuple, error: BaseException | None = None) -> None:
        with self._lock:
            self._names_in_flight.discard(key)

    def _counted_done(self, key: tuple, request: Request, submitted: float, error: BaseException | None) -> None:
        """``_name_done``, and the collective counted in rank 0's metrics."""
        self._name_done(key)
        kind = request.kind.label
        METRICS.count("roundel_collectives_total", kind=kind, outcome="error" if error else "ok")
        METRICS.count("roundel_collective_bytes_total", entry_bytes(Entry(request.name, request)), kind=kind)
        METRICS.observe("roundel_collective_seconds", time.monotonic() - submitted, kind=kind)

    def control(self, message: ProcessSetChange) -> None:
        """Queue a process-set change (applied in order with the requests around it)."""
        self._enqueue(message)

    def _enqueue(self, *items) -> None:
        """Queue ``items`` at once: the engine thread takes them in one drain."""
        if self._broken is not None:
            raise RoundelInternalError(str(self._broken))
        with self._lock:
            if self._stopping:
                raise RoundelInternalError("roundel is shutting down; no new collectives are accepted")
            self._queue.extend(items)
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
        self._thread.join(BYE_GRACE_S + 5)
        # after a failure the running batch may wait on a departed peer until the transport times
        # out; it ends in the background once a peer closes its side
        stopped = self.executor.stop(_ABANDON_S if self._broken else self.settings.collective_timeout_s)
        self.selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        return stopped

    @property
    def job_backend(self):
        """The communicator of the whole job (the global process set's)."""
        return self._process_sets[0][1]

    @property
    def broken(self) -> RoundelInternalError | None:
        """The error that broke the job's communication, or None."""
        return self._broken

    @property
    def stopping(self) -> bool:
        """Whether ``shutdown()`` has begun."""
        return self._stopping

    # ------------------------------------------- the core, for the coordinator and the rank loop
    def wake(self) -> None:
        """Wake the engine thread from its select (new connections, say); quiet once shut down."""
        try:
            os.write(self._wake_w, b"a")
        except OSError:
            pass

    def waits_snapshot(self) -> tuple:
        """What this rank's threads wait for now (see ``wait_state``)."""
        return self._waits.snapshot()

    def drain(self) -> list:
        """Take everything queued for the engine thread (requests and process-set changes)."""
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
        coordinator = self._coordinator
        if coordinator is not None and coordinator.awaiting_idle:
            coordinator.awaiting_idle = False
            try:
                os.write(self._wake_w, b"i")
            except OSError:
                pass

    def fail_inflight(self, error: Exception) -> None:
        """Fail every collective this rank has in flight with ``error``."""
        for work in self._inflight.values():
            work.handle.set_error(error)
        self._inflight.clear()
        self._sent_bits.clear()

    def break_job(self, message: str) -> None:
        """The job's communication is broken: fail what is in flight, and every later call, with ``message``."""
        if self._broken is None:
            self._broken = RoundelInternalError(message)
        self.fail_inflight(self._broken)
        self.executor.abort(self._broken)

    def watch_writes(self, connection: control_channel.Connection, data) -> None:
        """Have select report ``connection`` writable exactly while it holds queued bytes."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if connection.pending else 0)
        if self.selector.get_key(connection).events != events:
            self.selector.modify(connection, events, data)

    def register(self, work: Work) -> None:
        """Track ``work`` as in flight (submit() keeps names unique among this rank's in-flight work)."""
        self._inflight[(work.request.process_set_id, work.request.name)] = work

    def accept_batches(self, batches) -> None:
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

    # -------------------------------------------------------- rank 1..n-1
    def _rank_loop(self) -> None:
        try:
            while True:
                for key, events in self.selector.select(max(0.0, self._next_tick - time.monotonic())):
                    if key.data == "wake":
                        if self._rank_wake():
                            return
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush_to_coordinator()
                    if events & selectors.EVENT_READ and not self._coordinator_lost:
                        self._rank_receive()
                if time.monotonic() >= self._next_tick and self._rank_tick():
                    return
        except Exception as exc:  # keep the user's threads from hanging on a dead engine
            log.exception("roundel engine thread failed")
            self.break_job(f"roundel's engine thread failed: {exc!r}")
        finally:  # what is still queued (a goodbye) goes out first, unless rank 0 stops reading
            self._to_coordinator.drain(time.monotonic() + BYE_GRACE_S)
            self._to_coordinator.close()

    def _rank_wake(self) -> bool:
        items = self.drain()
        if self._broken is not None:
            self.fail_inflight(self._broken)
        bits, full, bit_data, full_data, carried = 0, [], {}, [], 0
        for item in items:
            if isinstance(item, ProcessSetChange):  # only the coordinator on rank 0 needs it
                continue
            if self._broken is not None:
                item.handle.set_error(self._broken)
                continue
            request = item.request
            self.register(item)
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
        if self._broken is None and (bits or full):
            self._send(Submit(self._cache.version, bits, full, bit_data, full_data))
        if self._stopping:
            if self._broken is None:
                self._send(Bye())
            self.fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
            return True
        return False

    def _rank_tick(self) -> bool:
        """Heartbeat, report what this rank waits for, and check the coordinator is alive."""
        now = time.monotonic()
        self._next_tick = now + TICK_S
        if self._coordinator_lost:
            return False
        seq, waits = self._waits.snapshot()  # before draining: every waited name is then submitted
        if seq != self._sent_waits_seq:
            if self._rank_wake():
                return True
            if self._broken is None:
                self._send(Waits(seq, waits))
            self._sent_waits_seq = seq
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            self._send(Heartbeat(self.host))
        self._flush_to_coordinator()  # gives up on a coordinator that took nothing for the send timeout
        silent = now - self._heard_coordinator
        if silent > self.settings.heartbeat_timeout_s:
            self._coordinator_lost = True
            reason = f"stopped responding: {describe_silence(silent, self.settings.heartbeat_timeout_s)}"
            self.record_lost(0, self._coordinator_host, reason)
            self.break_job(f"rank 0 (host {self._coordinator_host}), the coordinator, {reason}; "
                        "the job's communication is broken")
        return False

    def record_lost(self, rank: int, host: str, reason: str) -> None:
        """Write ``<prefix>lost/<rank>`` to the rendezvous store for the launcher; never waits long."""
        value = json.dumps({"rank": rank, "host": host, "reason": reason}).encode()

        def write():
            try:
                self._rendezvous.set(f"{self._key_prefix}lost/{rank}", value)
            except Exception as exc:  # best effort: the store may be gone with the launcher
                log.debug("roundel could not record lost rank %d: %s", rank, exc)

        _run_briefly(write)

    def _recorded_loss(self, rank: int) -> dict | None:
        """What another rank wrote in ``<prefix>lost/<rank>`` (see ``_record_lost``), if any; never waits long."""
        key = f"{self._key_prefix}lost/{rank}"
        found = []

        def read():
            try:
                if self._rendezvous.check([key]):
                    found.append(json.loads(self._rendezvous.get(key, timeout=_LOST_KEY_WRITE_S)))
            except Exception as exc:  # best effort: the store may be gone with the launcher
                log.debug("roundel could not read the record of lost rank %d: %s", rank, exc)

        _run_briefly(read)
        return found[0] if found and isinstance(found[0], dict) and "reason" in found[0] else None

    def _coordinator_gone(self, what: str) -> None:
        """Break the job after the connection to rank 0 failed (``what``, the default explanation).

        When another rank already found rank 0 stopped responding (the launcher then ends it, which
        closes this connection), that is the error here too.
        """
        recorded = self._recorded_loss(0)
        if recorded is None:
            self.break_job(what)
            return
        self.break_job(f"rank 0 (host {recorded.get('host', self._coordinator_host)}), the coordinator, "
                    f"{recorded['reason']} (found by another rank); the job's communication is broken")

    def _send(self, message) -> None:
        try:
            control_channel.send(self._to_coordinator, message)
        except OSError as exc:
            self._send_failed(exc)
            return
        if self._to_coordinator.pending:
            self.watch_writes(self._to_coordinator, "coordinator")

    def _flush_to_coordinator(self) -> None:
        """Write what the connection to rank 0 holds queued; stop watching for writability once it is out."""
        if self._coordinator_lost or not self._to_coordinator.pending:
            return
        try:
            self._to_coordinator.flush()
        except OSError as exc:
            self._send_failed(exc)
            return
        self.watch_writes(self._to_coordinator, "coordinator")

    def _send_failed(self, exc: OSError) -> None:
        self._coordinator_gone(f"lost the connection to the coordinator on rank 0 ({exc}); "
                               "rank 0 has shut down or died")

    def _rank_receive(self) -> None:
        try:
            data = self._to_coordinator.recv(control_channel.RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(self._to_coordinator)
            self._coordinator_lost = True
            self._coordinator_gone("lost the connection to the coordinator on rank 0: rank 0 has shut down "
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
                    self.break_job(f"the coordinator sent cache bit {exc} that this rank does not hold "
                                "(are all ranks running the same roundel version?)")
                    return
                self.accept_batches(batches)
            elif kind is Tune:
                self.tuned = message.params
                self.executor.retune(message.params)
            elif kind is Abort:
                self.break_job(message.message)

    def _resend(self, stale) -> None:
        """Send in full the requests whose (cache version, bit) the coordinator found stale."""
        full, full_data = [], []
        for sent in stale:
            key = self._sent_bits.pop(sent, None)
            work = self._inflight.get(key) if key else None
            if work is not None:
                work.sent_bit = None
                full.append(work.request)
                full_data.append(work.data)
        if full:
            self._send(Submit(self._cache.version, 0, full, {}, full_data))
