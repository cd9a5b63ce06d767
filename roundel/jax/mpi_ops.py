"""Collectives on ``jax.Array``s and pytrees of them, eagerly and inside ``jax.jit``; differentiable.

The names and argument order are roundel.torch's (Horovod's). A pytree with
several leaves travels as one grouped (fused) collective, its leaves named
``<name>.<i>``; the result has the input's structure and dtypes. Requests,
naming and handles are :mod:`roundel.common.collectives`'; this module adds
JAX's conventions: pytrees, compression, ``jax.custom_vjp`` gradients (as
roundel.torch defines them) and staging into compiled code
(:mod:`roundel.jax.host_calls`).

Inside ``jax.jit`` every result shape must be known when tracing: allgather
needs the same first dimension on every rank, alltoall an even split (no
``splits=``); both say so when called otherwise. Unnamed collectives are
numbered when they run, in program order, so ranks must run the same
program. A jitted function that uses collectives bakes in the set's size
and this rank's place in it where shapes depend on them (allgather,
reducescatter): trace it again after an elastic reset. JAX arrays are
immutable, so there are no in-place forms (``allreduce_``, ``broadcast_``).
The ``*_async`` forms run eagerly only.
"""

from __future__ import annotations

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import torch

from roundel.common import basics, buffers, collectives
from roundel.common.collectives import poll
from roundel.common.process_sets import global_process_set
from roundel.jax import host_calls
from roundel.jax.compression import Compression
from roundel.ops import ReduceOp, resolve_op

__all__ = ["allgather", "allgather_async", "allreduce", "allreduce_async", "alltoall", "alltoall_async", "barrier",
           "broadcast", "broadcast_async", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
           "grouped_allreduce_async", "grouped_reducescatter", "grouped_reducescatter_async", "init", "join", "poll",
           "reducescatter", "reducescatter_async", "synchronize"]

_float0 = jax.dtypes.float0


def init(comm=None, process_sets=None) -> None:
    """Join the job, as ``roundel.common.basics.init`` (Horovod's ``hvd.init``).

    First gives torch one thread (:func:`roundel.common.buffers.use_one_packing_thread`):
    in a JAX process torch only moves the engine's buffers.
    """
    buffers.use_one_packing_thread()
    basics.init(comm, process_sets)


# ------------------------------------------------------------------ plumbing
def _flatten(tree, what: str):
    """(arrays, treedef) of a pytree of arrays, each checked for a supported dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [jnp.asarray(leaf) for leaf in leaves]
    for array in arrays:
        host_calls.check_dtype(array, what)
    return arrays, treedef


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _same_specs(arrays):
    return [_spec(a.shape, a.dtype) for a in arrays]


def _grad_name(name, part="grad"):
    """The backward collective's name: derived from a given forward name, else None (numbered)."""
    return None if name is None else f"{name}.{part}"


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _differentiable(forward, backward, arrays: list) -> list:
    """``forward(arrays)`` -> (outputs, residual), with ``backward(residual, cotangents)`` as its VJP.

    Integer inputs get zero (float0) cotangents; integer outputs' cotangents
    reach ``backward`` as zeros of the output's dtype. Concrete arrays are not
    being differentiated, so they skip the ``custom_vjp`` machinery (a third of
    a small eager call's time).
    """
    if not host_calls.is_traced(arrays):
        return forward(list(arrays))[0]
    shapes: dict = {}

    @jax.custom_vjp
    def op(xs):
        return forward(xs)[0]

    def fwd(xs):
        outputs, residual = forward(xs)
        shapes["in"] = [(x.shape, x.dtype) for x in xs]
        shapes["out"] = [(o.shape, o.dtype) for o in outputs]
        return outputs, residual

    def bwd(residual, cts):
        cts = [jnp.zeros(shape, dtype) if ct.dtype == _float0 else ct
               for ct, (shape, dtype) in zip(cts, shapes["out"])]
        grads = backward(residual, cts)
        return ([g if _is_float(dtype) else np.zeros(shape, _float0)
                 for g, (shape, dtype) in zip(grads, shapes["in"])],)

    op.defvjp(fwd, bwd)
    return op(list(arrays))


def _wait_all(handles) -> list:
    return [collectives.synchronize(h) for h in handles]


# ------------------------------------------------------------------ allreduce
def _allreduce_host(name, op, pre, post, process_set):
    def host(arrays):
        buffers = [host_calls.to_buffer(a) for a in arrays]
        if len(buffers) == 1:
            results = [collectives.allreduce_blocking(buffers[0], name, op, pre, post, process_set)]
        else:
            results = collectives.blocking(lambda: collectives.grouped_allreduce_async(buffers, name, op, pre, post,
                                                                                       process_set))
        return results

    return host


def _allreduce_list(arrays, name, op, pre, post, process_set) -> list:
    def forward(xs):
        return host_calls.run(_allreduce_host(name, op, pre, post, process_set), xs, _same_specs), None

    def backward(_, cts):
        # Horovod's definition: the cotangent reduced with the same op and scale factors
        return host_calls.run(_allreduce_host(_grad_name(name), op, pre, post, process_set), cts, _same_specs)

    return _differentiable(forward, backward, arrays)


def _allreduce_tree(tree, name, compression, op, pre, post, process_set, what):
    arrays, treedef = _flatten(tree, what)
    if not arrays:
        return tree
    compressed = [compression.compress(a) for a in arrays]
    reduced = _allreduce_list([c[0] for c in compressed], name, op, float(pre), float(post), process_set)
    return treedef.unflatten([compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)])


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce an array (or every array of a pytree, fused) across the set, Average by default; differentiable."""
    return _allreduce_tree(tensor, name, compression, resolve_op(op, average), prescale_factor, postscale_factor,
                           process_set, "allreduce")


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """Reduce a list of arrays together (one fused request) and return the list of results; differentiable."""
    return list(_allreduce_tree(list(tensors), name, compression, resolve_op(op, average), prescale_factor,
                                postscale_factor, process_set, "grouped_allreduce"))


# ------------------------------------------------------------------ allgather
def _gathered_shape(shape, size: int, rows=None) -> tuple:
    if not shape:
        return (size,)
    return (rows if rows is not None else size * shape[0],) + tuple(shape[1:])


def _allgather_host(name, process_set, expected=None):
    """Allgather's host function; ``expected`` (staged only): the result shapes fixed at trace time."""
    def host(arrays):
        buffers = [host_calls.to_buffer(a) for a in arrays]
        if len(buffers) == 1:
            results = [collectives.blocking(lambda: collectives.allgather_async(buffers[0], name, process_set))]
        else:
            results = collectives.blocking(lambda: collectives.grouped_allgather_async(buffers, name, process_set))
        if expected is not None:
            for result, spec in zip(results, expected):
                if tuple(result.shape) != tuple(spec.shape):
                    raise ValueError(
                        f"allgather inside jax.jit gathered {tuple(result.shape)} where the traced program expects "
                        f"{tuple(spec.shape)}: inside jit every rank must pass the same first dimension. Call "
                        "hvd.allgather outside jit for first dimensions that differ between ranks")
        return results

    return host


def _gather(arrays, name, process_set, rows=None) -> list:
    """Allgather ``arrays`` now or staged; ``rows`` (staged): each result's first dimension, if not size x own."""
    size = process_set.size()
    specs = [_spec(_gathered_shape(a.shape, size, None if rows is None else rows[i]), a.dtype)
             for i, a in enumerate(arrays)]
    expected = specs if host_calls.is_traced(arrays) else None
    return host_calls.run(_allgather_host(name, process_set, expected), arrays, specs)


def _my_rows(shapes: list, gathered_cts: list, name, process_set) -> list:
    """This rank's rows of each gathered cotangent, reshaped to its input's shape."""
    first_dims = [shape[0] if shape else 1 for shape in shapes]
    me = process_set.rank()
    if host_calls.is_traced(gathered_cts):  # traced: the forward pass had equal first dimensions
        offsets = [me * d for d in first_dims]
    else:
        (dims,) = _gather([jnp.asarray(first_dims, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)],
                          _grad_name(name, "dims"), process_set)
        offsets = np.asarray(dims).reshape(-1, len(first_dims))[:me].sum(axis=0).tolist()
    return [jax.lax.dynamic_slice_in_dim(g, int(o), d, axis=0).reshape(shape)
            for g, o, d, shape in zip(gathered_cts, offsets, first_dims, shapes)]


def _allgather_list(arrays, name, process_set) -> list:
    shapes = [a.shape for a in arrays]

    def forward(xs):
        return _gather(xs, name, process_set), None

    def backward(_, cts):
        # Horovod's definition: every rank's cotangent averaged, then this rank's rows of it
        averaged = host_calls.run(_allreduce_host(_grad_name(name), ReduceOp.Average, 1.0, 1.0, process_set),
                                  cts, _same_specs)
        return _my_rows(shapes, averaged, name, process_set)

    return _differentiable(forward, backward, arrays)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's array along dimension 0 (each array of a pytree, fused); differentiable.

    Eagerly the first dimensions may differ between ranks; inside ``jax.jit`` they must be equal.
    """
    arrays, treedef = _flatten(tensor, "allgather")
    return treedef.unflatten(_allgather_list(arrays, name, process_set)) if arrays else tensor


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """Allgather a list of arrays together and return the list of results; differentiable."""
    arrays, _ = _flatten(list(tensors), "grouped_allgather")
    return _allgather_list(arrays, name, process_set) if arrays else []


# ------------------------------------------------------------------ broadcast
def _broadcast_host(root_rank, name, process_set):
    def host(arrays):
        names = [name] if len(arrays) == 1 else [None if name is None else f"{name}.{i}" for i in range(len(arrays))]
        with collectives.waited():  # waited for at once: this thread runs their replayed slot itself
            handles = [collectives.broadcast_async(host_calls.to_buffer(a), root_rank, n, process_set)
                       for a, n in zip(arrays, names)]
        return _wait_all(handles)

    return host


def _broadcast_list(arrays, root_rank, name, process_set) -> list:
    def forward(xs):
        return host_calls.run(_broadcast_host(root_rank, name, process_set), xs, _same_specs), None

    def backward(_, cts):
        # Horovod's definition: the root gets the average of every rank's cotangent, the others zeros
        averaged = host_calls.run(_allreduce_host(_grad_name(name), ReduceOp.Average, 1.0, 1.0, process_set),
                                  cts, _same_specs)
        return averaged if basics.rank() == root_rank else [jnp.zeros_like(g) for g in averaged]

    return _differentiable(forward, backward, arrays)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """The root's array (or pytree of arrays) on every rank; differentiable (the root gets the averaged gradient).

    ``root_rank`` is a global rank (a member of ``process_set``), as in Horovod.
    """
    arrays, treedef = _flatten(tensor, "broadcast")
    return treedef.unflatten(_broadcast_list(arrays, int(root_rank), name, process_set)) if arrays else tensor


# ------------------------------------------------------------------- alltoall
def _received_splits(received) -> torch.Tensor:
    return torch.as_tensor(np.asarray(received.numpy() if hasattr(received, "numpy") else received, dtype=np.int32))


def _alltoall_host(splits, name, process_set):
    def host(arrays):
        out, received = collectives.blocking(
            lambda: collectives.alltoall_async(host_calls.to_buffer(arrays[0]), splits, name, process_set))
        return [out, _received_splits(received)]

    return host


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` to rank j of the set; differentiable in ``tensor``.

    Returns the received array, or ``(received array, received splits)`` when
    ``splits`` is given, as Horovod does. Without ``splits`` the first
    dimension is divided evenly; inside ``jax.jit`` that is the only form
    (received sizes must be known when tracing).
    """
    x = jnp.asarray(tensor)
    host_calls.check_dtype(x, "alltoall")
    if splits is not None:
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    size = process_set.size()

    def specs(xs):
        if xs[0].ndim == 0:
            raise ValueError("alltoall needs an array with at least one dimension")
        return [_spec(xs[0].shape, xs[0].dtype), _spec((size,), jnp.int32)]

    def forward(xs):
        if splits is not None and host_calls.is_traced(xs):
            raise ValueError("alltoall with splits= inside jax.jit: the received rows are not known when tracing. "
                             "Call hvd.alltoall outside jit, or split evenly (no splits=)")
        out, received = host_calls.run(_alltoall_host(splits, name, process_set), xs, specs)
        return [out, received], received

    def backward(received, cts):
        back_splits = None if host_calls.is_traced(cts) else np.asarray(received).tolist()
        out, _ = host_calls.run(_alltoall_host(back_splits, _grad_name(name), process_set), cts[:1], specs)
        return [out]

    out, received = _differentiable(forward, backward, [x])
    return out if splits is None else (out, received)


# -------------------------------------------------------------- reducescatter
def _reducescatter_host(name, op, pre, post, process_set):
    def host(arrays):
        buffers = [host_calls.to_buffer(a) for a in arrays]
        if len(buffers) == 1:
            results = [collectives.blocking(lambda: collectives.reducescatter_async(buffers[0], name, op, process_set,
                                                                                    pre, post))]
        else:
            results = collectives.blocking(lambda: collectives.grouped_reducescatter_async(buffers, name, op,
                                                                                           process_set, pre, post))
        return results

    return host


def _scattered_rows(rows: int, process_set) -> int:
    """This rank's share of ``rows``: lower ranks of the set get one extra row when they do not divide evenly."""
    size, me = process_set.size(), process_set.rank()
    return rows // size + (1 if me < rows % size else 0)


def _reducescatter_list(arrays, name, op, pre, post, process_set) -> list:
    shapes = [a.shape for a in arrays]

    def specs(xs):
        if any(x.ndim == 0 for x in xs):
            raise ValueError("reducescatter needs arrays with at least one dimension")
        return [_spec((_scattered_rows(x.shape[0], process_set),) + tuple(x.shape[1:]), x.dtype) for x in xs]

    def forward(xs):
        return host_calls.run(_reducescatter_host(name, op, pre, post, process_set), xs, specs), None

    def backward(_, cts):
        # Horovod's definition: the allgathered cotangent, times the set size for Sum, times the scale factors
        scale = pre * post * (process_set.size() if op == ReduceOp.Sum else 1)
        scaled = [ct * scale if scale != 1.0 else ct for ct in cts]
        return _gather(scaled, _grad_name(name), process_set, rows=[s[0] for s in shapes])

    return _differentiable(forward, backward, arrays)


def _reducescatter_tree(tree, name, compression, op, process_set, pre, post, what):
    arrays, treedef = _flatten(tree, what)
    if not arrays:
        return tree
    compressed = [compression.compress(a) for a in arrays]
    reduced = _reducescatter_list([c[0] for c in compressed], name, resolve_op(op), float(pre), float(post),
                                  process_set)
    return treedef.unflatten([compression.decompress(r, c[1]) for r, c in zip(reduced, compressed)])


def reducescatter(tensor, name=None, compression=Compression.none, op=ReduceOp.Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce an array (or a pytree's arrays) and return this rank's slice of dimension 0; differentiable.

    Ranks with a lower index get one extra row when the first dimension does not divide evenly.
    """
    return _reducescatter_tree(tensor, name, compression, op, process_set, prescale_factor, postscale_factor,
                               "reducescatter")


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=ReduceOp.Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    """Reducescatter a list of arrays together and return the list of this rank's slices; differentiable."""
    return list(_reducescatter_tree(list(tensors), name, compression, op, process_set, prescale_factor,
                                    postscale_factor, "grouped_reducescatter"))


# ------------------------------------------------------------ barrier and join
def barrier(process_set=global_process_set) -> None:
    """Return once every rank of the set has called barrier; in compiled code, when the program reaches it
    (an ordered callback, like the collectives)."""
    def host():
        collectives.barrier(process_set)
        return np.int32(0)

    jax.experimental.io_callback(host, jax.ShapeDtypeStruct((), np.int32), ordered=True)


def join():
    """Wait until every rank has joined (Horovod's ``join``); returns the rank that joined last, an int
    eagerly and an int32 scalar in compiled code."""
    last = jax.experimental.io_callback(lambda: np.int32(collectives.join()), jax.ShapeDtypeStruct((), np.int32),
                                        ordered=True)
    return last if isinstance(last, jax.core.Tracer) else int(last)


# ------------------------------------------------------------ async forms
_finishers: dict = {}


def _start(kind: str, tree, submit, rebuild: bool = True):
    """Submit the arrays of ``tree`` with ``submit(buffers)`` -> handle; remember how to rebuild the result
    (unless ``rebuild`` is False: ``synchronize`` then converts what the engine returned)."""
    arrays, treedef = _flatten(tree, f"{kind}_async")
    if host_calls.is_traced(arrays):
        raise ValueError(f"{kind}_async returns a handle and runs eagerly only; inside jax.jit, grad or vmap use "
                         f"hvd.{kind}()")
    jax.effects_barrier()  # compiled code already dispatched submits its collectives first
    handle = submit([host_calls.to_buffer(a) for a in arrays])
    if rebuild:
            _finishers[handle] = lambda result: treedef.unflatten(
            [host_calls.to_jax(r) for r in (result if isinstance(result, list) else [result])])
    return handle


def synchronize(handle: int):
    """Wait for the collective behind ``handle`` and return its result as jax.Arrays (or raise its error)."""
    finish = _finishers.pop(handle, None)
    result = collectives.synchronize(handle)
    if finish is not None:
        return finish(result)
    if isinstance(result, tuple):  # alltoall: (received array, received splits)
        return host_calls.to_jax(result[0]), host_calls.to_jax(_received_splits(result[1]))
    return host_calls.to_jax(result)


def _one_or_group(single, grouped):
    return lambda buffers: single(buffers[0]) if len(buffers) == 1 else grouped(buffers)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing an array (or a pytree's arrays, fused); returns a handle for ``synchronize``."""
    op = resolve_op(op, average)
    return _start("allreduce", tensor, _one_or_group(
        lambda b: collectives.allreduce_async(b, name, op, prescale_factor, postscale_factor, process_set),
        lambda bs: collectives.grouped_allreduce_async(bs, name, op, prescale_factor, postscale_factor,
                                                       process_set)))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start reducing a list of arrays together; ``synchronize`` returns the list of results."""
    op = resolve_op(op, average)
    return _start("grouped_allreduce", list(tensors), lambda bs: collectives.grouped_allreduce_async(
        bs, name, op, prescale_factor, postscale_factor, process_set))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start allgathering an array (or a pytree's arrays); returns a handle for ``synchronize``."""
    return _start("allgather", tensor, _one_or_group(
        lambda b: collectives.allgather_async(b, name, process_set),
        lambda bs: collectives.grouped_allgather_async(bs, name, process_set)))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start allgathering a list of arrays together; ``synchronize`` returns the list of results."""
    return _start("grouped_allgather", list(tensors),
                  lambda bs: collectives.grouped_allgather_async(bs, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying the root's array to every rank; returns a handle for ``synchronize``."""
    arrays, _ = _flatten(tensor, "broadcast_async")
    if len(arrays) != 1:
        raise ValueError(f"broadcast_async takes one array, got a pytree of {len(arrays)}; use hvd.broadcast for "
                         "pytrees")
    return _start("broadcast", tensor, lambda bs: collectives.broadcast_async(bs[0], root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(received array, received splits)``, as in Horovod."""
    arrays, _ = _flatten(tensor, "alltoall_async")
    if len(arrays) != 1:
        raise ValueError(f"alltoall_async takes one array, got a pytree of {len(arrays)}")
    return _start("alltoall", tensor, lambda bs: collectives.alltoall_async(
        bs[0], None if splits is None else [int(s) for s in np.asarray(splits).reshape(-1)], name, process_set),
        rebuild=False)


def reducescatter_async(tensor, name=None, op=ReduceOp.Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducescattering an array (or a pytree's arrays); returns a handle for ``synchronize``."""
    op = resolve_op(op)
    return _start("reducescatter", tensor, _one_or_group(
        lambda b: collectives.reducescatter_async(b, name, op, process_set, prescale_factor, postscale_factor),
        lambda bs: collectives.grouped_reducescatter_async(bs, name, op, process_set, prescale_factor,
                                                           postscale_factor)))


def grouped_reducescatter_async(tensors, name=None, op=ReduceOp.Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Start reducescattering a list of arrays; ``synchronize`` returns the list of this rank's slices."""
    op = resolve_op(op)
    return _start("grouped_reducescatter", list(tensors), lambda bs: collectives.grouped_reducescatter_async(
        bs, name, op, process_set, prescale_factor, postscale_factor))
