"""Runs agreed batches on the transport, one at a time, in the order the coordinator chose.

Each rank's executor receives the same sequence of batches (those of its
process sets), packs fused entries into a reusable buffer, makes one backend
call, unpacks, and completes the handles.

On a backend that runs calls side by side (``allreduce_async``) or queues them
on a device and returns at once (NCCL; see ``_takes_own_calls``), the large
entries of a fused allreduce are reduced in their own memory, each by its own
call, and only the small ones go through the fusion buffer. An allreduce batch
of at least ``OWN_CALL_BYTES`` runs there in the background: the executor
starts it and goes on to the next batch (a gradient bucket that becomes ready
while the previous one is on the wire starts at once, as in DDP), and finishes
it (scaling, unpacking, handles) once the transport reports it done.

A small allreduce the coordinator has already reduced (``Batch.reduced``, see
:mod:`roundel.common.engine.small_allreduce`) only has its result copied out; when
nothing is queued ahead of it, that happens on the engine thread that received
it, without a hop to the executor's.

A batch of CUDA tensors runs on its GPU over the backend that
``Backend.for_device`` names, on a stream of roundel's own there (made at the
first CUDA batch): packing, the transport call and unpacking are queued on it
after the events its works were submitted with (what the submitting threads'
streams had queued), so the training's own streams go on meanwhile. The
executor does not wait for the device: it records a blocking CUDA event after
the batch and completes the handles at once; a handle's ``wait()`` makes the
waiting thread's current stream wait for that event (``_AfterGpu``). The batch's
tensors stay referenced until a finalizer thread, sleeping on the event (not
spinning), hands the batch back to be released, as Horovod's finalizer does.
When the job breaks (``abort``, or a transport failing here), the GPU
transports are aborted, so no kernel is left waiting on a lost peer, and a
handle of a batch still on the GPU then raises the error when waited for,
instead of returning a result the abort may have cut short.

Once the batch sequence repeats, the executor also runs *slots*: batches
replayed from the learned schedule without the coordinator (see
:mod:`roundel.common.engine.replay`). A slot's transfer carries its
agreement: whether some rank gave it up, and each rank's wait in its previous
slot (for rank 0's straggler record); how it travels is worked out once per
slot (:mod:`roundel.common.engine.slot_plans`). A slot given up anywhere is
dropped everywhere and its tensors go to the coordinator again. A slot runs
before any batch from the coordinator that reaches the executor while it is
pending, and that batch makes every rank give it up; a batch rank 0 reduced
itself moves nothing on the transport and passes beside the slots.

The executor's queue carries one small type per kind of work (``_Run``,
``_Retune``, ``_Slot``, ``_InFlight``, ``_OnGpu``, ``_Stop``), each with one
handler.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from typing import Callable, NamedTuple, NoReturn, Sequence

import torch

from roundel.common.engine import small_allreduce
from roundel.common.engine.replay import ScheduleReplay, Slot
from roundel.common.engine.slot_plans import ReducedPlan, RowsPlan, grad_off, plan_slot, serial_copy, serial_scale
from roundel.common.engine.adasum import adasum_tree
from roundel.common.control.records import Batch, OpKind, Request, TunedParams
from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError, RoundelInternalError
from roundel.common.engine.handles import Handle
from roundel.common.engine.process_set_registry import ProcessSetRegistry
from roundel.ops import ReduceOp
from roundel.transport.backend import ShapedViews, scale
from roundel.common.engine.timeline import Timeline, transport_activity
from roundel.common.engine.wait_state import REPLAY_WAIT, WaitTracker

log = logging.getLogger("roundel")

_ERROR_TYPES = {"internal": RoundelInternalError, "deadlock": CollectiveDeadlockError,
                "mismatch": CollectiveMismatchError}


class Work:
    """A rank's own part of one collective: its request, tensors and handle.

    ``output`` is where the result goes (the input itself for in-place ops);
    None lets the executor allocate it (allgather, alltoall, reducescatter).
    """

    __slots__ = ("request", "tensor", "output", "handle", "sent_bit", "data", "ready")

    def __init__(self, request: Request, tensor, output, handle: Handle, data: bytes | None = None, ready=None):
        self.request = request
        self.tensor = tensor
        self.output = output
        self.handle = handle
        self.sent_bit: tuple[int, int] | None = None  # (cache version, bit) when submitted as a cache bit
        self.data = data  # the tensor's bytes, sent with the request for the coordinator to reduce
        self.ready = ready  # a CUDA tensor's: an event after its producers on the submitting thread's stream


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# An allreduce entry of at least this many bytes is reduced in its own memory by its own call when the
# backend runs calls side by side (allreduce_async): copying it into the fusion buffer and back costs
# more than the call (a 25 MiB gradient bucket, say).
OWN_CALL_BYTES = 1 << 20


def _runs_side_by_side(backend) -> bool:
    """Whether ``backend`` can run allreduces on its own threads (``allreduce_async``)."""
    return getattr(backend, "allreduce_async", None) is not None


def _takes_own_calls(backend) -> bool:
    """Whether a large allreduce entry costs ``backend`` less as a call of its own than copied through the fusion
    buffer: it runs calls side by side, or queues them on a device and returns at once (NCCL)."""
    return backend.queues_on_device or _runs_side_by_side(backend)


def _runs_alone(request: Request, work: Work | None, entries: int, own_calls: bool) -> bool:
    """Whether an allreduce entry is reduced in its own output tensor rather than in the fusion buffer."""
    if work is not None and work.output is not None and not work.output.is_contiguous():
        return False
    if entries == 1:
        return True
    return own_calls and math.prod(request.shape) * torch_dtype(request.dtype).itemsize >= OWN_CALL_BYTES


def _in_hand(batch: Batch) -> bool:
    """Whether ``batch``'s outcome came with it (rank 0 reduced it, or failed it), so that it needs no peer: an
    abort (rank 0 gone just after sending it, say) completes it as it would have been, at once."""
    return batch.reduced is not None or bool(batch.error)


def _reraise(exc: Exception):
    raise exc


# what running a replay slot came to (see Executor._run_slot)
_RAN, _GIVEN_UP, _HANDED_ON = object(), object(), object()
_LONGEST_WAIT_MS = 60_000.0  # a wait in a slot is reported up to this (float16 holds it)
_KEPT_PLANS = 256  # slot plans kept; beyond this (a schedule that keeps changing) they are worked out anew


class _Run(NamedTuple):
    """Queue item: a batch ``put`` counted, with this rank's works, run after everything queued before it."""

    batch: Batch
    works: list


class _Retune(NamedTuple):
    """Queue item: autotune's parameters, applied after the batches put before them (``changed`` False: the ones
    in force, announced again, which only makes every rank give up its replay slot)."""

    params: TunedParams
    changed: bool = True


class _Stop:
    """Queue item: finish what is in flight, then end the executor's thread."""


class _Slot(NamedTuple):
    """Queue item: replay slot ``serial`` may be ready to run (complete, or given up)."""

    serial: int


class _OnGpu:
    """Queue item once ``done``, a blocking event after a CUDA batch on roundel's stream, has fired: the batch's
    tensors (its works' and its results) are held until then, and ``Executor._release`` lets them go. ``then`` is
    what its handles' ``wait()`` runs."""

    __slots__ = ("batch", "works", "results", "done", "names", "then")

    def __init__(self, batch: Batch, works: list, results: list, done, names: list | None, then: _AfterGpu):
        self.batch, self.works, self.results, self.done, self.names = batch, works, results, done, names
        self.then = then


class _AfterGpu:
    """What each ``wait()`` on a CUDA batch's handle does before returning the result (``Handle.set_result``'s
    ``then``): the waiting thread's current stream on ``device`` waits for ``done``, the event after the batch on
    roundel's stream; and the result's CUDA tensors are recorded as used on that stream, so that the caching
    allocator gives memory allocated on roundel's stream back to it only once the waiting stream is done with it.

    ``cut_short`` is the error that broke the job while the batch was still on the GPU (its NCCL call may have
    been aborted, its result never written): a ``wait()`` from then on raises it instead of returning the result."""

    __slots__ = ("done", "device", "cut_short")

    def __init__(self, done, device: torch.device):
        self.done, self.device = done, device
        self.cut_short: RoundelInternalError | None = None

    def __call__(self, result) -> None:
        if self.cut_short is not None:
            raise self.cut_short
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.done)
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                tensor.record_stream(stream)


class _InFlight:
    """Queue item once the transport calls of an allreduce batch started on the backend's threads are done
    (see ``Executor._start_in_background``)."""

    __slots__ = ("batch", "works", "backend", "parts", "outputs", "post", "futures", "names")

    def __init__(self, batch: Batch, works: list, backend, parts: list, outputs: list, post: float,
                 futures: list, names: list | None):
        self.batch, self.works, self.backend = batch, works, backend
        self.parts, self.outputs, self.post = parts, outputs, post
        self.futures = futures
        self.names = names  # for the timeline, while it records


class Executor:
    """A thread that executes batches on the backends of this rank's process sets."""

    def __init__(self, process_sets: ProcessSetRegistry, on_transport_failure: Callable[[RoundelInternalError], None],
                 on_idle: Callable[[], None], timeline: Timeline | None = None,
                 replay: ScheduleReplay | None = None, renegotiate: Callable[[list], None] | None = None,
                 on_slot_waits: Callable[[list], None] | None = None, waits: WaitTracker | None = None):
        """``replay``: the learned schedule whose slots this executor runs; ``renegotiate(works)`` sends the
        works of a slot given up to the coordinator; ``on_slot_waits(ms)`` gets every rank's wait in its
        previous slot (on rank 0, for the straggler record); ``waits``, where this rank's threads note what they
        wait for, also notes each slot's transfer while it waits for the other ranks (``REPLAY_WAIT``)."""
        self._timeline = timeline or Timeline()
        self._replay = replay or ScheduleReplay(False, lambda serial: None, lambda: False)
        self._renegotiate = renegotiate
        self._on_slot_waits = on_slot_waits
        self._waits = waits
        self._slot_wait_ms = 0.0  # this rank's wait in its last slot's transfer
        self._names: list | None = None  # the running batch's names while the timeline records
        self._process_sets = process_sets
        self._on_transport_failure = on_transport_failure
        self._on_idle = on_idle
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self._held: dict[int, list] = {}  # batches put and not yet finished: id -> works
        self._in_hand: dict[int, tuple] = {}  # the same for batches whose outcome came with them: id -> (batch, works)
        self._aborted: RoundelInternalError | None = None
        self._queue: "queue.SimpleQueue[_Run | _Retune | _Slot | _InFlight | _OnGpu | _Stop]" = queue.SimpleQueue()
        self._handlers: dict[type, Callable] = {_Run: self._on_run, _Retune: self._on_retune, _Slot: self._on_slot,
                                                _InFlight: self._land, _OnGpu: self._release, _Stop: self._on_stop}
        self._stopped = False  # set by _on_stop, on the executor's thread
        self._turn = threading.Lock()  # held while handling an item, or by a waiting thread running a slot
        self._in_flight: list[_InFlight | _OnGpu] = []  # started in the background or on a GPU, not yet finished
        self._gpu_waits: "queue.SimpleQueue[_OnGpu]" = queue.SimpleQueue()  # for the finalizer thread
        self._finalizer: threading.Thread | None = None  # started with the first CUDA batch
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # roundel's stream on each GPU it has used
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._slot_buffers: dict[torch.dtype, torch.Tensor] = {}  # the slots' (a batch in flight may hold the other)
        self._buffer_views = ShapedViews()  # the fusion buffers cut as the batches' tensors
        self._slot_plans: dict[tuple, tuple] = {}  # a slot's names -> (what it was planned for, how it runs here)
        self.cuda_device: torch.device | None = None  # see _cuda_device; join(device=...) may set it
        self._tuned: tuple[int, TunedParams | None] = (0, None)  # autotune's changes so far, the latest
        # (set id, name) -> self._tuned when that collective last ran
        self.tuned_at: dict[tuple, tuple[int, TunedParams | None]] = {}
        self._thread = threading.Thread(target=self._loop, name="roundel-executor", daemon=True)
        self._thread.start()

    def put(self, batch: Batch, works: list) -> None:
        """Run ``batch`` (with this rank's ``works``, None for joined ranks) after every batch put before it.

        A batch the coordinator already reduced needs no transport: when nothing is queued or running, it
        completes here, on the calling thread, without waking the executor's.
        """
        with self._count_lock:
            here = batch.reduced is not None and self._outstanding == 0
            self._outstanding += 1
            if _in_hand(batch):
                self._in_hand[id(works)] = (batch, works)
            else:
                self._held[id(works)] = works
        if self._timeline.active:
            self._timeline.begin([e.name for e in batch.entries], batch.kind.label, "QUEUE")
        if here and self._turn.acquire(blocking=False):  # else a user thread runs a slot: after it, in turn
            try:
                self._dispatched(batch, works)
            finally:
                self._turn.release()
        else:
            self._queue.put(_Run(batch, works))

    def retune(self, params, changed: bool = True) -> None:
        """Apply autotune's ``TunedParams`` after the batches put so far: the hierarchical switches, and
        the stamp ``tuned_at`` gives every later collective (every rank stamps the same collectives alike);
        a pending replay slot is given up either way (``changed`` False: nothing else)."""
        with self._count_lock:  # pending until applied, so that no later batch runs in put() before it
            self._outstanding += 1
        self._queue.put(_Retune(params, changed))

    def abort(self, error: RoundelInternalError) -> None:
        """Fail every handle queued or running here now, and every batch put later, but for the batches whose
        outcome is in hand (see ``_in_hand``): they complete now, as they would have (not after a transfer that
        may never end).

        The batch running on the transport (possibly blocked on a dead or
        departed peer) finishes in the background; its result is dropped.
        The GPU transports are aborted, so a CUDA batch's wait ends too, and
        the handles of CUDA batches still on the GPU raise ``error`` when waited
        for from now on (see ``_AfterGpu``).
        """
        with self._count_lock:
            self._aborted = error
            held = list(self._held.values())
            in_hand = list(self._in_hand.values())
            self._in_hand.clear()
        for works in held:
            self._fail(works, error)
        for batch, works in in_hand:
            self._deliver(batch, works)
            if self._timeline.active:  # out of QUEUE, where put() began it
                self._timeline.end([e.name for e in batch.entries])
        self._abort_gpu(error)

    def _abort_gpu(self, error: RoundelInternalError) -> None:
        """Mark the CUDA batches not yet finished on the GPU as cut short by ``error``, and abort the GPU transport
        of every process set (NCCL: a kernel waiting on a lost peer returns now)."""
        for flight in list(self._in_flight):
            if isinstance(flight, _OnGpu):
                flight.then.cut_short = error
        for _, backend in self._process_sets.values():
            if backend is not None and backend.cuda is not None:
                backend.cuda.abort()

    def _broke(self, error: RoundelInternalError) -> None:
        """A transport failed on this rank, which breaks the job: abort the GPU transports too (nothing is left
        waiting on them), then tell the engine."""
        self._abort_gpu(error)
        self._on_transport_failure(error)

    def idle(self) -> bool:
        """True when no batch is queued or running."""
        return self._outstanding == 0

    def _finished_one(self, works: list | None) -> None:
        with self._count_lock:
            self._outstanding -= 1
            if works is not None:
                self._held.pop(id(works), None)
            idle = self._outstanding == 0
        if idle:
            self._on_idle()

    def stop(self, timeout: float) -> bool:
        """Let the thread finish what is queued and end; False if it is still busy after ``timeout`` s."""
        self._queue.put(_Stop())
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end (after ``stop``); True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def slot_ready(self, serial: int) -> None:
        """Look at replay slot ``serial`` soon (see ``_Slot``)."""
        self._queue.put(_Slot(serial))

    def _loop(self) -> None:
        replay = self._replay
        while not self._stopped:
            try:
                item = self._queue.get(timeout=replay.wait_timeout())
            except queue.Empty:  # a pending slot is checked: ready, or a thread stuck waiting on it
                if replay.overdue():
                    with self._turn:
                        self._resolve_slot(False)
                continue
            with self._turn:
                self._handlers[type(item)](item)

    def run_slot_here(self) -> None:
        """Run the pending slot on the calling thread (one about to wait for it) when it is ready and the
        executor's thread is between items: a blocking collective then costs no thread hand-off. When the
        executor's thread is busy, it runs the slot after its current item instead."""
        serial = self._replay.ready_now()
        if serial is None:
            return
        if not self._turn.acquire(blocking=False):
            self.slot_ready(serial)
            return
        try:
            if not self._stopped and self._replay.ready_now() is not None:
                self._resolve_slot(False)
        finally:
            self._turn.release()

    def _on_run(self, item: _Run) -> None:
        self._dispatched(item.batch, item.works)

    def _dispatched(self, batch: Batch, works: list) -> None:
        """Run a batch from the coordinator: a pending slot first, given up (see the module's docstring), unless
        rank 0 reduced the batch (it moves nothing on the transport)."""
        if self._replay.armed and batch.reduced is None:
            self._resolve_slot(True)
        self._replay.dispatched(batch, works)
        self._run_batch(batch, works)

    def _on_slot(self, item: _Slot) -> None:
        if self._replay.ready_now() == item.serial:  # begin() checks again, under the lock
            self._resolve_slot(False)

    def _on_retune(self, item: _Retune) -> None:
        if self._replay.armed:
            self._resolve_slot(True)
        self._replay.retuned(item.params.tuning)
        if item.changed:
            job = self._process_sets.job_backend
            if job.tunable_hierarchy:
                job.use(item.params.hierarchical_allreduce, item.params.hierarchical_allgather)
            self._tuned = (self._tuned[0] + 1, item.params)
        self._finished_one(None)

    def _on_stop(self, _: _Stop) -> None:
        """Finish every batch still in flight (waiting for it) and end the loop."""
        for flight in list(self._in_flight):
            self._handlers[type(flight)](flight)
        self._stopped = True

    def _run_batch(self, batch: Batch, works: list) -> None:
        """Run (or start in the background) one batch that ``put`` counted."""
        self._stamp_tuned(batch.process_set_id, (entry.name for entry in batch.entries))
        if self._aborted is None and self._runs_in_background(batch):
            self._start_in_background(batch, works)
            return
        if self._aborted is None and self._runs_on_gpu(batch):
            self._start_on_gpu(batch, works)
            return
        try:
            if _in_hand(batch):
                with self._count_lock:
                    delivered = self._in_hand.pop(id(works), None) is None  # by abort()
                if not delivered:
                    self._execute(batch, works)
            elif self._aborted is not None:
                self._fail(works, self._aborted)
            else:
                self._execute(batch, works)
        finally:
            self._finished_one(works)

    def _stamp_tuned(self, process_set_id: int, names) -> None:
        """Note, once autotune has changed anything, under which parameters these collectives ran."""
        if self._tuned[1] is not None:
            for name in names:
                self.tuned_at[(process_set_id, name)] = self._tuned

    def _deliver(self, batch: Batch, works: list) -> None:
        """Complete a batch whose outcome is in hand (``_in_hand``) on the calling thread: fail it with rank 0's
        error, or land rank 0's result."""
        reduced = batch.reduced
        if batch.error or reduced is None:
            self._fail(works, _ERROR_TYPES.get(batch.error_type, CollectiveMismatchError)(batch.error))
        else:
            self._complete(works, lambda: self._reduced_by_coordinator(batch, works, reduced))

    def _execute(self, batch: Batch, works: list) -> None:
        self._names = [e.name for e in batch.entries] if self._timeline.active else None
        self._phase("")  # out of QUEUE
        results = None
        try:
            results = self._execute_batch(batch, works)
        finally:
            if self._names is not None:
                self._timeline.end(self._names, results)
                self._names = None

    def _phase(self, activity: str) -> None:
        """Mark the running batch's next timeline activity ("" for none)."""
        if self._names is not None:
            self._timeline.activity(self._names, activity)

    def _execute_batch(self, batch: Batch, works: list) -> list | None:
        """Run ``batch`` and complete its handles; returns the results, None when it failed."""
        if batch.error:
            self._deliver(batch, works)
            return None
        return self._complete(works, lambda: self._run(batch, works))

    def _complete(self, works: list, run: Callable[[], list]) -> list | None:
        """Complete the handles of ``works`` with what ``run()`` returns, or with what it raises (a
        transport failure breaks the job); returns the results, None when it failed."""
        try:
            results = run()
        except RoundelInternalError as exc:
            self._fail(works, exc)
            self._broke(exc)
            return None
        except Exception as exc:  # a bug or an input the checks missed: fail these handles only
            log.debug("batch failed", exc_info=True)
            self._fail(works, exc)
            return None
        for work, result in zip(works, results):
            if work is not None:
                work.handle.set_result(result)
        return results

    # ---------------------------------------------------------------- replay
    def _resolve_slot(self, force_give_up: bool) -> None:
        """Run the pending slot: with this rank's tensors when it brings them all, else to give it up
        (``force_give_up``: a batch from the coordinator came first). Every rank learns alike whether it ran."""
        taken = self._replay.begin(force_give_up)
        if taken is not None:
            self._run_taken(*taken)

    def run_alone(self, work: Work) -> bool:
        """Run the pending slot on the calling thread when ``work`` (a collective that thread waits for, not held
        by the schedule) is all of it and the executor's thread is between items: ``work``'s handle then completes
        here, or, if some rank gives the slot up, once the coordinator has run it. False, with nothing done, when
        it is not so."""
        if not self._turn.acquire(blocking=False):
            return False
        try:
            slot = None if self._stopped else self._replay.begin_alone(work.request)
            if slot is None:
                return False
            self._run_taken(slot, [work])
            return True
        finally:
            self._turn.release()

    def _run_taken(self, slot: Slot, works: list | None) -> None:
        """Run ``slot``, taken to run, with this rank's ``works`` (None: to give it up); then move the schedule on,
        alike on every rank."""
        with self._count_lock:
            self._outstanding += 1
            if works is not None:
                self._held[id(works)] = works
        try:
            outcome = self._run_slot(slot, works)
        except Exception as exc:  # the transport failed mid-slot: every rank's schedule is in doubt
            error = exc if isinstance(exc, RoundelInternalError) else RoundelInternalError(
                f"the replayed {slot.kind.label} of '{slot.names[0]}' failed: {exc}. A peer process has probably "
                "died or stopped; see the other ranks' output")
            self._fail(works or [], error)
            self._replay.fail(error)
            self._finished_one(works)
            self._broke(error)
            return
        if outcome is _GIVEN_UP:
            released = (works or []) + self._replay.given_up(slot)
        else:
            released = self._replay.ran(slot)
        if outcome is not _HANDED_ON:  # after the schedule moved on: an idle executor means no slot half done
            self._finished_one(works)
        if released and self._renegotiate is not None:
            self._renegotiate(released)

    def _run_slot(self, slot: Slot, works: list | None) -> object:
        """One slot on the job's transport: ``_RAN``, ``_GIVEN_UP`` (by some rank; ``works`` None: by this one),
        or ``_HANDED_ON`` (a slot that agrees on its own, on the executor's thread: run as a batch from the
        coordinator would be once all ranks agreed, possibly in the background)."""
        ranks, backend = self._process_sets.members_and_backend(0)
        backend = backend.for_device("cpu")
        plan = self._slot_plan(slot, ranks, backend.rank)
        # only this rank's own run of the slot is on the timeline: a rank that gives it up may meanwhile have put
        # one of its names, negotiated, whose record the slot's must not end
        names = list(slot.names) if self._timeline.active and works is not None else None
        if isinstance(plan, RowsPlan):
            return self._run_rows(slot, plan, works, backend, names)
        if plan.buffer is None:  # agree first, then move the tensors without a copy
            plan.fill_agreement(works is None, self._slot_wait_ms)
            self._agree(lambda: backend.allreduce(plan.agreement, ReduceOp.Sum), plan, slot.serial)
            if works is None or plan.given_up():
                return _GIVEN_UP
            if names is not None:
                self._timeline.begin(names, slot.kind.label, "QUEUE")
            if threading.current_thread() is not self._thread:  # a thread waiting for it: no hand-off back
                self._stamp_tuned(0, slot.names)
                self._execute(slot.batch, works)
                return _RAN
            self._run_batch(slot.batch, works)
            return _HANDED_ON
        cut = plan.cut
        with grad_off():
            if works is not None:
                if names is not None:
                    self._timeline.begin(names, OpKind.ALLREDUCE.label, "REPLAY_MEMCPY_IN")
                serial_copy(plan.inputs, [w.tensor for w in works], cut)
                serial_scale(plan.tensors, plan.prescale)
            plan.fill_agreement(works is None, self._slot_wait_ms)
            if names is not None:
                self._timeline.activity(names, transport_activity(backend.carrier("allreduce"), "allreduce"))
            self._agree(lambda: backend.allreduce(plan.buffer, ReduceOp.Sum), plan, slot.serial)
            if works is None or plan.given_up():
                if names is not None:
                    self._timeline.end(names, None)
                return _GIVEN_UP
            serial_scale(plan.tensors, plan.result_scale)
            outputs = self._outputs_in_place(works, [w.tensor for w in works])
            serial_copy(outputs, plan.inputs, cut)
        return self._slot_ran(slot, works, outputs, names)

    def _run_rows(self, slot: Slot, plan: RowsPlan, works: list | None, backend, names: list | None) -> object:
        """A broadcast or allgather slot in one allgather of rows, each a rank's agreement and then its data."""
        with grad_off():
            if works is not None:
                if names is not None:
                    self._timeline.begin(names, slot.kind.label, "QUEUE")
                if plan.sends_data:
                    serial_copy(plan.inputs, [w.tensor for w in works], plan.cut)
            plan.fill_agreement(works is None, self._slot_wait_ms)
            if names is not None:
                self._timeline.activity(names, transport_activity(backend.carrier("allgather"), "allgather"))
            self._agree(lambda: backend.allgather(plan.rows, plan.send), plan, slot.serial)
            if works is None or plan.given_up():
                if names is not None:
                    self._timeline.end(names, None)
                return _GIVEN_UP
            tensors = [w.tensor for w in works]
            outputs = plan.results(tensors, self._outputs_in_place(works, tensors) if plan.root is not None else [])
        return self._slot_ran(slot, works, outputs, names)

    def _slot_ran(self, slot: Slot, works: list, outputs: list, names: list | None) -> object:
        """Complete the handles of a slot that ran on this thread with its ``outputs``."""
        self._stamp_tuned(0, slot.names)
        for work, output in zip(works, outputs):
            work.handle.set_result(output)
        if names is not None:
            self._timeline.end(names, outputs)
        return _RAN

    # ------------------------------------------------------------- background
    def _runs_in_background(self, batch: Batch) -> bool:
        """Whether ``batch`` is an allreduce of at least OWN_CALL_BYTES on a backend with ``allreduce_async``
        (checked cheapest first: most batches of a busy job are small)."""
        if batch.kind != OpKind.ALLREDUCE or batch.error or batch.reduced is not None:
            return False
        request = batch.entries[0].request
        elements = sum(math.prod(e.request.shape) for e in batch.entries)
        if elements * torch_dtype(request.dtype).itemsize < OWN_CALL_BYTES:
            return False
        return (request.reduce_op != ReduceOp.Adasum
                and _runs_side_by_side(self._process_sets.backend_of(batch.process_set_id).for_device(request.device)))

    def _start_in_background(self, batch: Batch, works: list) -> None:
        """Start ``batch``'s transport calls; ``_land`` finishes it once they are done."""
        ranks, backend = self._process_sets.members_and_backend(batch.process_set_id)
        backend = backend.for_device(batch.entries[0].request.device)
        names = self._names = [e.name for e in batch.entries] if self._timeline.active else None
        self._phase("")  # out of QUEUE
        try:
            request = batch.entries[0].request
            inputs = self._inputs(batch, works)
            outputs = self._outputs_in_place(works, inputs)
            op = ReduceOp(request.reduce_op)
            post = request.result_scale(len(ranks))
            parts = self._allreduce_parts(batch, works, backend, inputs, outputs, in_background=True)
            self._phase(transport_activity(backend.carrier("allreduce"), "allreduce"))
            start = backend.allreduce_async
            assert start is not None, "_runs_in_background chose a backend with allreduce_async"
            futures = [start(buffer, op) for buffer, _ in parts]
        except Exception as exc:
            self._names = None
            self._complete(works, functools.partial(self._raise_from_transport, batch, backend, exc))
            if names is not None:
                self._timeline.end(names, None)
            self._finished_one(works)
            return
        self._names = None
        flight = _InFlight(batch, works, backend, parts, outputs, post, futures, names)
        self._in_flight.append(flight)
        done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        done.add_done_callback(lambda _: self._queue.put(flight))  # on the transport's thread

    def _land(self, flight: _InFlight) -> None:
        """Finish a batch started in the background once its transport calls are done (waiting for them first,
        when stopping)."""
        self._in_flight.remove(flight)
        try:
            finished = self._complete(flight.works, functools.partial(self._transport_results, flight))
            if flight.names is not None:
                self._timeline.end(flight.names, finished)
        finally:
            self._names = None
            self._finished_one(flight.works)

    def _transport_results(self, flight: _InFlight) -> list:
        try:
            torch.futures.wait_all(flight.futures)
        except RuntimeError as exc:
            self._raise_from_transport(flight.batch, flight.backend, exc)
        self._names = flight.names
        self._allreduce_results(flight.parts, flight.post)
        return flight.outputs

    @staticmethod
    def _fail(works, exc) -> None:
        for work in works:
            if work is not None:
                work.handle.set_error(exc)

    # --------------------------------------------------------------- dispatch
    def _run(self, batch: Batch, works: list) -> list:
        ranks, backend = self._process_sets.members_and_backend(batch.process_set_id)
        kind = batch.kind
        if kind == OpKind.BARRIER:
            return [None] * len(works)
        if kind == OpKind.JOIN:
            return [batch.last_joined] * len(works)
        if batch.reduced is not None:
            self._phase("COORDINATOR_ALLREDUCE")
            return self._reduced_by_coordinator(batch, works, batch.reduced)
        call = {
            OpKind.ALLREDUCE: self._allreduce,
            OpKind.ALLGATHER: self._allgather,
            OpKind.BROADCAST: self._broadcast,
            OpKind.ALLTOALL: self._alltoall,
            OpKind.REDUCESCATTER: self._reducescatter,
        }[kind]
        device = batch.entries[0].request.device
        backend = backend.for_device(device)
        try:
            return call(batch, works, backend, ranks)  # a CUDA batch: on its GPU, made current by _start_on_gpu
        except RuntimeError as exc:
            self._raise_from_transport(batch, backend, exc)

    # ------------------------------------------------------------------- GPU
    @staticmethod
    def _runs_on_gpu(batch: Batch) -> bool:
        """Whether ``batch`` moves CUDA tensors (queued on roundel's stream, released by ``_release``)."""
        return (batch.entries[0].request.device != "cpu" and not batch.error and batch.reduced is None
                and batch.kind not in (OpKind.BARRIER, OpKind.JOIN))

    def _start_on_gpu(self, batch: Batch, works: list) -> None:
        """Queue ``batch`` on roundel's stream of its GPU, after the events its works were submitted with;
        complete its handles at once, each ``wait()`` ordered after the batch on the device (``_AfterGpu``); and
        hand it to the finalizer thread, which returns it to ``_release`` once the GPU has finished it."""
        names = self._names = [e.name for e in batch.entries] if self._timeline.active else None
        self._phase("")  # out of QUEUE
        try:
            device = self._cuda_device(works)
            stream = self._cuda_stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                for ready in {id(w.ready): w.ready for w in works if w is not None and w.ready is not None}.values():
                    stream.wait_event(ready)  # the producers the submitting thread had queued
                results = self._run(batch, works)
                done = torch.cuda.Event(blocking=True)  # waited on by sleeping, not by spinning a core
                done.record(stream)
        except Exception as exc:  # _run gave a transport's failure as a RoundelInternalError already
            self._names = None
            self._complete(works, functools.partial(_reraise, exc))
            if names is not None:
                self._timeline.end(names, None)
            self._finished_one(works)
            return
        self._names = None
        then = _AfterGpu(done, device)
        flight = _OnGpu(batch, works, results, done, names, then)  # holds the batch's tensors until `done` fires
        self._in_flight.append(flight)
        if self._aborted is not None:  # an abort() after the check in _run_batch, too early to see this batch
            then.cut_short = self._aborted
        for work, result in zip(works, results):
            if work is not None:
                work.handle.set_result(result, then)
        if self._finalizer is None:
            self._finalizer = threading.Thread(target=self._finalize, name="roundel-finalizer", daemon=True)
            self._finalizer.start()
        self._gpu_waits.put(flight)

    def _cuda_stream(self, device: torch.device) -> torch.cuda.Stream:
        """roundel's own stream on ``device``, made at its first CUDA batch there."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _finalize(self) -> None:
        """The finalizer thread: wait for each CUDA batch's event in turn, then hand it back to the executor."""
        while True:
            flight = self._gpu_waits.get()
            try:
                flight.done.synchronize()
            except RuntimeError:
                pass  # a CUDA error: _release meets it again and reports it
            self._queue.put(flight)

    def _release(self, flight: _OnGpu) -> None:
        """Let go of a CUDA batch's tensors once the GPU has finished it (waiting for that first, when stopping).

        Its handles completed when it was queued; a CUDA error met here breaks the job, as a transport's does.
        """
        self._in_flight.remove(flight)
        try:
            flight.done.synchronize()
        except RuntimeError as exc:
            names = ", ".join(f"'{e.name}'" for e in flight.batch.entries[:4])
            self._broke(RoundelInternalError(
                f"{flight.batch.kind.label} of {names} failed on the GPU: {exc}. Its results cannot be trusted; "
                "see the other ranks' output"))
        finally:
            if flight.names is not None:
                self._timeline.end(flight.names, flight.results)
            self._finished_one(flight.works)

    def _cuda_device(self, works: list) -> torch.device:
        """The GPU a CUDA batch runs on: its tensors' (for a batch this rank joined, the last one seen or
        the one ``join(device=...)`` named)."""
        for work in works:
            if work is not None:
                self.cuda_device = work.tensor.device
                break
        if self.cuda_device is None:
            self.cuda_device = torch.device("cuda", torch.cuda.current_device())
        return self.cuda_device

    @staticmethod
    def _raise_from_transport(batch: Batch, backend, exc: Exception) -> NoReturn:
        """Raise ``exc``, a transport's RuntimeError as a RoundelInternalError naming the batch."""
        if isinstance(exc, RoundelInternalError) or not isinstance(exc, RuntimeError):
            raise exc
        names = ", ".join(f"'{e.name}'" for e in batch.entries[:4])
        raise RoundelInternalError(
            f"{batch.kind.label} of {names} failed in the {backend.name} transport: {exc}. "
            "A peer process has probably died or stopped; see the other ranks' output."
        ) from exc

    def _buffer(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """A reusable fusion buffer (kept per dtype and device, grown on demand)."""
        key = (dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffer_views.clear()  # they hold the buffer being replaced
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def _agree(self, transfer: Callable[[], None], plan: ReducedPlan | RowsPlan, serial: int) -> None:
        """Run slot ``serial``'s ``transfer`` (which carries its ``plan``'s agreement); time this rank's wait, and
        hand every rank's wait in its previous slot to ``on_slot_waits`` (rank 0's straggler record)."""
        token = None if self._waits is None else self._waits.enter((0, f"slot {serial}", REPLAY_WAIT), notify=False)
        started = time.perf_counter()
        try:
            transfer()
        finally:
            if self._waits is not None and token is not None:
                self._waits.leave(token)
        self._slot_wait_ms = min((time.perf_counter() - started) * 1e3, _LONGEST_WAIT_MS)
        if self._on_slot_waits is not None:
            waits = plan.waits()
            if any(waits):
                self._on_slot_waits(waits)

    def _slot_plan(self, slot: Slot, ranks: Sequence[int], rank: int) -> ReducedPlan | RowsPlan:
        """How this rank runs ``slot``: kept per name list while its requests, first dimensions and members stay
        (a step's slots repeat)."""
        key = (slot.requests, slot.first_dims, len(ranks))
        planned, plan = self._slot_plans.get(slot.names, (None, None))
        if planned != key:
            if len(self._slot_plans) >= _KEPT_PLANS:
                self._slot_plans.clear()
            plan = plan_slot(slot, ranks, rank, self._slot_buffer)
            self._slot_plans[slot.names] = (key, plan)
        return plan

    def _slot_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reusable CPU buffer for replay slots (per dtype, grown on demand)."""
        buffer = self._slot_buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            self._slot_plans.clear()  # they hold the buffer being replaced
            buffer = self._slot_buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer[:numel]

    @staticmethod
    def _inputs(batch: Batch, works: list) -> list:
        """Each entry's local tensor; ranks that joined contribute zeros."""
        return [w.tensor if w is not None else
                torch.zeros(e.request.shape, dtype=torch_dtype(e.request.dtype), device=e.request.device)
                for w, e in zip(works, batch.entries)]

    @staticmethod
    def _outputs_in_place(works: list, inputs: list) -> list:
        """The tensors that receive each entry's result (allocated when not given)."""
        outputs = []
        for work, tensor in zip(works, inputs):
            if work is not None and work.output is not None:
                outputs.append(work.output)
            else:
                outputs.append(torch.empty_like(tensor, memory_format=torch.contiguous_format))
        return outputs

    def _pack(self, tensors: list, dtype: torch.dtype, device: str = "cpu", fresh: bool = False) -> torch.Tensor:
        """``tensors`` (none: an empty buffer on ``device``) flattened into the fusion buffer (``fresh``: into a
        buffer of their own, for a batch that stays in flight while later ones use the fusion buffer)."""
        self._phase("MEMCPY_IN_FUSION_BUFFER")
        total = sum(t.numel() for t in tensors)
        where = tensors[0].device if tensors else torch.device(device)
        buffer = torch.empty(total, dtype=dtype, device=where) if fresh else self._buffer(dtype, where, total)
        if tensors:  # one call, not one copy per tensor
            with torch.no_grad():
                torch._foreach_copy_(self._buffer_views.of(buffer, tuple(t.shape for t in tensors)), tensors)
        return buffer

    def _unpack(self, buffer: torch.Tensor, outputs: list) -> None:
        self._phase("MEMCPY_OUT_FUSION_BUFFER")
        with torch.no_grad():
            torch._foreach_copy_(outputs, self._buffer_views.of(buffer, tuple(o.shape for o in outputs)))

    # -------------------------------------------------------------- allreduce
    def _allreduce(self, batch, works, backend, ranks):
        request = batch.entries[0].request
        op = ReduceOp(request.reduce_op)
        inputs = self._inputs(batch, works)
        outputs = self._outputs_in_place(works, inputs)
        if op == ReduceOp.Adasum:
            return self._adasum(inputs, outputs, request, backend, len(ranks))
        post = request.result_scale(len(ranks))
        if inputs[0].dtype in backend.fused_dtypes and all(t.is_contiguous() for t in (*inputs, *outputs)):
            self._phase(transport_activity(backend.carrier("allreduce"), "allreduce"))
            backend.allreduce_fused(inputs, outputs, op, request.prescale, post)
            return outputs
        parts = self._allreduce_parts(batch, works, backend, inputs, outputs)
        self._phase(transport_activity(backend.carrier("allreduce"), "allreduce"))
        for buffer, _ in parts:  # several only where the backend queues its calls (_takes_own_calls)
            backend.allreduce(buffer, op)
        self._allreduce_results(parts, post)
        return outputs

    def _reduced_by_coordinator(self, batch: Batch, works: list, reduced: bytes) -> list:
        """The results of an allreduce batch the coordinator reduced (``batch.reduced``), in its outputs."""
        outputs = self._outputs_in_place(works, self._inputs(batch, works))
        small_allreduce.unpack(reduced, torch_dtype(batch.entries[0].request.dtype), outputs)
        return outputs

    def _allreduce_parts(self, batch: Batch, works: list, backend, inputs: list, outputs: list,
                         in_background: bool = False) -> list:
        """[(buffer, its outputs)]: each buffer holds prescaled inputs and takes one backend call.

        An entry that runs alone (see ``_runs_alone``) is its own output's buffer; the others are packed
        into the fusion buffer (``in_background``: into a buffer of their own, which the next batches leave
        alone while this one is in flight).
        """
        request = batch.entries[0].request
        own_calls = _takes_own_calls(backend)
        parts, packed_inputs, packed_outputs = [], [], []
        for entry, work, tensor, output in zip(batch.entries, works, inputs, outputs):
            if _runs_alone(entry.request, work, len(works), own_calls):
                if output is not tensor:
                    output.copy_(tensor)
                parts.append((output, [output]))
            else:
                packed_inputs.append(tensor)
                packed_outputs.append(output)
        if packed_inputs:
            parts.append((self._pack(packed_inputs, torch_dtype(request.dtype), fresh=in_background), packed_outputs))
        for buffer, _ in parts:
            scale(buffer, request.prescale)
        return parts

    def _allreduce_results(self, parts: list, post: float) -> None:
        for buffer, outputs in parts:
            scale(buffer, post)
            if buffer is not outputs[0]:
                self._unpack(buffer, outputs)

    def _adasum(self, inputs, outputs, request, backend, n):
        """Gather every rank's gradients, then combine each tensor with the Adasum tree (one contiguous
        tensor with nothing to prescale is sent from its own memory)."""
        if len(inputs) == 1 and inputs[0].is_contiguous() and request.prescale == 1.0:
            buffer = inputs[0].detach().view(-1)
        else:
            buffer = self._pack(inputs, torch_dtype(request.dtype))
            scale(buffer, request.prescale)
        gathered = torch.empty(n * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
        self._phase(transport_activity(backend.carrier("allgather"), "allgather"))
        backend.allgather(gathered, buffer)
        self._phase("ADASUM_COMBINE")
        per_rank = gathered.view(n, buffer.numel())
        offset = 0
        for output in outputs:
            count = output.numel()
            combined = adasum_tree([per_rank[r, offset:offset + count] for r in range(n)])
            scale(combined, request.postscale)
            output.copy_(combined.view(output.shape))
            offset += count
        return outputs

    # -------------------------------------------------------------- broadcast
    def _broadcast(self, batch, works, backend, ranks):
        request = batch.entries[0].request
        inputs = self._inputs(batch, works)
        outputs = self._outputs_in_place(works, inputs)
        if len(inputs) == 1 and outputs[0].is_contiguous():
            buffer = outputs[0]
            if buffer is not inputs[0]:
                buffer.copy_(inputs[0])
        else:
            buffer = self._pack(inputs, torch_dtype(request.dtype))
        self._phase(transport_activity(backend.carrier("broadcast"), "broadcast"))
        backend.broadcast(buffer, ranks.index(request.root_rank))  # root_rank is global, as in Horovod
        if buffer is not outputs[0]:
            self._unpack(buffer, outputs)
        return outputs

    # -------------------------------------------------------------- allgather
    def _allgather(self, batch, works, backend, ranks):
        entries = batch.entries
        dtype = torch_dtype(entries[0].request.dtype)
        rows = [math.prod(e.request.shape[1:]) for e in entries]
        counts = [sum(e.first_dims[r] * row for e, row in zip(entries, rows)) for r in range(len(ranks))]
        width = max(counts) if counts else 0
        mine = [w.tensor.reshape(-1) for w in works if w is not None]
        send = self._pack(mine, dtype, entries[0].request.device) if len(mine) != 1 else mine[0]
        cpu = send.device.type == "cpu"  # there, large copies go in pieces on this thread (see serial_copy)
        if send.numel() < width:
            padded = torch.zeros(width, dtype=dtype, device=send.device)
            serial_copy([padded[:send.numel()]], [send], cut=cpu)
            send = padded
        received = torch.empty(width * len(ranks), dtype=dtype, device=send.device)
        self._phase(transport_activity(backend.carrier("allgather"), "allgather"))
        backend.allgather(received, send)
        shapes = [(sum(e.first_dims),) + tuple(e.request.shape[1:]) for e in entries]
        if len(entries) == 1 and min(counts) == width:  # every rank's rows back to back: the result as it is
            return [received.view(shapes[0])]
        self._phase("MEMCPY_OUT_FUSION_BUFFER")
        chunks = received.view(len(ranks), width) if width else received.view(len(ranks), 0)
        outputs = []
        offsets = [0] * len(ranks)
        for entry, row, shape in zip(entries, rows, shapes):
            output = torch.empty(shape, dtype=dtype, device=send.device)
            flat, at, into, parts = output.view(-1), 0, [], []
            for r in range(len(ranks)):
                n = entry.first_dims[r] * row
                into.append(flat[at:at + n])
                parts.append(chunks[r, offsets[r]:offsets[r] + n])
                at += n
                offsets[r] += n
            serial_copy(into, parts, cut=cpu)
            outputs.append(output)
        return outputs

    # --------------------------------------------------------------- alltoall
    def _alltoall(self, batch, works, backend, ranks):
        entry = batch.entries[0]
        work = works[0]
        request = entry.request
        me = backend.rank
        tail = tuple(request.shape[1:])
        send_splits = list(entry.splits[me])
        recv_splits = [entry.splits[j][me] for j in range(len(ranks))]
        dtype, device = torch_dtype(request.dtype), request.device
        tensor = work.tensor.contiguous() if work is not None else torch.empty((0,) + tail, dtype=dtype, device=device)
        output = torch.empty((sum(recv_splits),) + tail, dtype=dtype, device=device)
        self._phase(transport_activity(backend.carrier("alltoall"), "alltoall"))
        backend.alltoall(output, tensor, recv_splits, send_splits)
        return [(output, torch.tensor(recv_splits, dtype=torch.int32))]

    # ---------------------------------------------------------- reducescatter
    def _reducescatter(self, batch, works, backend, ranks):
        entry = batch.entries[0]
        request = entry.request
        op = ReduceOp(request.reduce_op)
        n = len(ranks)
        me = backend.rank
        tensor = self._inputs(batch, works)[0]
        first, tail = tensor.shape[0], tuple(tensor.shape[1:])
        counts = [first // n + (1 if r < first % n else 0) for r in range(n)]
        chunk = max(counts)
        if chunk * n == first and tensor.is_contiguous() and request.prescale == 1.0:
            padded = tensor.detach()  # already the member-major chunks the transport takes: no copy
        else:
            self._phase("MEMCPY_IN_FUSION_BUFFER")
            padded = torch.zeros((chunk * n,) + tail, dtype=tensor.dtype, device=tensor.device)
            start = 0
            for r, count in enumerate(counts):
                padded[r * chunk:r * chunk + count].copy_(tensor[start:start + count])
                start += count
            scale(padded, request.prescale)
        output = torch.empty((chunk,) + tail, dtype=tensor.dtype, device=tensor.device)
        self._phase(transport_activity(backend.carrier("reducescatter"), "reducescatter"))
        backend.reducescatter(output, padded, op)
        output = output[:counts[me]].clone() if counts[me] != chunk else output
        scale(output, request.result_scale(n))
        return [output]

