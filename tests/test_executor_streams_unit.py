"""The executor's GPU path in order, without a GPU: torch.cuda's streams and events replaced by recording fakes.

What the fakes let a CPU machine check is the executor's own logic: a CUDA batch runs on a stream of
roundel's own (made once), after the event its work was submitted with; an event is recorded after it;
the handle completes at once, and its ``wait()`` makes the waiting thread's stream wait for that event;
the batch stays in flight (the executor not idle, its tensors held) until the event fires, and stopping
waits for it. The real device semantics are tested in ``tests/test_cuda.py`` where a GPU exists.
"""

import contextlib
import threading

import pytest
import torch

from roundel.common.control.records import OpKind, Request
from roundel.common.engine.handles import Handle
from roundel.ops import ReduceOp
from test_fusion_unit import TIMEOUT_S, MemoryBackend, batch_of, group, wait, work  # noqa: F401 (group: fixture)

LOG = []  # what the fakes were asked to do, in order


class FakeStream:
    """A stream that records the events it is made to wait for."""

    def __init__(self, device=None, name="roundel"):
        self.device, self.name = device, name
        LOG.append(("made stream", self))

    def wait_event(self, event):
        LOG.append(("wait", self, event))


class FakeEvent:
    """An event that fires when the test says so; ``synchronize`` blocks until then."""

    def __init__(self, blocking=False):
        self.blocking = blocking
        self.fired = threading.Event()

    def record(self, stream):
        LOG.append(("record", stream, self))

    def synchronize(self):
        assert self.fired.wait(TIMEOUT_S), "the event never fired"


class FakeCuda:
    """Stands in for torch.cuda's streams, events and current-stream state (per thread, as CUDA's)."""

    def __init__(self):
        self._current = threading.local()
        self.caller = FakeStream(name="caller")  # every thread's stream outside ``stream(...)``

    def current_stream(self, device=None):
        return getattr(self._current, "stream", self.caller)

    @contextlib.contextmanager
    def stream(self, stream):
        before = self.current_stream()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before


class GpuMemoryBackend(MemoryBackend):
    """The communicator of a process set that is also its own CUDA communicator; logs each call's stream."""

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self.cuda = self

    def allreduce(self, tensor, op):
        LOG.append(("allreduce", FAKE.current_stream()))
        super().allreduce(tensor, op)


FAKE: FakeCuda


@pytest.fixture
def fake_cuda(monkeypatch):
    global FAKE
    FAKE = FakeCuda()
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", FAKE.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", FAKE.stream)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return FAKE


def _gpu_work(name, value, ready):
    request = Request(name, OpKind.ALLREDUCE, 0, "float32", (3,), reduce_op=int(ReduceOp.Sum), device="cuda")
    w = work(request, torch.full((3,), value))
    w.ready = ready
    return request, w


def _done_event(after):
    """The event recorded after the entry ``after`` in LOG."""
    return next(entry[2] for entry in LOG[LOG.index(after):] if entry[0] == "record")


def test_a_cuda_batch_runs_on_roundels_stream_after_its_ready_event_and_completes_without_waiting(group, fake_cuda):
    g = group(1, backend=GpuMemoryBackend)
    executor = g.executors[0]
    ready = FakeEvent()
    request, w = _gpu_work("x", 2.0, ready)
    executor.put(batch_of(OpKind.ALLREDUCE, [request]), [w])
    result = wait(w.handle)  # completes although the GPU has not finished: no thread waits for it
    assert torch.equal(result, torch.full((3,), 2.0))
    streams = [entry[1] for entry in LOG if entry[0] == "made stream" and entry[1].name == "roundel"]
    assert len(streams) == 1
    ours = streams[0]
    call = ("allreduce", ours)
    assert ("wait", ours, ready) in LOG and LOG.index(("wait", ours, ready)) < LOG.index(call)
    done = _done_event(call)
    assert done.blocking  # the finalizer sleeps on it
    assert ("wait", fake_cuda.caller, done) in LOG  # wait() ordered the waiting thread's stream after the batch
    assert not executor.idle()  # in flight until the event fires: its tensors are held
    done.fired.set()
    for _ in range(int(TIMEOUT_S / 0.01)):
        if executor.idle():
            break
        threading.Event().wait(0.01)
    assert executor.idle()


def test_later_batches_reuse_the_stream_and_stopping_waits_for_the_gpu(group, fake_cuda):
    g = group(1, backend=GpuMemoryBackend)
    executor = g.executors[0]
    works = []
    for i in range(3):
        request, w = _gpu_work(f"n{i}", float(i), FakeEvent())
        executor.put(batch_of(OpKind.ALLREDUCE, [request]), [w])
        works.append(w)
    for i, w in enumerate(works):
        assert torch.equal(wait(w.handle), torch.full((3,), float(i)))
    assert len([entry for entry in LOG if entry[0] == "made stream" and entry[1].name == "roundel"]) == 1
    events = [entry[2] for entry in LOG if entry[0] == "record"]
    assert len(events) == 3
    assert not executor.stop(0.2)  # the GPU has not finished: stopping waits for it
    for event in events:
        event.fired.set()
    assert executor.wait_stopped(TIMEOUT_S) and executor.idle()


def test_a_handle_runs_then_with_its_result_in_every_wait_and_not_for_an_error():
    seen = []
    handle = Handle("x")
    handle.set_result(7, seen.append)
    assert handle.wait() == 7 and handle.wait() == 7
    assert seen == [7, 7]
    failed = Handle("y")
    failed.set_error(RuntimeError("lost"))
    failed.set_result(1, seen.append)  # too late: the error stands, and nothing is run
    with pytest.raises(RuntimeError, match="lost"):
        failed.wait()
    assert seen == [7, 7]
