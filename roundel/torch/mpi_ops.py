"""Collectives on torch tensors, with Horovod's names and signatures.

Every collective has an ``_async`` form that returns an integer handle for
``poll()``/``synchronize()``; the plain forms wait and, where Horovod does,
carry gradients through autograd. Requests, naming and handles are
:mod:`roundel.common.collectives`'; this module adds Horovod's argument
conventions, compression and autograd.
"""

from __future__ import annotations

import torch

from roundel.common import basics, collectives
from roundel.common.collectives import barrier, join, poll, synchronize
from roundel.common.process_sets import global_process_set
from roundel.ops import ReduceOp, resolve_op
from roundel.torch.compression import Compression

__all__ = ["allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
           "broadcast_async_", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
           "grouped_reducescatter_async", "join", "poll", "reducescatter", "reducescatter_async",
           "sparse_allreduce_async", "synchronize"]


def _in_graph(tensors) -> bool:
    """Whether a differentiable collective of ``tensors`` joins autograd's graph: otherwise it skips
    ``torch.autograd.Function`` (whose bookkeeping is a good part of a small blocking call's cost)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# ------------------------------------------------------------------ allreduce
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` across the set into a new tensor; returns a handle."""
    return collectives.allreduce_async(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                                       process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place; returns a handle."""
    return collectives.allreduce_async(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                                       process_set, in_place=True)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        with collectives.waited():
            handle = allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale_factor, postscale_factor, process_set = ctx.args
        grad = synchronize(allreduce_async(grad_output, None, None, op, prescale_factor, postscale_factor,
                                           process_set))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across the set (Average by default) and return the result; differentiable."""
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    if _in_graph([compressed]):
        reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:
        reduced = collectives.allreduce_blocking(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` in place across the set and return it."""
    return collectives.allreduce_blocking(tensor, name, resolve_op(op, average), prescale_factor, postscale_factor,
                                          process_set, in_place=True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors together; ``synchronize`` returns the list of results."""
    return collectives.grouped_allreduce_async(tensors, name, resolve_op(op, average), prescale_factor,
                                               postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors in place; returns one handle for the group."""
    return collectives.grouped_allreduce_async(tensors, name, resolve_op(op, average), prescale_factor,
                                               postscale_factor, process_set, in_place=True)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        with collectives.waited():
            handle = grouped_allreduce_async(list(tensors), None, name, op, prescale_factor, postscale_factor,
                                             process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale_factor, postscale_factor, process_set = ctx.args
        reduced = synchronize(grouped_allreduce_async(list(grads), None, None, op, prescale_factor,
                                                      postscale_factor, process_set))
        return (None, None, None, None, None) + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors together and return the list of results; differentiable."""
    op = resolve_op(op, average)
    compressed = [compression.compress(t) for t in tensors]
    sent = [c[0] for c in compressed]
    if _in_graph(sent):
        reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set, *sent)
    else:
        reduced = collectives.blocking(lambda: grouped_allreduce_async(sent, None, name, op, prescale_factor,
                                                                       postscale_factor, process_set))
    return [compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce a list of tensors in place and return them."""
    with collectives.waited():
        handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                          process_set)
    return synchronize(handle)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing a sparse COO ``tensor`` across the set by allgathering its indices and values.

    Returns a function (not an integer handle, as in Horovod) that waits and
    returns the reduced sparse tensor: every rank's entries, summed where
    indices repeat, divided by the set size for ``op=Average``.
    """
    op = resolve_op(op)
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async expects a sparse COO torch.Tensor; use allreduce_async for "
                        "dense tensors")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, not {op.name}")
    source = tensor.coalesce()
    indices = allgather_async(source.indices().t().contiguous(), name=None if name is None else f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(source.values(), name=None if name is None else f"{name}.values",
                             process_set=process_set)

    def wait():
        gathered = synchronize(values)
        if op == ReduceOp.Average:
            gathered = gathered / process_set.size()
        return torch.sparse_coo_tensor(synchronize(indices).t(), gathered, source.shape).coalesce()

    return wait


# ------------------------------------------------------------------ allgather
def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0; returns a handle."""
    return collectives.allgather_async(tensor, name, process_set)


def _gathered_grads(grads, shapes: list, process_set) -> list:
    """The gradients of allgathered tensors of ``shapes``: each averaged over the set, then this rank's rows."""
    first_dims = [shape[0] if shape else 1 for shape in shapes]
    averaged = synchronize(grouped_allreduce_async([g.contiguous() for g in grads], op=ReduceOp.Average,
                                                   process_set=process_set))
    dims = synchronize(allgather_async(torch.tensor(first_dims, dtype=torch.int64), process_set=process_set))
    offsets = dims.view(-1, len(first_dims))[:process_set.rank()].sum(dim=0).tolist()
    return [g.narrow(0, int(o), d).reshape(shape) for g, o, d, shape in zip(averaged, offsets, first_dims, shapes)]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape = tensor.shape
        ctx.process_set = process_set
        with collectives.waited():
            handle = allgather_async(tensor, name, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's definition: the average of every rank's gradient, this rank's rows of it
        (grad,) = _gathered_grads([grad_output], [ctx.shape], ctx.process_set)
        return grad, None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ); differentiable."""
    if _in_graph([tensor]):
        return _Allgather.apply(tensor, name, process_set)
    return collectives.blocking(lambda: allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering a list of tensors together; ``synchronize`` returns the list of results."""
    return collectives.grouped_allgather_async(tensors, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        with collectives.waited():
            handle = grouped_allgather_async(list(tensors), name, process_set)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_gathered_grads(grads, ctx.shapes, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors together and return the list of results; differentiable."""
    tensors = list(tensors)
    if _in_graph(tensors):
        return list(_GroupedAllgather.apply(name, process_set, *tensors))
    return list(collectives.blocking(lambda: grouped_allgather_async(tensors, name, process_set)))


# ------------------------------------------------------------------ broadcast
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying the root's ``tensor`` to every rank into a new tensor; returns a handle.

    ``root_rank`` is a global rank (a member of ``process_set``), as in Horovod.
    """
    return collectives.broadcast_async(tensor, root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting ``tensor`` with the root's copy, in place; returns a handle."""
    return collectives.broadcast_async(tensor, root_rank, name, process_set, in_place=True)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        with collectives.waited():
            handle = broadcast_async(tensor, root_rank, name, process_set)
        return synchronize(handle)

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's definition: the root gets the average of every rank's gradient, the others zeros
        grad = synchronize(allreduce_async(grad_output, op=ReduceOp.Average, process_set=ctx.process_set))
        if basics.rank() != ctx.root_rank:  # root_rank is a global rank, as in Horovod
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return the root's ``tensor`` on every rank; differentiable (the root gets the averaged gradient)."""
    if _in_graph([tensor]):
        return _Broadcast.apply(tensor, root_rank, name, process_set)
    return collectives.blocking(lambda: broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with the root's copy, in place, and return it."""
    with collectives.waited():
        handle = broadcast_async_(tensor, root_rank, name, process_set)
    return synchronize(handle)


# ------------------------------------------------------------------- alltoall
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank j of the set; returns a handle.

    ``synchronize`` returns ``(received tensor, received splits)``, with or
    without ``splits``, as in Horovod. Without ``splits`` the first dimension
    is divided evenly.
    """
    return collectives.alltoall_async(tensor, splits, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        ctx.process_set = process_set
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_grad_splits):
        grad, _ = synchronize(alltoall_async(grad_output.contiguous(), ctx.received, None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Exchange rows with every rank of the set; differentiable.

    Returns the received tensor, or ``(received tensor, received splits)``
    when ``splits`` is given, as Horovod does.
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# -------------------------------------------------------------- reducescatter
def reducescatter_async(tensor, name=None, op=ReduceOp.Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and keeping this rank's slice of dimension 0; returns a handle."""
    return collectives.reducescatter_async(tensor, name, resolve_op(op), process_set, prescale_factor,
                                           postscale_factor)


def _scattered_grad(grad, op, process_set, prescale_factor, postscale_factor):
    """Horovod's gradient of reducescatter: the allgathered output gradient, times the set size for Sum,
    times the scale factors (so Average passes it on unscaled)."""
    scale = prescale_factor * postscale_factor * (process_set.size() if op == ReduceOp.Sum else 1)
    return grad * scale if scale != 1.0 else grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        op, process_set, pre, post = ctx.args
        grad = synchronize(allgather_async(_scattered_grad(grad_output, op, process_set, pre, post),
                                           process_set=process_set))
        return grad, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=ReduceOp.Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across the set and return this rank's slice of dimension 0; differentiable.

    Ranks with a lower index get one extra row when the first dimension does not divide evenly.
    """
    compressed, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(compressed, name, resolve_op(op), process_set, prescale_factor,
                                   postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors, name=None, op=ReduceOp.Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducescattering a list of tensors; ``synchronize`` returns the list of slices."""
    return collectives.grouped_reducescatter_async(tensors, name, resolve_op(op), process_set, prescale_factor,
                                                   postscale_factor)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(grouped_reducescatter_async(list(tensors), name, op, process_set,
                                                             prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        scaled = [_scattered_grad(g, op, process_set, pre, post).contiguous() for g in grads]
        gathered = synchronize(grouped_allgather_async(scaled, process_set=process_set))
        return (None, None, None, None, None) + tuple(gathered)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=ReduceOp.Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter a list of tensors and return the list of this rank's slices; differentiable."""
    compressed = [compression.compress(t) for t in tensors]
    reduced = _GroupedReducescatter.apply(name, resolve_op(op), process_set, prescale_factor, postscale_factor,
                                          *[c[0] for c in compressed])
    return [compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)]
