"""The background engine: queue → negotiate → fuse → execute → complete handles.

Every rank runs a negotiation thread and an executor thread around this
core (queue, wake, in-flight table, broken state, executor). On rank 0 the
negotiation thread runs the coordinator (:mod:`roundel.common.engine.coordinator`),
which matches every rank's requests and sends the agreed batches back. On the
other ranks it runs the rank link (:mod:`roundel.common.engine.rank_link`),
which forwards their queued requests (a cache bit for names already agreed,
the full request otherwise) and hands the batches it receives to the
executor. Both sides use only the core's public methods. In the steady state both
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

Once the global set's batches repeat, a rank stops asking the coordinator for
them: the executor replays the learned schedule, holding each submission the
schedule expects until its batch is complete (``steady_replay``; see
:mod:`roundel.common.engine.replay`).

The fusion threshold, cycle time and response cache in force are
``tuned`` (:mod:`roundel.common.engine.autotune`): the configured settings, or with
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

import torch

from roundel.common.control.records import Entry, Request, TunedParams
from roundel.common.engine import autotune, relay, small_allreduce
from roundel.common.engine.coordinator import Coordinator
from roundel.common.engine.core_api import EngineTools, QueueItem
from roundel.common.engine.executor import Executor, Work
from roundel.common.engine.handles import Handle
from roundel.common.engine.liveness import BYE_GRACE_S, LostRankRecords
from roundel.common.engine.metrics import METRICS
from roundel.common.engine.negotiation import entry_bytes
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.common.engine.rank_link import RankLink
from roundel.common.engine.replay import ScheduleReplay
from roundel.common.engine.requests import ProcessSetChange
from roundel.common.engine.timeline import Timeline
from roundel.common.engine.wait_state import WaitTracker
from roundel.common.settings import Settings
from roundel.errors import RoundelInternalError
from roundel.transport.backend import Backend
from roundel.transport.peer_links import MOST_LINKED

log = logging.getLogger("roundel")

_ABANDON_S = 1.0
# up to this many ranks (where a Gloo communicator has its peer links; shared memory is faster still), small
# allreduces the schedule could replay are left to it rather than reduced by rank 0 (ScheduleReplay.runs_small)
REPLAYS_SMALL_UP_TO = MOST_LINKED
_SHUTTING_DOWN = "roundel is shutting down; no new collectives are accepted"


def _ready_event(tensor, recorded: dict):
    """For a CUDA tensor, an event recorded now on the calling thread's current stream of its GPU (one per
    GPU and submission, kept in ``recorded``): the executor's stream waits on it, not on the whole device;
    None for any other tensor."""
    if tensor is None or not tensor.is_cuda:
        return None
    event = recorded.get(tensor.device)
    if event is None:
        event = recorded[tensor.device] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
    return event


class Engine:
    """One rank's engine; create it after the global backend, stop it with ``shutdown()``."""

    def __init__(self, rank: int, size: int, settings: Settings, secret: bytes,
                 rendezvous, key_prefix: str, advertise_host: str, process_sets: ProcessSetRegistry,
                 timeline: Timeline | None = None, placement: tuple | None = None):
        """``placement``: this rank's (local rank, cross rank, host, local size), for relays (None: no relays)."""
        self.rank = rank
        self.size = size
        self.settings = settings
        if settings.autotune:
            autotune.require_scikit_learn()  # on every rank, before anything starts
        self.tuned = autotune.initial_params(settings)  # what the coordinator applies; rank 0 decides
        self._bucketed = False  # whether a DistributedOptimizer reduces gradients in buckets (autotune's question)
        self._process_sets = process_sets
        self._lock = threading.Lock()
        self._queue: list[QueueItem] = []
        self._wake_pending = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stopping = False
        self._broken: RoundelInternalError | None = None
        self._inflight: dict[tuple, Work] = {}
        self._names_in_flight: set[tuple] = set()  # (set id, name) submitted here and not finished
        self.selector = selectors.DefaultSelector()
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.timeline = timeline or Timeline()  # recorded on rank 0 only, once a file is started
        self._replay = ScheduleReplay(settings.steady_replay, self._slot_ready, self._someone_waits,
                                      small_allreduces=size <= REPLAYS_SMALL_UP_TO)
        self._replay.tuning = self.tuned.tuning
        self._waits = WaitTracker(self._about_to_wait)
        self.executor = Executor(process_sets, self._transport_failed, self._executor_went_idle, self.timeline,
                                 self._replay, self._renegotiate, self._slot_waits if rank == 0 else None,
                                 self._waits)
        self.host = (placement[2] if placement else "") or os.environ.get("ROUNDEL_HOSTNAME") or socket.gethostname()
        self._counted = rank == 0 and bool(settings.metrics_port)  # rank 0 counts collectives for its metrics
        tools = EngineTools(self.selector, self.timeline, rendezvous, LostRankRecords(rendezvous, key_prefix))

        key = key_prefix + "coordinator"
        self._coordinator: Coordinator | None = None
        self._link: RankLink | None = None
        relayed = placement is not None and 0 < settings.relay_from_ranks <= size
        if rank == 0:
            coordinator = self._coordinator = Coordinator(
                self, tools, secret, advertise_host, tunable_hierarchy=self.job_backend.tunable_hierarchy,
                bucketed=lambda: self._bucketed)
            if coordinator.local_name is not None:  # before the address: ranks that read it find this
                rendezvous.set(key + "/local", json.dumps({"host": self.host, "name": coordinator.local_name}).encode())
            rendezvous.set(key, f"{advertise_host}:{coordinator.port}".encode())
            # no relay on rank 0's host: the top of the relays' tree comes here
            if placement is not None and relayed and placement[3] == 1:
                rendezvous.set(relay.leader_key(key_prefix, 0), relay.address_record(
                    0, f"{advertise_host}:{coordinator.port}", self.host, coordinator.local_name))
            target = coordinator.run
        elif placement is not None and relayed:
            local_rank, cross_rank = placement[:2]
            keys: tuple[str, ...] = ()
            if local_rank == relay.relay_local_rank(cross_rank):
                keys = (relay.host_key(key_prefix, self.host), relay.leader_key(key_prefix, cross_rank))
            self._link = RankLink(self, tools, secret, key_prefix, relay.parent_key(
                key_prefix, self.host, local_rank, cross_rank, settings.relay_fanout), keys, advertise_host)
            target = self._link.run
        else:
            self._link = RankLink(self, tools, secret, key_prefix, None)
            target = self._link.run
        self._thread = threading.Thread(target=target, name="roundel-engine", daemon=True)
        self._thread.start()
        if rank == 0:
            self._await_peers(coordinator, settings.start_timeout_s)

    def _await_peers(self, coordinator: Coordinator, timeout_s: float) -> None:
        """Return once every other rank has joined the coordinator (init() is collective, as in Horovod:
        a rank 0 that shuts down right after init() must not refuse a rank still connecting).
        Raises RoundelInternalError naming the missing ranks after ``timeout_s``."""
        if coordinator.all_connected.wait(timeout_s):
            return
        missing = coordinator.missing_peers()
        self.shutdown()
        raise RoundelInternalError(
            f"rank(s) {', '.join(map(str, missing))} did not join rank 0's coordinator within {timeout_s:g} s "
            "(HOROVOD_START_TIMEOUT); check that every rank started and can reach rank 0")

    # ------------------------------------------------------------ user side
    def submit(self, request: Request, tensor, output) -> Handle:
        """Queue one collective; return its handle. Raises if the job's communication has failed."""
        return self.submit_group([(request, tensor, output)])[0]

    def submit_group(self, parts: list, caller_waits: bool = False) -> list:
        """Queue collectives, ``(request, tensor, output)`` each, to reach the coordinator in one message
        (a grouped call's tensors, so that they become ready, and fuse, together); return their handles.
        ``caller_waits``: the calling thread waits for them at once (it then runs a replay slot they complete).

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
        ready: dict = {}  # device -> the event after what this thread's stream there has queued so far
        for (request, tensor, output), key in zip(parts, keys):
            handle = self._handle(request, key)
            data = None
            if (not self._replay.runs_small(request)
                    and small_allreduce.eligible(request, self.settings.coordinator_reduce_bytes)):
                data = small_allreduce.snapshot(tensor)
            works.append(Work(request, tensor, output, handle, data, _ready_event(tensor, ready)))
        try:
            self._check_open()
            negotiate = self._replay.take(works, caller_waits)
            if negotiate:
                self._enqueue(*negotiate)
        except BaseException:
            for key in keys:
                self._name_done(key)
            raise
        if caller_waits:  # run a slot these complete now: the wait that follows then finds the handles done
            self._about_to_wait()
        return [work.handle for work in works]

    def run_alone(self, request: Request, tensor, output) -> Handle | None:
        """Run one collective that the calling thread waits for at once, on that thread, when it alone is the
        replayed slot pending (a blocking call in a steady loop), without ``submit_group``'s queuing: returns its
        handle (done, unless some rank gave the slot up and it went to the coordinator), or None when it is not that
        slot (then submit it). Raises when the job's communication has failed."""
        if self._replay.pending_names != (request.name,):  # a hint: no work made for a call that is not the slot
            return None
        key = (request.process_set_id, request.name)
        with self._lock:
            if key in self._names_in_flight:  # submit_group says what is wrong
                return None
            self._names_in_flight.add(key)
        handle = self._handle(request, key)
        try:
            self._check_open()
            ran = self.executor.run_alone(Work(request, tensor, output, handle))
        except BaseException:
            self._name_done(key)
            raise
        if not ran:
            self._name_done(key)
            return None
        return handle

    def _handle(self, request: Request, key: tuple) -> Handle:
        """A new collective's handle: it takes the name out of flight when it completes (and, on rank 0 with
        metrics on, counts the collective)."""
        if self._counted:
            done = functools.partial(self._counted_done, key, request, time.monotonic())
        else:
            done = functools.partial(self._name_done, key)
        return Handle(request.name, self._waits, (request.process_set_id, request.name, request.kind.label),
                      on_done=done)

    def _name_done(self, key: tuple, error: BaseException | None = None) -> None:
        with self._lock:
            self._names_in_flight.discard(key)
        self._replay.finished(key)

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

    def _check_open(self) -> None:
        """Raise RoundelInternalError when the job's communication has failed or roundel is shutting down."""
        if self._broken is not None:
            raise RoundelInternalError(str(self._broken))
        if self._stopping:
            raise RoundelInternalError(_SHUTTING_DOWN)

    def _enqueue(self, *items) -> None:
        """Queue ``items`` at once: the engine thread takes them in one drain."""
        self._check_open()
        with self._lock:
            if self._stopping:  # again, under the lock shutdown() sets it with
                raise RoundelInternalError(_SHUTTING_DOWN)
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
        self._replay.fail(RoundelInternalError("roundel was shut down on this rank"))
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
    def replaying(self) -> bool:
        """Whether the learned schedule is armed: the collectives it expects next run without asking rank 0."""
        return self._replay.armed

    @property
    def replay_counts(self) -> tuple[int, int]:
        """(slots run, slots given up) of the replayed schedule on this rank so far."""
        return self._replay.slots_run, self._replay.slots_given_up

    def note_gradient_buckets(self) -> None:
        """A DistributedOptimizer on this rank reduces gradients in buckets (autotune then tunes their size)."""
        self._bucketed = True

    @property
    def job_backend(self) -> Backend:
        """The communicator of the whole job (the global process set's)."""
        return self._process_sets.job_backend

    @property
    def broken(self) -> RoundelInternalError | None:
        """The error that broke the job's communication, or None."""
        return self._broken

    @property
    def stopping(self) -> bool:
        """Whether ``shutdown()`` has begun."""
        return self._stopping

    @property
    def coordinator_peer(self) -> str | None:
        """How this rank reaches rank 0's coordinator (its local socket, or ``host:port``); None on rank 0."""
        return self._link.peer if self._link is not None else None

    # ------------------------------------------- the core, for the coordinator and the rank link
    def wake(self) -> None:
        """Wake the engine thread from its select (new connections, say); quiet once shut down."""
        try:
            os.write(self._wake_w, b"a")
        except OSError:
            pass

    def waits_snapshot(self) -> tuple:
        """What this rank's threads wait for now (see ``wait_state``)."""
        return self._waits.snapshot()

    def drain(self) -> list[QueueItem]:
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

    def _executor_went_idle(self) -> None:
        """The executor finished its last batch: wake rank 0's engine thread if the coordinator holds
        ready names back until then."""
        if self._coordinator is not None and self._coordinator.wants_idle_wake():
            try:
                os.write(self._wake_w, b"i")
            except OSError:
                pass

    def executor_idle(self) -> bool:
        """Whether the executor has nothing queued or running."""
        return self.executor.idle()

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the executor thread to end (after ``shutdown()`` left it inside a
        transfer with a lost rank); True once it has."""
        return self.executor.wait_stopped(timeout)

    def tuned_when_ran(self, process_set_id: int, names) -> TunedParams | None:
        """The ``TunedParams`` in force when the latest of the finished collectives ``names`` (of one process
        set) ran on this rank; None before autotune changed anything."""
        table = self.executor.tuned_at
        stamps = [table[(process_set_id, name)] for name in names if (process_set_id, name) in table]
        return max(stamps, key=lambda stamp: stamp[0])[1] if stamps else None

    def fail_inflight(self, error: Exception) -> None:
        """Fail every collective this rank has in flight with ``error`` (those held for the schedule too)."""
        for work in self._inflight.values():
            work.handle.set_error(error)
        self._inflight.clear()
        self._replay.fail(error)

    def _about_to_wait(self) -> None:
        """A user thread is about to block on a collective: it runs a ready replay slot itself (no hand-off)."""
        if self._replay.armed:
            self.executor.run_slot_here()

    def _slot_waits(self, waits_ms: list) -> None:
        """Rank 0: every rank's wait in a replayed slot, for the coordinator's straggler record."""
        if self._coordinator is not None:
            self._coordinator.note_slot_waits(waits_ms)

    def _slot_ready(self, serial: int) -> None:
        self.executor.slot_ready(serial)

    def _someone_waits(self) -> bool:
        return self._waits.busy()

    def _renegotiate(self, works: list) -> None:
        """Send the works of a replay slot given up to the coordinator (fail them when that is over)."""
        try:
            self._enqueue(*works)
        except RoundelInternalError as exc:
            for work in works:
                work.handle.set_error(exc)

    @property
    def cuda_device(self) -> torch.device | None:
        """This rank's GPU (see ``claim_cuda_device``); None before its first CUDA collective."""
        return self.executor.cuda_device

    def claim_cuda_device(self, device: torch.device) -> None:
        """Make ``device`` this rank's GPU, on which its CUDA collectives run (the first claim, or
        ``join(device=...)``, decides); raises ValueError for another GPU: one GPU per rank, as in Horovod
        (a batch fused from tensors on two GPUs could not run on either)."""
        current = self.executor.cuda_device
        if current is None:
            self.executor.cuda_device = device
        elif current != device:
            raise ValueError(
                f"a tensor on {device}, but rank {self.rank}'s CUDA collectives run on {current}: roundel runs one "
                "GPU per rank; call torch.cuda.set_device(hvd.local_rank()) after hvd.init() and keep the "
                "tensors of collectives on that GPU (or start one rank per GPU)")

    def break_job(self, message: str) -> None:
        """The job's communication is broken: fail what is in flight, and every later call, with ``message``."""
        if self._broken is None:
            self._broken = RoundelInternalError(message)
        self.fail_inflight(self._broken)
        self.executor.abort(self._broken)

    def register(self, work: Work) -> None:
        """Track ``work`` as in flight (submit() keeps names unique among this rank's in-flight work)."""
        self._inflight[(work.request.process_set_id, work.request.name)] = work

    def inflight(self, key: tuple) -> Work | None:
        """The work in flight under ``(process set id, name)``, or None."""
        return self._inflight.get(key)

    def take_inflight(self, key: tuple) -> Work | None:
        """Stop tracking the work under ``(process set id, name)`` and return it (None if there is none)."""
        return self._inflight.pop(key, None)

    def execute(self, batch, works: list) -> None:
        """Hand an agreed batch and this rank's work for its entries (None where it has none) to the executor."""
        self.executor.put(batch, works)

    def accept_batches(self, batches) -> None:
        """Match agreed batches with local work and hand them to the executor."""
        for batch in batches:
            self.execute(batch, [self.take_inflight((batch.process_set_id, entry.name)) for entry in batch.entries])

    def retune(self, params) -> None:
        """Apply the coordinator's tuned parameters (fusion threshold, cycle time, cache) on this rank (the same
        ones again: rank 0 moves the ranks off their replay slots)."""
        changed, self.tuned = params != self.tuned, params
        self.executor.retune(params, changed)
