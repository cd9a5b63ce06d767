"""``roundel.tensorflow.DistributedOptimizer``: Horovod's TF entry point, forwarding Keras optimizers."""

from __future__ import annotations

import keras
import tensorflow as tf

from roundel.ops import ReduceOp, resolve_op
from roundel.common.process_sets import global_process_set
from roundel.tensorflow import keras as tf_keras  # Horovod's door to the Keras adapter
from roundel.tfops.compression import Compression


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=ReduceOp.Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras optimizer so its updates average the gradients across ranks (Horovod's signature).

    As in Horovod 0.28.1, a Keras optimizer is handed to the Keras
    implementation (``roundel.keras.DistributedOptimizer``); unlike Horovod's
    forwarding, ``op`` and ``groups``/``num_groups`` are kept. TF1's
    ``tf.compat.v1.train.Optimizer`` is not supported: a TypeError says what
    to use. Raises ValueError for ``op=Adasum`` (as Horovod does with Keras)
    and for bad arguments. ``use_locking`` and ``device_*`` are accepted for
    Horovod compatibility and ignored.
    """
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError("roundel.tensorflow.DistributedOptimizer does not support TF1 optimizers "
                        f"({type(optimizer).__name__}); use a Keras optimizer (keras.optimizers.SGD, Adam, ...), "
                        "or hvd.DistributedGradientTape in a custom training loop")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer expects a Keras optimizer, got {type(optimizer).__name__}")
    op = resolve_op(op)
    if op == ReduceOp.Adasum:
        raise ValueError("op == Adasum is not supported yet with Keras")
    return tf_keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
