"""Reducing a list of TensorFlow gradients across the ranks, as a ``GradientOptions`` says.

Shared by ``roundel.tensorflow``'s ``DistributedGradientTape`` and
``roundel.keras``'s ``DistributedOptimizer`` on Keras's TensorFlow backend.
"""

from __future__ import annotations

import tensorflow as tf

from roundel.common.gradient_groups import group_indices
from roundel.common.gradient_options import GradientOptions
from roundel.ops import ReduceOp
from roundel.tfops import mpi_ops

_do_not_convert = tf.autograph.experimental.do_not_convert


@_do_not_convert
def reduce_gradients(grads, options: GradientOptions, name="gradients", index_groups=None):
    """Allreduce a list of gradients (None entries stay None) as ``options`` say; returns the reduced list.

    Dense gradients go in ``options.num_groups`` grouped allreduces (0: one
    group), or in ``index_groups`` (lists of positions in ``grads``, see
    ``roundel.common.gradient_groups``); ``tf.IndexedSlices`` are allgathered
    unless ``options.sparse_as_dense``. ``options.gradient_predivide_factor``
    f splits Average into scaling by 1/f before the sum and f/size after it.
    """
    process_set = options.process_set
    op, prescale, postscale = options.reduction_scaling(process_set.size())
    compression = options.compression
    grads = list(grads)
    results = list(grads)
    dense = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if options.sparse_as_dense:
                grads[i] = tf.convert_to_tensor(g)
                dense.append(i)
            else:
                reduced = mpi_ops.allreduce(g, op=op, name=f"{name}.sparse.{i}" if tf.executing_eagerly() else None,
                                            process_set=process_set)
                if prescale * postscale != 1.0:  # allreduce itself refuses factors with IndexedSlices (as Horovod)
                    scale = tf.cast(prescale * postscale, reduced.values.dtype)
                    reduced = tf.IndexedSlices(reduced.values * scale, reduced.indices, reduced.dense_shape)
                results[i] = reduced
        else:
            dense.append(i)
    for group_number, group in enumerate(group_indices(dense, options.num_groups, index_groups)):
        compressed = [compression.compress(grads[i]) for i in group]
        pieces = [c for c, _ in compressed]
        group_name = f"{name}.group{group_number}" if tf.executing_eagerly() else None
        if len(pieces) > 1 and op != ReduceOp.Adasum and len({p.dtype for p in pieces}) == 1:
            reduced = _allreduce_concatenated(pieces, op, prescale, postscale, process_set, group_name)
        else:
            reduced = mpi_ops.grouped_allreduce(pieces, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                                process_set=process_set, name=group_name)
        for i, r, (_, ctx) in zip(group, reduced, compressed):
            results[i] = compression.decompress(r, ctx)
    return results


@_do_not_convert
def _allreduce_concatenated(tensors, op, prescale, postscale, process_set, name):
    """Reduce ``tensors`` (one dtype) as one tensor: concatenated by TensorFlow, one allreduce, split back.

    For an element-wise op this is the grouped allreduce's result, with one
    request to the engine and one result to convert instead of one per tensor.
    """
    sizes = [t.shape.num_elements() for t in tensors]
    if None in sizes:  # a shape known only when the step runs
        sizes = tf.stack([tf.size(t) for t in tensors])
    flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
    reduced = mpi_ops.allreduce(flat, op=op, prescale_factor=prescale, postscale_factor=postscale, name=name,
                                process_set=process_set)
    return [tf.reshape(part, tf.shape(t)) for part, t in zip(tf.split(reduced, sizes), tensors)]
