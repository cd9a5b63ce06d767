"""Collectives on MXNet NDArrays, with Horovod 0.28.1's MXNet names and signatures.

Each collective copies its NDArrays to host memory (``NDArray.asnumpy()``:
one copy, which also waits for MXNet's pending writes to them), wraps those
private NumPy copies as the engine's buffers without a second copy
(:mod:`roundel.common.buffers`), submits them through
:mod:`roundel.common.collectives`, waits, and copies the results back: into a
new NDArray on the input's context (``allreduce``, ``allgather``, ...) or into
the input itself (``allreduce_``, ``broadcast_``, ``grouped_allreduce_``).
So every call costs one copy out of MXNet and one copy back in, and nothing
here talks to the other ranks itself.

Unlike Horovod's, these calls return once the result is in place (Horovod's
return at once and let MXNet's engine wait). ``priority`` is accepted and has
no effect: the engine runs collectives in the order every rank submitted them.
Adasum is rejected, as in Horovod's MXNet adapter.
"""

from __future__ import annotations

from typing import Callable

import mxnet as mx
import numpy as np

from roundel.common import basics, buffers, collectives
from roundel.common.process_sets import global_process_set
from roundel.ops import ReduceOp, resolve_op

__all__ = ["allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_", "grouped_allgather",
           "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init", "reducescatter",
           "start_allreduce_", "start_broadcast_", "start_grouped_allreduce_"]


def init(comm=None, process_sets=None) -> None:
    """Join the job, as ``roundel.common.basics.init`` (Horovod's ``hvd.init``).

    First gives torch one thread (:func:`roundel.common.buffers.use_one_packing_thread`):
    in an MXNet process torch only moves the engine's buffers.
    """
    buffers.use_one_packing_thread()
    basics.init(comm, process_sets)


# ------------------------------------------------------------ conversions
def _to_buffer(tensor, what: str):
    """A host copy of ``tensor`` as an engine buffer (the copy is private, so ops may run in place on it)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mxnet NDArray, got {type(tensor).__name__}; "
                        "wrap NumPy data with mx.nd.array(...)")
    if tensor.stype != "default":
        raise TypeError(f"{what} supports dense NDArrays only, not stype={tensor.stype!r}; "
                        "convert with .tostype('default')")
    return buffers.from_numpy(tensor.asnumpy())


def _to_buffers(tensors, what: str) -> list:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} expects a list of NDArrays, got {type(tensors).__name__}")
    return [_to_buffer(t, what) for t in tensors]


def _new_ndarray(buffer, like) -> mx.nd.NDArray:
    """A new NDArray on ``like``'s context holding ``buffer`` (a copy)."""
    return mx.nd.array(buffers.to_numpy(buffer), ctx=like.context, dtype=like.dtype)


def _write_into(tensor: mx.nd.NDArray, buffer) -> mx.nd.NDArray:
    """Copy ``buffer`` into ``tensor`` and return ``tensor``."""
    tensor[:] = np.asarray(buffers.to_numpy(buffer), dtype=tensor.dtype)
    return tensor


def _reduce_op(op, average) -> ReduceOp:
    op = resolve_op(op, average)
    if op == ReduceOp.Adasum:
        raise ValueError("Adasum is not supported for MXNet (as in Horovod); use op=hvd.Average or hvd.Sum")
    return op


# ------------------------------------------------------------ allreduce
def start_allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set, op=None) -> Callable[[], mx.nd.NDArray]:
    """Submit an in-place allreduce of ``tensor`` and return a function that waits and writes the result in.

    Lets a caller submit many collectives before waiting on any (so the engine
    can fuse them); ``allreduce_`` is this followed by the wait.
    """
    handle = collectives.allreduce_async(_to_buffer(tensor, "allreduce_"), name, _reduce_op(op, average),
                                         prescale_factor, postscale_factor, process_set, in_place=True)
    return lambda: _write_into(tensor, collectives.synchronize(handle))


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None) -> mx.nd.NDArray:
    """Reduce ``tensor`` across the set (Average by default) into a new NDArray; ``tensor`` is unchanged."""
    source = _to_buffer(tensor, "allreduce")
    return _new_ndarray(collectives.allreduce_blocking(source, name, _reduce_op(op, average), prescale_factor,
                                                       postscale_factor, process_set, in_place=True), tensor)


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None) -> mx.nd.NDArray:
    """Reduce ``tensor`` across the set in place and return it."""
    return start_allreduce_(tensor, average, name, priority, prescale_factor, postscale_factor, process_set, op)()


def start_grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, op=None
                             ) -> Callable[[], list]:
    """Submit an in-place grouped allreduce; returns a function that waits and writes the results in."""
    tensors = list(tensors)
    sources = _to_buffers(tensors, "grouped_allreduce_")
    handle = collectives.grouped_allreduce_async(sources, name, _reduce_op(op, average), prescale_factor,
                                                 postscale_factor, process_set, in_place=True)
    return lambda: [_write_into(t, b) for t, b in zip(tensors, collectives.synchronize(handle))]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, op=None) -> list:
    """Reduce a list of NDArrays together; returns a list of new NDArrays (an empty list as it is)."""
    if not tensors:
        return tensors
    sources = _to_buffers(tensors, "grouped_allreduce")
    results = collectives.blocking(lambda: collectives.grouped_allreduce_async(
        sources, name, _reduce_op(op, average), prescale_factor, postscale_factor, process_set, in_place=True))
    return [_new_ndarray(b, t) for t, b in zip(tensors, results)]


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, op=None) -> list:
    """Reduce a list of NDArrays together, in place; returns ``tensors``."""
    if not tensors:
        return tensors
    start_grouped_allreduce_(tensors, average, name, priority, prescale_factor, postscale_factor,
                             process_set, op)()
    return tensors


# ------------------------------------------------------------ allgather
def allgather(tensor, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ) into a new NDArray."""
    source = _to_buffer(tensor, "allgather")
    return _new_ndarray(collectives.blocking(lambda: collectives.allgather_async(source, name, process_set)), tensor)


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set) -> list:
    """Allgather a list of NDArrays together; returns a list of new NDArrays."""
    sources = _to_buffers(tensors, "grouped_allgather")
    results = collectives.blocking(lambda: collectives.grouped_allgather_async(sources, name, process_set))
    return [_new_ndarray(b, t) for t, b in zip(tensors, results)]


# ------------------------------------------------------------ broadcast
def start_broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set
                     ) -> Callable[[], mx.nd.NDArray]:
    """Submit an in-place broadcast of ``tensor``; returns a function that waits and writes the result in."""
    handle = collectives.broadcast_async(_to_buffer(tensor, "broadcast_"), root_rank, name, process_set,
                                         in_place=True)
    return lambda: _write_into(tensor, collectives.synchronize(handle))


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """Return the root's ``tensor`` on every rank as a new NDArray (``root_rank`` is a global rank)."""
    source = _to_buffer(tensor, "broadcast")
    return _new_ndarray(collectives.blocking(lambda: collectives.broadcast_async(source, root_rank, name, process_set,
                                                                                 in_place=True)), tensor)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """Overwrite ``tensor`` with the root's copy, in place, and return it."""
    return start_broadcast_(tensor, root_rank, name, priority, process_set)()


# ------------------------------------------------------------ alltoall
def _split_counts(splits) -> list | None:
    if splits is None:
        return None
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    return [int(s) for s in np.asarray(splits).reshape(-1)]


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` to rank j of the set (an even split without ``splits``).

    Returns the received rows as a new NDArray, or, when ``splits`` is given
    (a list or an NDArray of integers), ``(received rows, received splits)``
    with the splits as an int32 NDArray on the CPU, as in Horovod.
    """
    counts = _split_counts(splits)
    handle = collectives.alltoall_async(_to_buffer(tensor, "alltoall"), counts, name, process_set)
    output, received = collectives.synchronize(handle)
    result = _new_ndarray(output, tensor)
    if splits is None:
        return result
    return result, mx.nd.array(received.numpy(), ctx=mx.cpu(), dtype="int32")


# ------------------------------------------------------------ reducescatter
def _scatter_op(op, tensors, what: str) -> ReduceOp:
    op = resolve_op(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"{what} supports op=hvd.Average or hvd.Sum, not {op.name} (as in Horovod)")
    if any(isinstance(t, mx.nd.NDArray) and t.shape == () for t in tensors):
        raise ValueError(f"{what} does not support scalar inputs; give tensors at least one dimension")
    return op


def reducescatter(tensor, op=ReduceOp.Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> mx.nd.NDArray:
    """Reduce ``tensor`` across the set and return this rank's slice of dimension 0 as a new NDArray.

    Ranks with a lower index get one extra row when the first dimension does not divide evenly.
    """
    op = _scatter_op(op, [tensor], "reducescatter")
    handle = collectives.reducescatter_async(_to_buffer(tensor, "reducescatter"), name, op, process_set,
                                             prescale_factor, postscale_factor)
    return _new_ndarray(collectives.synchronize(handle), tensor)


def grouped_reducescatter(tensors, op=ReduceOp.Average, name=None, priority=0, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0) -> list:
    """Reducescatter a list of NDArrays together; returns the list of this rank's slices (new NDArrays)."""
    op = _scatter_op(op, tensors, "grouped_reducescatter")
    handle = collectives.grouped_reducescatter_async(_to_buffers(tensors, "grouped_reducescatter"), name, op,
                                                     process_set, prescale_factor, postscale_factor)
    return [_new_ndarray(b, t) for t, b in zip(tensors, collectives.synchronize(handle))]
