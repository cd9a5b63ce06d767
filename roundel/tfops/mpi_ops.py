"""Collectives on TensorFlow tensors, eagerly and inside ``tf.function``.

Each collective hands its inputs to the engine as buffers
(:mod:`roundel.common.buffers`), submits them through
:mod:`roundel.common.collectives` and converts the results back. Nothing here
talks to the other ranks itself. Eagerly, inputs and results cross over
DLPack without a copy: the engine only reads a TensorFlow tensor's memory and
writes the result into a buffer of its own, which becomes the result tensor
(one copy in all, the engine's; through ``Tensor.numpy()`` and
``tf.convert_to_tensor`` there would be three). Inside ``tf.function`` the
values are NumPy copies (see below).

Eagerly, a collective submits and waits in place. Inside a ``tf.function``
each collective becomes two ``tf.numpy_function`` ops:

* a stateful *submit* op that hands the tensor to the engine and returns a
  handle at once (TensorFlow keeps stateful ops in program order), and
* a stateless *wait* op that blocks until the engine has the result.

Inside a ``tf.function`` every wait op is made to run after every submit op
of that function that does not itself depend on the wait (control edges added
while tracing). So a rank submits all the collectives of a step before it
blocks on any, and ranks whose executors reach the ops in different orders
still match them by name; a blocked wait never holds the inter-op thread
another submit needs. A ``tf.compat.v1`` graph gets no such edges: there each
``Session.run`` evaluates a part of the graph of its own choosing, and it must
submit exactly the collectives it evaluates. A wait blocks one of the
session's inter-op threads, so a run of more collectives than threads could
leave a rank's remaining submits queued behind its blocked waits while the
other ranks wait for those: unless the user set ``TF_NUM_INTEROP_THREADS``,
importing this module sets it to at least 64 (TensorFlow reads it when it
makes its thread pool, for sessions whose config leaves
``inter_op_parallelism_threads`` at 0; eager execution uses it too).

Mismatches inside a graph reach the user as ``FailedPreconditionError`` as
eagerly (see ``roundel.tfops.tf_errors`` for how).

Names: a ``name=`` you pass is used as is. Inside ``tf.function`` a missing
name is derived from the function's name and the input tensor's graph name
(stable across ranks that trace the same code); eagerly a missing name comes
from a counter per op kind and process set that every ``init()`` restarts, so
ranks must then call collectives in the same order (as in Horovod).

Signatures follow Horovod 0.28.1's positional order; ``ignore_name_scope``
is accepted wherever Horovod has it and has no effect (names never include
TensorFlow name scopes here). Mismatched collectives raise Horovod's
TensorFlow error types (see ``roundel.tfops.tf_errors``).
"""

from __future__ import annotations

import os
import re

import numpy as np
import tensorflow as tf
import torch
import torch.utils.dlpack

from roundel.common import basics, buffers, collectives
from roundel.common.process_sets import global_process_set
from roundel.errors import CollectiveDeadlockError, CollectiveMismatchError
from roundel.ops import ReduceOp, resolve_op
from roundel.tfops import tf_errors
from roundel.tfops.compression import Compression

tf_errors.install_graph_errors()
_INTEROP_THREADS = max(64, os.cpu_count() or 1)
os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(_INTEROP_THREADS))  # see the module notes

_do_not_convert = tf.autograph.experimental.do_not_convert

_BF16 = tf.bfloat16.as_numpy_dtype
_SUPPORTED = (tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32,
              tf.float64, tf.bool)


# ------------------------------------------------------------ conversions
@_do_not_convert
def to_buffer(array):
    """The engine's buffer sharing memory with ``array`` where possible (see roundel.common.buffers)."""
    return buffers.from_numpy(array)


@_do_not_convert
def to_numpy(buffer) -> np.ndarray:
    """The NumPy view of an engine buffer (bfloat16 as TensorFlow's NumPy bfloat16)."""
    return buffers.to_numpy(buffer, bfloat16=_BF16)


@_do_not_convert
def _shared_numpy(tensor) -> np.ndarray:
    """A NumPy view of an eager CPU tensor's own memory (DLPack); for reading only."""
    return to_numpy(torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor)))


@_do_not_convert
def _as_tensor(array: np.ndarray, dtype):
    """``array`` (an engine result, not used elsewhere) as a tensor of ``dtype``, sharing its memory."""
    if array.dtype != dtype.as_numpy_dtype:
        return tf.convert_to_tensor(array, dtype=dtype)
    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(buffers.from_numpy(array)))


@_do_not_convert
def _check_dtype(tensor, what: str) -> None:
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(d.name for d in _SUPPORTED)
        raise TypeError(f"{what}: dtype {tensor.dtype.name} is not supported; use one of {names}")


def init(comm=None, process_sets=None) -> None:
    """Join the job, as ``roundel.common.basics.init`` (Horovod's ``hvd.init``).

    First gives torch one thread (:func:`roundel.common.buffers.use_one_packing_thread`):
    in a TensorFlow process torch only moves the engine's buffers.
    """
    buffers.use_one_packing_thread()
    basics.init(comm, process_sets)


# ------------------------------------------------------------ graph mode
_UID_SUFFIX = re.compile(r"_\d+$")


class _GraphState:
    """What the collectives traced into one graph so far need to know about each other."""

    def __init__(self):
        self.submits: list = []
        self.waits: list = []
        self.names: dict[str, int] = {}


@_do_not_convert
def _graph_state(graph) -> _GraphState:
    state = getattr(graph, "_roundel_state", None)
    if state is None:
        state = _GraphState()
        graph._roundel_state = state
    return state


@_do_not_convert
def _graph_name(graph, kind: str, name, tensor) -> str:
    """A name for a collective traced into ``graph``: the same on every rank that traces the same code."""
    if name is None:
        base = _UID_SUFFIX.sub("", getattr(graph, "name", "") or "graph")
        name = f"{kind}.{base}/{tensor.name if tensor is not None else 'none'}"
    state = _graph_state(graph)
    count = state.names.get(name, 0)
    state.names[name] = count + 1
    return name if count == 0 else f"{name}#{count}"


@_do_not_convert
def _ancestors(op) -> set:
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@_do_not_convert
def _has_stateful_descendant(op) -> bool:
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        children = [c for t in current.outputs for c in t.consumers()] + list(current._control_outputs)
        for child in children:
            if child in seen:
                continue
            if child._is_stateful:
                return True
            seen.add(child)
            stack.append(child)
    return False


@_do_not_convert
def _order(graph, submit_op, wait_op) -> None:
    """Make waits of ``graph`` run after submits that do not depend on them (see the module notes)."""
    state = _graph_state(graph)
    ancestors = _ancestors(submit_op)
    for earlier_wait in state.waits:
        if earlier_wait not in ancestors and not _has_stateful_descendant(earlier_wait):
            earlier_wait._add_control_input(submit_op)
    for earlier_submit in state.submits:
        wait_op._add_control_input(earlier_submit)
    state.submits.append(submit_op)
    state.waits.append(wait_op)


@_do_not_convert
def _collective(kind: str, inputs: list, name, submit, finish, out_dtypes: list, out_shapes: list):
    """Run one collective on ``inputs`` (tf tensors); returns the list of output tensors.

    ``submit(arrays, name, own)`` hands NumPy arrays to the engine and returns a
    roundel.common.collectives handle; ``own`` says the arrays are private
    copies the collective may overwrite (inside ``tf.function``), not views of
    the caller's tensors. ``finish(result)`` turns what ``synchronize``
    returned into a list of NumPy arrays.
    """
    if tf.executing_eagerly():
        try:
            shared = [_shared_numpy(t) for t in inputs]
            arrays = finish(collectives.blocking(lambda: submit(shared, name, False)))
        except CollectiveMismatchError as error:
            raise tf_errors.translate(kind, error) from error
        return [_as_tensor(a, d) for a, d in zip(arrays, out_dtypes)]

    graph = tf.compat.v1.get_default_graph()
    op_name = _graph_name(graph, kind, name, inputs[0] if inputs else None)

    def submit_np(*arrays):
        # Copies: the engine reads the inputs after this op has returned.
        return np.int64(submit([np.array(a, copy=True) for a in arrays], op_name, True))

    v1_graph = not getattr(graph, "building_function", False)

    def wait_np(handle):
        try:
            arrays = finish(collectives.synchronize(int(handle)))
        except CollectiveDeadlockError as error:
            if not v1_graph:
                raise
            raise CollectiveDeadlockError(
                f"{error} (in a tf.compat.v1 graph each waiting collective holds one of the session's inter-op "
                "threads: if the ranks run the same graph, give the session more inter_op_parallelism_threads "
                "than the collectives one Session.run evaluates)") from error
        except CollectiveMismatchError as error:
            raise tf_errors.graph_error(kind, error) from error
        return [np.asarray(a, dtype=d.as_numpy_dtype) for a, d in zip(arrays, out_dtypes)]

    safe = re.sub(r"[^A-Za-z0-9_.\-/]", "_", kind)
    handle = tf.numpy_function(submit_np, list(inputs), tf.int64, stateful=True, name=f"Roundel{safe}Submit")
    outputs = tf.numpy_function(wait_np, [handle], list(out_dtypes), stateful=False,
                                name=f"Roundel{safe}Wait")
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = list(outputs)
    if getattr(graph, "building_function", False):  # tf.function; a v1 graph gets no edges (see the module notes)
        _order(graph, handle.op, outputs[0].op)
    for out, shape in zip(outputs, out_shapes):
        out.set_shape(shape)
    return outputs


@_do_not_convert
def _blocking(kind: str, fn, out_dtype):
    """A collective that only blocks (barrier, join): one stateful op in graph mode."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(), dtype=out_dtype)
    return tf.numpy_function(lambda: np.asarray(fn(), dtype=out_dtype.as_numpy_dtype), [], out_dtype,
                             stateful=True, name=f"Roundel{kind}")


# ------------------------------------------------------------ allreduce
def _grad_name(name, part="grad"):
    """The backward collective's name: derived from a given forward name, else None (auto)."""
    return None if name is None else f"{name}.{part}"


@_do_not_convert
def _first_np(result):
    return [to_numpy(result)]


@_do_not_convert
def _list_np(result):
    return [to_numpy(r) for r in result]


@_do_not_convert
def _dense_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set):
    @tf.custom_gradient
    def run(x):
        def submit(arrays, nm, own):
            return collectives.allreduce_async(to_buffer(arrays[0]), name=nm, op=op, prescale_factor=prescale_factor,
                                               postscale_factor=postscale_factor, process_set=process_set,
                                               in_place=own)

        (out,) = _collective("allreduce", [x], name, submit, _first_np, [x.dtype], [x.shape])

        def grad(dy):
            return _dense_allreduce(tf.convert_to_tensor(dy), _grad_name(name), op, prescale_factor,
                                    postscale_factor, process_set)

        return out, grad

    return run(tensor)


@_do_not_convert
def _allreduce(tensor, name=None, op=ReduceOp.Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set):
    """Reduce a dense tensor across the set without compression (Horovod's low-level ``_allreduce``)."""
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "allreduce")
    return _dense_allreduce(tensor, name, resolve_op(op), float(prescale_factor), float(postscale_factor),
                            process_set)


@_do_not_convert
def _dense_grouped_allreduce(tensors, name, op, prescale_factor, postscale_factor, process_set):
    @tf.custom_gradient
    def run(*xs):
        def submit(arrays, nm, own):
            return collectives.grouped_allreduce_async([to_buffer(a) for a in arrays], name=nm, op=op,
                                                       prescale_factor=prescale_factor,
                                                       postscale_factor=postscale_factor, process_set=process_set,
                                                       in_place=own)

        outs = _collective("grouped_allreduce", list(xs), name, submit, _list_np, [x.dtype for x in xs],
                           [x.shape for x in xs])

        def grad(*dys):
            return _dense_grouped_allreduce([tf.convert_to_tensor(d) for d in dys], _grad_name(name), op,
                                            prescale_factor, postscale_factor, process_set)

        return outs, grad

    return run(*tensors)


@_do_not_convert
def _sparse_allreduce(slices: tf.IndexedSlices, name, op, prescale_factor, postscale_factor, process_set):
    if op == ReduceOp.Adasum:
        raise NotImplementedError("Adasum does not support tf.IndexedSlices; pass sparse_as_dense=True to "
                                  "DistributedOptimizer (or convert to a dense tensor)")
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise NotImplementedError("allreduce of tf.IndexedSlices supports only op=Average and op=Sum; "
                                  "pass sparse_as_dense=True (or convert to a dense tensor) for other ops")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor and postscale_factor are not supported with tf.IndexedSlices")
    values = allgather(slices.values, name=None if name is None else f"{name}.values", process_set=process_set)
    indices = allgather(slices.indices, name=None if name is None else f"{name}.indices",
                        process_set=process_set)
    if op == ReduceOp.Average:
        # As Horovod: values / size in the values' dtype, so integers give TensorFlow's true division
        # (float64 for int32/int64, float32 for smaller integers).
        values = values / tf.cast(process_set.size(), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_do_not_convert
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` across the set (Average by default) and return the result; differentiable.

    A ``tf.IndexedSlices`` is reduced by allgathering its values and indices
    (op must be Average or Sum). ``compression`` (``Compression.fp16``/``bf16``)
    casts floating-point tensors for the wire and back. ``device_dense``,
    ``device_sparse`` and ``ignore_name_scope`` are accepted for Horovod
    compatibility and ignored (everything runs on the CPU).
    """
    op = resolve_op(op, average)
    compression = compression or Compression.none
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, name, op, float(prescale_factor), float(postscale_factor), process_set)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor)
    reduced = _dense_allreduce(compressed, name, op, float(prescale_factor), float(postscale_factor),
                               process_set)
    return compression.decompress(reduced, ctx)


@_do_not_convert
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce a list of tensors together (one negotiation, fused); returns the list; differentiable.

    ``tf.IndexedSlices`` entries are reduced as in ``allreduce``. Arguments in Horovod's order.
    """
    op = resolve_op(op, average)
    compression = compression or Compression.none
    tensors = list(tensors)
    results = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _sparse_allreduce(t, None if name is None else f"{name}.sparse{i}", op,
                                           float(prescale_factor), float(postscale_factor), process_set)
        else:
            dense_idx.append(i)
    if dense_idx:
        dense = [tf.convert_to_tensor(tensors[i]) for i in dense_idx]
        for t in dense:
            _check_dtype(t, "grouped_allreduce")
        compressed = [compression.compress(t) for t in dense]
        reduced = _dense_grouped_allreduce([c[0] for c in compressed], name, op, float(prescale_factor),
                                           float(postscale_factor), process_set)
        for i, r, c in zip(dense_idx, reduced, compressed):
            results[i] = compression.decompress(r, c[1])
    return results


# ------------------------------------------------------------ allgather
@_do_not_convert
def _gather_shape(shape: tf.TensorShape) -> tf.TensorShape:
    if shape.rank is None:
        return tf.TensorShape(None)
    if shape.rank == 0:
        return tf.TensorShape([None])
    return tf.TensorShape([None]).concatenate(shape[1:])


@_do_not_convert
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0 (first dimensions may differ); differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "allgather")

    @tf.custom_gradient
    def run(x):
        def submit(arrays, nm, own):
            return collectives.allgather_async(to_buffer(arrays[0]), name=nm, process_set=process_set)

        (out,) = _collective("allgather", [x], name, submit, _first_np, [x.dtype], [_gather_shape(x.shape)])

        def grad(dy):
            return _allgather_grad(x, dy, _grad_name(name), process_set)

        return out, grad

    return run(tensor)


@_do_not_convert
def _allgather_grad(x, dy, name, process_set):
    """The gradient of an allgather of ``x``: this rank's rows of the ranks' average ``dy`` (as Horovod)."""
    averaged = _dense_allreduce(tf.convert_to_tensor(dy), name, ReduceOp.Average, 1.0, 1.0, process_set)
    first = tf.reshape(tf.shape(x, out_type=tf.int64)[0] if x.shape.rank != 0 else tf.constant(1, tf.int64), [1])
    dims = allgather(first, name=_grad_name(name, "dims"), process_set=process_set)
    offset = tf.reduce_sum(dims[:process_set.rank()])
    piece = averaged[offset:offset + first[0]]
    return tf.reshape(piece, tf.shape(x))


@_do_not_convert
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Allgather a list of tensors together; returns the list of results; differentiable (as ``allgather``)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_dtype(t, "grouped_allgather")

    @tf.custom_gradient
    def run(*xs):
        def submit(arrays, nm, own):
            return collectives.grouped_allgather_async([to_buffer(a) for a in arrays], name=nm,
                                                       process_set=process_set)

        outs = _collective("grouped_allgather", list(xs), name, submit, _list_np, [x.dtype for x in xs],
                           [_gather_shape(x.shape) for x in xs])

        def grad(*dys):
            # One allreduce per tensor (as Horovod): their gradients' dtypes may differ.
            return [_allgather_grad(x, dy, _grad_name(name, f"grad{i}"), process_set)
                    for i, (x, dy) in enumerate(zip(xs, dys))]

        return outs, grad

    return list(run(*tensors))


# ------------------------------------------------------------ broadcast
@_do_not_convert
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Return the root's ``tensor`` on every rank; differentiable (gradients flow to the root)."""
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "broadcast")
    root_rank = int(root_rank)

    @tf.custom_gradient
    def run(x):
        def submit(arrays, nm, own):
            return collectives.broadcast_async(to_buffer(arrays[0]), root_rank, name=nm, process_set=process_set,
                                               in_place=own)

        (out,) = _collective("broadcast", [x], name, submit, _first_np, [x.dtype], [x.shape])

        def grad(dy):
            # As Horovod: the ranks' average gradient on the root, zeros elsewhere.
            reduced = _dense_allreduce(tf.convert_to_tensor(dy), _grad_name(name), ReduceOp.Average, 1.0, 1.0,
                                       process_set)
            return reduced if process_set.rank() == root_rank else reduced * 0

        return out, grad

    return run(tensor)


# ------------------------------------------------------------ alltoall
@_do_not_convert
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[j]`` rows of ``tensor`` to rank j of the set; differentiable in ``tensor``.

    As in Horovod, returns ``(received, received_splits)`` when ``splits`` is
    given and only ``received`` without it (the first dimension is then
    divided evenly).
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "alltoall")
    size = process_set.size()
    splits_t = (tf.zeros([0], tf.int64) if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int64))
    even = splits is None

    @tf.custom_gradient
    def run(x):
        def submit(arrays, nm, own):
            return collectives.alltoall_async(to_buffer(arrays[0]), None if even else arrays[1].tolist(), name=nm,
                                       process_set=process_set)

        def finish(result):
            out, received = result
            return [to_numpy(out), np.asarray(received.numpy() if hasattr(received, "numpy")
                                              else received, dtype=np.int32)]

        out, received = _collective("alltoall", [x, splits_t], name, submit, finish, [x.dtype, tf.int32],
                                    [_gather_shape(x.shape), tf.TensorShape([size])])

        def grad(dy, _unused=None):
            back, _ = alltoall(tf.convert_to_tensor(dy), received, name=_grad_name(name), process_set=process_set)
            return back

        return (out, received), grad

    out, received = run(tensor)
    return out if even else (out, received)


# ------------------------------------------------------------ reducescatter
@_do_not_convert
def reducescatter(tensor, device_dense="", compression=None, op=ReduceOp.Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` (Average by default) and return this rank's slice of dimension 0; differentiable.

    Lower ranks get one extra row when the first dimension does not divide
    evenly. Arguments in Horovod's order; ``device_dense`` is ignored.
    """
    op = resolve_op(op)
    compression = compression or Compression.none
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def run(x):
        def submit(arrays, nm, own):
            return collectives.reducescatter_async(to_buffer(arrays[0]), name=nm, op=op, prescale_factor=pre,
                                            postscale_factor=post, process_set=process_set)

        (out,) = _collective("reducescatter", [x], name, submit, _first_np, [x.dtype], [_gather_shape(x.shape)])

        def grad(dy):
            return _reducescatter_grad(dy, _grad_name(name), op, pre, post, process_set)

        return out, grad

    return compression.decompress(run(compressed), ctx)


@_do_not_convert
def _reducescatter_grad(dy, name, op, pre, post, process_set):
    """The gradient of a reducescatter, as Horovod: ``dy`` times size for Sum (1 for Average), pre and post, allgathered."""
    dy = tf.convert_to_tensor(dy)
    scale = pre * post * (process_set.size() if op == ReduceOp.Sum else 1)
    if scale != 1.0:
        dy = dy * tf.constant(scale, dtype=dy.dtype)
    return allgather(dy, name=name, process_set=process_set)


@_do_not_convert
def grouped_reducescatter(tensors, device_dense="", compression=None, op=ReduceOp.Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reducescatter a list of tensors together; returns the list of this rank's slices (Horovod's argument order)."""
    op = resolve_op(op)
    compression = compression or Compression.none
    compressed = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]

    pre, post = float(prescale_factor), float(postscale_factor)
    for c in compressed:
        _check_dtype(c[0], "grouped_reducescatter")

    @tf.custom_gradient
    def run(*xs):
        def submit(arrays, nm, own):
            return collectives.grouped_reducescatter_async([to_buffer(a) for a in arrays], name=nm, op=op,
                                                           prescale_factor=pre, postscale_factor=post,
                                                           process_set=process_set)

        outs = _collective("grouped_reducescatter", list(xs), name, submit, _list_np, [x.dtype for x in xs],
                           [_gather_shape(x.shape) for x in xs])

        def grad(*dys):
            # One allgather per tensor (as Horovod): their gradients' dtypes may differ.
            return [_reducescatter_grad(dy, _grad_name(name, f"grad{i}"), op, pre, post, process_set)
                    for i, dy in enumerate(dys)]

        return outs, grad

    outs = run(*[c[0] for c in compressed])
    return [compression.decompress(o, c[1]) for o, c in zip(outs, compressed)]


# ------------------------------------------------------------ barrier, join, sizes
@_do_not_convert
def barrier(process_set=global_process_set):
    """Return once every rank of the set has called barrier (in graph mode: an op that does so)."""
    def fn():
        collectives.barrier(process_set=process_set)
        return 0

    out = _blocking("Barrier", fn, tf.int32)
    return None if tf.executing_eagerly() else out


@_do_not_convert
def join():
    """Declare this rank has no more data; returns (a tensor holding) the last rank to join.

    Until every rank has joined, the others' allreduces go on with this rank contributing zeros.
    """
    return _blocking("Join", collectives.join, tf.int32)


# Horovod's codes from process_set_included_op
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3


@_do_not_convert
def _value_op(fn, name):
    """An int32 scalar op that calls ``fn`` when it runs (eagerly: at once), as Horovod's ``*_op`` do."""
    if tf.executing_eagerly():
        return tf.constant(fn(), tf.int32, name=name)
    return tf.numpy_function(lambda: np.int32(fn()), [], tf.int32, stateful=True,
                             name=name or "RoundelValue")


@_do_not_convert
def size_op(process_set_id=0, name=None):
    """The number of ranks in the process set, as an int32 tensor (read when the op runs)."""
    return _value_op(lambda: len(basics.runtime("size_op").process_sets[process_set_id][0]), name)


@_do_not_convert
def local_size_op(name=None):
    """The number of ranks on this host, as an int32 tensor (read when the op runs)."""
    return _value_op(basics.local_size, name)


@_do_not_convert
def rank_op(name=None):
    """This process's rank, as an int32 tensor (read when the op runs)."""
    return _value_op(basics.rank, name)


@_do_not_convert
def local_rank_op(name=None):
    """This process's rank on its host, as an int32 tensor (read when the op runs)."""
    return _value_op(basics.local_rank, name)


def _included(process_set_id) -> int:
    if not basics.is_initialized():
        return PROCESS_SET_ERROR_INIT
    sets = basics.runtime("process_set_included_op").process_sets
    if process_set_id not in sets:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(basics.rank() in sets[process_set_id][0])


@_do_not_convert
def process_set_included_op(process_set_id=0, name=None):
    """1 if this process belongs to the set, else 0; -1 before ``init()``, -3 for an unknown set (as Horovod)."""
    return _value_op(lambda: _included(process_set_id), name)


# ------------------------------------------------------------ in-place broadcast
@_do_not_convert
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` in place with the root rank's values; returns their new values.

    Variables are matched across ranks by ``name`` and their position in the
    list. Eagerly it assigns at once; inside ``tf.function`` the returned
    values depend on the assignments.
    """
    variables = list(variables)
    prefix = name or "broadcast_"
    values = [broadcast(tf.convert_to_tensor(v), root_rank,
                        name=f"{prefix}.{i}.{getattr(v, 'name', '')}" if name or tf.executing_eagerly() else None,
                        process_set=process_set)
              for i, v in enumerate(variables)]
    assigns = [v.assign(value) for v, value in zip(variables, values)]
    if tf.executing_eagerly():
        return [v.read_value() for v in variables]
    with tf.control_dependencies(assigns):
        return [v.read_value() for v in variables]
