"""NCCL failures stay bounded and reach the caller as roundel's errors, checked without a GPU.

torch's ``ProcessGroupNCCL`` is replaced by a recording fake (a CPU build of
torch has none) and torch.cuda's streams and events by the fakes of
``tests/test_executor_streams_unit.py``. Checked here: the process group's
timeout is roundel's collective timeout; torch is told to abort NCCL's
communicators without ending the process, unless the user chose otherwise;
a failed call is raised before its result is written back or unpacked, and
breaks the job, aborting the GPU transport; a handle whose batch was still on
the GPU when the job broke raises the break instead of returning a result;
and a collective submitted while a CUDA graph is being captured is refused.
The same failures on real GPUs are in ``tests/test_cuda.py``.
"""

import os
import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from roundel.common import basics, collectives
from roundel.common.control.records import OpKind, Request
from roundel.common.settings import Settings
from roundel.errors import RoundelInternalError
from roundel.ops import ReduceOp
from roundel.transport import factory, nccl
from test_executor_streams_unit import LOG, FakeEvent, GpuMemoryBackend, fake_cuda  # noqa: F401 (fixture)
from test_fusion_unit import TIMEOUT_S, MemoryBackend, batch_of, group, wait, work  # noqa: F401 (fixture)


class FailedWork:
    """A work whose ``wait()`` raises as torch's does for a failed NCCL call."""

    def wait(self):
        raise RuntimeError("NCCL error: remote process exited or there was a network error")


class FakeProcessGroupNCCL:
    """Records how it was made; its allreduce writes into its tensor, then its work fails."""

    made: list = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, options):
        self.rank, self.size, self.timeout = rank, size, options._timeout
        self.async_error_handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")  # what torch would read now
        self.aborts = 0
        FakeProcessGroupNCCL.made.append(self)

    def allreduce(self, tensors, options):
        tensors[0].fill_(99)
        return FailedWork()

    def abort(self):
        self.aborts += 1

    def shutdown(self):
        pass


@pytest.fixture
def fake_nccl(monkeypatch):
    """torch.distributed with the fake NCCL process group, NCCL usable, and no NCCL variable set by the user."""
    FakeProcessGroupNCCL.made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeProcessGroupNCCL, raising=False)
    monkeypatch.setattr(nccl, "usable", lambda: True)
    environ = {k: v for k, v in os.environ.items() if k not in nccl.ASYNC_ERROR_HANDLING_VARS}
    monkeypatch.setattr(os, "environ", environ)  # whatever the code sets goes with the test
    return environ


class Host(MemoryBackend):
    def __init__(self):
        super().__init__(0, 2, exchange=None)


def test_the_nccl_process_group_times_out_after_roundels_collective_timeout(fake_nccl):
    settings = Settings.from_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": "7.5"})
    host = Host()
    factory._with_cuda(basics._transport(settings), host, dist.HashStore())
    assert isinstance(host.for_device("cuda"), nccl.NcclBackend)
    (made,) = FakeProcessGroupNCCL.made
    assert made.timeout == timedelta(seconds=7.5)  # not torch's default of 10 minutes
    assert (made.rank, made.size) == (0, 2)


def test_torch_is_told_to_abort_the_communicators_without_ending_the_process(fake_nccl):
    nccl.NcclBackend(dist.HashStore(), 0, 2, 60.0)
    # set before the process group is made, which is when torch reads it
    assert FakeProcessGroupNCCL.made[0].async_error_handling == "2"
    assert fake_nccl["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"


@pytest.mark.parametrize("name", nccl.ASYNC_ERROR_HANDLING_VARS)
def test_the_users_own_async_error_handling_is_left_alone(fake_nccl, name):
    fake_nccl[name] = "1"
    nccl.NcclBackend(dist.HashStore(), 0, 2, 60.0)
    assert fake_nccl[name] == "1"
    assert {k: v for k, v in fake_nccl.items() if k in nccl.ASYNC_ERROR_HANDLING_VARS} == {name: "1"}


def test_a_failed_nccl_call_raises_before_its_result_is_written_back(fake_nccl):
    backend = nccl.NcclBackend(dist.HashStore(), 0, 2, 60.0)
    tensor = torch.tensor([1, 2, 3], dtype=torch.int16)  # sent widened to int32, narrowed back after the call
    with pytest.raises(RuntimeError, match="remote process exited"):
        backend.allreduce(tensor, ReduceOp.Sum)
    assert tensor.tolist() == [1, 2, 3]  # the widened copy holds 99s; nothing was copied back
    backend.abort()
    backend.abort()  # again (the executor and a second break): harmless
    assert FakeProcessGroupNCCL.made[0].aborts == 2
    backend.close()
    backend.abort()  # after close: nothing to abort
    assert FakeProcessGroupNCCL.made[0].aborts == 2


class FailingGpuBackend(GpuMemoryBackend):
    """A CUDA communicator whose calls fail (a peer died mid-transfer); records its aborts."""

    def __init__(self, rank, size, exchange, fail=False):
        super().__init__(rank, size, exchange, fail)
        self.aborts = 0

    def abort(self):
        self.aborts += 1


def _cuda_request(name, **fields):
    return Request(name, OpKind.ALLREDUCE, 0, "float32", (3,), reduce_op=int(ReduceOp.Sum), device="cuda", **fields)


def test_a_failed_gpu_batch_is_not_unpacked_and_breaks_the_job_aborting_the_gpu_transport(group, fake_cuda):
    g = group(1, fail=True, backend=FailingGpuBackend)
    requests = [_cuda_request(n, prescale=2.0) for n in "ab"]  # packed (and doubled) in the fusion buffer
    works = [work(r, torch.full((3,), float(i + 1))) for i, r in enumerate(requests)]
    for w in works:
        w.ready = FakeEvent()
    g.executors[0].put(batch_of(OpKind.ALLREDUCE, requests), works)
    for w in works:
        with pytest.raises(RoundelInternalError, match="failed in the memory transport: connection reset by peer"):
            wait(w.handle)
    assert [w.tensor.tolist() for w in works] == [[1.0] * 3, [2.0] * 3]  # the fusion buffer was not unpacked
    assert len(g.transport_failures) == 1 and g.backends[0].aborts == 1


def _done_events():
    """The events the executor recorded after its CUDA batches, in order."""
    return [entry[2] for entry in LOG if entry[0] == "record"]


def _when_done(handle):
    for _ in range(int(TIMEOUT_S / 0.01)):
        if handle.done():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the handle never completed")


def test_a_handle_whose_batch_is_still_on_the_gpu_when_the_job_breaks_raises_the_break(group, fake_cuda):
    g = group(1, backend=GpuMemoryBackend)
    executor = g.executors[0]
    finished, cut = (work(_cuda_request(n), torch.full((3,), 5.0)) for n in ("finished", "cut"))
    finished.ready = cut.ready = FakeEvent()
    executor.put(batch_of(OpKind.ALLREDUCE, [finished.request]), [finished])
    _when_done(finished.handle)
    _done_events()[0].fired.set()  # the GPU finishes the first batch; the executor lets it go
    for _ in range(int(TIMEOUT_S / 0.01)):
        if executor.idle():
            break
        threading.Event().wait(0.01)
    assert executor.idle()
    executor.put(batch_of(OpKind.ALLREDUCE, [cut.request]), [cut])
    _when_done(cut.handle)  # completed when queued on the GPU, where it has not finished
    executor.abort(RoundelInternalError("rank 1 (host h) died"))
    with pytest.raises(RoundelInternalError, match=r"rank 1 \(host h\) died"):
        cut.handle.wait()
    with pytest.raises(RoundelInternalError, match="died"):
        cut.handle.wait()  # every wait, not only the first
    assert torch.equal(finished.handle.wait(), torch.full((3,), 5.0))  # finished before the break: it stands
    _done_events()[1].fired.set()  # the abort ended the kernel: the batch is let go


class RecordingEngine:
    def __init__(self):
        self.claimed, self.submitted = [], []

    def claim_cuda_device(self, device):
        self.claimed.append(device)

    def submit_group(self, parts, caller_waits=False):
        self.submitted.append(parts)
        return ["handle"]


def _submit(monkeypatch, buffer, capturing):
    engine = RecordingEngine()
    monkeypatch.setattr(basics, "runtime", lambda what="": SimpleNamespace(engine=engine))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    return engine, lambda: collectives._start("allreduce", [(_cuda_request("x"), buffer, None)])


def test_a_collective_submitted_during_cuda_graph_capture_is_refused_saying_what_to_do(monkeypatch):
    on_gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    engine, start = _submit(monkeypatch, on_gpu, lambda: True)
    with pytest.raises(RuntimeError, match=r"allreduce was called while this thread's CUDA stream is capturing a "
                                           r"CUDA graph; CUDA graph capture of a step that submits collectives is "
                                           r"not supported.*torch.cuda.make_graphed_callables.*optimizer.step\(\)"):
        start()
    assert engine.submitted == [] and engine.claimed == []
    engine, start = _submit(monkeypatch, on_gpu, lambda: False)
    assert start() == ["handle"] and engine.claimed == [torch.device("cuda", 0)]


def test_a_cpu_collective_does_not_ask_about_graph_capture(monkeypatch):
    def asked():
        raise AssertionError("asked CUDA about graph capture for a CPU tensor")

    engine, start = _submit(monkeypatch, torch.ones(3), asked)
    assert start() == ["handle"] and engine.claimed == [] and len(engine.submitted) == 1
