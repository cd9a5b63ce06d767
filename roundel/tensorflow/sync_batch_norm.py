"""``SyncBatchNormalization``: Keras batch normalization with batch statistics over every rank."""

from __future__ import annotations

import keras
import tensorflow as tf

from roundel.ops import ReduceOp
from roundel.common.process_sets import global_process_set
from roundel.tfops import mpi_ops


@keras.saving.register_keras_serializable(package="roundel")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """A ``keras.layers.BatchNormalization`` whose training batch statistics cover the ranks' batches together.

    In training the per-channel count, sum and sum of squares of every rank's
    batch are summed with one allreduce, so mean, variance and the moving
    statistics equal those of BatchNormalization over the concatenated batch
    (also when ranks have different batch sizes, and with masks). Inference
    uses the moving statistics, as BatchNormalization. ``fused`` is accepted
    for Horovod compatibility; only ``fused=False`` (or leaving it out) is
    allowed, as in Horovod. Every rank must call the layer in training
    together.
    """

    def __init__(self, fused=False, process_set=global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs, mask):
        if self.process_set.size() <= 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        dtype = inputs.dtype
        inputs = tf.cast(inputs, tf.float64)  # sums of squares in double: E[x^2] - E[x]^2 cancels
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(inputs * weights, axis=axes)
        squares = tf.reduce_sum(tf.square(inputs) * weights, axis=axes)
        summed = mpi_ops._allreduce(tf.stack([count, total, squares]), op=ReduceOp.Sum,
                                    process_set=self.process_set)
        count, total, squares = tf.unstack(summed)
        count = tf.maximum(count, tf.ones_like(count))
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), tf.zeros_like(mean))
        return tf.cast(mean, dtype), tf.cast(variance, dtype)
