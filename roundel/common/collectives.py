"""The collectives every framework adapter submits through, on the engine's buffers.

The engine moves CPU (or CUDA) torch tensors, the buffer type of its
transports; an adapter converts its framework's tensors to them (NumPy arrays
through :mod:`roundel.common.buffers`, without a copy) and back. Here live
what every adapter shares: building and validating requests, naming unnamed
ops (one policy, restarted by ``init()``), handles, and barrier/join.

Every ``*_async`` function returns an integer handle, Horovod's boundary type;
``poll(handle)`` says whether it finished and ``synchronize(handle)`` waits and
returns its result, or raises the collective's error. Inside, a handle is a
:class:`Pending` object.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable

import torch

from roundel.common import basics
from roundel.common.engine.negotiation import JOIN_NAME
from roundel.common.process_sets import global_process_set
from roundel.common.control.records import OpKind, Request
from roundel.ops import ReduceOp

__all__ = ["Pending", "blocking", "waited", "allgather_async", "allreduce_async", "allreduce_blocking",
           "alltoall_async", "barrier", "broadcast_async", "grouped_allgather_async", "grouped_allreduce_async",
           "grouped_reducescatter_async", "join", "poll", "note_gradient_buckets", "reducescatter_async", "set_id",
           "synchronize", "tuned_settings"]


class Pending:
    """A collective in flight: the engine handles it waits for, and how their results become its result."""

    __slots__ = ("handles", "finish")

    def __init__(self, handles: list, finish: Callable[[list], object]):
        self.handles = handles
        self.finish = finish

    def done(self) -> bool:
        """True once every part has finished (successfully or not)."""
        return all(h.done() for h in self.handles)

    def wait(self):
        """Block until every part has finished; return the result or raise the first error."""
        return self.finish([h.wait() for h in self.handles])


# Integer handle -> its pending collective. Module level, as Horovod's API is: a handle is a plain int the
# caller passes back to poll()/synchronize() from any thread, and one outlives an elastic reset's init().
_pending: dict[int, Pending] = {}
_pending_lock = threading.Lock()
_handle_ids = itertools.count()
_caller = threading.local()  # .waits: the collectives started now are waited for at once (see ``waited``)


class waited:
    """Around starting a collective that the calling thread waits for right after (a blocking call): the
    thread then runs a replayed batch it completes itself, instead of handing it to roundel's executor.

    A class rather than a generator: a blocking call enters it every time, and this costs half as much."""

    __slots__ = ()

    def __enter__(self) -> None:
        _caller.waits = True

    def __exit__(self, *exc_info) -> None:
        _caller.waits = False


def blocking(start: Callable[[], int]):
    """Start a collective with ``start()`` (which returns its handle) and wait for its result, as one blocking
    call: the calling thread runs the collective's replayed slot itself (see ``waited``)."""
    with waited():
        handle = start()
    return synchronize(handle)


def _register(pending: Pending) -> int:
    handle = next(_handle_ids)
    with _pending_lock:
        _pending[handle] = pending
    return handle


def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished; ``synchronize`` will not block."""
    with _pending_lock:
        pending = _pending.get(handle)
    if pending is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return pending.done()


def synchronize(handle: int):
    """Wait for the collective behind ``handle`` and return its result (or raise its error)."""
    with _pending_lock:
        pending = _pending.pop(handle, None)
    if pending is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return pending.wait()


def note_gradient_buckets() -> None:
    """Tell autotune that this job reduces gradients in buckets (``DistributedOptimizer``), so it tunes
    their size."""
    basics.runtime().engine.note_gradient_buckets()


def tuned_settings(names, process_set=global_process_set):
    """The ``TunedParams`` autotune had put in force when the latest of the finished collectives ``names``
    ran on this rank; None before autotune changed anything. The same on every member of the set."""
    return basics.runtime().engine.tuned_when_ran(set_id(process_set), names)


def set_id(process_set) -> int:
    """The id of a registered process set; ValueError for one not registered on this rank."""
    number = process_set.process_set_id
    if number is None:
        raise ValueError(f"{process_set!r} is not registered; call hvd.add_process_set() on every rank first")
    return number


_DTYPE_NAMES: dict = {}  # torch.dtype -> its name without "torch.": asked for on every submission


def _dtype_name(buffer: torch.Tensor) -> str:
    dtype = buffer.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).split(".", 1)[1]
    return name


def _request(what: str, kind: OpKind, buffer: torch.Tensor, name, process_set, cacheable: bool | None = None,
             group: str = "", **fields) -> Request:
    """The request for one collective on ``buffer`` (an unnamed one gets the next automatic name)."""
    runtime = basics.runtime(what)
    number = set_id(process_set)
    return Request(
        name if name is not None else runtime.unnamed_name(kind.label, number), kind, number,
        dtype=_dtype_name(buffer), shape=tuple(buffer.shape),
        device="cpu" if buffer.is_cpu else buffer.device.type,  # is_cpu: a tenth of device.type's cost
        cacheable=name is not None if cacheable is None else cacheable, group=group, **fields)


def _start(what: str, parts: list) -> list:
    """Queue ``(request, buffer, output)`` parts on the engine in one submission; returns the engine's handles.

    Parts on a GPU are refused while the calling thread's stream captures a CUDA graph (see ``_not_capturing``).
    """
    engine = basics.runtime(what).engine
    devices = {buffer.device for _, buffer, _ in parts if buffer.is_cuda}
    if devices:
        _not_capturing(what)
    for device in devices:
        engine.claim_cuda_device(device)
    return engine.submit_group(parts, getattr(_caller, "waits", False))


def _not_capturing(what: str) -> None:
    """Raise RuntimeError if the calling thread's current CUDA stream is capturing a CUDA graph: roundel's executor
    thread runs the collective on roundel's own stream, outside the capture, so a replay of the graph would not
    repeat it."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} was called while this thread's CUDA stream is capturing a CUDA graph; CUDA graph capture of a "
            "step that submits collectives is not supported, because roundel runs them outside the graph. Capture "
            "the model's forward and backward only (e.g. with torch.cuda.make_graphed_callables) and run "
            "optimizer.step() and other collectives outside the capture")


def _checked(what: str, buffer) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{what} expects a tensor, got {type(buffer).__name__}")
    return buffer


def _first(results):
    return results[0]


def _in_place_target(buffer: torch.Tensor):
    """The contiguous buffer an in-place op writes to, and how to finish into ``buffer``. An inference tensor (made
    under ``torch.inference_mode()``) is written through a normal copy: roundel's threads work outside that mode,
    where such a tensor cannot be written in place."""
    if buffer.is_contiguous() and not buffer.is_inference():
        return buffer, _first
    if buffer.is_inference():
        with torch.inference_mode(False):
            target = buffer.clone(memory_format=torch.contiguous_format)
    else:
        target = buffer.contiguous()

    def finish(results):
        with torch.inference_mode(buffer.is_inference()):
            buffer.copy_(results[0])
        return buffer

    return target, finish


def _target(buffer: torch.Tensor, in_place: bool):
    """What a collective reads from and writes to, and how its result becomes the caller's (a normal tensor, even
    when the caller is in ``torch.inference_mode()``: roundel's threads write it outside that mode)."""
    if in_place:
        target, finish = _in_place_target(buffer)
        return target, target, finish
    target = buffer.contiguous()
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return target, torch.empty_like(target), _first
    return target, torch.empty_like(target), _first


def _group_names(name, count: int, kind: str, process_set) -> tuple[list, bool, str]:
    """Per-tensor names for a grouped op, whether they are worth caching (user-given), and the group's name."""
    base = name if name is not None else \
        basics.runtime(f"grouped_{kind}").unnamed_name(f"grouped_{kind}", set_id(process_set))
    return [f"{base}.{i}" for i in range(count)], name is not None, base


# ------------------------------------------------------------------ allreduce
def _reduction_problem(buffer: torch.Tensor, op: ReduceOp) -> str | None:
    if op == ReduceOp.Adasum and not buffer.dtype.is_floating_point:
        return f"Adasum needs floating-point tensors, not {_dtype_name(buffer)}"
    if buffer.dtype == torch.bool and op == ReduceOp.Average:
        return "Average is not defined for bool tensors; use op=hvd.Sum (logical or), Min, Max or Product"
    return None


def _allreduce_part(buffer, in_place: bool, name, op, prescale, postscale, process_set, cacheable=None,
                    group: str = ""):
    target, output, finish = _target(_checked("allreduce", buffer), in_place)
    request = _request("allreduce", OpKind.ALLREDUCE, target, name, process_set, cacheable, group,
                       reduce_op=int(op), prescale=float(prescale), postscale=float(postscale),
                       error=_reduction_problem(target, op))
    return (request, target, output), finish


def allreduce_async(buffer, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, in_place: bool = False) -> int:
    """Start reducing ``buffer`` across the set, into a new buffer or (``in_place``) into itself."""
    part, finish = _allreduce_part(buffer, in_place, name, op, prescale_factor, postscale_factor, process_set)
    return _register(Pending(_start("allreduce", [part]), finish))


def allreduce_blocking(buffer, name=None, op=ReduceOp.Average, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, in_place: bool = False):
    """``allreduce_async`` and its wait, as one blocking call. When the collective alone is the replayed slot this
    rank stands at (the same blocking call in a steady loop), it runs at once on the calling thread, without a
    handle to register and wait for (see ``Engine.run_alone``)."""
    part, finish = _allreduce_part(buffer, in_place, name, op, prescale_factor, postscale_factor, process_set)
    handle = basics.runtime("allreduce").engine.run_alone(*part)
    if handle is None:
        return blocking(lambda: _register(Pending(_start("allreduce", [part]), finish)))
    return finish([handle.wait()])


def grouped_allreduce_async(buffers, name=None, op=ReduceOp.Average, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, in_place: bool = False) -> int:
    """Start reducing a list of buffers together; the result is the list of reduced buffers.

    The buffers reach the coordinator together, so they are fused with each
    other (up to the fusion threshold, per dtype), as in Horovod.
    """
    names, named, group = _group_names(name, len(buffers), "allreduce", process_set)
    parts = [_allreduce_part(b, in_place, n, op, prescale_factor, postscale_factor, process_set, named, group)
             for b, n in zip(buffers, names)]
    finishers = [finish for _, finish in parts]
    return _register(Pending(_start("grouped_allreduce", [part for part, _ in parts]),
                             lambda results: [f([r]) for f, r in zip(finishers, results)]))


# ------------------------------------------------------------------ allgather
def _allgather_part(buffer, name, process_set, cacheable=None, group: str = ""):
    source = _checked("allgather", buffer).contiguous()
    if source.dim() == 0:
        source = source.reshape(1)
    return _request("allgather", OpKind.ALLGATHER, source, name, process_set, cacheable, group), source, None


def allgather_async(buffer, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``buffer`` along dimension 0 (first dimensions may differ)."""
    return _register(Pending(_start("allgather", [_allgather_part(buffer, name, process_set)]), _first))


def grouped_allgather_async(buffers, name=None, process_set=global_process_set) -> int:
    """Start allgathering a list of buffers together; the result is the list of gathered buffers."""
    names, named, group = _group_names(name, len(buffers), "allgather", process_set)
    parts = [_allgather_part(b, n, process_set, named, group) for b, n in zip(buffers, names)]
    return _register(Pending(_start("grouped_allgather", parts), list))


# ------------------------------------------------------------------ broadcast
def broadcast_async(buffer, root_rank, name=None, process_set=global_process_set, in_place: bool = False) -> int:
    """Start copying the root's ``buffer`` to every rank, into a new buffer or (``in_place``) over it.

    ``root_rank`` is a global rank (a member of ``process_set``), as in Horovod.
    """
    target, output, finish = _target(_checked("broadcast", buffer), in_place)
    request = _request("broadcast", OpKind.BROADCAST, target, name, process_set, root_rank=int(root_rank))
    return _register(Pending(_start("broadcast", [(request, target, output)]), finish))


# ------------------------------------------------------------------- alltoall
def _split_list(buffer: torch.Tensor, splits, members: int) -> tuple[tuple, str | None]:
    """The rows ``buffer`` sends to each of ``members`` ranks, and what is wrong with them (or None)."""
    if buffer.dim() == 0:
        return (0,) * members, "alltoall needs a tensor with at least one dimension"
    rows = buffer.shape[0]
    if splits is None:
        error = None if rows % members == 0 else (
            f"alltoall without splits needs the first dimension ({rows}) to divide evenly among {members} "
            "ranks; pass splits=")
        return (rows // members,) * members, error
    split_list = tuple(int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits))
    if any(s < 0 for s in split_list) or sum(split_list) != rows:
        return split_list, (f"alltoall splits {list(split_list)} must be non-negative and sum to the first "
                            f"dimension of the tensor ({rows})")
    return split_list, None


def alltoall_async(buffer, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``buffer`` to rank j of the set (even split without ``splits``).

    The result is ``(received buffer, received splits)``.
    """
    registered = basics.runtime("alltoall").process_sets.get(set_id(process_set))
    members = registered.ranks if registered is not None else ()
    source = _checked("alltoall", buffer).contiguous()
    split_list, error = _split_list(source, splits, len(members))
    request = _request("alltoall", OpKind.ALLTOALL, source, name, process_set, splits=split_list, error=error)
    return _register(Pending(_start("alltoall", [(request, source, None)]), _first))


# -------------------------------------------------------------- reducescatter
def _reducescatter_part(buffer, name, op, prescale, postscale, process_set, cacheable=None, group: str = ""):
    source = _checked("reducescatter", buffer).contiguous()
    error = _reduction_problem(source, op) if op != ReduceOp.Adasum else "reducescatter does not support Adasum"
    request = _request("reducescatter", OpKind.REDUCESCATTER, source, name, process_set, cacheable, group,
                       reduce_op=int(op), prescale=float(prescale), postscale=float(postscale), error=error)
    return request, source, None


def reducescatter_async(buffer, name=None, op=ReduceOp.Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducing ``buffer`` and keeping this rank's slice of dimension 0.

    Ranks with a lower index get one extra row when the first dimension does not divide evenly.
    """
    part = _reducescatter_part(buffer, name, op, prescale_factor, postscale_factor, process_set)
    return _register(Pending(_start("reducescatter", [part]), _first))


def grouped_reducescatter_async(buffers, name=None, op=ReduceOp.Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducescattering a list of buffers; the result is the list of this rank's slices."""
    names, named, group = _group_names(name, len(buffers), "reducescatter", process_set)
    parts = [_reducescatter_part(b, n, op, prescale_factor, postscale_factor, process_set, named, group)
             for b, n in zip(buffers, names)]
    return _register(Pending(_start("grouped_reducescatter", parts), list))


# ------------------------------------------------------------ barrier and join
def barrier(process_set=global_process_set) -> None:
    """Return once every rank of the set has called barrier."""
    runtime = basics.runtime("barrier")
    number = set_id(process_set)
    # numbered per set, so that the members agree on the name even when they ran different
    # numbers of other collectives (e.g. on other process sets); restarted by init()
    request = Request(f"__barrier__.{runtime.next_barrier(number)}", OpKind.BARRIER, number, cacheable=False)
    runtime.engine.submit(request, None, None).wait()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; returns the last rank to join.

    Until every rank has joined, the others' allreduces go on with this rank
    contributing zeros (and empty rows to allgathers). ``device`` is the GPU
    on which those zeros are made for CUDA collectives (-1: this rank's GPU,
    the one of its CUDA collectives, else the calling thread's current one).
    Raises ValueError for a GPU other than the one its collectives ran on.
    """
    engine = basics.runtime("join").engine
    if device >= 0:
        engine.claim_cuda_device(torch.device("cuda", device))
    elif engine.cuda_device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
        engine.claim_cuda_device(torch.device("cuda", torch.cuda.current_device()))  # this thread's device
    return engine.submit(Request(JOIN_NAME, OpKind.JOIN, 0, cacheable=False), None, None).wait()
