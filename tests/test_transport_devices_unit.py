"""Which backend moves a device's tensors (``Backend.for_device``), and host staging, without processes.

The staging test runs on CPU tensors (``.cpu()`` of one is itself), so it
checks what reaches the host backend and what comes back; the CUDA tests in
``tests/test_cuda.py`` run the same path with real device copies.
"""

import torch

from roundel.ops import ReduceOp
from roundel.transport import factory
from roundel.transport.backend import Backend, HostStaged


class Recorder(Backend):
    """Adds its rank + 1 to what it reduces, copies what it gathers, and records every call."""

    name = "recorder"

    def __init__(self):
        super().__init__(rank=1, size=2)
        self.calls = []

    def allreduce(self, tensor, op):
        self.calls.append(("allreduce", tensor.device.type, op))
        tensor.add_(self.rank + 1)

    def allgather(self, output, tensor):
        self.calls.append(("allgather", tensor.device.type))
        output.copy_(torch.cat([tensor, tensor]))

    def broadcast(self, tensor, root):
        self.calls.append(("broadcast", root))
        tensor.fill_(7)

    def alltoall(self, output, tensor, output_splits, input_splits):
        self.calls.append(("alltoall", tuple(output_splits), tuple(input_splits)))
        output.copy_(tensor.flip(0))

    def reducescatter(self, output, tensor, op):
        self.calls.append(("reducescatter", op))
        output.copy_(tensor[:output.numel()] * 2)

    def barrier(self):
        self.calls.append(("barrier",))

    def close(self):
        self.calls.append(("close",))


def test_cpu_tensors_stay_on_the_backend_itself():
    backend = Recorder()
    backend.make_cuda = lambda: (_ for _ in ()).throw(AssertionError("made for a CPU tensor"))
    assert backend.for_device("cpu") is backend


def test_the_cuda_backend_is_made_once_at_the_first_cuda_collective():
    backend, made = Recorder(), []
    cuda = Recorder()
    backend.make_cuda = lambda: made.append(1) or cuda
    assert made == []
    assert backend.for_device("cuda") is cuda
    assert backend.for_device("cuda") is cuda
    assert made == [1] and backend.cuda is cuda


def test_without_a_cuda_backend_device_tensors_are_staged_through_this_one():
    backend, made = Recorder(), []
    backend.make_cuda = lambda: made.append(1)  # NCCL not usable: returns None
    staged = backend.for_device("cuda")
    assert isinstance(staged, HostStaged) and staged.host is backend and staged.name == "recorder"
    assert isinstance(backend.for_device("cuda"), HostStaged) and made == [1]
    assert (staged.rank, staged.size) == (1, 2)


def test_host_staging_hands_host_tensors_over_and_copies_results_back():
    backend = Recorder()
    staged = HostStaged(backend)
    x = torch.arange(4.0)
    staged.allreduce(x, ReduceOp.Sum)
    assert x.tolist() == [2.0, 3.0, 4.0, 5.0]
    gathered = torch.empty(8)
    staged.allgather(gathered, torch.arange(4.0))
    assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0] * 2
    y = torch.zeros(3, dtype=torch.int64)
    staged.broadcast(y, root=1)
    assert y.tolist() == [7, 7, 7]
    out = torch.empty(3)
    staged.alltoall(out, torch.tensor([1.0, 2.0, 3.0]), [1, 2], [2, 1])
    assert out.tolist() == [3.0, 2.0, 1.0]
    half = torch.empty(2)
    staged.reducescatter(half, torch.tensor([1.0, 2.0, 3.0, 4.0]), ReduceOp.Max)
    assert half.tolist() == [2.0, 4.0]
    staged.barrier()
    staged.close()  # the host backend belongs to its owner: not closed here
    assert backend.calls == [("allreduce", "cpu", ReduceOp.Sum), ("allgather", "cpu"), ("broadcast", 1),
                             ("alltoall", (1, 2), (2, 1)), ("reducescatter", ReduceOp.Max), ("barrier",)]


def test_host_staging_takes_tensors_that_require_grad_out_of_autograd():
    # the host copy of a CUDA tensor that requires grad requires it too, and the host backend's in-place
    # and out= ops refuse it; a CPU leaf that requires grad (its .cpu() is itself) takes the same path
    staged = HostStaged(Recorder())
    x = torch.arange(4.0, requires_grad=True)
    staged.allreduce(x, ReduceOp.Sum)
    staged.broadcast(x, root=1)
    gathered = torch.empty(8, requires_grad=True)
    staged.allgather(gathered, torch.arange(4.0, requires_grad=True))
    assert x.tolist() == [7.0] * 4 and gathered.tolist() == [0.0, 1.0, 2.0, 3.0] * 2
    assert x.requires_grad and x.grad_fn is None  # still the user's leaf, no operation recorded on it


def test_closing_a_communicator_closes_the_cuda_one_beside_it():
    backend, cuda = Recorder(), Recorder()
    backend.make_cuda = lambda: cuda
    backend.for_device("cuda")
    factory.close(backend)
    assert backend.calls == [("close",)] and cuda.calls == [("close",)]


class Aborting(Recorder):
    def abort(self):
        self.calls.append(("abort",))


def test_a_broken_job_aborts_the_gpu_transport_of_every_process_set():
    # NCCL kernels waiting on a lost peer must end at once, not at NCCL's timeout
    from roundel.common.engine.executor import Executor
    from roundel.common.engine.process_set_registry import ProcessSetRegistry
    from roundel.errors import RoundelInternalError

    job, other = Recorder(), Recorder()
    job.cuda, other.cuda = Aborting(), Aborting()
    registry = ProcessSetRegistry((0, 1), job)
    registry.add(1, (0, 1), other)
    registry.add(2, (0,), None)
    executor = Executor(registry, lambda error: None, lambda: None)
    try:
        executor.abort(RoundelInternalError("rank 1 was lost"))
        assert job.cuda.calls == [("abort",)] and other.cuda.calls == [("abort",)]
        assert job.calls == [] and other.calls == []  # the host transports are left to the launcher's kill
    finally:
        executor.stop(5)


def test_a_rank_runs_its_cuda_collectives_on_one_gpu():
    # a batch fused from tensors on two GPUs could run on neither: the second GPU is refused at submission
    from types import SimpleNamespace

    import pytest

    from roundel.common.engine.core import Engine

    engine = SimpleNamespace(executor=SimpleNamespace(cuda_device=None), rank=1)
    Engine.claim_cuda_device(engine, torch.device("cuda", 1))
    Engine.claim_cuda_device(engine, torch.device("cuda:1"))
    assert engine.executor.cuda_device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"a tensor on cuda:0, but rank 1's CUDA collectives run on cuda:1: .*"
                                         r"torch.cuda.set_device\(hvd.local_rank\(\)\)"):
        Engine.claim_cuda_device(engine, torch.device("cuda", 0))
