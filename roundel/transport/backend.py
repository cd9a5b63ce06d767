"""The interface a transport implements: collectives on contiguous CPU/GPU buffers.

The engine decides what runs and in which order; a backend only moves data.
Every call is blocking, operates on contiguous ``torch.Tensor`` buffers, and
raises ``RuntimeError`` when the transport fails (a peer died, a timeout).
A backend that can also run an allreduce on its own threads offers
``allreduce_async``; the executor then runs large allreduces on them in the
background, the large tensors of a fused batch side by side, each in its own
memory. One that can reduce several tensors straight from and into their own
memory offers ``allreduce_fused``; the executor then fuses a batch without a
fusion buffer.

CUDA tensors go to the backend of the same members that :meth:`Backend.for_device`
names: NCCL where the factory attached one, else a :class:`HostStaged` view that
copies them through host memory and moves them over this backend.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from roundel.ops import ReduceOp

#: ``torch.distributed``'s reduction for each op a backend reduces (Average is summed; the executor divides).
#: Any: torch's stubs type these members as ``ReduceOp.RedOpType`` but the options' ``reduceOp`` they are
#: assigned to as ``ReduceOp``, which pybind11 converts them to.
TORCH_REDUCE_OPS: dict[ReduceOp, Any] = {
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Average: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}

#: The ops whose local reduction is a sum (Average is summed; the executor divides): the ones the transports'
#: NumPy paths take.
SUM_OPS = frozenset({ReduceOp.Sum, ReduceOp.Average})

#: The local reduction for each op, applied to an accumulator with each next member's data in turn
#: (Average is summed; the executor divides).
COMBINE = {
    ReduceOp.Sum: torch.Tensor.add_,
    ReduceOp.Average: torch.Tensor.add_,
    ReduceOp.Min: lambda into, row: torch.minimum(into, row, out=into),
    ReduceOp.Max: lambda into, row: torch.maximum(into, row, out=into),
    ReduceOp.Product: torch.Tensor.mul_,
}

#: The dtypes reduced with torch's arithmetic outside the transports (by shared memory and by the
#: coordinator): every integer and floating type, not bool or complex.
ARITHMETIC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                     torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64)

# Neither Gloo nor NCCL has kernels for these; they travel widened and come back narrowed.
_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


class ShapedViews:
    """Views of a flat buffer cut into tensors of given shapes, one after the other.

    A steady training step sends the same batches again and again, and a view
    costs microseconds to make, so the views of each (buffer, shapes) are kept
    for the next call: one ``torch._foreach_copy_`` over them then fills or
    empties the buffer in one call whatever the tensor count. Holding a view
    holds its buffer's memory; ``clear()`` lets a replaced buffer go.
    """

    def __init__(self, kept: int = 64):
        self._kept = kept
        self._views: dict = {}

    def of(self, buffer: torch.Tensor, shapes: tuple) -> list:
        """``buffer``'s first elements as tensors of ``shapes`` (a tuple of ``torch.Size``), in order."""
        def cut():
            sizes = [math.prod(shape) for shape in shapes]
            return [piece.view(shape) for piece, shape in zip(buffer[:sum(sizes)].split(sizes), shapes)]
        return self._kept_view((buffer.data_ptr(), buffer.dtype, buffer.device, shapes), cut)

    def at(self, buffer: torch.Tensor, start: int, shape: torch.Size) -> torch.Tensor:
        """``buffer``'s elements from ``start`` on as one tensor of ``shape``."""
        return self._kept_view((buffer.data_ptr(), buffer.dtype, buffer.device, start, shape),
                               lambda: buffer[start:start + math.prod(shape)].view(shape))

    def _kept_view(self, key: tuple, make):
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self._kept:
                self._views.clear()
            views = self._views[key] = make()
        return views

    def clear(self) -> None:
        """Forget every view kept."""
        self._views.clear()


def widens(dtype: torch.dtype) -> bool:
    """Whether ``widened`` copies tensors of ``dtype`` into a wider type."""
    return dtype in _WIDENED


def widened(tensor):
    """``tensor``, or a copy in a wider integer type where the transports have no kernels for its own."""
    wide = _WIDENED.get(tensor.dtype)
    return tensor if wide is None else tensor.to(wide)


def narrow_back(original, sent) -> None:
    """Copy a result received in ``widened(original)`` back into ``original``."""
    if sent is not original:
        original.copy_(sent)


# dtypes whose CPU tensors NumPy can view (``numpy()``); bfloat16, complex32 and the 8-bit floats it cannot
_NUMPY_VIEWED = frozenset({torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
                           torch.int32, torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128})


def has_flat_array(tensor) -> bool:
    """Whether ``flat_array(tensor)`` views ``tensor``: contiguous, of a dtype NumPy has, and neither a conjugate
    nor a negative view."""
    return (tensor.dtype in _NUMPY_VIEWED and tensor.is_contiguous()
            and not (tensor.is_conj() or tensor.is_neg()))


def flat_array(tensor):
    """A contiguous CPU ``tensor``'s elements as a flat NumPy array sharing its memory, through ``numpy()`` alone
    where it can (a torch view or detach costs microseconds a call; a NumPy reshape, a fraction of one)."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy().reshape(-1)


def scale(buffer, factor: float) -> None:
    """Multiply ``buffer`` by ``factor`` in place (integers in float64, truncated back; bools never)."""
    if factor == 1.0:
        return
    if buffer.dtype.is_floating_point or buffer.dtype.is_complex:
        buffer.mul_(factor)
    elif buffer.dtype != torch.bool:
        buffer.copy_(buffer.double().mul_(factor).trunc_())


def shut_down(process_group) -> None:
    """Shut a ``torch.distributed`` process group down (None: nothing to do); one already broken is left be.

    In older torch (2.6 among them) a Gloo group has no ``shutdown()``: it closes when its last reference goes.
    """
    shutdown = getattr(process_group, "shutdown", None)
    if shutdown is None:
        return
    try:
        shutdown()
    except RuntimeError:
        pass


class Backend(abc.ABC):
    """One communicator over the members of a process set."""

    name: str = "backend"

    #: The communicator of the same members for CUDA tensors (NCCL) once made; None: CUDA tensors are
    #: staged through host memory and moved by this backend.
    cuda: Backend | None = None
    #: Makes ``cuda`` at the first CUDA collective (set by the factory; returns None where it cannot), so
    #: that a job that never uses a GPU starts nothing of CUDA's.
    make_cuda: Callable[[], Backend | None] | None = None
    #: Whether autotune may switch this communicator between hierarchical and flat collectives (``use``).
    tunable_hierarchy = False
    #: Whether a call returns once queued on the tensors' device, the device then working on its own (NCCL):
    #: a large tensor then costs less as a call of its own than copied through a fusion buffer and back.
    queues_on_device = False
    #: The host staging of device tensors (made at the first one where ``cuda`` is None), kept for its buffers.
    _staged: HostStaged | None = None

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size

    def carrier(self, op_label: str) -> str:
        """The name of the transport that moves this backend's ``op_label`` collectives (for the timeline)."""
        return self.name

    def use(self, hierarchical_allreduce: bool, hierarchical_allgather: bool) -> None:
        """Switch allreduce and allgather between hierarchical and flat (where ``tunable_hierarchy``)."""
        raise NotImplementedError(f"{type(self).__name__} has no hierarchical collectives to switch")

    def for_device(self, device_type: str) -> Backend:
        """The backend that moves tensors on ``device_type`` ("cpu" or "cuda") among these members."""
        if device_type == "cpu":
            return self
        if self.make_cuda is not None:
            make, self.make_cuda = self.make_cuda, None
            self.cuda = make()
        if self.cuda is not None:
            return self.cuda
        if self._staged is None:
            self._staged = HostStaged(self)
        return self._staged

    @abc.abstractmethod
    def allreduce(self, tensor, op: ReduceOp) -> None:
        """Reduce ``tensor`` in place across members; ``op`` is Sum, Min, Max or Product."""

    #: ``allreduce_async(tensor, op)``, where offered: start :meth:`allreduce` on the transport's own
    #: threads and return a ``torch.futures.Future`` that completes once ``tensor`` holds the result
    #: (or fails with the transport's ``RuntimeError``). Calls run in the order they are made.
    allreduce_async: Callable[[Any, ReduceOp], torch.futures.Future] | None = None

    #: The dtypes ``allreduce_fused(inputs, outputs, op, prescale, postscale)`` takes, where offered:
    #: allreduce contiguous ``inputs`` of one dtype as a fusion buffer of them would be (scaled by
    #: ``prescale`` before and ``postscale`` after, as the executor scales one), each result into its
    #: contiguous ``outputs`` tensor (which may be its input), without filling or emptying a fusion buffer.
    fused_dtypes: frozenset = frozenset()

    @abc.abstractmethod
    def allgather(self, output, tensor) -> None:
        """Gather equal-sized ``tensor`` from every member into ``output`` (member-major, flat)."""

    @abc.abstractmethod
    def broadcast(self, tensor, root: int) -> None:
        """Overwrite ``tensor`` with the root member's copy."""

    @abc.abstractmethod
    def alltoall(self, output, tensor, output_splits: list[int], input_splits: list[int]) -> None:
        """Send ``input_splits[j]`` rows of ``tensor`` to member j; receive ``output_splits[j]`` rows from j."""

    @abc.abstractmethod
    def reducescatter(self, output, tensor, op: ReduceOp) -> None:
        """Reduce ``tensor`` (``size`` equal chunks, member-major) and keep this member's chunk in ``output``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every member has called barrier."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator; later calls are undefined."""

    def abort(self) -> None:
        """End the transfers in progress now, the job being broken (a peer is lost); later calls fail.

        Does nothing by default: a host transport's transfer with a dead peer ends when that peer's
        process (killed by the launcher) closes its sockets.
        """

    def subset(self, ranks: tuple[int, ...]) -> Backend:
        """A communicator of this one's members ``ranks``, made by them alone (MPI's way to a process set).

        Raises NotImplementedError where process sets are built through the rendezvous store instead
        (Gloo, shared memory, NCCL).
        """
        raise NotImplementedError(f"the {self.name} transport builds process sets through the rendezvous store")


class RootedBackend(Backend):
    """A backend that also reduces and gathers to one member, as the local communicator of hierarchical
    collectives must (:mod:`roundel.transport.hierarchical`): Gloo, MPI and shared memory."""

    @abc.abstractmethod
    def reduce(self, tensor, root: int, op: ReduceOp) -> None:
        """Reduce ``tensor`` into the root member's copy (the others' are left undefined)."""

    @abc.abstractmethod
    def gather(self, outputs: list, tensor, root: int) -> None:
        """Gather ``tensor`` from every member into the root's ``outputs`` (one tensor per member)."""


class _PinnedBuffers:
    """Page-locked host buffers for staging CUDA tensors, one per use ("in", "out") and dtype, grown on demand
    and reused: the device copies into and out of them without the CPU, and a buffer is handed out again only
    after the device has finished copying out of it."""

    def __init__(self):
        self._kept: dict[tuple, torch.Tensor] = {}  # (use, dtype) -> buffer
        self._copying: dict[tuple, Any] = {}  # (use, dtype) -> an event after its latest copy to the device

    def take(self, use: str, dtype: torch.dtype, shape) -> torch.Tensor:
        """A pinned host tensor of ``shape`` and ``dtype`` for ``use``, free of earlier copies."""
        key, numel = (use, dtype), math.prod(shape)
        copying = self._copying.pop(key, None)
        if copying is not None:
            copying.synchronize()  # a blocking event: the thread sleeps
        buffer = self._kept.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._kept[key] = torch.empty(numel, dtype=dtype, pin_memory=True)
        return buffer[:numel].view(shape)

    def copied_back(self, use: str, dtype: torch.dtype, stream) -> None:
        """A copy out of the ``use`` buffer of ``dtype`` was queued on ``stream``: wait for it before the next take."""
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
        self._copying[(use, dtype)] = event


def _to_host(tensor, pinned: _PinnedBuffers, use: str):
    """``tensor`` in host memory, outside autograd (a copy of a device tensor that requires grad would otherwise
    require it too, and the host backend's ``out=`` and in-place ops refuse such tensors). A CUDA tensor is copied
    into a pinned buffer on its device's current stream, complete on return; any other tensor is copied to the
    host by ``.cpu()`` (none at all for a CPU tensor, which is returned detached)."""
    if not tensor.is_cuda:
        return tensor.detach().cpu()
    host = pinned.take(use, tensor.dtype, tensor.shape)
    host.copy_(tensor.detach(), non_blocking=True)
    copied = torch.cuda.Event(blocking=True)
    copied.record(torch.cuda.current_stream(tensor.device))
    copied.synchronize()  # the host backend reads it next
    return host


def _host_output(output, pinned: _PinnedBuffers, use: str):
    """Host memory for the host backend to write ``output``'s values into."""
    if not output.is_cuda:
        return torch.empty(output.shape, dtype=output.dtype)
    return pinned.take(use, output.dtype, output.shape)


def _to_device(tensor, staged, pinned: _PinnedBuffers, use: str) -> None:
    """Copy ``staged`` (from ``_to_host`` or ``_host_output`` with ``use``) back into ``tensor``; for a CUDA
    tensor the copy is queued on its device's current stream, and the buffer is not reused before it is done."""
    if not tensor.is_cuda:
        tensor.detach().copy_(staged)
        return
    tensor.detach().copy_(staged, non_blocking=True)
    pinned.copied_back(use, tensor.dtype, torch.cuda.current_stream(tensor.device))


class HostStaged(Backend):
    """Device tensors copied to host memory, moved by a host backend, and copied back.

    CUDA tensors go through pinned host buffers kept for the next call; the copies are queued on the device's
    current stream, the copy to the host waited for (sleeping) before the host backend reads it.
    """

    def __init__(self, host: Backend):
        super().__init__(host.rank, host.size)
        self.host = host
        self.name = host.name
        self._pinned = _PinnedBuffers()

    def carrier(self, op_label: str) -> str:
        return self.host.carrier(op_label)

    def allreduce(self, tensor, op):
        staged = _to_host(tensor, self._pinned, "in")
        self.host.allreduce(staged, op)
        _to_device(tensor, staged, self._pinned, "in")

    def allgather(self, output, tensor):
        staged = _host_output(output, self._pinned, "out")
        self.host.allgather(staged, _to_host(tensor, self._pinned, "in"))
        _to_device(output, staged, self._pinned, "out")

    def broadcast(self, tensor, root):
        staged = _to_host(tensor, self._pinned, "in")
        self.host.broadcast(staged, root)
        _to_device(tensor, staged, self._pinned, "in")

    def alltoall(self, output, tensor, output_splits, input_splits):
        staged = _host_output(output, self._pinned, "out")
        self.host.alltoall(staged, _to_host(tensor, self._pinned, "in"), output_splits, input_splits)
        _to_device(output, staged, self._pinned, "out")

    def reducescatter(self, output, tensor, op):
        staged = _host_output(output, self._pinned, "out")
        self.host.reducescatter(staged, _to_host(tensor, self._pinned, "in"), op)
        _to_device(output, staged, self._pinned, "out")

    def barrier(self):
        self.host.barrier()

    def close(self):
        """Nothing of its own to release: the host backend is closed by its owner."""
