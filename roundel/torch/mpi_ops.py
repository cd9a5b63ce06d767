"""Collectives on torch tensors, with Horovod's names and signatures.

Every collective has an ``_async`` form that returns an integer handle for
``poll()``/``synchronize()``; the plain forms wait and, where Horovod does,
carry gradients through autograd.
"""

from __future__ import annotations

import itertools
import threading

import torch

from roundel.common import basics
from roundel.common.ops import ReduceOp, resolve_op
from roundel.common.process_sets import global_process_set
from roundel.common.requests import OpKind, Request
from roundel.torch.compression import Compression

_handles: dict[int, tuple[list, object]] = {}
_handles_lock = threading.Lock()
_counter = itertools.count()


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).split(".", 1)[1]


def _set_id(process_set) -> int:
    set_id = process_set.process_set_id
    if set_id is None:
        raise ValueError(f"{process_set!r} is not registered; call hvd.add_process_set() on every rank first")
    return set_id


def _submit(what: str, kind: OpKind, tensor: torch.Tensor, output, name, process_set,
            cacheable: bool | None = None, **fields):
    runtime = basics.runtime(what)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    set_id = _set_id(process_set)
    request = Request(
        name if name is not None else runtime.unnamed_name(kind.label, set_id), kind, set_id,
        dtype=_dtype_name(tensor), shape=tuple(tensor.shape), device=str(tensor.device),
        cacheable=name is not None if cacheable is None else cacheable, **fields)
    return runtime.engine.submit(request, tensor, output)


def _register(handle_id: int, handles: list, finish) -> int:
    with _handles_lock:
        _handles[handle_id] = (handles, finish)
    return handle_id


def _first(results):
    return results[0]


def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished; ``synchronize`` will not block."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return all(h.done() for h in entry[0])


def synchronize(handle: int):
    """Wait for the collective behind ``handle`` and return its result (or raise its error)."""
    with _handles_lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    handles, finish = entry
    return finish([h.wait() for h in handles])


# ------------------------------------------------------------------ allreduce
def _allreduce_problem(tensor: torch.Tensor, op: ReduceOp) -> str | None:
    if op == ReduceOp.Adasum and not tensor.dtype.is_floating_point:
        return f"Adasum needs floating-point tensors, not {tensor.dtype}"
    if tensor.dtype == torch.bool and op in (ReduceOp.Average,):
        return "Average is not defined for bool tensors; use op=hvd.Sum (logical or), Min, Max or Product"
    return None


def _allreduce_submit(tensor, output, name, op, prescale_factor, postscale_factor, process_set,
                      cacheable=None):
    return _submit("allreduce", OpKind.ALLREDUCE, tensor, output, name, process_set, cacheable,
                   reduce_op=int(op), prescale=float(prescale_factor), postscale=float(postscale_factor),
                   error=_allreduce_problem(tensor, op))


def _in_place_target(tensor: torch.Tensor):
    """The contiguous buffer an in-place op writes to, and how to finish into ``tensor``."""
    if tensor.is_contiguous():
        return tensor, _first
    buffer = tensor.contiguous()

    def finish(results):
        tensor.copy_(results[0])
        return tensor

    return buffer, finish


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` across the set into a new tensor; returns a handle."""
    op = resolve_op(op, average)
    handle_id = next(_counter)
    source = tensor.contiguous()
    handle = _allreduce_submit(source, torch.empty_like(source), name, op, prescale_factor,
                               postscale_factor, process_set)
    return _register(handle_id, [handle], _first)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place; returns a handle."""
    op = resolve_op(op, average)
    handle_id = next(_counter)
    target, finish = _in_place_target(tensor)
    handle = _allreduce_submit(target, target, name, op, prescale_factor, postscale_factor, process_set)
    return _register(handle_id, [handle], finish)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale_factor, postscale_factor,
                                           process_set))

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
    reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` in place across the set and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _group_names(name, count: int, kind: str, process_set) -> tuple[list, bool]:
    """Per-tensor names for a grouped op, and whether they are worth caching (user-given)."""
    base = name if name is not None else \
        basics.runtime(f"grouped_{kind}").unnamed_name(f"grouped_{kind}", _set_id(process_set))
    return [f"{base}.{i}" for i in range(count)], name is not None


def _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                             in_place: bool) -> int:
    op = resolve_op(op, average)
    handle_id = next(_counter)
    names, named = _group_names(name, len(tensors), "allreduce", process_set)
    handles, finishers = [], []
    for tensor, sub_name in zip(tensors, names):
        if in_place:
            target, finish = _in_place_target(tensor)
            output = target
        else:
            target, finish = tensor.contiguous(), _first
            output = torch.empty_like(target)
        handles.append(_allreduce_submit(target, output, sub_name, op, prescale_factor, postscale_factor,
                                         process_set, named))
        finishers.append(finish)
    return _register(handle_id, handles, lambda results: [f([r]) for f, r in zip(finishers, results)])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors together; ``synchronize`` returns the list of results."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set, in_place=False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start reducing a list of tensors in place; returns one handle for the group."""
    return _grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set, in_place=True)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, prescale_factor,
                                                         postscale_factor, process_set)))

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
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[c[0] for c in compressed])
    return [compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce a list of tensors in place and return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


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
def _allgather_submit(tensor, name, process_set, cacheable=None):
    source = tensor.contiguous()
    if source.dim() == 0:
        source = source.reshape(1)
    return _submit("allgather", OpKind.ALLGATHER, source, None, name, process_set, cacheable)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0; returns a handle."""
    handle_id = next(_counter)
    return _register(handle_id, [_allgather_submit(tensor, name, process_set)], _first)


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
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's definition: the average of every rank's gradient, this rank's rows of it
        (grad,) = _gathered_grads([grad_output], [ctx.shape], ctx.process_set)
        return grad, None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering a list of tensors together; ``synchronize`` returns the list of results."""
    handle_id = next(_counter)
    names, named = _group_names(name, len(tensors), "allgather", process_set)
    handles = [_allgather_submit(t, n, process_set, named) for t, n in zip(tensors, names)]
    return _register(handle_id, handles, list)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_gathered_grads(grads, ctx.shapes, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list of tensors together and return the list of results; differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ------------------------------------------------------------------ broadcast
def _broadcast_submit(tensor, output, root_rank, name, process_set):
    return _submit("broadcast", OpKind.BROADCAST, tensor, output, name, process_set,
                   root_rank=int(root_rank))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying the root's ``tensor`` to every rank into a new tensor; returns a handle.

    ``root_rank`` is a global rank (a member of ``process_set``), as in Horovod.
    """
    handle_id = next(_counter)
    source = tensor.contiguous()
    handle = _broadcast_submit(source, torch.empty_like(source), root_rank, name, process_set)
    return _register(handle_id, [handle], _first)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start overwriting ``tensor`` with the root's copy, in place; returns a handle."""
    handle_id = next(_counter)
    target, finish = _in_place_target(tensor)
    return _register(handle_id, [_broadcast_submit(target, target, root_rank, name, process_set)],
                     finish)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # Horovod's definition: the root gets the average of every rank's gradient, the others zeros
        grad = synchronize(allreduce_async(grad_output, op=ReduceOp.Average, process_set=ctx.process_set))
        if basics.rank() != ctx.root_rank:  # root_rank is a global rank, as in Horovod
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return the root's ``tensor`` on every rank; differentiable (the root gets the averaged gradient)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with the root's copy, in place, and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------- alltoall
def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank j of the set; returns a handle.

    ``synchronize`` returns ``(received tensor, received splits)``, with or
    without ``splits``, as in Horovod. Without ``splits`` the first dimension
    is divided evenly.
    """
    handle_id = next(_counter)
    members = basics.runtime("alltoall").process_sets.get(_set_id(process_set), ((),))[0]
    source = tensor.contiguous()
    error = None
    if source.dim() == 0:
        error = "alltoall needs a tensor with at least one dimension"
        split_list = (0,) * len(members)
    elif splits is None:
        if source.shape[0] % len(members):
            error = (f"alltoall without splits needs the first dimension ({source.shape[0]}) to divide "
                     f"evenly among {len(members)} ranks; pass splits=")
        split_list = (source.shape[0] // len(members),) * len(members)
    else:
        split_list = tuple(int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits))
        if any(s < 0 for s in split_list) or sum(split_list) != source.shape[0]:
            error = (f"alltoall splits {list(split_list)} must be non-negative and sum to the first "
                     f"dimension of the tensor ({source.shape[0]})")
    handle = _submit("alltoall", OpKind.ALLTOALL, source, None, name, process_set,
                     splits=split_list, error=error)
    return _register(handle_id, [handle], _first)


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
def _reducescatter_submit(tensor, name, op, prescale_factor, postscale_factor, process_set,
                          cacheable=None):
    error = _allreduce_problem(tensor, op) if op != ReduceOp.Adasum else "reducescatter does not support Adasum"
    return _submit("reducescatter", OpKind.REDUCESCATTER, tensor.contiguous(), None, name, process_set,
                   cacheable, reduce_op=int(op), prescale=float(prescale_factor),
                   postscale=float(postscale_factor), error=error)


def reducescatter_async(tensor, name=None, op=ReduceOp.Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and keeping this rank's slice of dimension 0; returns a handle."""
    op = resolve_op(op)
    handle_id = next(_counter)
    handle = _reducescatter_submit(tensor, name, op, prescale_factor, postscale_factor, process_set)
    return _register(handle_id, [handle], _first)


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
    op = resolve_op(op)
    handle_id = next(_counter)
    names, named = _group_names(name, len(tensors), "reducescatter", process_set)
    handles = [_reducescatter_submit(t, n, op, prescale_factor, postscale_factor, process_set, named)
               for t, n in zip(tensors, names)]
    return _register(handle_id, handles, list)


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


# ------------------------------------------------------------ barrier and join
_barrier_counts: dict[tuple[str, int], int] = {}  # (runtime prefix, set id) -> barriers called


def barrier(process_set=global_process_set) -> None:
    """Return once every rank of the set has called barrier."""
    runtime = basics.runtime("barrier")
    set_id = _set_id(process_set)
    # Numbered per set (not by the global handle counter), so that the members agree on the name
    # even when they ran different numbers of other collectives, e.g. on other process sets.
    key = (runtime.prefix, set_id)
    with _handles_lock:
        count = _barrier_counts[key] = _barrier_counts.get(key, 0) + 1
    request = Request(f"__barrier__.{count}", OpKind.BARRIER, set_id, cacheable=False)
    runtime.engine.submit(request, None, None).wait()


def join(device=-1) -> int:
    """Declare that this rank has no more data; returns the last rank to join.

    Until every rank has joined, the others' allreduces go on with this rank
    contributing zeros (and empty rows to allgathers).
    """
    from roundel.common.negotiation import JOIN_NAME
    request = Request(JOIN_NAME, OpKind.JOIN, 0, cacheable=False)
    return basics.runtime("join").engine.submit(request, None, None).wait()
