"""The background engine: queue → negotiate → fuse → execute → complete handles.

Every rank runs a negotiation thread and an executor thread. Rank 0's
negotiation thread is also the coordinator: it accepts the other ranks'
control connections, feeds their requests to the ``Negotiator`` and sends the
agreed batches back. Other ranks' negotiation threads forward their queued
requests (a cache bit for names already agreed, the full request otherwise)
and hand the batches they receive to their executor.

Nothing polls: the threads sleep in ``select`` until work is queued, a message
arrives, a dispatch delay (the cycle time) runs out, or, while names are
pending, the once-a-second stall check is due.
"""

from __future__ import annotations

import logging
import os
import queue
import selectors
import socket
import threading
import time

from roundel.common import control_channel
from roundel.common.errors import CollectiveMismatchError, RoundelInternalError
from roundel.common.executor import Executor, Work
from roundel.common.handles import Handle
from roundel.common.negotiation import Negotiator
from roundel.common.requests import Request
from roundel.common.response_cache import RankCache
from roundel.common.settings import Settings

log = logging.getLogger("roundel")

_STALL_POLL_S = 1.0
_BYE_GRACE_S = 5.0
_ABANDON_S = 1.0


class Engine:
    """One rank's engine; create it after the global backend, stop it with ``shutdown()``."""

    def __init__(self, rank: int, size: int, settings: Settings, secret: bytes,
                 rendezvous, key_prefix: str, advertise_host: str, process_sets: dict):
        self.rank = rank
        self.size = size
        self.settings = settings
        self._secret = secret
        self._process_sets = process_sets
        self._lock = threading.Lock()
        self._queue: list = []
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._broken: RoundelInternalError | None = None
        self._inflight: dict[tuple, list[Work]] = {}
        self._sent_bits: dict[tuple, tuple] = {}  # (cache version, bit) -> key
        self._cache = RankCache()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._awaiting_idle = False
        self.executor = Executor(process_sets, self._transport_failed, self._executor_idle)
        self._stopped = threading.Event()

        key = key_prefix + "coordinator"
        if rank == 0:
            self._negotiator = Negotiator(size, settings.cache_capacity)
            self._peers: dict[int, socket.socket] = {}
            self._readers: dict[int, control_channel.FrameReader] = {}
            self._outbox: dict[int, list] = {}
            self._resends: dict[int, list] = {}
            self._finishing_since: float | None = None
            self._accepted: "queue.SimpleQueue" = queue.SimpleQueue()
            self._last_dispatch = 0.0
            self._next_stall_check = 0.0
            self._listener = socket.create_server((advertise_host, 0), backlog=max(16, size))
            rendezvous.set(key, f"{advertise_host}:{self._listener.getsockname()[1]}".encode())
            threading.Thread(target=self._accept_loop, name="roundel-accept", daemon=True).start()
            target = self._coordinator_loop
        else:
            address = rendezvous.get(key, timeout=settings.start_timeout_s).decode()
            host, port = address.rsplit(":", 1)
            self._coordinator = control_channel.connect(host, int(port), secret, rank,
                                                        settings.start_timeout_s)
            self._coordinator_reader = control_channel.FrameReader()
            self._selector.register(self._coordinator, selectors.EVENT_READ, "coordinator")
            target = self._rank_loop
        self._thread = threading.Thread(target=target, name="roundel-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ user side
    def submit(self, request: Request, tensor, output) -> Handle:
        """Queue one collective; return its handle. Raises if the job's communication has failed."""
        handle = Handle(request.name)
        self._enqueue(Work(request, tensor, output, handle))
        return handle

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
        for works in self._inflight.values():
            for work in works:
                work.handle.set_error(error)
        self._inflight.clear()
        self._sent_bits.clear()

    def _break(self, message: str) -> None:
        if self._broken is None:
            self._broken = RoundelInternalError(message)
        self._fail_inflight(self._broken)
        self.executor.abort(self._broken)

    def _register(self, work: Work) -> bool:
        """Track ``work`` as in flight; False if its name already is (a duplicate)."""
        key = (work.request.process_set_id, work.request.name)
        works = self._inflight.get(key)
        if works is None:
            self._inflight[key] = [work]
            return True
        works.append(work)
        return False

    def _accept_batches(self, batches) -> None:
        """Match agreed batches with local work and hand them to the executor."""
        for batch in batches:
            works = []
            for entry in batch.entries:
                key = (batch.process_set_id, entry.name)
                local = self._inflight.pop(key, None)
                if not local:
                    works.append(None)
                    continue
                work = local[0]
                if work.sent_bit is not None:
                    self._sent_bits.pop(work.sent_bit, None)
                if entry.cache_bit >= 0:
                    self._cache.record(key, entry.cache_bit, work.request)
                works.append(work)
                if batch.error:
                    works.extend(local[1:])
                else:
                    for duplicate in local[1:]:
                        duplicate.handle.set_error(CollectiveMismatchError(
                            f"'{entry.name}' was submitted again on rank {self.rank} while its first "
                            "submission was already executing; give each in-flight collective a unique name"))
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
                for key, _ in self._selector.select():
                    if key.data == "wake":
                        if self._rank_wake():
                            return
                    else:
                        self._rank_receive()
        except Exception as exc:  # keep the user's threads from hanging on a dead engine
            log.exception("roundel engine thread failed")
            self._break(f"roundel's engine thread failed: {exc!r}")
        finally:
            self._coordinator.close()

    def _rank_wake(self) -> bool:
        items = self._drain()
        if self._broken is not None:
            self._fail_inflight(self._broken)
        bits, full, duplicates = 0, [], []
        for item in items:
            if isinstance(item, tuple):
                self._apply_control(item)
                continue
            if self._broken is not None:
                item.handle.set_error(self._broken)
                continue
            request = item.request
            if not self._register(item):
                duplicates.append(request)
                continue
            key = (request.process_set_id, request.name)
            bit = self._cache.bit_for(key, request)
            if bit >= 0:
                item.sent_bit = (self._cache.version, bit)
                self._sent_bits[item.sent_bit] = key
                bits |= 1 << bit
            else:
                full.append(request)
        if self._broken is None and (bits or full or duplicates):
            self._send(("submit", self._cache.version, bits, full, duplicates))
        if self._stopping:
            if self._broken is None:
                self._send(("bye",))
            self._fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
            return True
        return False

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
            self._break("lost the connection to the coordinator on rank 0: rank 0 has shut down "
                        "or died (see its output)")
            return
        for message in self._coordinator_reader.feed(data):
            if message[0] == "work":
                _, version, batches, evicted, resend = message
                self._cache.evict(evicted)
                self._cache.version = version
                if resend:
                    self._resend(resend)
                self._accept_batches(batches)
            elif message[0] == "abort":
                self._break(message[1])

    def _resend(self, stale) -> None:
        """Send in full the requests whose (cache version, bit) the coordinator found stale."""
        full = []
        for sent in stale:
            key = self._sent_bits.pop(sent, None)
            works = self._inflight.get(key) if key else None
            if works:
                works[0].sent_bit = None
                full.append(works[0].request)
        if full:
            self._send(("submit", self._cache.version, 0, full, []))

    # ------------------------------------------------------ rank 0: coordinator
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, rank = control_channel.accept(self._listener, self._secret, self.settings.start_timeout_s)
            except control_channel.ChannelError as exc:
                log.warning("roundel coordinator refused a connection: %s", exc)
                continue
            except OSError:
                return  # listener closed at shutdown
            self._accepted.put((sock, rank))
            try:
                os.write(self._wake_w, b"a")
            except OSError:
                return

    def _coordinator_loop(self) -> None:
        try:
            while not self._coordinator_step():
                pass
        except Exception as exc:
            log.exception("roundel coordinator failed")
            self._break(f"roundel's coordinator on rank 0 failed: {exc!r}")
            self._broadcast_abort(str(self._broken))
        finally:
            self._listener.close()
            for sock in self._peers.values():
                sock.close()

    def _coordinator_step(self) -> bool:
        if self._finishing_since is not None:  # leaving: wait for byes in bounded steps, never block
            return self._coordinator_finish()
        timeout = self._coordinator_timeout()
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                self._coordinator_wake()
            else:
                self._coordinator_receive(key.data)
        now = time.monotonic()
        if self._stopping:
            return self._coordinator_finish()
        self._check_stalls(now)
        self._dispatch(now)
        return False

    def _coordinator_timeout(self) -> float | None:
        negotiator = self._negotiator
        waits = []
        if negotiator.has_ready():  # held back while the executor is busy: wake on idle or at the cycle
            waits.append(self._last_dispatch + self.settings.cycle_time_ms / 1000 - time.monotonic())
        if negotiator.has_pending() and self.settings.stall_check_enabled:
            waits.append(_STALL_POLL_S)
        return max(0.0, min(waits)) if waits else None

    def _coordinator_wake(self) -> None:
        items = self._drain()
        while not self._accepted.empty():
            sock, rank = self._accepted.get()
            if rank in self._peers or not 0 < rank < self.size:
                log.warning("roundel coordinator refused a second connection claiming rank %d", rank)
                sock.close()
                continue
            self._peers[rank] = sock
            self._readers[rank] = control_channel.FrameReader()
            self._selector.register(sock, selectors.EVENT_READ, rank)
        if self._broken is not None:
            self._fail_inflight(self._broken)
        now = time.monotonic()
        for item in items:
            if isinstance(item, tuple):
                self._apply_control(item)
            elif self._broken is not None:
                item.handle.set_error(self._broken)
            elif self._register(item):
                self._negotiator.submit(0, item.request, now)
            else:
                self._negotiator.mark_duplicate(0, item.request.process_set_id, item.request.name)

    def _coordinator_receive(self, rank: int) -> None:
        sock = self._peers[rank]
        try:
            data = sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:  # gone without saying goodbye: the job cannot go on, so every rank is told
            reason = f"rank {rank} died or lost its connection to the coordinator"
            self._drop_peer(rank, reason)
            self._break(f"{reason}; the job's communication is broken")
            self._broadcast_abort(str(self._broken))
            return
        now = time.monotonic()
        negotiator = self._negotiator
        for message in self._readers[rank].feed(data):
            if message[0] == "submit":
                _, version, bits, full, duplicates = message
                stale = []
                bit = 0
                while bits:
                    if bits & 1 and not negotiator.submit_bit(rank, bit, version, now):
                        stale.append((version, bit))
                    bits >>= 1
                    bit += 1
                for request in full:
                    negotiator.submit(rank, request, now)
                for request in duplicates:
                    negotiator.mark_duplicate(rank, request.process_set_id, request.name)
                if stale:
                    self._resends.setdefault(rank, []).extend(stale)
            elif message[0] == "bye":
                self._drop_peer(rank, f"rank {rank} has shut down (it finished or called hvd.shutdown())")
                return

    def _drop_peer(self, rank: int, reason: str) -> None:
        sock = self._peers.pop(rank, None)
        if sock is None:
            return
        self._selector.unregister(sock)
        sock.close()
        self._readers.pop(rank, None)
        self._negotiator.rank_left(rank, reason)

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
        due = self.executor.idle() or now - self._last_dispatch >= self.settings.cycle_time_ms / 1000
        batches = []
        if due and negotiator.has_ready():
            batches = negotiator.take(self.settings.fusion_threshold)
            self._last_dispatch = now
        elif negotiator.has_direct():
            batches = negotiator.take_direct()
        self._awaiting_idle = negotiator.has_ready()
        mine = []
        for members, batch in batches:
            for member in members:
                if member == 0:
                    mine.append(batch)
                elif member in self._peers:
                    self._outbox.setdefault(member, []).append(batch)
        if mine:
            self._accept_batches(mine)
        evicted = [bit for bit, _ in negotiator.take_evictions()]
        version = negotiator.cache.version
        targets = set(self._outbox) | set(self._resends) | (set(self._peers) if evicted else set())
        for rank in targets:
            message = ("work", version, self._outbox.get(rank, []), evicted, self._resends.get(rank, []))
            try:
                control_channel.send(self._peers[rank], message)
            except (OSError, KeyError):
                pass  # a closed peer is noticed by select and dropped there
        self._outbox.clear()
        self._resends.clear()

    def _broadcast_abort(self, message: str) -> None:
        for sock in self._peers.values():
            try:
                control_channel.send(sock, ("abort", message))
            except OSError:
                pass

    def _coordinator_finish(self) -> bool:
        """Rank 0 is leaving: fail what needs it, let the others say goodbye, then stop."""
        if self._finishing_since is None:
            self._finishing_since = time.monotonic()
            self._negotiator.rank_left(0, "rank 0 has shut down (it finished or called hvd.shutdown())")
            self._fail_inflight(RoundelInternalError("roundel was shut down on this rank"))
        self._dispatch(time.monotonic() + 1.0)
        waited = time.monotonic() - self._finishing_since
        if self._peers and waited < _BYE_GRACE_S:
            for key, _ in self._selector.select(0.1):
                if key.data == "wake":
                    self._drain()
                else:
                    self._coordinator_receive(key.data)
            return False
        return True
