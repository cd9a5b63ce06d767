"""``DistributedGradientTape`` and the gradient reduction it shares with ``roundel.keras``."""

from __future__ import annotations

import tensorflow as tf

_do_not_convert = tf.autograph.experimental.do_not_convert

from roundel.common.ops import ReduceOp, resolve_op
from roundel.common.process_sets import global_process_set
from roundel.gradient_groups import group_indices
from roundel.tensorflow import mpi_ops
from roundel.tensorflow.compression import Compression


@_do_not_convert
def reduce_gradients(grads, compression=Compression.none, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                     sparse_as_dense=False, num_groups=0, process_set=global_process_set, name="gradients",
                     groups=None):
    """Allreduce a list of gradients (None entries stay None); returns the reduced list.

    Dense gradients go in ``num_groups`` grouped allreduces (0: one group), or
    in the groups of ``groups`` (lists of positions in ``grads``, see
    ``roundel.gradient_groups``); ``tf.IndexedSlices`` are allgathered unless ``sparse_as_dense``.
    ``gradient_predivide_factor`` f splits Average into scaling by 1/f before
    the sum and f/size after it.
    """
    op = resolve_op(op)
    prescale, postscale = 1.0, 1.0
    if gradient_predivide_factor != 1.0:
        if op != ReduceOp.Average:
            raise ValueError("gradient_predivide_factor needs op=Average")
        op = ReduceOp.Sum
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor / process_set.size()
    grads = list(grads)
    results = list(grads)
    dense = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                grads[i] = tf.convert_to_tensor(g)
                dense.append(i)
            else:
                reduced = mpi_ops.allreduce(g, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                            name=f"{name}.sparse.{i}" if tf.executing_eagerly() else None,
                                            process_set=process_set)
                results[i] = reduced
        else:
            dense.append(i)
    for group_number, group in enumerate(group_indices(dense, int(num_groups or 0), groups)):
        reduced = mpi_ops.grouped_allreduce(
            [grads[i] for i in group], compression=compression, op=op, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set,
            name=f"{name}.group{group_number}" if tf.executing_eagerly() else None)
        for i, r in zip(group, reduced):
            results[i] = r
    return results


class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the wrapped tape's class by ``DistributedGradientTape``."""

    @_do_not_convert
    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
        kwargs = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        if self._roundel_process_set.size() <= 1 and not self._roundel_always:
            return grads
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, self._roundel_compression, self._roundel_op,
                                   self._roundel_predivide, self._roundel_sparse_as_dense,
                                   self._roundel_num_groups, self._roundel_process_set)
        return tf.nest.pack_sequence_as(grads, reduced)


@_do_not_convert
def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=ReduceOp.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=global_process_set,
                            scale_local_gradients=True):
    """Wrap ``gradtape`` so ``gradient()`` returns gradients averaged (``op``) across the ranks.

    Returns a tape of a subclass of ``gradtape``'s class sharing its recorded
    operations. ``groups`` (explicit lists) is not supported: use
    ``num_groups``. ``device_*`` and ``scale_local_gradients`` are accepted for
    Horovod compatibility.
    """
    if groups is not None:
        raise NotImplementedError("groups= is not supported by roundel.tensorflow; use num_groups=")
    if int(num_groups or 0) < 0:
        raise ValueError(f"num_groups={num_groups} must be >= 0")
    cls = type(gradtape.__class__.__name__, (_DistributedGradientTape, gradtape.__class__), {})
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)
    tape._roundel_compression = compression or Compression.none
    tape._roundel_op = resolve_op(op)
    tape._roundel_predivide = float(gradient_predivide_factor)
    tape._roundel_sparse_as_dense = sparse_as_dense
    tape._roundel_num_groups = int(num_groups or 0)
    tape._roundel_process_set = process_set
    tape._roundel_always = True
    return tape
